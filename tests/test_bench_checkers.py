"""Chapter 8's checkers fail the answers that read the answer: issue 17 item 3 and issue 18 item 16."""

import statistics

import pytest

from course_utils import bench
from course_utils.check import CheckFailure
from course_utils.checkers import bench as checks
from course_utils.timing import time_ms


def protocol(gpu, fn, rep=50, warmup=3):
    for _ in range(warmup):
        fn()
    gpu.synchronize()
    starts = [gpu.Event() for _ in range(rep)]
    ends = [gpu.Event() for _ in range(rep)]
    for s, e in zip(starts, ends):
        gpu.flush_l2()
        s.record()
        fn()
        e.record()
    gpu.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def test_the_protocol_passes(capsys):
    checks.check_timer(protocol)
    assert capsys.readouterr().out.startswith("PASS time_kernel")


def test_no_warm_up_fails_although_the_median_hides_it():
    with pytest.raises(CheckFailure, match="no warm-up"):
        checks.check_timer(lambda gpu, fn, rep=50: protocol(gpu, fn, rep, warmup=0))


def test_time_ms_imported_by_name_is_still_the_harness():
    def escaped(gpu, fn, rep=50):   # from course_utils.bench import time_ms: escapes a patched bench.time_ms
        return time_ms(fn, device=gpu, rep=rep)
    with pytest.raises(CheckFailure, match="harness"):
        checks.check_timer(escaped)


def test_discarding_the_first_repetitions_is_a_valid_warm_up(capsys):
    def discards(gpu, fn, rep=50, skip=3):   # events around every call from the first; the first 3 dropped
        starts, ends = [gpu.Event() for _ in range(rep + skip)], [gpu.Event() for _ in range(rep + skip)]
        for s, e in zip(starts, ends):
            gpu.flush_l2()
            s.record()
            fn()
            e.record()
        gpu.synchronize()
        return statistics.median([s.elapsed_time(e) for s, e in zip(starts, ends)][skip:])
    checks.check_timer(discards)
    assert capsys.readouterr().out.startswith("PASS time_kernel")



def _pairs(gpu, fn, rep):
    starts, ends = [gpu.Event() for _ in range(rep)], [gpu.Event() for _ in range(rep)]
    for s, e in zip(starts, ends):
        gpu.flush_l2()
        s.record()
        fn()
        e.record()
    gpu.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def test_a_warm_up_sized_from_the_first_call_is_valid(capsys):
    """Its calls depend on the first call's time (the twins' noise differs), its number does not."""
    def sized(gpu, fn):
        s, e = gpu.Event(), gpu.Event()
        s.record()
        fn()
        e.record()
        gpu.synchronize()
        for _ in range(max(1, min(1000, int(5 / s.elapsed_time(e))))):
            fn()
        gpu.synchronize()
        return statistics.median(_pairs(gpu, fn, 30))
    checks.check_timer(sized)
    assert capsys.readouterr().out.startswith("PASS time_kernel")


def test_the_first_call_inside_a_trimmed_mean_fails():
    def trimmed(gpu, fn):   # the slowest tenth dropped, the first call kept (it is not always the slowest)
        return statistics.mean(sorted(_pairs(gpu, fn, 60))[:54])
    with pytest.raises(CheckFailure, match="no warm-up"):
        checks.check_timer(trimmed)


def test_the_first_call_in_a_mean_of_sized_repetitions_fails():
    def sized_mean(gpu, fn):   # repetitions sized from the first call, which stays in the mean
        s, e = gpu.Event(), gpu.Event()
        s.record()
        fn()
        e.record()
        gpu.synchronize()
        first = s.elapsed_time(e)
        rest = _pairs(gpu, fn, max(2, min(100, int(5 / first))))
        return statistics.mean([first, *rest])
    with pytest.raises(CheckFailure, match="you reported"):
        checks.check_timer(sized_mean)

def test_no_warm_up_with_a_mean_fails():
    def mean_of_all(gpu, fn, rep=50):
        starts, ends = [gpu.Event() for _ in range(rep)], [gpu.Event() for _ in range(rep)]
        for s, e in zip(starts, ends):
            gpu.flush_l2()
            s.record()
            fn()
            e.record()
        gpu.synchronize()
        return statistics.mean(s.elapsed_time(e) for s, e in zip(starts, ends))
    with pytest.raises(CheckFailure, match="no warm-up"):
        checks.check_timer(mean_of_all)


def test_time_rounds_is_the_harness_too():
    def rounds(gpu, fn):
        return bench.time_rounds({"k": fn}, rounds=3, device=gpu)["k"].median
    with pytest.raises(CheckFailure, match="harness"):
        checks.check_timer(rounds)

    def rounds_swallowing_errors(gpu, fn):   # time_rounds(errors=...) swallows the refusal: still caught
        out = bench.time_rounds({"k": fn}, rounds=3, device=gpu, errors={})
        return out["k"].median if "k" in out else 1.0
    with pytest.raises(CheckFailure, match="harness"):
        checks.check_timer(rounds_swallowing_errors)


def test_a_function_local_import_or_an_alias_of_the_harness_is_refused():
    def local_import(gpu, fn):
        from course_utils import timing
        return timing.time_ms(fn, device=gpu).median
    with pytest.raises(CheckFailure, match="harness"):
        checks.check_timer(local_import)

    hidden = {"t": getattr(__import__("course_utils.timing").timing, "time_" + "ms")}

    def aliased(gpu, fn):
        return hidden["t"](fn, device=gpu).median
    with pytest.raises(CheckFailure, match="harness"):
        checks.check_timer(aliased)


def test_reading_the_true_time_or_the_bandwidth_fails():
    with pytest.raises(CheckFailure, match="true_ms"):
        checks.check_timer(lambda gpu, fn, rep=50: gpu.true_ms(fn))
    with pytest.raises(CheckFailure, match="hbm_gbps"):
        checks.check_bandwidth(lambda gpu: gpu.hbm_gbps)


def test_bandwidth_by_the_protocol_passes(capsys):
    def copy_bandwidth(gpu):
        k = gpu.kernel(8 * gpu.l2_bytes)
        return bench.gbps(k.nbytes, bench.time_ms(k, device=gpu))
    checks.check_bandwidth(copy_bandwidth)
    assert capsys.readouterr().out.startswith("PASS copy_bandwidth")


def test_attainable_calling_the_course_roofline_fails():
    with pytest.raises(CheckFailure, match="attainable_tflops"):
        checks.check_attainable(lambda i, p, b: bench.attainable_tflops(i, p, b))
    checks.check_attainable(lambda i, p, b: min(p, i * b / 1e3))
