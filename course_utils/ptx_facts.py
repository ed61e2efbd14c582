"""What Triton's software pipeliner does to the loops of chapters 6 and 7, read from sm_90 PTX.

A pipelined loop loads its next tiles with asynchronous copies (``cp.async``, or ``cp.async.bulk``
with TMA) into shared memory while the current tile is computed; a loop that is not pipelined has
none. :func:`facts` compiles, for ``sm_90`` on any machine (no GPU: :mod:`course_utils.aot`'s
pretend-and-compile), the three loop forms of exercise 6.2's long-row softmax and chapter 7's
teaching attention kernel with Triton's default stages and with one stage, and counts those copies:

    python -m course_utils.ptx_facts [--out results/ptx]    # writes pipelining_ptx.csv

The kernels below are exercise 6.2's answer written three ways (``LOOP``: 0 ``tl.range`` with no
``num_stages``, 1 ``tl.range(..., num_stages=NUM_STAGES)``, 2 a ``while`` loop); the course's own
long-row kernel is ``course_utils.kernels.softmax.softmax_online_kernel``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch
import triton
import triton.language as tl

LOOP_FORMS = {0: "for ... in tl.range(0, n_cols, BLOCK_SIZE)",
              1: "for ... in tl.range(0, n_cols, BLOCK_SIZE, num_stages=3)",
              2: "while start < n_cols"}


@triton.jit
def long_row_forms_kernel(y_ptr, x_ptr, n_cols, x_row_stride, y_row_stride, BLOCK_SIZE: tl.constexpr,
                          LOOP: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Exercise 6.2's two passes (running max and sum, then normalize) in the loop form ``LOOP``."""
    pid = tl.program_id(0)
    x_row = x_ptr + pid.to(tl.int64) * x_row_stride
    y_row = y_ptr + pid.to(tl.int64) * y_row_stride
    offsets = tl.arange(0, BLOCK_SIZE)
    m = -float("inf")
    s = 0.0
    if LOOP == 2:
        start = 0
        while start < n_cols:
            cols = start + offsets
            x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
            m = m_new
            start += BLOCK_SIZE
        start = 0
        while start < n_cols:
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
            tl.store(y_row + cols, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=mask)
            start += BLOCK_SIZE
    else:
        for start in tl.range(0, n_cols, BLOCK_SIZE, num_stages=NUM_STAGES if LOOP == 1 else None):
            cols = start + offsets
            x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
            m = m_new
        for start in tl.range(0, n_cols, BLOCK_SIZE, num_stages=NUM_STAGES if LOOP == 1 else None):
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
            tl.store(y_row + cols, (tl.exp(x - m) / s).to(y_ptr.dtype.element_ty), mask=mask)


def long_row_forms(x: torch.Tensor, loop: int, block_size: int = 1024, num_stages: int = 3) -> torch.Tensor:
    """Row softmax of a 2-D ``x`` with :func:`long_row_forms_kernel` in loop form ``loop``; the launch
    leaves ``num_stages`` at Triton's default (3), the ``tl.range`` of form 1 sets its own."""
    if loop not in LOOP_FORMS:
        raise ValueError(f"loop must be one of {sorted(LOOP_FORMS)}, got {loop!r}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    y = torch.empty_like(x)
    if x.numel():
        long_row_forms_kernel[(x.shape[0],)](y, x, x.shape[1], x.stride(0), y.stride(0),
                                             BLOCK_SIZE=block_size, LOOP=loop, NUM_STAGES=num_stages)
    return y


def facts(arch: int = 90):
    """The async copies of each loop, compiled for sm_``arch`` (TRITON_INTERPRET must be unset)."""
    import pandas as pd

    from . import aot
    from .kernels import attention as A
    rows = []

    def add(what, call, stages=None):
        from . import aot_compile, hardware
        from . import triton_internals as internals
        info = hardware.DeviceInfo.for_arch(arch)
        with aot.pretend(info, aot.kernel_modules()) as launches:
            call()
        target = internals.gpu_target(arch)
        for launch in launches:
            if stages is not None:
                launch.kwargs = {**launch.kwargs, "num_stages": stages}
            src, options = aot_compile.bind_launch(launch, target)
            k = internals.compile_for(src, target, options)
            rows.append({"arch": arch, "what": what, "kernel": launch.kernel.fn.__name__,
                         "launch_num_stages": options.num_stages, **aot.async_copies(k.asm["ptx"]),
                         "shared_bytes": int(k.metadata.shared), "triton": triton.__version__,
                         "date": datetime.date.today().isoformat()})

    x = torch.empty(4, 100_000, dtype=torch.float32)
    for loop, what in LOOP_FORMS.items():
        add(f"exercise 6.2, {what}", lambda loop=loop: long_row_forms(x, loop))
    for d in (64, 128):
        q = torch.empty(1, 2, 1024, d, dtype=torch.bfloat16)
        for causal in (False, True):
            call = (lambda q=q, causal=causal: A.flash_attention_teaching(q, q, q, causal=causal))
            add(f"chapter 7 teaching kernel, bf16, d={d}, causal={causal}, launch default", call)
            add(f"chapter 7 teaching kernel, bf16, d={d}, causal={causal}, num_stages=1", call, stages=1)
    return pd.DataFrame(rows)


_BOOT = ("import os, sys, triton, triton.language\nimport course_utils\n"
         "os.environ.pop('TRITON_INTERPRET', None)  # import course_utils set it (no GPU): kernels must be real\n"
         "from course_utils import ptx_facts\nsys.exit(ptx_facts.main(sys.argv[1:], _booted=True))")


def main(argv: list[str] | None = None, _booted: bool = False) -> int:
    """Compile in a fresh process that imports Triton before course_utils, with the interpreter off."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="python -m course_utils.ptx_facts", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("results", "ptx"))
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args(argv)
    if not _booted:
        from . import aot
        return subprocess.call([sys.executable, "-c", _BOOT, *argv], env=aot.subprocess_env())
    df = facts(a.arch)
    os.makedirs(a.out, exist_ok=True)
    df.to_csv(os.path.join(a.out, "pipelining_ptx.csv"), index=False)
    print(df.drop(columns=["triton", "date"]).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
