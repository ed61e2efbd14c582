"""Counting the kernels a callable launches.
(The fusion ladder's modelled bytes, :data:`FUSIONS` and :func:`fusion_accounts`, live in
:mod:`course_utils.fusion_ladder`; they are re-exported here, where chapter 12 first met them.)

:func:`count_launches` gives the same count on a GPU and under the interpreter, so check cells can
print it: every Triton launch counts one, and every eager PyTorch operator that computes (not a
view, not an allocation) counts one, which is what eager PyTorch launches on a GPU for the
elementwise and reduction ops of this course. :func:`cuda_kernel_table` asks the real profiler on a
GPU, for the lecture cells that show what ran.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .fusion_ladder import FUSIONS, fusion_accounts  # noqa: F401  (re-exported: chapter 12 calls them here)

# Operators that launch no kernel: allocation, metadata and views.
_NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
    "lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "is_same_size", "resize_", "set_",
    "_unsafe_view", "view", "reshape", "unsqueeze", "squeeze", "t", "transpose", "permute", "expand",
    "select", "slice", "as_strided", "unbind", "split", "chunk", "narrow", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "stride", "size", "dim", "numel", "_reshape_alias", "promote_types",
    "result_type",
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


# ------------------------------------------------------------------------------------------------
# A training step's kernels by category, and its host time split by who spends it (chapter 12)
# ------------------------------------------------------------------------------------------------

CATEGORIES = ("GEMM", "attention", "norm", "loss", "optimizer", "cast", "copy", "elementwise glue")

# (category, substrings of the kernel's own name), lower case; the first rule that matches wins.
_KERNEL_RULES = (
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("attention", ("flash", "attn", "attention", "fmha", "sdpa")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax", "softmaxforward", "softmaxbackward", "fused_classifier")),
    ("norm", ("layer_norm", "layernorm", "gammabetabackward")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "cublas", "splitk", "linear_gelu")),
    ("copy", ("memcpy", "catarraybatchedcopy")),
)
# (category, substrings of the name of an operator above the launch): the nearest operator decides.
_OP_RULES = (
    ("optimizer", ("optimizer.step", "adam")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax")),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention",
                   "course::attention", "flashattention")),
    ("norm", ("layer_norm", "layernorm")),
    ("GEMM", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")),
    ("cast", ("aten::_to_copy", "aten::to")),
    ("copy", ("aten::contiguous", "aten::clone", "aten::copy_", "aten::cat")),
)


# The operators an Inductor kernel's name lists (``triton_poi_fused__to_copy_clone_3``) that move or view
# data without computing: a kernel that does nothing else is a cast (if it converts) or a copy.
_DATA_MOVES = {"clone", "view", "unsafe", "permute", "transpose", "t", "copy", "expand", "squeeze", "unsqueeze",
               "slice", "select", "cat", "split", "with", "sizes", "alias", "reshape", "contiguous"}


def _fused_move(name: str) -> str | None:
    """"cast" or "copy" for a generated kernel whose fused operators only convert, copy or view, by what
    the kernel does (its name lists its operators), whichever aten op launched it; else None."""
    if "fused_" not in name:
        return None
    ops = re.sub(r"_\d+$", "", name.split("fused_", 1)[1])
    converts = "_to_copy" in ops
    rest = [t for t in ops.replace("_to_copy", "_").split("_") if t and t not in _DATA_MOVES]
    if rest:
        return None
    return "cast" if converts else "copy"


def categorize(kernel: str, ops=()) -> str:
    """The category of one kernel launch, from its name, else from the operators above it (nearest
    first): one of :data:`CATEGORIES`. A generated (Inductor) kernel that only converts dtypes counts as
    a cast, one that only copies as a copy, like eager's ``aten::_to_copy`` and ``aten::clone``. A
    kernel nothing names is elementwise glue (adds, the embeddings' gathers, fills, reductions of
    gradients)."""
    name = kernel.lower()
    for category, keys in _KERNEL_RULES:
        if any(k in name for k in keys):
            return category
    moved = _fused_move(name)
    if moved is not None:
        return moved
    # nearest operator first, but a copy_ names a category only when nothing above it does (a cast is
    # aten::_to_copy calling aten::copy_; a copy inside an attention backward belongs to attention)
    for rules in (_OP_RULES[:-1], _OP_RULES[-1:]):
        for op in ops:
            low = op.lower()
            for category, keys in rules:
                if any(k in low for k in keys):
                    return category
    return "elementwise glue"


def step_kernels(fn, steps: int = 2):
    """Every kernel ``fn`` launches over ``steps`` calls, on a GPU (torch.profiler): a DataFrame with
    one row per launch (kernel, the operators above it, category, microseconds). Call ``fn`` once
    before: compilation and tile choices stay out."""
    import pandas as pd
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    if not torch.cuda.is_available():
        raise RuntimeError("step_kernels needs a CUDA GPU: on the CPU, read the recorded results instead")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = list(prof.events())
    rows = [{"kernel": name, "ops": " < ".join(ops[:6]), "category": categorize(name, ops), "us": us}
            for name, ops, us in _kernels_with_their_ops(events, DeviceType) if us > 0]
    return pd.DataFrame(rows, columns=["kernel", "ops", "category", "us"])


def _op_chain(event) -> list[str]:
    ops = []
    while event is not None:
        ops.append(event.name)
        event = event.cpu_parent
    return ops


def _kernels_with_their_ops(events, DeviceType):
    """``(kernel name, operators above it, microseconds)`` for every kernel the profiler saw.

    torch >= 2.12 gives each kernel event the id of the operator that launched it
    (``linked_correlation_id``: operator ids are the correlation ids, while runtime calls such as
    cudaLaunchKernel link to an operator themselves); older releases list the kernels on the
    operator instead (``FunctionEvent.kernels``)."""
    # a record_function range (an optimizer's "Optimizer.step#AdamW.step") also shows on the GPU's timeline under
    # the CPU range's name: it spans kernels, it is not one, and counting it would count them twice
    ranges = {e.name for e in events if e.device_type == DeviceType.CPU}
    events = [e for e in events if e.device_type != DeviceType.CUDA or e.name not in ranges]
    if events and not hasattr(events[0], "linked_correlation_id"):
        attached: Counter = Counter()
        for e in events:
            if e.device_type == DeviceType.CPU:
                for k in getattr(e, "kernels", ()):
                    attached[k.name] += 1
                    yield k.name, _op_chain(e), float(k.duration)
        # a kernel launched under no operator (a Triton launch outside any aten op or autograd Function, as
        # an optimizer's) is on no operator's list: the device's own events still have it
        for e in events:
            if e.device_type == DeviceType.CUDA:
                if attached[e.name] > 0:
                    attached[e.name] -= 1
                else:
                    yield e.name, [], float(e.time_range.elapsed_us())
        return
    cpu = {e.id: e for e in events if e.device_type == DeviceType.CPU and not e.linked_correlation_id}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            yield e.name, _op_chain(cpu.get(e.linked_correlation_id)), e.time_range.elapsed_us()


def by_category(kernels, steps: int):
    """Launches and GPU milliseconds per step in each category (from :func:`step_kernels`' rows)."""
    import pandas as pd

    g = kernels.groupby("category")["us"].agg(["count", "sum"]).reindex(CATEGORIES, fill_value=0)
    out = pd.DataFrame({"category": g.index, "launches": (g["count"] / steps).round(1),
                        "gpu_ms": g["sum"] / steps / 1e3})
    total = pd.DataFrame([{"category": "(all: launches, GPU-busy time)", "launches": out["launches"].sum(),
                           "gpu_ms": out["gpu_ms"].sum()}])
    return pd.concat([out, total], ignore_index=True)


HOST_BUCKETS = ("Triton's launcher", "course's Python wrappers", "torch.library dispatch",
                "autograd engine (C++)", "autograd Functions (Python)", "optimizer (Python)",
                "PyTorch modules and functional (Python)", "other Python")


def _bucket(path: str, func: str) -> str | None:
    p = path.replace("\\", "/")
    if p == "~":
        return "autograd engine (C++)" if "run_backward" in func else None   # other builtins: their caller's
    if "/triton/" in p:
        return "Triton's launcher"
    if "/course_utils/" in p:
        return "course's Python wrappers"
    if "/torch/_library/" in p or p.endswith("/torch/_ops.py") or "/torch/library" in p:
        return "torch.library dispatch"
    if "/torch/autograd/" in p:
        return "autograd Functions (Python)"
    if "/torch/optim/" in p:
        return "optimizer (Python)"
    if "/torch/" in p:
        return "PyTorch modules and functional (Python)"
    return "other Python"


def host_split(fn, calls: int = 1) -> dict:
    """Host milliseconds per call of ``fn`` by who spends them, from a deterministic CPU profile
    (cProfile): time in Python functions goes to their file's bucket (:data:`HOST_BUCKETS`); a C
    builtin's time goes to its caller's bucket (a Triton launch's driver call to Triton's launcher,
    a torch op a wrapper calls to the wrapper), except the autograd engine's, which is its own.
    cProfile slows Python-heavy code more than C: compare the buckets, not the total with a clock."""
    import cProfile
    import pstats

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync()
    spent = dict.fromkeys(HOST_BUCKETS, 0.0)
    for (path, _, func), (_, _, tottime, _, callers) in pstats.Stats(prof).stats.items():
        bucket = _bucket(path, func)
        if bucket is not None:
            spent[bucket] += tottime
            continue
        for (cpath, _, cfunc), caller_stats in callers.items():   # (calls, prim calls, tottime, cumtime)
            spent[_bucket(cpath, cfunc) or "other Python"] += caller_stats[2]
    return {k: v * 1e3 / calls for k, v in spent.items()}


@contextlib.contextmanager
def launches_stubbed():
    """Inside the block every launch that goes through ``plain_launch`` (all of them off a GPU) does nothing: what
    a call costs the host without its kernels (tools/host_ab.py, tools/step_host_cpu.py). Outputs stay unwritten."""
    from .tuned import launch as TL
    real = TL.plain_launch
    TL.plain_launch = lambda *args, **kwargs: None
    try:
        yield
    finally:
        TL.plain_launch = real


def print_cprofile(fn, calls: int, top: int = 25) -> None:
    """``fn()`` called ``calls`` times under cProfile; the ``top`` functions by their own time printed."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
