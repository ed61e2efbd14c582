"""The optimizer step's bytes under mixed precision (chapter 12): fp32 weights under autocast against
bf16 weights with fp32 master weights updated by one fused kernel.

Logical traffic per parameter per training step, counting only what differs between the two
(the GEMMs read a bf16 weight and write a bf16 weight gradient in both, so those bytes are left out):

(a) **fp32 weights under bf16 autocast, torch's fused AdamW** (what ``torch.autocast`` does):
    forward, each weight a GEMM uses is cast once (autocast caches the cast within the region):
    read fp32, write bf16; backward, the cast's backward turns the bf16 weight gradient into the
    fp32 ``.grad``: read bf16, write fp32; AdamW reads grad, param, m, v (fp32) and writes param, m, v.
(b) **bf16 weights, fp32 masters, one fused kernel** (:class:`course_utils.tuned.adamw.MasterAdamW`):
    no casts; the kernel reads the bf16 gradient and the fp32 master, m and v, and writes master, m,
    v and the bf16 weight.

Parameters that autocast does not cast (those of ops autocast runs in fp32, such as LayerNorm's
weight and bias, or an embedding's table that no GEMM reads) pay no cast: ``n_cast`` says how many
of the parameters are cast.
"""

from __future__ import annotations

from .model import Comparison, Kernel, Traffic
from .units import _count, dtype_bytes, dtype_name

MASTER_BYTES = 4        # fp32 master weight, and each fp32 moment


def autocast_adamw_bytes_per_param(compute_dtype="bfloat16", cast: bool = True) -> dict[str, int]:
    """Bytes per parameter per step of (a): fp32 weights, autocast casts, torch's fused AdamW on fp32.

    ``{"forward cast": 6, "backward cast": 6, "AdamW": 28}`` for bf16 (``cast=False``: a parameter
    autocast leaves in fp32, no cast bytes)."""
    low = dtype_bytes(compute_dtype)
    cast_bytes = MASTER_BYTES + low if cast else 0
    return {"forward cast": cast_bytes,               # read the fp32 weight, write its bf16 copy
            "backward cast": cast_bytes,              # read the bf16 weight gradient, write the fp32 .grad
            "AdamW": 4 * MASTER_BYTES + 3 * MASTER_BYTES}  # read grad, w, m, v; write w, m, v


def master_adamw_bytes_per_param(weight_dtype="bfloat16") -> dict[str, int]:
    """Bytes per parameter per step of (b): ``{"fused AdamW": 28}`` for bf16 weights.

    Reads the gradient (weight dtype) and the fp32 master, m, v; writes master, m, v and the weight."""
    low = dtype_bytes(weight_dtype)
    return {"fused AdamW": (low + 3 * MASTER_BYTES) + (3 * MASTER_BYTES + low)}


def optimizer_step(n_params, *, n_cast=None, n_tensors=None, compute_dtype="bfloat16") -> Comparison:
    """The step's optimizer-related bytes for a whole model of ``n_params`` parameters: (a) against (b).

    ``n_cast``: how many parameters autocast casts (default all). ``n_tensors`` (optional): how many
    parameter tensors the model has, for the notes' launch counts (autocast launches one cast per
    cast tensor in the forward and one in the backward). ``unfused`` is (a), ``fused`` is (b); each
    kernel line is the total over all tensors (launches are in the notes, not in ``launches``).
    """
    n = _count("n_params", n_params)
    cast = n if n_cast is None else _count("n_cast", n_cast, allow_zero=True)
    if cast > n:
        raise ValueError(f"n_cast ({cast}) cannot exceed n_params ({n})")
    name = dtype_name(compute_dtype)
    a_cast, a_plain = autocast_adamw_bytes_per_param(name), autocast_adamw_bytes_per_param(name, cast=False)
    low = dtype_bytes(name)
    autocast = Traffic(f"fp32 weights, {name} autocast + torch fused AdamW", (
        Kernel("forward casts (fp32 weight -> bf16)", cast * MASTER_BYTES, cast * low, 0),
        Kernel("backward casts (bf16 weight grad -> fp32)", cast * low, cast * MASTER_BYTES, 0),
        Kernel("fused AdamW (fp32 grad, w, m, v)", n * 4 * MASTER_BYTES, n * 3 * MASTER_BYTES, 0),
    ))
    master = Traffic(f"{name} weights, fp32 masters, one fused kernel", (
        Kernel(f"fused AdamW (reads {name} grad, fp32 w, m, v; writes w, m, v, {name} weight)",
               n * (low + 3 * MASTER_BYTES), n * (3 * MASTER_BYTES + low), 0),
    ))
    per_param_a = (cast * sum(a_cast.values()) + (n - cast) * sum(a_plain.values())) / n
    notes = [f"bytes/param autocast={per_param_a:g}",
             f"bytes/param master={sum(master_adamw_bytes_per_param(name).values())}"]
    if n_tensors is not None:
        t = _count("n_tensors", n_tensors)
        notes.append(f"cast launches per step <= {2 * t} (one per cast tensor, forward and backward)")
    return Comparison(f"optimizer step of {n:,} parameters ({name} compute)", autocast, master, tuple(notes))


__all__ = ["MASTER_BYTES", "autocast_adamw_bytes_per_param", "master_adamw_bytes_per_param", "optimizer_step"]
