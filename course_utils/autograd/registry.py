"""The ops a transformer block needs, from torch or from the course's kernels (chapter 11).

A model takes an :class:`Ops` and calls only it, so that the same parameters and the same batches
run through eager PyTorch (``torch_ops()``) or through the course's Triton kernels
(``course_ops()``). Which implementation each course op has is said by :func:`course_table`; a
course op that is not available is never replaced by torch silently: ``course_ops()`` raises and
names it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F


@dataclass(frozen=True)
class Ops:
    """``layer_norm(x, w, b, eps)``; ``linear_gelu(x, w, b)`` = gelu_tanh(x @ w.T + b) with ``w`` laid out
    as ``nn.Linear``'s (out, in); ``attention(q, k, v)`` causal, (batch, heads, seq, head_dim)."""
    name: str
    layer_norm: Callable
    linear_gelu: Callable
    attention: Callable


def torch_ops() -> Ops:
    return Ops(
        "torch",
        layer_norm=lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps),
        linear_gelu=lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"),
        attention=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    )


# Each course op: (module, attribute, what it is). The first one found wins.
COURSE_CANDIDATES: dict[str, list[tuple[str, str, str]]] = {
    "layer_norm": [("course_utils.tuned.layernorm", "layer_norm_autograd", "chapter 10's LayerNorm, fwd + bwd"),
                   ("course_utils.kernels.layernorm", "layer_norm_autograd", "chapter 10's LayerNorm, fwd + bwd")],
    "linear_gelu": [("course_utils.autograd.registry", "_matmul_then_bias_gelu",
                     "cuBLAS matmul, then chapter 4's fused bias + GELU (fwd and bwd kernels)")],
    "attention": [("course_utils.tuned.attention_backward", "flash_attention_autograd",
                   "chapter 7's FlashAttention forward + chapter 11's backward"),
                  ("course_utils.kernels.attention_backward", "flash_attention_autograd",
                   "chapter 7's FlashAttention forward + chapter 11's backward")],
}


def _matmul_then_bias_gelu(x, w, b):
    from .elementwise import bias_gelu
    return bias_gelu(F.linear(x, w), b)


def _find_one(module: str, attr: str, what: str):
    try:
        return getattr(importlib.import_module(module), attr), what, []
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


def _attention_causal(fn):
    def attention(q, k, v):
        return fn(q, k, v, causal=True)
    return attention


# Chapter 9's GEMM for linear_gelu instead (its backward recomputes z: four GEMMs a step, see .gemm)
GEMM_EPILOGUE = ("course_utils.autograd.gemm", "linear_gelu", "chapter 9's GEMM with the bias + GELU epilogue, "
                 "z recomputed in backward")


def course_ops(gemm_epilogue: bool = False) -> Ops:
    """The course's kernels for every op, or a ``RuntimeError`` naming each op that has none.

    ``linear_gelu`` is cuBLAS's matmul followed by the course's fused bias + GELU, or, with
    ``gemm_epilogue=True``, chapter 9's GEMM with the epilogue in the same kernel (all four GEMMs
    of a step then run on the course's kernel, which reaches about 95% of cuBLAS's speed).
    """
    found = {op: _find(op) for op in COURSE_CANDIDATES}
    if gemm_epilogue:
        found["linear_gelu"] = _find_one(*GEMM_EPILOGUE)
    missing = [f"{op} ({'; '.join(r)})" for op, (fn, _, r) in found.items() if fn is None]
    if missing:
        raise RuntimeError("the course has no kernel yet for: " + ", ".join(missing))
    return Ops("course", layer_norm=found["layer_norm"][0], linear_gelu=found["linear_gelu"][0],
               attention=_attention_causal(found["attention"][0]))


def ops(name: str) -> Ops:
    """``"torch"`` or ``"course"``."""
    if name == "torch":
        return torch_ops()
    if name == "course":
        return course_ops()
    raise ValueError(f"ops must be 'torch' or 'course', got {name!r}")

