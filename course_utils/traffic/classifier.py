"""The LM head and its cross-entropy (chapter 12): HBM bytes and activation memory of
``loss = CE(h @ weight.T, targets)`` and its backward, for h (rows, d), weight (vocab, d), three ways.

- ``"eager"``: ``F.cross_entropy(F.linear(h, weight).float(), targets)`` and autograd. The GEMM writes
  the logits in the compute dtype, ``.float()`` copies them to float32, ``log_softmax`` writes float32
  log-probabilities (saved for the backward), ``nll_loss`` gathers. Backward: ``nll_loss_backward``
  fills a float32 (rows x vocab) gradient with zeros and scatters -1/rows into it, ``log_softmax_backward``
  reads it and the saved log-probabilities and writes float32 dlogits, the cast's backward writes them
  in the compute dtype, then the two GEMMs dh = g @ weight and dweight = g.T @ h.
- ``"unchunked fused"``: the best any version can do that writes all the logits once: the GEMM writes
  them in the compute dtype, one fused kernel computes the loss and each row's logsumexp, the logits
  are saved, and one fused backward kernel reads them and writes dlogits in the compute dtype (this is
  :mod:`course_utils.kernels.cross_entropy` after ``F.linear``; torch.compile's generated code is
  measured by :func:`measure_peak_memory`, not modelled here).
- ``"chunked fused"``: :mod:`course_utils.tuned.linear_cross_entropy`: per chunk of ``c`` rows the head's
  GEMM into one reused (c x vocab) buffer, the fused classifier kernel (loss, and the gradient in
  place), dh_c = g @ weight, and dweight += g.T @ h_c into a float32 accumulator (first chunk: written,
  not read); then the accumulator is cast to the weight's dtype, and the backward multiplies dh and
  dweight by the incoming gradient.

Logical traffic, as everywhere in :mod:`course_utils.traffic`: a kernel reads each tensor it takes once
and writes each it produces once; a GEMM reads its operands once (its tiles re-read them from L2). The
fused classifier's second pass over a row (100 KB for GPT-2) is counted as L2 traffic, not HBM.
Targets (int64) and per-row float32 values are counted; the 0-d results are not.

Memory (bytes above the inputs h, weight and targets, gradients dh and dweight included): ``saved`` is
what stays allocated between the forward and the backward; ``peak`` the most allocated at once,
from the tensors alive at each step (the caching allocator's rounding is ignored;
:func:`measure_peak_memory` measures it on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import Kernel, Traffic
from .units import _count, dtype_bytes, dtype_name

F32 = 4                     # float32 logits, log-probabilities, accumulators, per-row losses
I64 = 8                     # int64 targets
CHUNK_BYTES = 512 * 2**20   # the most bytes of logits one chunk may hold (H100: 4096-row chunks of 50304 bf16
                            # logits ran 0.95x torch.compile against 0.89x for 2048-row ones: fewer fp32 dW passes)
ROW_MULTIPLE = 64           # chunk rows are a multiple of this (a GEMM tile's rows), except a last ragged chunk
VERSIONS = ("eager", "unchunked fused", "chunked fused")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_rows_for(rows: int, vocab: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: the fewest chunks whose logits fit ``chunk_bytes``, evened out, rounded up to
    ``ROW_MULTIPLE`` (at least 1, at most ``rows``; at least ROW_MULTIPLE when rows allow)."""
    most = max(ROW_MULTIPLE, chunk_bytes // (vocab * itemsize) // ROW_MULTIPLE * ROW_MULTIPLE)
    n_chunks = _cdiv(max(rows, 1), most)
    return max(1, min(rows, _cdiv(_cdiv(rows, n_chunks), ROW_MULTIPLE) * ROW_MULTIPLE))


@dataclass(frozen=True)
class HeadVersion:
    """One version of the LM head + loss: its kernels, and the bytes it holds."""

    label: str
    traffic: Traffic
    saved_bytes: int
    peak_bytes: int


def _gemms(r: int, v: int, d: int, b: int, tag: str = "") -> tuple[Kernel, Kernel, Kernel]:
    """logits = h @ W.T, dh = g @ W, dW = g.T @ h on r rows, all in dtype bytes b."""
    f = 2 * r * v * d
    return (Kernel(f"logits{tag} = h @ W.T", (r * d + v * d) * b, r * v * b, f),
            Kernel(f"dh{tag} = g @ W", (r * v + v * d) * b, r * d * b, f),
            Kernel(f"dW{tag} = g.T @ h", (r * v + r * d) * b, v * d * b, f))


def _eager(r: int, v: int, d: int, b: int) -> HeadVersion:
    n = r * v
    logits, dh, dw = _gemms(r, v, d, b)
    kernels = (logits,
               Kernel(".float()", n * b, n * F32, 0, n * b),
               Kernel("log_softmax", n * F32, n * F32, 4 * n, n * F32),
               Kernel("nll_loss", r * (I64 + F32), F32, r),
               Kernel("nll_loss_backward: zeros", 0, n * F32),
               Kernel("nll_loss_backward: scatter", r * I64, r * F32),
               Kernel("log_softmax_backward", 2 * n * F32, n * F32, 3 * n, n * F32),
               Kernel("cast to the compute dtype", n * F32, n * b, 0, n * F32),
               dh, dw)
    saved = n * F32                                           # the log-probabilities
    peak = max(n * (b + F32 + F32),                           # log_softmax: bf16 logits, float32 copy, output
               3 * n * F32,                                   # log_softmax_backward: saved, incoming, result
               n * b + (r + v) * d * b)                       # the GEMMs: g and both gradients
    return HeadVersion("eager", Traffic("eager", kernels), saved, peak)


def _unchunked(r: int, v: int, d: int, b: int) -> HeadVersion:
    n = r * v
    logits, dh, dw = _gemms(r, v, d, b)
    kernels = (logits,
               Kernel("loss + lse (one fused pass)", n * b + r * I64, r * F32 * 2, 4 * n, n * b),
               Kernel("dlogits (one fused pass)", n * b + r * (I64 + F32), n * b, 3 * n),
               dh, dw)
    saved = n * b + r * F32                                   # the logits and each row's logsumexp
    peak = max(2 * n * b + r * F32,                           # backward kernel: logits and dlogits
               n * b + (r + v) * d * b)                       # the GEMMs: g and both gradients
    return HeadVersion("unchunked fused", Traffic("unchunked fused", kernels), saved, peak)


def _chunked(r: int, v: int, d: int, b: int, c: int) -> HeadVersion:
    kernels = [Kernel("scale = 1 / rows not ignored", r * I64, F32, r)]
    for i, start in enumerate(range(0, r, c)):
        rc = min(c, r - start)
        logits, dh, dw = _gemms(rc, v, d, b, f" [{i}]")
        acc_read = 0 if i == 0 else v * d * F32               # the first chunk writes the accumulator
        kernels += [logits,
                    Kernel(f"fused classifier [{i}]", rc * v * b + rc * I64 + F32, rc * v * b + rc * F32,
                           7 * rc * v, rc * v * b),
                    dh,
                    Kernel(dw.name + " (float32 +=)", dw.read_bytes + acc_read, v * d * F32, dw.flops, rc * v * b)]
    kernels += [Kernel("loss = sum(losses) * scale", r * F32, F32, r),
                Kernel("dW to the weight's dtype", v * d * F32, v * d * b),
                Kernel("backward: dh * grad_output", r * d * b, r * d * b, r * d),
                Kernel("backward: dW * grad_output", v * d * b, v * d * b, v * d)]
    grads = (r + v) * d * b
    saved = grads                                             # dh and dW, computed in the forward
    peak = max(min(c, r) * v * b + r * F32 + grads + v * d * F32,   # end of the forward: buffer, losses,
               2 * grads)                                           # dh, dW and the accumulator; backward
    return HeadVersion(f"chunked fused ({min(c, r)} rows a chunk)", Traffic("chunked fused", tuple(kernels)),
                       saved, peak)


def lm_head_loss(rows, vocab, d, dtype="bfloat16", *, chunk_rows=None) -> dict[str, HeadVersion]:
    """The three versions (:data:`VERSIONS`) of ``CE(h @ W.T)``, forward and backward, by name.

    ``dtype`` is the compute dtype of h, W, the logits and the gradients; ``chunk_rows`` defaults to
    :func:`chunk_rows_for` (the tuned path's choice).
    """
    r, v, k = _count("rows", rows), _count("vocab", vocab), _count("d", d)
    b = dtype_bytes(dtype)
    if dtype_name(dtype) not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"lm_head_loss: dtype must be float32, float16 or bfloat16, got {dtype!r}")
    c = chunk_rows_for(r, v, b) if chunk_rows is None else _count("chunk_rows", chunk_rows)
    return {"eager": _eager(r, v, k, b), "unchunked fused": _unchunked(r, v, k, b),
            "chunked fused": _chunked(r, v, k, b, c)}


def lm_head_table(rows, vocab, d, dtype="bfloat16", *, chunk_rows=None) -> list[dict]:
    """One row per version (for a DataFrame): HBM GB, launches, GFLOP, saved and peak GB."""
    return [{"version": hv.label, "HBM GB": round(hv.traffic.total_bytes / 1e9, 3), "launches": hv.traffic.launches,
             "GFLOP": round(hv.traffic.flops / 1e9, 1), "saved GB": round(hv.saved_bytes / 1e9, 3),
             "peak GB": round(hv.peak_bytes / 1e9, 3)}
            for hv in lm_head_loss(rows, vocab, d, dtype, chunk_rows=chunk_rows).values()]


def measure_peak_memory(rows, vocab, d, dtype="bfloat16", *, versions=("eager", "compile", "course"),
                        device="cuda", repeats: int = 2) -> dict[str, int]:
    """Measured bytes above the inputs (h, W, targets) that one forward + backward of each version
    allocates at its peak (``torch.cuda.max_memory_allocated``), on ``device`` (a CUDA GPU).

    ``"eager"``: F.linear + F.cross_entropy(logits.float()); ``"compile"``: that function under
    ``torch.compile``; ``"course"``: :func:`course_utils.ops.linear_ce.linear_cross_entropy`. Each runs
    ``repeats`` times first (compilation, cuBLAS workspaces), then once measured; gradients are set to
    None between runs, so each measurement includes dh and dW.
    """
    import torch  # noqa: PLC0415  (the calculators above stay free of torch)

    from ..ops.linear_ce import linear_cross_entropy
    from ..tuned.linear_cross_entropy import linear_cross_entropy_ref

    if not torch.cuda.is_available():
        raise RuntimeError("measure_peak_memory: needs a CUDA GPU (torch.cuda.max_memory_allocated)")
    tdt = getattr(torch, dtype_name(dtype))
    fns = {"eager": linear_cross_entropy_ref, "compile": torch.compile(linear_cross_entropy_ref),
           "course": linear_cross_entropy}
    unknown = set(versions) - set(fns)
    if unknown:
        raise ValueError(f"measure_peak_memory: unknown versions {sorted(unknown)}; expected some of {sorted(fns)}")
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, d, device=device, generator=gen).to(tdt).requires_grad_(True)
    w = (torch.randn(vocab, d, device=device, generator=gen) * d ** -0.5).to(tdt).requires_grad_(True)
    t = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    out = {}
    for name in versions:
        for i in range(repeats + 1):
            h.grad = w.grad = None
            torch.cuda.synchronize(device)
            if i == repeats:
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            fns[name](h, w, t).backward()
            torch.cuda.synchronize(device)
        out[name] = torch.cuda.max_memory_allocated(device) - base
    h.grad = w.grad = None
    return out


__all__ = ["VERSIONS", "CHUNK_BYTES", "ROW_MULTIPLE", "HeadVersion", "chunk_rows_for", "lm_head_loss",
           "lm_head_table", "measure_peak_memory"]
