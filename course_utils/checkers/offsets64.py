"""Cases past 2**31 elements: where a kernel's int32 offsets wrap around and its int64 ones do not.

``pid * BLOCK_SIZE`` or ``pid * row_stride`` is int32 arithmetic in Triton (``tl.program_id`` and an
integer argument below 2**31 are int32): past 2**31 elements the product wraps to a negative offset,
about 2**32 elements before the right one. A check sees that only on inputs that long, so these
cases build them without paying for them:

- :func:`wide_buffer` holds a 1-D tensor of billions of 16-bit elements. On a GPU it is real memory; under
  the interpreter it is an anonymous mapping whose pages exist only where something reads or writes
  (``MAP_NORESERVE``), so 8 GiB cost a few pages. The tensors of a case are views into it, laid out so
  that a wrapped offset lands inside the buffer too: the wrong kernel reads and writes the wrong place
  instead of crashing the process (or the GPU context).
- :func:`launch_last_programs` launches a 1-D grid whole on a GPU, and only its last programs under the
  interpreter (which runs programs one by one: millions would take hours).
- :func:`wide_rows` lays out three rows of each tensor of a row kernel (one program per row) so far apart that
  the last starts past 2**31 elements: three programs, whole on a GPU as under the interpreter.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator

import torch

from .. import check, env, triton_internals
from . import answer_keys

# The course's kernels a case past 2**31 elements might be handed (chapters 11 and 12): refused before any launch
COURSE_KERNELS = ("course_utils.kernels.gelu_backward", "course_utils.kernels.cross_entropy",
                  "course_utils.kernels.fused_classifier", "course_utils.tuned.bias_gelu_dropout")

MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
GPU_MARGIN = 2**30        # bytes left free on the card beside the buffer
LOCK_NAME = "course-wide-buffer.lock"

HINT = ("an offset computed in int32 wraps around past 2**31 elements (tl.program_id and an integer argument "
        "below 2**31 are int32): widen the first factor before the product, pid.to(tl.int64) * {what}")


@contextlib.contextmanager
def wide_buffer(n: int, dtype: torch.dtype) -> Iterator[torch.Tensor | None]:
    """A 1-D tensor of ``n`` elements of ``dtype`` (contents undefined) for the block; None where it cannot
    be had (a GPU without the memory, a system that refuses the mapping): the caller skips its case, and a
    warning says so. On a GPU one such buffer at a time on the machine (parallel checks wait their turn), its
    memory given back to the card at the end."""
    if not env.on_gpu():
        yield _mapping(n, dtype)
        return
    import fcntl  # POSIX, as Triton's GPU backends are

    nbytes = n * dtype.itemsize
    with open(os.path.join(tempfile.gettempdir(), LOCK_NAME), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        torch.cuda.empty_cache()
        buf = None
        if torch.cuda.mem_get_info()[0] < nbytes + GPU_MARGIN:
            _skipped(f"{nbytes / 2**30:.0f} GiB of GPU memory are not free")
        else:
            try:
                buf = torch.empty(n, dtype=dtype, device=env.DEVICE)
            except torch.cuda.OutOfMemoryError:
                _skipped(f"{nbytes / 2**30:.0f} GiB of GPU memory could not be allocated")
        try:
            yield buf
        finally:
            del buf
            torch.cuda.empty_cache()


def _mapping(n: int, dtype: torch.dtype) -> torch.Tensor | None:
    nbytes = n * dtype.itemsize
    if not MAP_NORESERVE:
        return _skipped("no MAP_NORESERVE mapping on this system")
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except (OSError, ValueError) as e:
        return _skipped(f"the system refused an {nbytes / 2**30:.0f} GiB mapping ({e})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=dtype)  # the tensor's storage keeps the mapping alive


def _skipped(why: str) -> None:
    warnings.warn(f"the case past 2**31 elements was skipped: {why}", RuntimeWarning, stacklevel=4)
    return None


def launch_last_programs(kernel, n_programs: int, n_last: int, args: tuple, kwargs: dict) -> bool:
    """``kernel[(n_programs,)](*args, **kwargs)``: whole on a GPU, its last ``n_last`` programs under the
    interpreter. False where the interpreter cannot be told (its internal changed): nothing ran. The
    kernel must be the student's: the course's own kernels are refused here too, not only by the caller."""
    answer_keys.refuse("a case past 2**31 elements", kernel, answer_keys.course_answers(*COURSE_KERNELS))
    if env.on_gpu():
        kernel[(n_programs,)](*args, **kwargs)
        return True
    with triton_internals.interpreter_programs_from(n_programs - n_last, n_programs) as placed:
        if placed:
            kernel[(n_last,)](*args, **kwargs)
    if not placed:
        _skipped("the interpreter's program ids cannot be placed (see course_utils/triton_internals/)")
    return placed


# --------------------------------------------------------------------------- rows past 2**31 elements
#: the rows of a row kernel's tensors (chapters 10 and 11): three float16 rows WIDE_STRIDE elements apart, the first
#: WIDE_START elements into a wide buffer: the last row starts 2 * WIDE_STRIDE = 2**31 + 8198 elements past its
#: tensor's pointer, where pid * row_stride in int32 wraps about 2**32 back, into the buffer's first elements
#: (8 GiB; a few pages under the interpreter)
WIDE_ROWS, WIDE_STRIDE, WIDE_START = 3, 2**30 + 4099, 2**31


def wide_case(name: str, n_cols: int) -> str:
    return (f"{name} (float16, {WIDE_ROWS} rows x {n_cols} cols {WIDE_STRIDE} elements apart: the last row starts "
            f"{(WIDE_ROWS - 1) * WIDE_STRIDE} elements in, past 2**31)")


@contextlib.contextmanager
def wide_rows(n_cols: int, names: tuple[str, ...]):
    """``{name: (WIDE_ROWS, n_cols) float16 view}`` for each of ``names``, rows WIDE_STRIDE apart, side by side
    after WIDE_START elements of padding; None where the buffer cannot be had (the case is skipped, with a
    warning). The caller copies what it needs out before the block ends (the memory goes back then)."""
    gap = n_cols + 8
    with wide_buffer(WIDE_START + (WIDE_ROWS - 1) * WIDE_STRIDE + len(names) * gap, torch.float16) as buf:
        if buf is None:
            yield None
            return
        views = {n: buf.as_strided((WIDE_ROWS, n_cols), (WIDE_STRIDE, 1), WIDE_START + i * gap)
                 for i, n in enumerate(names)}
        del buf
        yield views


def wide_launch(launch, case: str, signature: str) -> None:
    """Run a launch on the wide rows (no load tracking: a wrapped offset reads the padding, named after)."""
    try:
        launch()
    except (NotImplementedError, check.CheckFailure):
        raise
    except Exception as e:  # a crash in the student's kernel: say where
        raise check.CheckFailure(f"{case}: your kernel raised {type(e).__name__}: {str(e)[:400]}\n{signature}") from e


def wide_last_row(case: str, got: torch.Tensor, name: str, what: str) -> None:
    """Fail, named, when the last row of ``got`` (NaN-filled before the launch) was never written."""
    if bool(got[-1].isnan().all()) and not bool(got[0].isnan().any()):
        raise check.CheckFailure(f"{case}: your kernel never wrote the last row of {name}: "
                                 + HINT.format(what=what) + ".")
