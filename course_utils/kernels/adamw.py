"""AdamW with fp32 master weights (chapter 12): the optimizer step that also writes the model's copy.

Version ladder:
- v0 ``torch.optim.AdamW`` on fp32 parameters, the model run under bf16 autocast: every step casts
  each weight to bf16 in the forward and each bf16 weight gradient back to fp32 in the backward.
- v1 ``adamw_kernel``: the model keeps bf16 (or fp16) weights; fp32 master weights and moments live
  beside them, and one kernel per flat block reads the gradient, updates master, m and v, and writes
  the rounded copy of the new weight the next forward uses. No casts anywhere else.
- v2 (tuned shelf, :class:`course_utils.tuned.adamw.MasterAdamW`): every parameter of a model in one
  launch, through a table of pointers.

The update, torch.optim.AdamW's exactly (decoupled weight decay; ``t`` counts steps from 1)::

    w      <- w * (1 - lr * weight_decay)
    m      <- beta1 * m + (1 - beta1) * g
    v      <- beta2 * v + (1 - beta2) * g^2
    w      <- w - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    weight <- w rounded to the model's dtype (round to nearest even)

``t`` and ``lr`` are read from one-element device tensors, so a CUDA graph that captured the launch
replays the next step with the next values and the host never reads them; the bias corrections
``1 - beta^t`` are computed in the kernel, as ``beta^t = 2^(t log2 beta)``. In float32 that power
is within a few ulp of 1 (about 1e-7 absolute), so the relative error of ``1 - beta2^t`` is largest
at t = 1, where it is about 1e-7 / (1 - beta2) = 1e-4 for beta2 = 0.999: a relative change of 5e-5
in the first update, below the rounding of a float32 weight for any learning rate under 1e-3
(torch's capturable AdamW computes the same power in float32 on the device).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

TEACHING_BLOCK = 1024                       # elements per program of :func:`adamw_teaching`
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# --- Kernels -----------------------------------------------------------------------------------


@triton.jit
def adamw_math(g, w, m, v, t, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay):
    """One AdamW step on float32 blocks: returns the new (w, m, v). ``t`` and ``lr`` are float32 scalars.

    sqrt and division are the correctly rounded ones (``sqrt_rn``, ``div_rn``), as torch's CUDA
    kernels compute them: the kernel is bound by memory, the few extra instructions cost nothing."""
    bias_correction1 = 1.0 - tl.exp2(t * log2_beta1)           # 1 - beta1^t
    bias_correction2 = 1.0 - tl.exp2(t * log2_beta2)           # 1 - beta2^t
    w = w * (1.0 - lr * weight_decay)                           # decoupled weight decay first
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), tl.sqrt_rn(bias_correction2)) + eps
    w = w - tl.div_rn(lr, bias_correction1) * tl.div_rn(m, denom)
    return w, m, v


@triton.jit
def adamw_kernel(grad_ptr, master_ptr, m_ptr, v_ptr, weight_ptr, step_ptr, lr_ptr, n_elements,
                 beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(axis=0)
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    t = tl.load(step_ptr).to(tl.float32)                        # this step's number, from the device
    lr = tl.load(lr_ptr).to(tl.float32)
    g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)   # bf16, fp16 or fp32 gradient
    w = tl.load(master_ptr + offsets, mask=mask)                # fp32 master weight, m and v
    m = tl.load(m_ptr + offsets, mask=mask)
    v = tl.load(v_ptr + offsets, mask=mask)
    w, m, v = adamw_math(g, w, m, v, t, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay)
    tl.store(master_ptr + offsets, w, mask=mask)
    tl.store(m_ptr + offsets, m, mask=mask)
    tl.store(v_ptr + offsets, v, mask=mask)
    tl.store(weight_ptr + offsets, w.to(weight_ptr.dtype.element_ty), mask=mask)  # the model's copy


# --- Plain launcher ------------------------------------------------------------------------------


def check_hyperparameters(betas, eps: float, weight_decay: float) -> tuple[float, float]:
    """(beta1, beta2), or a ValueError naming the bad hyperparameter."""
    try:
        beta1, beta2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of floats (beta1, beta2), got {betas!r}") from None
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 < b < 1.0:
            raise ValueError(f"{name} must be in (0, 1), got {b}")
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay}")
    return beta1, beta2


def scalar_args(betas, eps: float, weight_decay: float) -> tuple[float, ...]:
    """The kernel's scalar arguments: beta1, beta2, log2(beta1), log2(beta2), eps, weight_decay."""
    beta1, beta2 = check_hyperparameters(betas, eps, weight_decay)
    return beta1, beta2, math.log2(beta1), math.log2(beta2), float(eps), float(weight_decay)


def _check_flat(name: str, t, like: torch.Tensor, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected {' or '.join(map(str, dtypes))}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but master is on {like.device}: keep them on one device")
    if t.numel() != like.numel():
        raise ValueError(f"{name} has {t.numel()} elements but master has {like.numel()}: one element each")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous: the kernel indexes it as one flat array")


def _check_scalar(name: str, t, like: torch.Tensor, dtypes) -> None:
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype not in dtypes:
        raise TypeError(f"{name} must be a one-element tensor of dtype {' or '.join(map(str, dtypes))} "
                        f"(read on the device, so a CUDA graph replays it), got {t!r}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but master is on {like.device}: keep them on one device")


def adamw_teaching(grad, master, exp_avg, exp_avg_sq, weight, step, lr, *, betas=(0.9, 0.999),
                   eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
    """One AdamW step on a flat block, in place: master, exp_avg (m), exp_avg_sq (v) and weight.

    ``grad`` and ``weight`` are float32, float16 or bfloat16; ``master``, ``exp_avg``, ``exp_avg_sq``
    float32; all contiguous, with the same number of elements. ``step`` is a one-element tensor
    holding this step's number (1 for the first step; the caller adds 1 before each call) and ``lr``
    a one-element float32 tensor: both are read by the kernel, never by the host.
    """
    _check_flat("master", master, master, (torch.float32,))
    _check_flat("exp_avg", exp_avg, master, (torch.float32,))
    _check_flat("exp_avg_sq", exp_avg_sq, master, (torch.float32,))
    _check_flat("grad", grad, master, WEIGHT_DTYPES)
    _check_flat("weight", weight, master, WEIGHT_DTYPES)
    _check_scalar("step", step, master, (torch.int32, torch.int64, torch.float32))
    _check_scalar("lr", lr, master, (torch.float32,))
    args = scalar_args(betas, eps, weight_decay)
    n = master.numel()
    if n > 0:                                                    # empty in, nothing to do, no launch
        adamw_kernel[(triton.cdiv(n, TEACHING_BLOCK),)](grad, master, exp_avg, exp_avg_sq, weight, step, lr, n,
                                                        *args, BLOCK_SIZE=TEACHING_BLOCK)


# --- PyTorch reference (float64) -----------------------------------------------------------------


def adamw_ref(grad, master, exp_avg, exp_avg_sq, step: int, lr: float, *, betas=(0.9, 0.999),
              eps: float = 1e-8, weight_decay: float = 1e-2):
    """The new (master, exp_avg, exp_avg_sq) in float64, for step number ``step`` (1 for the first).

    torch.optim.AdamW's formula written out, on float64 copies (the inputs are not changed)."""
    beta1, beta2 = check_hyperparameters(betas, eps, weight_decay)
    g, w, m, v = (t.detach().double() for t in (grad, master, exp_avg, exp_avg_sq))
    w = w * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = v.sqrt() / math.sqrt(1.0 - beta2 ** step) + eps
    w = w - (lr / (1.0 - beta1 ** step)) * m / denom
    return w, m, v
