"""Chapter 2's checkers judge the student's counting, not the course's calculator (issue 17 item 3)."""

import pytest

from course_utils import hardware
from course_utils import traffic as T
from course_utils.check import CheckFailure
from course_utils.checkers import traffic as CT


def test_returning_the_calculators_answer_fails():
    def chain_bytes(n_ops, numel, itemsize):
        c = T.elementwise_chain(n_ops, numel, CT.ITEMSIZES[itemsize])
        return c.unfused.total_bytes, c.fused.total_bytes
    with pytest.raises(CheckFailure, match="elementwise_chain"):
        CT.check_chain_bytes(chain_bytes)

    def softmax_bytes(rows, cols, itemsize):
        c = T.softmax(rows, cols, CT.ITEMSIZES[itemsize])
        return c.unfused.total_bytes, c.fused.total_bytes
    with pytest.raises(CheckFailure, match="softmax"):
        CT.check_softmax_bytes(softmax_bytes)


def test_speedup_from_the_reference_fails_and_a_helper_does_not_hide_it():
    def helper(comparison, gpu, dtype):
        return CT.reference_speedup(comparison, gpu, dtype)

    def fusion_speedup(comparison, gpu, dtype):
        return helper(comparison, gpu, dtype)
    with pytest.raises(CheckFailure, match="reference_speedup"):
        CT.check_fusion_speedup(fusion_speedup)
    with pytest.raises(CheckFailure, match="speedup"):
        CT.check_fusion_speedup(lambda c, g, d: T.speedup(c, g, d, l2_reuse=False)["estimated_speedup"])


def test_the_students_own_time_model_passes(capsys):
    def kernel_time_us(nbytes, flops, hbm_gbps, peak_tflops, launch_us):
        return max(nbytes / (hbm_gbps * 1e9), flops / (peak_tflops * 1e12)) * 1e6 + launch_us

    def fusion_speedup(comparison, gpu, dtype):
        spec = hardware.lookup(gpu)

        def total(t):
            return sum(kernel_time_us(k.total_bytes, k.flops, spec.hbm_gbps, spec.peak_tflops(dtype),
                                      T.LAUNCH_OVERHEAD_US) for k in t.kernels)
        return total(comparison.unfused) / total(comparison.fused)
    CT.check_kernel_time(kernel_time_us)
    CT.check_fusion_speedup(fusion_speedup)
    assert capsys.readouterr().out.count("PASS") == 2


def _chain(n_ops, numel, b):
    return 2 * n_ops * numel * b, 2 * numel * b


def _softmax(m, n, b):
    return (8 * m * n + 4 * m) * b, 2 * m * n * b


def _bgd(m, n, b):
    return (6 * m * n + n) * b + m * n, (2 * m * n + n) * b


@pytest.mark.parametrize("check, wrong, words", [
    (CT.check_chain_bytes, lambda k, n, b: _chain(k, n, 4), "uses 4 bytes per element .float32. whatever"),
    (CT.check_chain_bytes, lambda k, n, b: tuple(8 * v for v in _chain(k, n, b)), "that is bits"),
    (CT.check_softmax_bytes, lambda m, n, b: (_softmax(m, n, b)[0] - 2 * m * b, _softmax(m, n, b)[1]),
     "sub and div read the row vectors back"),
    (CT.check_softmax_bytes, lambda m, n, b: ((8 * m * n + 4 * n) * b, 2 * m * n * b), "one value per row"),
    (CT.check_softmax_bytes, lambda m, n, b: (8 * m * n * b + 16 * m, 2 * m * n * b), "have x's dtype"),
    (CT.check_softmax_bytes, lambda m, n, b: (_softmax(m, n, b)[0], 3 * m * n * b), "keeps each row on chip"),
    (CT.check_bias_gelu_dropout_bytes, lambda m, n, b: (_bgd(m, n, b)[0] - n * b + m * b, _bgd(m, n, b)[1]),
     "one value per column: cols values, not rows"),
    (CT.check_bias_gelu_dropout_bytes, lambda m, n, b: (_bgd(m, n, b)[0] - m * n + m * n // 8, _bgd(m, n, b)[1]),
     "one byte per element, not one bit"),
    (CT.check_bias_gelu_dropout_bytes, lambda m, n, b: (_bgd(m, n, b)[0] + m * n, _bgd(m, n, b)[1]),
     "does not read it back"),
    (CT.check_chain_bytes, lambda k, n, b: (k * n * b, _chain(k, n, b)[1]), "each op also writes its output"),
    (CT.check_chain_bytes, lambda k, n, b: (2 * k * n, 2 * n), "multiply by itemsize"),
    (CT.check_chain_bytes, lambda k, n, b: (2 * (k + 1) * n * b, _chain(k, n, b)[1]), "launches n kernels"),
    (CT.check_chain_bytes, lambda k, n, b: (_chain(k, n, b)[0], n * b), "still writes its result once"),
    (CT.check_softmax_bytes, lambda m, n, b: (8 * m * n + 4 * m, 2 * m * n), "counts elements"),
    (CT.check_softmax_bytes, lambda m, n, b: (10 * m * n * b, 2 * m * n * b), "five ops, five kernels"),
    (CT.check_bias_gelu_dropout_bytes, lambda m, n, b: (_bgd(m, n, b)[0] - m * n, _bgd(m, n, b)[1]),
     "also writes a keep-mask"),
    (CT.check_bias_gelu_dropout_bytes, lambda m, n, b: (_bgd(m, n, b)[0] + m * n * (b - 1), _bgd(m, n, b)[1]),
     "the mask is torch.bool"),
    (CT.check_bias_gelu_dropout_bytes, lambda m, n, b: (_bgd(m, n, b)[0], _bgd(m, n, b)[1] + m * n),
     "regenerates the mask"),
])
def test_byte_counts_name_the_usual_mistakes(check, wrong, words):
    with pytest.raises(CheckFailure, match=words):
        check(wrong)


def _kt(nbytes, flops, bw, peak, launch):
    return max(nbytes / (bw * 1e9), flops / (peak * 1e12)) * 1e6 + launch


@pytest.mark.parametrize("wrong, words", [
    (lambda *a: _kt(*a) * 1e-3, "not milliseconds"),
    (lambda *a: _kt(*a) * 1e3, "not nanoseconds"),
    (lambda B, F, bw, pk, L: max(B / (bw * 2**30), F / (pk * 1e12)) * 1e6 + L, "not 2..30"),
    (lambda B, F, bw, pk, L: _kt(B, F, bw, pk, 0) + L * 1e-3, "already in microseconds"),
    (lambda B, F, bw, pk, L: _kt(2 * B, F, bw, pk, L), "already counts every read and write"),
    (lambda *a: round(_kt(*a)), "rounded to a whole microsecond"),
    (lambda B, F, bw, pk, L: B / (bw * 1e9) * 1e6 + F / (pk * 1e12) * 1e6 + L, "not their sum"),
    (lambda B, F, bw, pk, L: _kt(B, F, bw, pk, 0), "add the launch overhead"),
    (lambda *a: _kt(*a) * 1e-6, "not seconds"),
    (lambda B, F, bw, pk, L: min(B / (bw * 1e9), F / (pk * 1e12)) * 1e6 + L, "larger of the two times"),
    # on a compute-bound kernel this is the time in nanoseconds too: named "not nanoseconds" before
    (lambda B, F, bw, pk, L: max(B / (bw * 1e9), F / (pk * 1e9)) * 1e6 + L, "TFLOP/s means 1e12 FLOP per second"),
])
def test_kernel_time_names_the_usual_mistakes(wrong, words):
    with pytest.raises(CheckFailure, match=words):
        CT.check_kernel_time(wrong)


def _speedup(*, launch=True, peak_dtype=None, nbytes=lambda k: k.total_bytes, add=False, merged=False,
             one_launch=False, flops=True):
    def fusion_speedup(comparison, gpu, dtype):
        spec = hardware.lookup(gpu)
        peak, lat = spec.peak_tflops(peak_dtype or dtype), T.LAUNCH_OVERHEAD_US if launch else 0.0

        def one(b, f):
            mem, comp = b / (spec.hbm_gbps * 1e9) * 1e6, (f if flops else 0) / (peak * 1e12) * 1e6
            return (mem + comp if add else max(mem, comp)) + (0.0 if one_launch else lat)

        def total(t):
            if merged:
                return one(sum(nbytes(k) for k in t.kernels), sum(k.flops for k in t.kernels))
            return sum(one(nbytes(k), k.flops) for k in t.kernels) + (lat if one_launch else 0.0)
        return total(comparison.unfused) / total(comparison.fused)
    return fusion_speedup


def test_the_speedup_helper_of_these_tests_is_right(capsys):
    CT.check_fusion_speedup(_speedup())
    assert capsys.readouterr().out.startswith("PASS fusion_speedup")


@pytest.mark.parametrize("wrong, words", [
    (_speedup(peak_dtype="float32"), "peak of the dtype you were given"),
    (_speedup(nbytes=lambda k: k.read_bytes), "its reads and its writes"),
    (_speedup(add=True), "max, not their sum"),
    (_speedup(merged=True), "time each kernel on its own"),
    # without launches a memory-bound fusion's speedup is its traffic ratio: named "the traffic ratio alone" before
    (_speedup(launch=False), "add each kernel's launch overhead"),
    (_speedup(one_launch=True), "once per kernel, not once per version"),
    (_speedup(flops=False), "a kernel's FLOPs count too"),   # refused before, with no hint
])
def test_fusion_speedup_names_the_usual_mistakes(wrong, words):
    with pytest.raises(CheckFailure, match=words):
        CT.check_fusion_speedup(wrong)
