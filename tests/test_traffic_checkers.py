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
