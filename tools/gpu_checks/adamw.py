"""GPU checks and timing of AdamW with fp32 master weights (chapter 12), in about a minute on an H100.

    python tools/gpu_checks/adamw.py

Checks, each one line of the table at the end (PASS / FAIL and what was seen):
1. bf16 (and fp16) weights: ``MasterAdamW`` follows torch's fused AdamW run on an fp32 copy over 20
   steps on the same gradients (masters within fp32 rounding, the weights its bf16 rounding);
2. a CUDA graph of backward + ``step()`` on a small bf16 MLP, replayed on changing inputs (and a new
   learning rate), gives the same losses and weights as the same steps run eagerly; an eager step after
   the replays still agrees (eager and graphed steps mixed);
3. host cost of one ``step()``: microseconds and Python function calls (cProfile), beside torch's fused
   AdamW on the same number of tensors.
Timing (GPT-2 small's 148 parameter tensors, 124.5 M parameters): the course's one-launch step on bf16
weights, the teaching kernel on one flat block, torch's fused AdamW on fp32 parameters, and the casts
autocast adds around it (each fp32 weight to bf16 in the forward, each bf16 weight gradient to fp32 in
the backward, timed as a CUDA graph of one cast per tensor), with GB/s against the bytes of
``course_utils.traffic.optimizer``.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import course_utils as cu  # noqa: E402
from course_utils import bench, traffic  # noqa: E402
from course_utils.kernels import adamw as teaching  # noqa: E402
from course_utils.tuned import adamw as tuned  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"          # on a CPU (interpreter) only check 1 runs, in fp16: a smoke test
RESULTS: list[tuple[str, bool, str]] = []
TIMES: list[dict] = []
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
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


def gpt2_small_shapes(vocab=50304, n_ctx=1024, d=768, layers=12) -> list[tuple[int, ...]]:
    """GPT-2 small's parameter tensors (the LM head tied to the token embedding): 148 tensors."""
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [(vocab, d), (n_ctx, d)] + block * layers + [(d,), (d,)]


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@check("1 bf16/fp16 weights follow torch fused AdamW on fp32 (20 steps)")
def _():
    shapes = [(1,), (7,), (1000,), (4099,), (768, 768), (3 * 768,), (333, 1001)]
    details, ok = [], True
    for dtype in (torch.bfloat16, torch.float16) if GPU else (torch.float16,):
        src = [torch.randn(s, device=DEVICE) * 0.02 for s in shapes]
        ref = [w.clone().requires_grad_() for w in src]
        topt = torch.optim.AdamW(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
        params = [w.to(dtype) for w in src]
        opt = tuned.MasterAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master_from=src)
        for _ in range(20):
            for p, r in zip(params, ref):
                p.grad = torch.randn(p.shape, device=DEVICE).to(dtype)
                r.grad = p.grad.float()
            opt.step()
            topt.step()
        worst = max(rel(w, r.detach()) for w, r in zip(opt.masters(), ref))
        rounded = all(torch.equal(p, w.to(dtype)) for p, w in zip(params, opt.masters()))
        # the model's copy against torch's fp32 weights rounded: equal but where the masters differ by an ulp
        off = sum(int((p != r.detach().to(dtype)).sum()) for p, r in zip(params, ref))
        total = sum(p.numel() for p in params)
        ok &= worst < 1e-5 and rounded and off <= total * 1e-3
        details.append(f"{str(dtype)[6:]}: master max rel err {worst:.1e}, weight==round(master) {rounded}, "
                       f"{off}/{total} weights differ from round(torch fp32)")
    return ok, "; ".join(details)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                               torch.nn.Linear(256, 10)).cuda().to(torch.bfloat16)


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def graph_check():
    eager, graphed = _mlp(), _mlp()
    opt_e = tuned.MasterAdamW(eager.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    opt_g = tuned.MasterAdamW(graphed.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    batches = [(torch.randn(32, 64, device=DEVICE, generator=gen).to(torch.bfloat16),
                torch.randint(0, 10, (32,), device=DEVICE, generator=gen)) for _ in range(16)]
    x, y = (t.clone() for t in batches[0])
    losses_e, losses_g = [], []

    def eager_step(xb, yb):
        loss = _loss(eager, xb, yb)
        loss.backward()
        opt_e.step()
        opt_e.zero_grad(set_to_none=True)
        losses_e.append(float(loss))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                          # warm-up: compiles, allocates, builds a table
        for xb, yb in batches[:3]:
            x.copy_(xb)
            y.copy_(yb)
            loss = _loss(graphed, x, y)
            loss.backward()
            opt_g.step()
            opt_g.zero_grad(set_to_none=True)
            losses_g.append(float(loss))
    torch.cuda.current_stream().wait_stream(side)
    for xb, yb in batches[:3]:
        eager_step(xb, yb)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _loss(graphed, x, y)
        static_loss.backward()
        opt_g.step()
    for i, (xb, yb) in enumerate(batches[3:15]):
        if i == 6:                                         # a new learning rate, written on the device
            opt_g.lr.fill_(LR / 2)
            opt_e.lr.fill_(LR / 2)
        x.copy_(xb)
        y.copy_(yb)
        graph.replay()
        losses_g.append(float(static_loss))
        eager_step(xb, yb)
    for p in graphed.parameters():                         # then an eager step on the graphed model
        p.grad = None
    xb, yb = batches[15]
    loss = _loss(graphed, xb, yb)
    loss.backward()
    opt_g.step()
    losses_g.append(float(loss))
    eager_step(xb, yb)
    torch.cuda.synchronize()
    worst_w = max(rel(a, b) for a, b in zip(graphed.parameters(), eager.parameters()))
    worst_m = rel(opt_g.master, opt_e.master)
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses_g, losses_e))
    same = worst_w == 0.0 and worst_m == 0.0
    ok = worst_w < 1e-2 and worst_m < 1e-5 and worst_loss < 1e-3 and float(opt_g.step_count) == 16
    return ok, (f"{len(losses_g)} steps (3 warm-up, 12 replays, 1 eager): loss rel diff {worst_loss:.1e}, masters "
                f"{worst_m:.1e}, weights {worst_w:.1e}{' (bitwise equal)' if same else ''}; tables built: "
                f"graphed {opt_g.rebuilds}, eager {opt_e.rebuilds}")


def _params(dtype, grad_dtype=None, shapes=None):
    shapes = shapes or gpt2_small_shapes()
    params = [torch.randn(s, device=DEVICE).mul_(0.02).to(dtype) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=DEVICE).mul_(1e-3).to(grad_dtype or dtype)
    return params


def _python_calls(fn) -> int:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return pstats.Stats(prof).total_calls


def _host_us(fn, n=30) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    return sorted(times)[n // 2]


HOST: dict[str, tuple[float, int]] = {}


def host_check():
    shapes = gpt2_small_shapes(vocab=1024, n_ctx=64)       # the same 148 tensors, small: the host is the cost
    params = _params(torch.bfloat16, shapes=shapes)
    opt = tuned.MasterAdamW(params, lr=LR, betas=BETAS, weight_decay=WD)
    ref = _params(torch.float32, shapes=shapes)
    topt = torch.optim.AdamW(ref, lr=LR, betas=BETAS, weight_decay=WD, fused=True)
    opt.step()
    before = opt.rebuilds
    for name, fn in (("course MasterAdamW", opt.step), ("torch fused AdamW", topt.step)):
        HOST[name] = (_host_us(fn), _python_calls(fn))
    ok = opt.rebuilds == before == 1                           # the gradients never moved: one table
    return ok, "; ".join(f"{k}: {us:.0f} us, {calls} Python calls per step" for k, (us, calls) in HOST.items())


def timing():
    n = sum(torch.Size(s).numel() for s in gpt2_small_shapes())
    per = {"course": sum(traffic.master_adamw_bytes_per_param().values()),
           "adamw32": traffic.autocast_adamw_bytes_per_param()["AdamW"],
           "casts": traffic.autocast_adamw_bytes_per_param()["forward cast"]
           + traffic.autocast_adamw_bytes_per_param()["backward cast"]}
    bf = _params(torch.bfloat16)
    opts = {b: tuned.MasterAdamW(bf, lr=LR, betas=BETAS, weight_decay=WD, block_size=b) for b in (1024, 2048, 4096)}
    fp = _params(torch.float32)
    topt = torch.optim.AdamW(fp, lr=LR, betas=BETAS, weight_decay=WD, fused=True)
    bf_copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in fp]
    bf_grads = [p.grad.to(torch.bfloat16) for p in fp]

    def casts():                                           # what autocast adds around the fp32 step
        for p, c in zip(fp, bf_copies):
            c.copy_(p)                                     # forward: fp32 weight -> bf16 copy
        for p, g in zip(fp, bf_grads):
            p.grad.copy_(g)                                # backward: bf16 weight grad -> fp32 .grad

    flat = [torch.zeros(n, device=DEVICE) for _ in range(3)]
    flat_g, flat_w = torch.randn(n, device=DEVICE).to(torch.bfloat16), torch.empty(n, device=DEVICE,
                                                                                   dtype=torch.bfloat16)
    step_t, lr_t = torch.ones(1, device=DEVICE), torch.full((1,), LR, device=DEVICE)

    def flat_teaching():
        teaching.adamw_teaching(flat_g, *flat, flat_w, step_t, lr_t, betas=BETAS, weight_decay=WD)

    graph_timer = lambda fn, **kw: bench.time_ms(fn, cuda_graph=True, graph_calls=2, **kw)  # noqa: E731
    impls = {f"course MasterAdamW bf16, block {b}": opt.step for b, opt in opts.items()}
    impls["course teaching kernel, one flat block"] = flat_teaching
    impls["torch fused AdamW fp32"] = topt.step
    impls["autocast casts (fwd + bwd), graphed"] = (casts, graph_timer)
    got = bench.time_rounds(impls, rounds=5, warmup=3, rep=10)
    for key, t in got.items():
        b = per["casts"] if key.startswith("autocast") else per["adamw32"] if key.startswith("torch") else per["course"]
        TIMES.append({"what": key, "ms": t.median, "bytes/param": b, "GB/s": b * n / (t.median * 1e-3) / 1e9})
    best = min((r for r in TIMES if r["what"].startswith("course MasterAdamW")), key=lambda r: r["ms"])
    torch_total = sum(r["ms"] for r in TIMES if r["what"].startswith(("torch", "autocast")))
    TIMES.append({"what": "torch fused AdamW fp32 + autocast casts", "ms": torch_total,
                  "bytes/param": per["adamw32"] + per["casts"],
                  "GB/s": (per["adamw32"] + per["casts"]) * n / (torch_total * 1e-3) / 1e9})
    fused32 = next(r["ms"] for r in TIMES if r["what"].startswith("torch"))
    print(f"\n{n:,} parameters in {len(gpt2_small_shapes())} tensors; course best ({best['what']}): "
          f"{fused32 / best['ms']:.2f}x torch fused AdamW alone, {torch_total / best['ms']:.2f}x it + the casts")


if GPU:
    check("2 CUDA graph of backward + step() = eager (MLP, bf16)")(graph_check)
    check("3 host cost of one step (148 tensors, no rebuild)")(host_check)
    try:
        timing()
    except Exception as e:
        traceback.print_exc()
        RESULTS.append(("4 timing", False, f"{type(e).__name__}: {e}"[:200]))
else:
    RESULTS.append(("2-4 graph, host cost, timing", False, "skipped: no CUDA GPU (run this on a GPU)"))

print("\ncheck | result | detail")
for name, ok, detail in RESULTS:
    print(f"{name} | {'PASS' if ok else 'FAIL'} | {detail}")
if TIMES:
    print(f"\ntiming on {torch.cuda.get_device_name()} (median of 5 interleaved rounds; GPU ms per step)")
    print(f"{'what':48s} {'ms':>8s} {'B/param':>8s} {'GB/s':>8s}")
    for r in TIMES:
        print(f"{r['what']:48s} {r['ms']:8.3f} {r['bytes/param']:8d} {r['GB/s']:8.0f}")
if HOST:
    print("\nhost per step (148 tensors): " + "; ".join(f"{k} {us:.0f} us, {c} Python calls"
                                                          for k, (us, c) in HOST.items()))
sys.exit(0 if all(ok for _, ok, _ in RESULTS) else 1)
