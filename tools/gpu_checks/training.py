"""GPU sanity checks of chapter 12's model and measurements, in under 3 minutes on an H100.

    python tools/gpu_checks/training.py

Checks, each printed as one line of the table at the end (PASS / FAIL and what was seen):
1. every course op of the model comes from ``torch.ops.course`` (``registry.course_table``);
2. the course version's loss and gradients agree with the torch version's (gpt.GPU, batch 2, bf16);
3. ``torch.compile(course_model, fullgraph=True)`` traces and its step's loss matches eager's;
4. decoding with the KV cache gives the full forward's logits (bottom-right causal), and sampling runs;
5. the profiler's categories: what the step's kernels are, and the names that fell to "elementwise glue"
   (so that the rules of ``course_utils.profile.categorize`` can be checked by eye);
6. the host split of one course step (cProfile) and the per-op host overhead table.
The speed targets themselves are ``python -m benchmarks.run --only training``.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import course_utils as cu  # noqa: E402
from course_utils import gpt, profile  # noqa: E402
from course_utils.autograd import registry  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []
print(cu.banner(), flush=True)


def check(name):
    def wrap(fn):
        t = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as e:
            traceback.print_exc()
            ok, detail = False, f"{type(e).__name__}: {e}"[:200]
        RESULTS.append((name, ok, f"{detail} ({time.perf_counter() - t:.1f} s)"))
        return fn
    return wrap


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def batch(cfg, n=2, seed=3):
    x, y = next(gpt.batches(gpt.tokens(), n, cfg.seq_len, 1, seed=seed))
    return x.cuda(), y.cuda()


@check("1 ops from torch.ops.course")
def _():
    table = registry.course_table()
    return registry.uses_library_ops(), "; ".join(f"{r['op']}: {r['implementation'][:40]}" for r in table)


@check("2 twins agree (loss, gradients)")
def _():
    a, b = gpt.twins(gpt.GPU, "cuda")
    x, y = batch(gpt.GPU)
    worst = 0.0
    with gpt._autocast(x.device):
        la, lb = a(x, y)[1], b(x, y)[1]
    la.backward()
    lb.backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        worst = max(worst, rel(pb.grad, pa.grad))
    loss_rel = abs(float(la) - float(lb)) / float(la)
    return loss_rel < 1e-2 and worst < 5e-2, f"loss rel diff {loss_rel:.1e}, worst gradient rel error {worst:.1e}"


@check("3 course model under torch.compile(fullgraph=True)")
def _():
    model = gpt.GPT(gpt.GPU).cuda().use("course")
    x, y = batch(gpt.GPU)
    with gpt._autocast(x.device):
        eager = float(model(x, y)[1])
        compiled = float(torch.compile(model, fullgraph=True)(x, y)[1])
    d = abs(eager - compiled) / eager
    return d < 1e-2, f"eager {eager:.4f}, compiled {compiled:.4f}"


@check("4 KV-cache decoding = full forward; sampling")
def _():
    worst = 0.0
    for ops in ("torch", "course"):
        model = gpt.GPT(gpt.GPU).cuda().use(ops)
        idx = batch(gpt.GPU, 1)[0][:, :80]
        with torch.no_grad(), gpt._autocast(idx.device):
            full = model(idx)
            cache = gpt.KVCache(gpt.GPU, 1)
            steps = [model(idx[:, :64], cache=cache)[:, -1]]
            steps += [model(idx[:, j:j + 1], cache=cache)[:, -1] for j in range(64, 80)]
        worst = max(worst, rel(torch.stack(steps, 1), full[:, 63:80]))
    text = gpt.generate(gpt.GPT(gpt.GPU).cuda().use("course"), "The kernel", 32)
    return worst < 2e-2, f"worst relative difference {worst:.1e}; sample {text!r}"


@check("5 kernel categories of one step")
def _():
    lines = []
    for ops in ("torch", "course"):
        model = gpt.GPT(gpt.GPU).cuda().use(ops)
        opt = gpt.optimizer(model)
        x, y = batch(gpt.GPU, 8)
        step = lambda: gpt.train_step(model, opt, x, y)  # noqa: E731
        step()
        k = profile.step_kernels(step, steps=1)
        print(profile.by_category(k, 1).to_string(index=False))
        glue = k[k["category"] == "elementwise glue"].groupby("kernel")["us"].agg(["count", "sum"])
        print(glue.sort_values("sum", ascending=False).head(12).to_string())
        lines.append(f"{ops}: {len(k)} launches, {k['us'].sum() / 1e3:.2f} ms GPU-busy")
    return True, "; ".join(lines)


@check("6 host split and per-op overhead")
def _():
    from course_utils import ops
    model = gpt.GPT(gpt.GPU).cuda().use("course")
    opt = gpt.optimizer(model)
    x, y = batch(gpt.GPU, 8)
    gpt.train_step(model, opt, x, y)
    split = profile.host_split(lambda: gpt.train_step(model, opt, x, y))
    print({k: round(v, 2) for k, v in split.items()})
    print(ops.host_overhead_table().round(1).to_string(index=False))
    return True, f"course step under cProfile: {sum(split.values()):.1f} ms"


if __name__ == "__main__":
    width = max(len(n) for n, _, _ in RESULTS)
    print("\n" + "\n".join(f"{'PASS' if ok else 'FAIL'}  {n:{width}s}  {d}" for n, ok, d in RESULTS))
    sys.exit(0 if all(ok for _, ok, _ in RESULTS) else 1)
