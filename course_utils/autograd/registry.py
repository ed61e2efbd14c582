"""The ops a transformer block needs, from torch or from the course's kernels (chapters 11 and 12).

A model takes an :class:`Ops` and calls only it, so that the same parameters and the same batches
run through eager PyTorch (``torch_ops()``) or through the course's kernels (``course_ops()``).
The course's ops come from :mod:`course_utils.ops` (the ``torch.ops.course.*`` operators of chapter
12: registered with ``torch.library``, so ``torch.compile`` traces them) when that module is there,
else from chapter 11's autograd Functions, whose glue (the q/k/v copies, the residual add, the loss)
is PyTorch's. :func:`course_table` says which implementation each op has; a course op that has none
is never replaced by torch silently: ``course_ops()`` raises and names it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F


@dataclass(frozen=True)
class Ops:
    """The ops of the model, each with one calling convention whatever implements it:

    - ``layer_norm(x, w, b, eps)``;
    - ``add_layer_norm(x, residual, w, b, eps) -> (y, s)`` with ``s = x + residual``, ``y = LayerNorm(s)``;
    - ``linear_gelu(x, w, b)`` = gelu_tanh(x @ w.T + b), ``w`` laid out as ``nn.Linear``'s (out, in);
    - ``attention(q, k, v, causal)``: (batch, heads, seq, head_dim), any strides with a unit last one;
      with fewer queries than keys the causal mask is aligned bottom-right (the last query sees every
      key: decoding with a KV cache); returns o whose ``.transpose(1, 2)`` is (batch, seq, heads, d);
    - ``cross_entropy(logits, targets)``: the mean loss of (rows, vocab) logits, float32;
    - ``linear_cross_entropy(h, weight, targets)``: the same loss of the logits ``h @ weight.T`` (the LM
      head and the loss together: the course's op never writes the whole logits);
    - ``attention_qkv(qkv, n_head, causal)``: ``attention`` on the q, k, v of a packed (B, N, 3 H hd)
      projection, o as ``attention``'s (None: the model splits qkv and calls ``attention``);
    - ``block(h, x, blk, nxt, n_head, eps) -> (h, x)``: a whole block, from its first LayerNorm's output to
      the next one's, as one autograd node (:mod:`course_utils.ops.block`; None: the model calls the ops
      one by one). The model takes it only to train eagerly, without autocast.
    """
    name: str
    layer_norm: Callable
    add_layer_norm: Callable
    linear_gelu: Callable
    attention: Callable
    cross_entropy: Callable
    linear_cross_entropy: Callable
    attention_qkv: Callable | None = None
    block: Callable | None = None


def _torch_add_layer_norm(x, residual, w, b, eps):
    s = x + residual
    return F.layer_norm(s, (s.shape[-1],), w, b, eps), s


def _torch_attention(q, k, v, causal=True):
    if causal and q.shape[-2] != k.shape[-2]:  # SDPA's is_causal is aligned top-left: say bottom-right
        from torch.nn.attention.bias import causal_lower_right
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def torch_ops() -> Ops:
    return Ops(
        "torch",
        layer_norm=lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps),
        add_layer_norm=_torch_add_layer_norm,
        linear_gelu=lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"),
        attention=_torch_attention,
        cross_entropy=lambda logits, targets: F.cross_entropy(logits.float(), targets),
        linear_cross_entropy=lambda h, w, targets: F.cross_entropy(F.linear(h, w).float(), targets),
    )


OPS_MODULE = "course_utils.ops"
# Each course op: (module, attribute, what it is). The first one found wins: the torch.library operators
# of chapter 12, else chapter 11's autograd Functions with PyTorch's glue around them.
COURSE_CANDIDATES: dict[str, list[tuple[str, str, str]]] = {
    "layer_norm": [(OPS_MODULE, "layer_norm", "torch.ops.course.layer_norm (chapter 10's kernels)"),
                   ("course_utils.tuned.layernorm_autograd", "layer_norm_autograd",
                    "chapter 10's LayerNorm, fwd + bwd (autograd Function)")],
    "add_layer_norm": [(OPS_MODULE, "add_layer_norm", "torch.ops.course.add_layer_norm: residual add + "
                        "LayerNorm in one kernel"),
                       ("course_utils.autograd.registry", "_add_then_layer_norm",
                        "PyTorch's add, then chapter 10's LayerNorm (two kernels)")],
    "linear_gelu": [(OPS_MODULE, "linear_gelu", "torch.ops.course.linear_gelu: cuBLAS + the bias-GELU kernel "
                     "(acc saved) or chapter 9's GEMM epilogue, whichever is timed faster for the shape"),
                    ("course_utils.autograd.registry", "_matmul_then_bias_gelu",
                     "cuBLAS matmul, then chapter 4's fused bias + GELU (fwd and bwd kernels)")],
    "attention": [(OPS_MODULE, "attention", "torch.ops.course.attention: FlashAttention reading q, k, v "
                   "from the packed projection by strides"),
                  ("course_utils.autograd.registry", "_attention_contiguous",
                   "chapter 7's FlashAttention + chapter 11's backward, on .contiguous() copies of q, k, v")],
    "cross_entropy": [(OPS_MODULE, "cross_entropy", "torch.ops.course.cross_entropy: loss and gradient in "
                       "one pass (online softmax)"),
                      ("course_utils.autograd.registry", "_torch_cross_entropy",
                       "PyTorch's cross_entropy (the course's loss kernel is chapter 12's operator)")],
    "linear_cross_entropy": [(OPS_MODULE, "linear_cross_entropy", "torch.ops.course.linear_cross_entropy: the "
                              "LM head's GEMM and the loss by chunks of rows, logits never written whole"),
                             ("course_utils.autograd.registry", "_linear_then_cross_entropy",
                              "cuBLAS's logits, then the course's cross-entropy (or PyTorch's)")],
}


def _matmul_then_bias_gelu(x, w, b):
    from .elementwise import bias_gelu
    return bias_gelu(F.linear(x, w), b)


def _add_then_layer_norm(x, residual, w, b, eps):
    from ..tuned.layernorm_autograd import layer_norm_autograd
    s = x + residual
    return layer_norm_autograd(s, w, b, eps), s


def _attention_contiguous(q, k, v, causal=True, scale=None):
    from ..tuned.attention_backward import flash_attention_autograd
    return flash_attention_autograd(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal, sm_scale=scale)


def _torch_cross_entropy(logits, targets):
    return F.cross_entropy(logits.float(), targets)


def _linear_then_cross_entropy(h, w, targets):
    fn, _, _ = _find("cross_entropy")
    return fn(F.linear(h, w), targets)


def _unwritten(package, op: str) -> bool:
    """Whether the operator package still holds the skeleton of ``op`` (a body that raises 'not written yet')."""
    from pathlib import Path
    marker = f"course::{op} is not written yet"
    return any(marker in f.read_text(encoding="utf-8") for f in Path(package.__file__).parent.glob("*.py"))


def _find_one(module: str, attr: str, what: str):
    try:
        found = importlib.import_module(module)
        if module == OPS_MODULE and _unwritten(found, attr):
            return None, None, [f"{module}.{attr}: not written yet"]
        return getattr(found, attr), what, []
    except (ImportError, AttributeError) as e:
        return None, None, [f"{module}.{attr}: {type(e).__name__}: {e}"]


def _find(op: str):
    reasons = []
    for candidate in COURSE_CANDIDATES[op]:
        fn, what, why = _find_one(*candidate)
        if fn is not None:
            return fn, what, reasons
        reasons += why
    return None, None, reasons


def course_table() -> list[dict]:
    """One row per op: which course implementation it uses, or why none is available."""
    rows = []
    for op in COURSE_CANDIDATES:
        fn, what, reasons = _find(op)
        rows.append({"op": op, "implementation": what or "missing", "why": "" if fn else "; ".join(reasons)})
    return rows


def uses_library_ops() -> bool:
    """Whether every course op comes from the ``torch.ops.course`` operators (``course_utils.ops``)."""
    return all(_find(op)[1] == COURSE_CANDIDATES[op][0][2] for op in COURSE_CANDIDATES)


def _attention_causal(fn):
    def attention(q, k, v, causal=True):
        return fn(q, k, v, causal, q.shape[-1] ** -0.5)
    return attention


# Chapter 9's GEMM for linear_gelu instead (its backward recomputes z: four GEMMs a step, see .gemm)
GEMM_EPILOGUE = ("course_utils.autograd.gemm", "linear_gelu", "chapter 9's GEMM with the bias + GELU epilogue, "
                 "z recomputed in backward")


def course_ops(gemm_epilogue: bool = False, library=None, block_nodes: bool = False) -> Ops:
    """The course's kernels for every op, or a ``RuntimeError`` naming each op that has none.

    ``block_nodes``: each block of the model one autograd node (``Ops.block``), the ops of
    :mod:`course_utils.ops` all taken (it calls their functions), no GEMM epilogue, no ``library``.

    Without :mod:`course_utils.ops`, ``linear_gelu`` is cuBLAS's matmul followed by the course's
    fused bias + GELU, or, with ``gemm_epilogue=True``, chapter 9's GEMM with the epilogue in the
    same kernel (the autograd Function of chapter 11). ``library`` (op names) takes those ops from
    ``torch.ops.course`` and every other one from chapter 11's implementation: the steps of chapter
    12's fusion ladder (``library=()`` is chapter 11's model).
    """
    if library is None:
        found = {op: _find(op) for op in COURSE_CANDIDATES}
    else:
        unknown = set(library) - set(COURSE_CANDIDATES)
        if unknown:
            raise ValueError(f"library: unknown op(s) {sorted(unknown)}; the ops are {list(COURSE_CANDIDATES)}")
        found = {op: _find_one(*COURSE_CANDIDATES[op][0 if op in library else 1]) for op in COURSE_CANDIDATES}
    if library is not None and "linear_cross_entropy" not in library:
        # the head and the loss as two ops: cuBLAS's logits, then the loss the library has (the course's or torch's)
        loss = found["cross_entropy"][0]
        found["linear_cross_entropy"] = (lambda h, w, t, loss=loss: loss(F.linear(h, w), t), "F.linear, then "
                                         + found["cross_entropy"][1], [])
    if gemm_epilogue:
        found["linear_gelu"] = _find_one(*GEMM_EPILOGUE)
    missing = [f"{op} ({'; '.join(r)})" for op, (fn, _, r) in found.items() if fn is None]
    if missing:
        raise RuntimeError("the course has no kernel yet for: " + ", ".join(missing))
    packed = block = None
    if found["attention"][1] == COURSE_CANDIDATES["attention"][0][2]:   # the operator: its packed twin too
        from course_utils.ops import attention_qkv as packed
    if block_nodes:
        if gemm_epilogue or library is not None or not all(found[op][1] == COURSE_CANDIDATES[op][0][2]
                                                           for op in COURSE_CANDIDATES):
            raise ValueError("block_nodes needs every op from course_utils.ops (no gemm_epilogue, no library)")
        from course_utils.ops.block import block
    return Ops("course", layer_norm=found["layer_norm"][0], add_layer_norm=found["add_layer_norm"][0],
               linear_gelu=found["linear_gelu"][0], attention=_attention_causal(found["attention"][0]),
               cross_entropy=found["cross_entropy"][0], linear_cross_entropy=found["linear_cross_entropy"][0],
               attention_qkv=packed, block=block)


def ops(name: str) -> Ops:
    """``"torch"``, ``"course"`` or ``"course-blocks"`` (the course's, each block one autograd node)."""
    if name == "torch":
        return torch_ops()
    if name == "course":
        return course_ops()
    if name == "course-blocks":
        return course_ops(block_nodes=True)
    raise ValueError(f"ops must be 'torch', 'course' or 'course-blocks', got {name!r}")


__all__ = ["Ops", "torch_ops", "course_ops", "course_table", "uses_library_ops", "ops", "COURSE_CANDIDATES"]
