"""Chapters 9 and 10's checkers on a GPU, where no load is recorded: which wrong answers still fail, named.

Each row runs one check on a right or a wrong answer from the checkers' tests (``tests/test_gemm_checkers.py``,
``tests/test_layernorm_checkers.py``) with fresh inputs, RUNS times, and counts the runs whose verdict is the
expected one: PASS for a right answer, a failure whose message holds the expected words for a wrong one. On
a GPU the masks of exercise 9.2's epilogue are judged by the probe kernel alone (every lane stored), the
statistics faults of 10.1, 10.2's stride mix-up and the accumulator dtype of 10.3 by the numbers; the
faults seen only in the loads (9.1's re-walked K tiles, 10.1's third pass) are left to the interpreter and
not listed here.

Run from the repository root on a GPU (about a minute):

    python tools/gpu_checks/checkers_09_10.py            # (--smoke: once each, under the interpreter too)
"""

from __future__ import annotations

import contextlib
import io
import sys
import time

import torch

RUNS = 1 if "--smoke" in sys.argv else 3


def _rows():
    sys.path.insert(0, ".")
    from course_utils.checkers import gemm as cg
    from course_utils.checkers import layernorm as cl
    from tests import test_gemm_checkers as TG
    from tests import test_layernorm_checkers as TL

    fp32 = (torch.float32,)

    def residual(variant):
        epi = TG._epilogue(variant)
        return lambda: cg.check_linear_gelu_residual(TG._epilogue_launcher(epi), dtypes=fp32, epilogue=epi)

    return [
        ("9.1 right slice loop", lambda: cg.check_matmul(TG._slice_launcher(TG.SLICE_OK), dtypes=fp32, k_slices=2),
         None),
        ("9.1 tail tile dropped", lambda: cg.check_matmul(TG._slice_launcher(TG.SLICE_DROP_TAIL), dtypes=fp32,
                                                          k_slices=2), "last, partial K tile"),
        ("9.2 right epilogue", residual(TG.EPI_OK), None),
        ("9.2 right, masked lanes without other=", residual(TG.EPI_NO_OTHER), None),
        ("9.2 residual without row mask", residual(TG.EPI_NO_ROW_MASK), "residual load is not masked by rows"),
        ("9.2 residual without column mask", residual(TG.EPI_NO_COL_MASK), "residual load is not masked by columns"),
        ("9.2 bias without mask", residual(TG.EPI_BIAS_NO_MASK), "bias load is not masked by columns"),
        ("10.1 right Welford", lambda: cl.check_forward_kernel(TL._chunked_mode(0), chunk=64), None),
        ("10.1 delta^2 after the update", lambda: cl.check_forward_kernel(TL._chunked_mode(6), chunk=64),
         "delta from the mean after its update"),
        ("10.1 eps outside sqrt", lambda: cl.check_forward_kernel(TL._chunked_mode(7), chunk=64),
         "eps is outside the square root"),
        ("10.2 right RMSNorm dx", lambda: cl.check_rms_backward_kernel(TL._rms_mode(0)), None),
        ("10.2 dy read with x's row stride", lambda: cl.check_rms_backward_kernel(TL._rms_mode(6)),
         "dy read with x's row stride"),
        ("10.3 right dw/db", lambda: cl.check_dw_db_kernel(TL._dw_mode(0)), None),
        ("10.3 accumulators in x's dtype", lambda: cl.check_dw_db_kernel(TL._dw_mode(8)),
         "accumulated (or rounded) in the input's dtype"),
    ]


#: under the interpreter (--smoke) the loads name these faults first, in their own words
LOADS_NAME_IT = ("residual load reads past", "bias load reads past", "rows of dy")


def _verdict(run, words) -> bool:
    import course_utils as cu
    from course_utils import check
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run()
    except check.CheckFailure as e:
        if words is None:
            return False
        seen_in_loads = not cu.on_gpu() and any(w in str(e) for w in LOADS_NAME_IT)
        return words in str(e) or seen_in_loads
    return words is None


def main() -> int:
    import course_utils as cu
    if not cu.on_gpu() and "--smoke" not in sys.argv:
        print("tools/gpu_checks/checkers_09_10.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    t0 = time.time()
    lines = []
    for what, run, words in _rows():
        good = sum(_verdict(run, words) for _ in range(RUNS))
        lines.append(f"{what:<42} {'PASS' if words is None else 'fail: ' + words:<52} {good}/{RUNS}"
                     + ("" if good == RUNS else "   <-- UNEXPECTED"))
    print(f"device: {cu.env.device_name()}, {time.time() - t0:.0f} s")
    print(f"{'answer':<42} {'expected verdict':<52} runs as expected")
    print("\n".join(lines))
    return 0 if all("UNEXPECTED" not in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
