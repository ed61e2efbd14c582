"""Does torch.compile see the course's kernels? On a GPU the ops are ``triton_op``s (course_utils/ops/_lib.py):
while AOTAutograd traces, each launch is recorded as ``wrap_triton(kernel)[grid]``, and Inductor's generated
code launches the kernels itself. This compiles chapter 12's GPT (toy width, bf16 weights) on the course's
ops, runs one forward + backward, and prints which of the course's kernels the generated code launches,
whether any op is still called opaquely (``torch.ops.course``), and how far the compiled loss and
gradients are from the same model run eagerly on the same ops.

    python tools/gpu_checks/visible_ops.py
"""

from __future__ import annotations

import copy
import re

import torch
from torch._inductor.utils import run_and_get_code

from course_utils import gpt
from course_utils.ops import _lib, attn

KERNELS = ("norm_fwd_kernel", "add_layer_norm_fwd_kernel", "add_layer_norm_bwd_kernel", "attn_fwd_tuned_kernel",
           "attn_bwd_dkdv_tuned_kernel", "attn_bwd_dq_tuned_kernel", "attn_bwd_preprocess_kernel",
           "fused_classifier_kernel", "bias_gelu_scale_tuned_kernel", "bias_gelu_backward_kernel",
           "column_sum_pair_kernel", "norm_bwd_kernel", "norm_bwd_row_kernel", "norm_bwd_split_kernel",
           "norm_bwd_chunked_kernel")


ATTENTION_OPS = {"attention_qkv_fwd", "attention_qkv_bwd", "attention_fwd", "attention_bwd"}
ATTENTION_KERNELS = ("attn_fwd_tuned_kernel", "attn_bwd_dkdv_tuned_kernel")   # dQ may be atomic, in dkdv


def main() -> int:
    print(f"INDUCTOR_SEES_KERNELS = {_lib.INDUCTOR_SEES_KERNELS} (torch {torch.__version__})")
    cfg = gpt.GPU
    base = gpt.GPT(cfg).cuda().use("course")
    gpt.bf16_weights(base)
    eager, compiled = base, copy.deepcopy(base)
    x, y = next(gpt.batches(gpt.tokens(), 2, cfg.seq_len, 1, seed=3))
    x, y = x.cuda(), y.cuda()

    def fwd_bwd(model):
        _, loss = model(x, y)
        loss.backward()
        return loss.detach()

    ref = fwd_bwd(eager)
    run = torch.compile(compiled, fullgraph=True)
    got, codes = run_and_get_code(lambda: fwd_bwd(run))
    code = "\n".join(codes)
    seen = {k: len(re.findall(rf"\b{k}\b", code)) for k in KERNELS}
    allowed = set() if attn._VISIBLE else ATTENTION_OPS          # ops/attn.py says when attention is visible
    opaque = sorted(set(re.findall(r"torch\.ops\.course\.(\w+)", code)) - allowed)
    missing = [k for k in ATTENTION_KERNELS if not seen[k]] if attn._VISIBLE else []
    print(f"{len(codes)} generated modules; course kernels named in them:")
    for k, n in seen.items():
        print(f"  {k:32s} {n}")
    print(f"attention visible: {attn._VISIBLE}; its kernels missing from the code: {missing or 'none'}")
    print(f"ops called opaquely (torch.ops.course.*) that should not be: {opaque or 'none'}")
    worst = 0.0
    for a, b in zip(eager.parameters(), compiled.parameters()):
        r = (b.grad.double() - a.grad.double()).abs().max().item() / max(a.grad.double().abs().max().item(), 1e-30)
        worst = max(worst, r)
    loss_rel = abs(got.item() - ref.item()) / abs(ref.item())
    ok = sum(seen.values()) > 0 and not opaque and not missing and loss_rel < 1e-2 and worst < 5e-2
    print(f"loss eager {ref.item():.5f} compiled {got.item():.5f} (rel {loss_rel:.2e}); worst gradient rel diff "
          f"{worst:.2e}")
    print(("PASS" if ok else "FAIL") + ": the compiled step launches the course's kernels itself" if
          _lib.INDUCTOR_SEES_KERNELS else "(opaque ops: COURSE_OPAQUE_OPS set or not on a GPU)")
    return 0 if ok or not _lib.INDUCTOR_SEES_KERNELS else 1


if __name__ == "__main__":
    raise SystemExit(main())
