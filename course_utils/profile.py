"""Counting the kernels a callable launches.
(Over 350 lines: launch counting, a training step's kernels by category, its host split and the fusion ladder's
modelled bytes are chapter 12's one profile; the next split is ``fusion_accounts`` into a module of its own.)

:func:`count_launches` gives the same count on a GPU and under the interpreter, so check cells can
print it: every Triton launch counts one, and every eager PyTorch operator that computes (not a
view, not an allocation) counts one, which is what eager PyTorch launches on a GPU for the
elementwise and reduction ops of this course. :func:`cuda_kernel_table` asks the real profiler on a
GPU, for the lecture cells that show what ran.
"""

from __future__ import annotations

import contextlib
import re
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


# ------------------------------------------------------------------------------------------------
# What each fusion of the GPT's step should save: the traffic model's prediction (chapter 12)
# ------------------------------------------------------------------------------------------------

#: The fusion ladder's steps, in order (benchmarks/training.py measures each one).
FUSIONS = ("+ AdamW(fused=True)", "+ attention reads q, k, v by strides", "+ residual add + LayerNorm in one kernel",
           "+ bias + GELU fused with the MLP's first GEMM", "+ fused cross-entropy",
           "+ LM head and loss in one op (logits never written whole)",
           "+ bf16 weights, float32 masters in one AdamW kernel (the course's step)")


def fusion_accounts(cfg, batch: int, n_params: int) -> dict:
    """``{fusion: traffic.Comparison}``: the kernels one training step runs before and after each fusion
    of :data:`FUSIONS` (forward and backward, every layer), as the course's traffic model counts them.

    M = batch x seq_len rows of width d; bf16 activations (2 bytes), a float32 residual stream and
    float32 optimizer state (4 bytes), P parameters, vocabulary V. A kernel's ``reuse_bytes`` are the
    reads of what the kernel before it wrote (``traffic.estimate_time(..., l2_reuse=True)`` lets L2
    serve them). Modelled, not measured:

    - AdamW: the foreach version's seven passes over the parameters (lerp m; v *= b2; v += g*g; sqrt;
      divide; add eps; p -= lr m / denom: 18 P floats) against one fused pass (reads p, g, m, v and
      writes p, m, v: 7 P); one launch per pass (each is a few multi-tensor launches in reality).
    - q, k, v: three copies forward (Md each, read and written) and one in backward (3Md), per layer.
    - residual add + LayerNorm, at 2 x n_layer sites: forward, the add (reads x and the bf16 branch,
      writes s) and the LayerNorm reading s again; backward, the add that sums the two gradients of s.
    - bias + GELU: chapter 9's comparison (the GEMM writes z, one kernel reads it and writes GELU(z)),
      forward only: what the backward does is the op's choice (see the measurement).
    - the loss: cast to float32, log-softmax, NLL, and their backward (three kernels each way) against
      one pass each way over the bf16 logits (and the mean of the rows' losses).
    """
    from . import traffic as T

    L, d, V = cfg.n_layer, cfg.d_model, cfg.vocab
    M = batch * cfg.seq_len
    md16, md32 = M * d * 2, M * d * 4

    def pair(name, unfused, fused):
        return T.Comparison(name, T.Traffic("unfused", tuple(T.Kernel(*k) for k in unfused)),
                            T.Traffic("fused", tuple(T.Kernel(*k) for k in fused)))

    adam = [(n, r * n_params * 4, w * n_params * 4, 0, (n != "lerp m") * n_params * 4) for n, r, w in (
        ("lerp m", 2, 1), ("v *= b2", 1, 1), ("v += g*g", 2, 1), ("sqrt v", 1, 1), ("/ bias corr.", 1, 1),
        ("+ eps", 1, 1), ("p -= lr m / denom", 3, 1))]
    out = {FUSIONS[0]: pair(FUSIONS[0], adam, [("fused AdamW", 4 * n_params * 4, 3 * n_params * 4)])}
    copies = [(f"{t}.contiguous() L{i}", md16, md16) for i in range(L) for t in "qkv"]
    copies += [(f"dqkv copy L{i}", 3 * md16, 3 * md16) for i in range(L)]
    out[FUSIONS[1]] = pair(FUSIONS[1], copies, [])
    sites = 2 * L
    add_ln = [k for i in range(sites) for k in (   # the LayerNorm re-reads the s the add just wrote
        (f"add site {i}", md32 + md16, md32), (f"LayerNorm site {i}", md32, md32, 0, md32),
        (f"grad accumulate site {i}", 2 * md32, md32))]
    # one kernel forward; its backward reads the gradient of s from outside too (md32) instead of an add
    fused_ln = [(f"add + LayerNorm site {i}, + its backward's read of ds", 2 * md32 + md16, 2 * md32)
                for i in range(sites)]
    out[FUSIONS[2]] = pair(FUSIONS[2], add_ln, fused_ln)
    mlp = T.gemm_epilogue(M, 4 * d, d, trailing="fused")
    out[FUSIONS[3]] = T.Comparison(FUSIONS[3], T.Traffic("unfused", mlp.unfused.kernels * L),
                                   T.Traffic("fused", mlp.fused.kernels * L))
    mv = M * V
    loss = [("logits.float()", 2 * mv, 4 * mv), ("log_softmax", 4 * mv, 4 * mv, 0, 4 * mv),
            ("nll_loss", 4 * M + 8 * M, 4, 0, 4 * M), ("nll backward", 8 * M, 4 * mv),
            ("log_softmax backward", 8 * mv, 4 * mv, 0, 4 * mv), ("cast back", 4 * mv, 2 * mv, 0, 4 * mv)]
    out[FUSIONS[4]] = pair(FUSIONS[4], loss, [("loss, online softmax", 2 * mv + 8 * M, 8 * M), ("mean", 4 * M, 4),
                                              ("gradient", 2 * mv + 8 * M, 2 * mv)])
    # the head's GEMM writes the bf16 logits either way; the fused op's one kernel per chunk reads them, writes
    # the loss and the gradient in place (its second pass over a row re-reads it from the cache), instead of
    # a loss kernel and a gradient kernel that each read the logits from HBM
    out[FUSIONS[5]] = pair(FUSIONS[5], [("loss, online softmax", 2 * mv + 8 * M, 8 * M),
                                        ("gradient", 2 * mv + 8 * M, 2 * mv)],
                           [("loss and gradient in place, per chunk", 2 * mv + 8 * M, 2 * mv + 4 * M, 0, 2 * mv)])
    # float32 weights under autocast: each weight cast to bf16 once per forward (read 4 P, write 2 P), each
    # gradient back to float32 (read 2 P, write 4 P), AdamW on float32 (reads p, g, m, v; writes p, m, v);
    # bf16 weights: one kernel reads g (bf16), the float32 master, m and v, writes them and the bf16 weight
    P = n_params
    out[FUSIONS[6]] = pair(FUSIONS[6], [("weights to bf16 (autocast)", 4 * P, 2 * P),
                                        ("gradients to float32", 2 * P, 4 * P),
                                        ("fused AdamW, float32", 16 * P, 12 * P)],
                           [("AdamW on float32 masters, writes the bf16 weights", 14 * P, 14 * P)])
    return out
