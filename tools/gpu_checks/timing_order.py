"""Does a kernel's place in an interleaved round change its time? (chapter 8's protocol, issue 29)

The same tuned attention forward is entered three times (``same#1..3``: one kernel, one binary), beside
cuDNN's and FlashAttention-2's forward through SDPA, and timed by ``timing.time_rounds``: first in a fixed
order, then in balanced orders (``balance=True``), then balanced with a warm-up long in time
(``warmup_ms``). A power-limited GPU that has just run a lighter kernel runs the next one at higher
clocks for a while; if so, the fixed order gives ``same#1`` a lead over ``same#2`` and ``same#3`` that no
code explains. Prints each entry's median, and the spread of the three copies in each protocol.

    python tools/gpu_checks/timing_order.py          # one H100/H200, about a minute
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import course_utils as cu  # noqa: E402
from course_utils import timing  # noqa: E402
from course_utils.tuned import attention as TA  # noqa: E402

CASES = ((16384, 1, True), (4096, 4, False))   # N, batch, causal; 16 heads of d = 128, bf16
ROUNDS = 6


def sdpa(backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def impls(n, b, causal):
    q, k, v = (torch.randn(b, 16, n, 128, device=cu.DEVICE, dtype=torch.bfloat16) for _ in range(3))
    TA.flash_attention(q, k, v, causal)
    cfg = TA.last_config
    same = {f"same#{i}": (lambda: TA.flash_attention(q, k, v, causal, config=cfg)) for i in (1, 2, 3)}
    return same | {"cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal),
                   "flash2": lambda: sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal)}


def main() -> int:
    if not cu.on_gpu():
        print("timing_order.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(cu.env.banner(), flush=True)
    protocols = {"fixed, 2 calls warm-up": {"balance": False, "warmup_ms": 0.0},
                 "balanced, 2 calls warm-up": {"warmup_ms": 0.0},
                 "balanced, 100 ms warm-up": {"warmup_ms": 100.0}}
    for n, b, causal in CASES:
        fns = impls(n, b, causal)
        for name, kw in protocols.items():
            t = timing.time_rounds(fns, ROUNDS, warmup=2, rep=8, **kw)
            ms = {key: v.median for key, v in t.items()}
            copies = [ms[f"same#{i}"] for i in (1, 2, 3)]
            print(f"N={n:>5} causal={causal!s:<5} {name:<26} " + " ".join(f"{k} {v:.3f}" for k, v in ms.items())
                  + f" | copies' spread {max(copies) / min(copies) - 1:6.1%}, cudnn/same#1 "
                  f"{ms['cudnn'] / ms['same#1']:.3f}, cudnn/same#3 {ms['cudnn'] / ms['same#3']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
