"""Elementwise ops on dense non-contiguous inputs, on a GPU (issue 30): layout, values, and what it costs.

    python tools/gpu_checks/elementwise_layouts.py          # about a minute on an H100 (--smoke: tiny, any device)

1. For bf16 and fp32, channels-last, transposed and permuted inputs: ``torch.ops.course.bias_gelu_dropout``
   forward and backward (through autograd), the tuned ``bias_gelu_scale`` / ``bias_gelu_dropout`` and
   ``gelu``: output strides equal the input's, values against float64 (the mask by logical index).
2. Time (CUDA events, L2 flushed, interleaved rounds) of the tuned ``bias_gelu_dropout`` on a 256 MiB
   bf16 input: contiguous (the flat kernel), channels-last read in place (``bias_gelu_strided_kernel``),
   and channels-last copied first (``x.contiguous()`` then the flat kernel: what the op did before), with
   eager PyTorch's dropout(gelu(x + b)) on the channels-last input beside them; GB/s count one read of x
   and one write of y. The last table says whether reading in place beats copying first.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import course_utils as cu  # noqa: E402
from course_utils import bench, check  # noqa: E402
from course_utils.kernels import elementwise as ew  # noqa: E402
from course_utils.kernels import gelu_backward as gb  # noqa: E402
from course_utils.tuned import elementwise as tuned  # noqa: E402

SMOKE = "--smoke" in sys.argv
P, SEED = 0.1, 1234
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def layouts(dtype):
    n, c, h, w = (2, 3, 5, 7) if SMOKE else (8, 768, 33, 17)
    base = check.randn((n, c, h, w), dtype, scale=3.0)
    return {"channels_last": base.to(memory_format=torch.channels_last),
            "transposed": check.randn((4099, 96) if not SMOKE else (13, 6), dtype, scale=3.0).t(),
            "permuted 3-D": check.randn((33, 17, 768) if not SMOKE else (3, 5, 7), dtype, scale=3.0).permute(1, 2, 0)}


def correctness() -> list[dict]:
    import course_utils.ops  # noqa: F401  (registers torch.ops.course)
    rows = []
    dtypes = [torch.float32] + ([torch.bfloat16] if cu.on_gpu() else [])
    for dtype in dtypes:
        for name, x0 in layouts(dtype).items():
            b0 = check.randn((x0.shape[-1],), dtype)
            x, b = x0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
            seed = torch.tensor([SEED], dtype=torch.int64, device=x0.device)
            y = torch.ops.course.bias_gelu_dropout(x, b, P, seed)
            dy = check.randn(x0.shape, dtype)
            dx, db = torch.autograd.grad(y, (x, b), dy)
            keep = ew.dropout_keep_mask_teaching(x0.shape, P, SEED, device=x0.device)
            rx, rb = gb.bias_gelu_backward_ref(dy.double(), x0.double(), b0.double(), keep=keep, p=P)
            outs = {"registered op y": (y, ew.bias_gelu_dropout_ref(x0.double(), b0.double(), P, SEED)),
                    "registered op dx": (dx, rx),
                    "tuned bias_gelu_scale": (tuned.bias_gelu_scale(x0, b0, 0.5),
                                              ew.bias_gelu_scale_ref(x0.double(), b0.double(), 0.5)),
                    "tuned bias_gelu_dropout": (tuned.bias_gelu_dropout(x0, b0, P, SEED),
                                                ew.bias_gelu_dropout_ref(x0.double(), b0.double(), P, SEED)),
                    "tuned gelu": (tuned.gelu(x0), ew.gelu_ref(x0.double()))}
            for what, (got, ref) in outs.items():
                ok, note = got.stride() == x0.stride(), ""
                try:
                    check.compare(what, got, ref, **TOL[dtype])
                except check.CheckFailure as e:
                    ok, note = False, str(e).splitlines()[0][:80]
                rows.append({"dtype": str(dtype)[6:], "layout": name, "op": what, "strides kept":
                             got.stride() == x0.stride(), "ok": ok, "note": note})
            db_err = float((db.double() - rb).abs().max() / rb.abs().max())
            rows.append({"dtype": str(dtype)[6:], "layout": name, "op": "registered op db", "strides kept": True,
                         "ok": db_err < (1e-4 if dtype == torch.float32 else 2e-2), "note": f"rel err {db_err:.1e}"})
    return rows


def timing() -> list[dict]:
    if not cu.on_gpu():
        return []   # the smoke run checks the script; it times nothing on the CPU
    n, c, h, w = 16, 1024, 64, 64     # 2^26 bf16 elements: 128 MiB read + 128 MiB written
    x = torch.randn(n, c, h, w, device="cuda", dtype=torch.bfloat16)
    xl = x.to(memory_format=torch.channels_last)
    b = torch.randn(w, device="cuda", dtype=torch.bfloat16)
    impls = {"contiguous, flat kernel": lambda: tuned.bias_gelu_dropout(x, b, P, SEED),
             "channels_last, read in place": lambda: tuned.bias_gelu_dropout(xl, b, P, SEED),
             "channels_last, copied first": lambda: tuned.bias_gelu_dropout(xl.contiguous(), b, P, SEED),
             "channels_last, eager PyTorch": lambda: F.dropout(F.gelu(xl + b, approximate="tanh"), P)}
    ts = bench.time_rounds(impls, 3, warmup=3, rep=20)
    nbytes = 2 * x.numel() * x.element_size()
    return [{"impl": k, "ms": t.median, "GB/s": bench.gbps(nbytes, t)} for k, t in ts.items()]


def main() -> int:
    import pandas as pd
    pd.set_option("display.width", 200)
    print(cu.banner())
    rows = pd.DataFrame(correctness())
    print(rows.to_string(index=False))
    speed = pd.DataFrame(timing())
    if len(speed):
        print(f"\nbias_gelu_dropout, bf16 16 x 1024 x 64 x 64, p={P} ({cu.env.device_name()}, events, L2 flushed):")
        print(speed.round(3).to_string(index=False))
    bad = rows[~rows.ok]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} checks pass" + (": FAILED " + ", ".join(
        f"{r.dtype} {r.layout} {r.op}" for r in bad.itertuples()) if len(bad) else ""))
    return 1 if len(bad) else 0


if __name__ == "__main__":
    sys.exit(main())
