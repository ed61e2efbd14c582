"""Counting the kernels a callable launches.

:func:`count_launches` gives the same count on a GPU and under the interpreter, so check cells can
print it: every Triton launch counts one, and every eager PyTorch operator that computes (not a
view, not an allocation) counts one, which is what eager PyTorch launches on a GPU for the
elementwise and reduction ops of this course. :func:`cuda_kernel_table` asks the real profiler on a
GPU, for the lecture cells that show what ran.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that launch no kernel: allocation, metadata and views.
_NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
    "lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "is_same_size", "resize_", "set_",
    "_unsafe_view", "view", "reshape", "unsqueeze", "squeeze", "t", "transpose", "permute", "expand",
    "select", "slice", "as_strided", "unbind", "split", "chunk", "narrow", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "stride", "size", "dim", "numel", "_reshape_alias",
}


@dataclass
class LaunchCount:
    triton: Counter = field(default_factory=Counter)
    torch: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.torch.values())

    def __str__(self) -> str:
        parts = [f"{n}x {k}" for k, n in self.triton.items()] + [f"{n}x aten.{k}" for k, n in self.torch.items()]
        return f"{self.total} kernel launch(es): " + (", ".join(parts) if parts else "none")


class _TorchOps(TorchDispatchMode):
    def __init__(self, counts: LaunchCount):
        super().__init__()
        self.counts = counts
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = func.overloadpacket.__name__
            if name not in _NO_KERNEL and not func.is_view:
                self.counts.torch[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def triton_launch_hook(on_launch, observer):
    """Call ``on_launch(original_run, kernel, args, kwargs)`` at every Triton launch (not warm-ups).

    ``observer.paused`` (a dispatch mode watching torch ops) is raised during the launch: the
    interpreter moves tensors with torch ops of its own, which are not the program's.
    """
    from .triton_internals import launch_classes  # the one module that touches Triton's internals

    originals = {cls: cls.run for cls in launch_classes()}

    def wrap(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                on_launch(original, self, args, kwargs)
            observer.paused += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                observer.paused -= 1
        return run

    for cls, original in originals.items():
        cls.run = wrap(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def count_launches(fn, *args, **kwargs) -> LaunchCount:
    """Run ``fn(*args, **kwargs)`` once and count the kernels it launches.

    Run it once before counting if it compiles or autotunes on first use: autotuning launches
    every candidate configuration.
    """
    counts = LaunchCount()
    mode = _TorchOps(counts)
    def count(original, kernel, args, kwargs):
        counts.triton[getattr(kernel, "__name__", "triton_kernel")] += 1

    with triton_launch_hook(count, mode), mode:
        fn(*args, **kwargs)
    return counts


def cuda_kernel_table(fn, *args, row_limit: int = 15, **kwargs) -> str:
    """The profiler's table of CUDA kernels that ``fn`` launches (GPU only)."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_kernel_table needs a CUDA GPU; use count_launches on the CPU")
    fn(*args, **kwargs)  # warm-up: compilation and autotuning stay out of the table
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn(*args, **kwargs)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=row_limit)
