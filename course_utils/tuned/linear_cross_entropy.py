"""The LM head and its cross-entropy fused by chunks of rows (chapter 12): ``mean(CE(h @ weight.T, targets))``
without ever holding the (rows x vocab) logits, in float32 or in full.

For each chunk of ``c`` rows (``h_c`` is (c, d), ``weight`` is (vocab, d), the head tied to the embedding):

    logits_c   = h_c @ weight.T                      cuBLAS (torch.mm), into one reused (c, vocab) buffer
    loss_c, g  = fused classifier(logits_c)          one Triton kernel: g = dloss/dlogits_c, written over logits_c
    dh_c       = g @ weight                          cuBLAS, into its rows of the preallocated dh
    dweight   += g.T @ h_c                           cuBLAS, accumulated in float32 on CUDA (see below)

The loss is the end of the graph, so its gradient can be computed in the forward: d(loss)/d(logits) does
not depend on anything after the loss except one number, the incoming gradient ``grad_output`` (1 for
``loss.backward()``, 3 for ``(3 * loss).backward()``). The forward returns the mean loss and keeps dh and
dweight; the backward multiplies them by ``grad_output`` on the device (no host read: a CUDA graph replays
it) and returns them. So the LM head's backward costs no GEMM after the forward: the three GEMMs all
run there, and no logits are saved between the passes.

**Chunk size.** Two pulls: a chunk's logits buffer, ``c x vocab x 2`` bytes in bf16, is the memory the
head needs, so ``c`` should be small; but every chunk after the first rereads and rewrites the float32
dweight accumulator (``2 x vocab x d x 4`` bytes: 310 MB for GPT-2 small) while its three GEMMs do
``6 c vocab d`` FLOPs, so ``c`` should be large (and a GEMM whose inner dimension, c for dweight, is below a
few hundred runs far from cuBLAS's peak). :func:`chunk_rows_for` takes the most rows whose buffer fits
``CHUNK_BYTES`` (512 MiB: 5336 rows of GPT-2's 50304-entry vocabulary in bf16), then evens the chunks
out in multiples of ``ROW_MULTIPLE``: 8192 rows are 2 chunks of 4096 (412 MB of logits, where eager holds
824 MB in bf16 and 1.65 GB in float32), 16384 rows 4 chunks of 4096. Liger's rule (rows / ceil(vocab / d)
rounded to a power of two: 128 rows here) holds less but rereads the accumulator 64 times.
``tools/gpu_checks/linear_cross_entropy.py`` times other chunk sizes next to this choice.

**dweight precision.** On CUDA with bf16/fp16 inputs the accumulation uses ``torch.mm`` / ``torch.addmm``
with ``out_dtype=torch.float32`` (CUDA only, for fp16/bf16 inputs, as torch 2.13's ``torch.addmm`` documents):
every chunk's partial product is added in float32 and rounded to the weight's dtype once, at the end.
Where ``addmm`` refuses a float32 accumulator (some torch versions want it in the inputs' dtype), each
chunk's float32 product is added by one more kernel (``ACCUMULATE_IN_PLACE`` records it). Where those
overloads do not exist at all, the accumulator has the weight's dtype and each of the n chunks adds a
rounding of up to 2**-9 relative (bf16): about n x 2**-9 in all. On CPU (the interpreter's tests) the
chunk is upcast to float32.

v1  ``linear_cross_entropy_ref``: ``F.linear`` + ``F.cross_entropy(logits.float())`` (eager: bf16
    logits, a float32 copy, log-softmax, and the backward of each).
v2  ``linear_cross_entropy``: the chunked forward above, an ``autograd.Function``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import fused_classifier as K
from ..state import RuntimeCache
from ..traffic.classifier import CHUNK_BYTES, ROW_MULTIPLE, chunk_rows_for  # the chunk rule is a bytes rule
from .launch import launch, traced

__all__ = ["CHUNK_BYTES", "ROW_MULTIPLE", "chunk_rows_for", "check", "linear_cross_entropy_forward",
           "linear_cross_entropy_backward", "LinearCrossEntropy", "linear_cross_entropy", "linear_cross_entropy_ref"]



def check(h, weight, targets, what: str = "linear_cross_entropy") -> None:
    if not all(isinstance(t, torch.Tensor) for t in (h, weight, targets)):
        raise TypeError(f"{what}: h, weight and targets must be torch.Tensors")
    if h.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"{what}: h must be (rows, d) and weight (vocab, d), got shapes {tuple(h.shape)} and "
                         f"{tuple(weight.shape)} (flatten the leading dims: h.view(-1, d))")
    if h.dtype not in K.DTYPES or weight.dtype != h.dtype:
        raise TypeError(f"{what}: h and weight must both be float32, float16 or bfloat16, got {h.dtype} and "
                        f"{weight.dtype}")
    if h.shape[1] != weight.shape[1]:
        raise ValueError(f"{what}: h has {h.shape[1]} features but weight (vocab, d) has {weight.shape[1]}")
    if weight.shape[0] == 0 or h.shape[1] == 0:
        raise ValueError(f"{what}: the vocabulary and the width must not be empty, got weight shape "
                         f"{tuple(weight.shape)}")
    if h.device != weight.device or targets.device != h.device:
        raise ValueError(f"{what}: h, weight and targets must be on one device, got {h.device}, {weight.device}, "
                         f"{targets.device}")
    if targets.shape != h.shape[:1] or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what}: targets must be int64 or int32 of shape ({h.shape[0]},), got {targets.dtype} "
                         f"of shape {tuple(targets.shape)}")


#: device -> False once torch.addmm(acc_fp32, g.T, h, out_dtype=float32) has refused a float32 ``acc`` (some
#: torch versions require it in the inputs' dtype); then each chunk adds a float32 product instead.
ACCUMULATE_IN_PLACE: dict = RuntimeCache()


def _fp32_out_dtype_gemm(t: torch.Tensor) -> bool:
    """Whether torch.mm/addmm can take ``t``'s half-precision operands to a float32 output on its device."""
    return t.is_cuda and hasattr(torch.ops.aten.addmm, "dtype_out") and hasattr(torch.ops.aten.mm, "dtype_out")


def _accumulator(weight: torch.Tensor) -> torch.Tensor:
    fp32 = weight.dtype == torch.float32 or not weight.is_cuda or _fp32_out_dtype_gemm(weight)
    return torch.empty(weight.shape, dtype=torch.float32 if fp32 else weight.dtype, device=weight.device)


def _accumulate(acc: torch.Tensor, g: torch.Tensor, h_c: torch.Tensor, first: bool) -> None:
    """acc (vocab, d) = (acc if not first) + g.T @ h_c; the first chunk writes acc (no zero fill)."""
    gt = g.t()
    if acc.dtype == g.dtype:                        # float32 inputs, or no float32-output GEMM
        if first:
            torch.mm(gt, h_c, out=acc)
        else:
            acc.addmm_(gt, h_c)
    elif acc.is_cuda:                               # half inputs, float32 accumulator
        if first:
            torch.mm(gt, h_c, out_dtype=torch.float32, out=acc)
        elif ACCUMULATE_IN_PLACE.get(acc.device, True) and not traced(acc):   # (torch 2.11's decomposition of
            # addmm with out_dtype misreads it while torch.compile traces: then the product and the add)
            try:                                    # one cuBLAS call: acc = acc + g.T @ h_c, in float32
                torch.addmm(acc, gt, h_c, out_dtype=torch.float32, out=acc)
            except RuntimeError:                    # a torch whose addmm wants `acc` in the inputs' dtype
                ACCUMULATE_IN_PLACE[acc.device] = False
                acc.add_(torch.mm(gt, h_c, out_dtype=torch.float32))
        else:                                       # a float32 product, then an add: 3 more passes over dW
            acc.add_(torch.mm(gt, h_c, out_dtype=torch.float32))
    elif first:                                     # CPU: upcast the chunk (tests only)
        torch.mm(gt.float(), h_c.float(), out=acc)
    else:
        acc.addmm_(gt.float(), h_c.float())


def linear_cross_entropy_forward(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 ignore_index: int = K.IGNORE_INDEX, chunk_rows: int | None = None,
                                 block: int | None = None, num_warps: int | None = None):
    """(loss, dh, dweight): the float32 mean loss over the rows not ignored (0-d) and its gradients with
    respect to h ((rows, d), contiguous, h's dtype) and weight ((vocab, d), weight's dtype)."""
    check(h, weight, targets)
    rows, d = h.shape
    vocab = weight.shape[0]
    chunk = chunk_rows or chunk_rows_for(rows, vocab, h.element_size())
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows must be a positive int, got {chunk_rows!r}")
    block = block or K.block_size(vocab)
    num_warps = num_warps or (8 if block > 1024 else 4)       # as course_utils.ops.loss plans cross_entropy
    targets = targets.contiguous()
    scale = K.mean_scale(targets, ignore_index)               # 1 / rows not ignored, on the device
    dh = torch.empty((rows, d), dtype=h.dtype, device=h.device)
    # Eager: one logits buffer reused by every chunk, the kernel writes each chunk's losses into a slice of one
    # vector. While torch.compile traces, the kernel writes whole tensors of its own: Inductor's copies around
    # a user kernel that writes successive slices of one buffer read past that buffer's end (an illegal
    # address on the H100 under CUDA graphs, GPT-2 small at B=16), and it reuses memory itself.
    per_chunk = traced(h)
    losses = None if per_chunk else torch.empty(rows, dtype=torch.float32, device=h.device)
    logits = None if per_chunk else torch.empty((min(chunk, rows), vocab), dtype=h.dtype, device=h.device)
    chunk_losses = []
    acc = _accumulator(weight)
    wt = weight.t()
    for i, start in enumerate(range(0, rows, chunk)):
        stop = min(start + chunk, rows)
        h_c = h[start:stop]
        if per_chunk:
            g = torch.empty((stop - start, vocab), dtype=h.dtype, device=h.device)
            losses_c = torch.empty(stop - start, dtype=torch.float32, device=h.device)
            chunk_losses.append(losses_c)
        else:
            g, losses_c = logits[:stop - start], losses[start:stop]
        torch.mm(h_c, wt, out=g)
        _classify(g, targets[start:stop], scale, int(ignore_index), losses_c, block, num_warps)
        torch.mm(g, weight, out=dh[start:stop])
        _accumulate(acc, g, h_c, first=i == 0)
    if rows == 0:
        acc.zero_()
    if per_chunk:
        losses = torch.cat(chunk_losses) if chunk_losses else torch.zeros(0, dtype=torch.float32, device=h.device)
    dweight = acc if acc.dtype == weight.dtype else acc.to(weight.dtype)
    return losses.sum() * scale, dh, dweight


def _classify(g, targets_c, scale, ignore_index: int, losses_c, block: int, num_warps: int) -> None:
    """``fused_classifier_teaching(g, targets_c, scale, ...)`` on a chunk this module made from checked inputs
    (g: the chunk's logits, scale: the device tensor of ``mean_scale``): the same kernel and arguments,
    through the ops' cheaper launch (:mod:`.launch`), without the per-chunk checks that cannot fail here."""
    launch(K.fused_classifier_kernel, "fused_classifier", (g.shape[0],),
           (g, losses_c, targets_c, scale, 0.0, g.shape[1], g.stride(0), ignore_index),
           dict(SCALE_FROM_PTR=True, BLOCK_SIZE=block, NUM_STAGES=2, num_warps=num_warps))


def linear_cross_entropy_backward(grad_output: torch.Tensor, dh: torch.Tensor, dweight: torch.Tensor):
    """(dh, dweight) times the incoming gradient of the loss, read on the device."""
    return dh * grad_output, dweight * grad_output


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, chunk_rows):
        loss, dh, dweight = linear_cross_entropy_forward(h, weight, targets, ignore_index, chunk_rows)
        ctx.save_for_backward(dh, dweight)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        dh, dweight = ctx.saved_tensors
        return (*linear_cross_entropy_backward(grad_output, dh, dweight), None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int | None = None,
                         ignore_index: int = K.IGNORE_INDEX) -> torch.Tensor:
    """v2: ``F.cross_entropy(h @ weight.T, targets, ignore_index=ignore_index)`` (float32 scalar), chunked:
    the gradients of h and weight are computed here and handed out by the backward."""
    return LinearCrossEntropy.apply(h, weight, targets, int(ignore_index), chunk_rows)


def linear_cross_entropy_ref(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             ignore_index: int = K.IGNORE_INDEX) -> torch.Tensor:
    """v1: eager, the logits in h's dtype and then in float32 (float64 inputs stay float64)."""
    logits = F.linear(h, weight)
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), targets.long(),
                           ignore_index=ignore_index)


def measure_peak_memory(rows, vocab, d, dtype="bfloat16", *, versions=("eager", "compile", "course"),
                        device="cuda", repeats: int = 2) -> dict[str, int]:
    """Measured bytes above the inputs (h, W, targets) that one forward + backward of each version
    allocates at its peak (``torch.cuda.max_memory_allocated``), on ``device`` (a CUDA GPU).

    ``"eager"``: F.linear + F.cross_entropy(logits.float()); ``"compile"``: that function under
    ``torch.compile``; ``"course"``: :func:`course_utils.ops.linear_ce.linear_cross_entropy`. Each runs
    ``repeats`` times first (compilation, cuBLAS workspaces), then once measured; gradients are set to
    None between runs, so each measurement includes dh and dW.
    """
    from ..ops.linear_ce import linear_cross_entropy
    from ..traffic.units import dtype_name

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
