"""Chapter 12 benchmark: one training step of the GPT, eager PyTorch and ``torch.compile`` against the
course's ops, like with like, in one run.

Configuration: ``course_utils.gpt.GPU`` (6 layers, width 768, 12 heads, 1024 tokens per sequence),
batch 8, bf16 autocast with float32 master weights, fused AdamW for every version. Eight ways to run
the same step (:data:`IMPLS`), timed in interleaved rounds; for each one the host's time to issue a
step, the GPU-busy time (sum of its kernels' durations, torch.profiler), its kernels by category
and its own peak memory; MFU. Also written (``_quick`` appended to the names under ``--quick``, so a
quick run never overwrites a full one's side files): ``training_categories.csv`` (launches and GPU
ms per step by category, per version), ``training_kernels.csv`` (the largest kernels of each),
``training_host.csv`` (one step's host time by who spends it, cProfile, eager and course),
``training_overhead.csv`` (host us per call of each course op against aten's),
``training_ladder.csv`` (the fusions added one at a time, :data:`LADDER`), ``training_loss.csv``
(every step's loss of both versions: same weights, same batches), ``training_divergence.csv`` (when
a step differs by more than :data:`LOSS_TOLERANCE`: that batch replayed through both versions, each
layer against float32) and ``training_sample.csv`` (text from the trained course model).
"""

from __future__ import annotations

import copy
import functools
import gc
import sys
import time

import pandas as pd
import torch

from course_utils import bench, gpt, hardware, profile
from course_utils.autograd import registry

TITLE = "GPT training step: eager, torch.compile and the course's ops (chapter 12)"
BATCH = 8
LOSS_STEPS, QUICK_LOSS_STEPS = 200, 50
LOSS_TOLERANCE = 0.02      # |loss_course - loss_torch| / loss_torch at every step
ISSUE = 24
SAMPLE_PROMPT, SAMPLE_BYTES = "Fusion ", 300
#: name -> (ops, how the step runs)
IMPLS = {
    "eager": ("torch", "python"),
    "torch.compile": ("torch", "compile"),
    "course": ("course", "python"),
    "course + torch.compile": ("course", "compile"),
    "eager + CUDA graph": ("torch", "graph"),
    "course + CUDA graph": ("course", "graph"),
    "torch.compile reduce-overhead": ("torch", "reduce-overhead"),
    "course + torch.compile reduce-overhead": ("course", "reduce-overhead"),
}


def _log(msg: str, t0: float) -> None:  # what took how long, on stderr (make bench's log)
    print(f"[training {time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=2)
def _weights(cfg) -> gpt.GPT:
    return gpt.GPT(cfg)  # initialized once on the CPU (43M normal draws); every version copies it


def _model(cfg, ops):
    return copy.deepcopy(_weights(cfg)).cuda().use(ops)


def _batch(cfg, data, seed: int = 7):
    x, y = next(gpt.batches(data, BATCH, cfg.seq_len, 1, seed=seed))
    return x.cuda(), y.cuda()


def build(name: str, cfg, data, warmup: int = 3):
    """The zero-argument step of version ``name``, warmed up (compiled, tiles chosen, graph captured)."""
    ops, how = IMPLS[name]
    model = _model(cfg, ops)
    x, y = _batch(cfg, data)
    if how == "graph":
        replay, _ = gpt.graphed_step(model, x, y, warmup=warmup)
        return replay
    opt = gpt.optimizer(model)
    mode = {"compile": "default", "reduce-overhead": "reduce-overhead"}.get(how)
    run = model if mode is None else torch.compile(model, fullgraph=True, mode=mode)

    def step():
        return gpt.train_step(run, opt, x, y)

    for _ in range(warmup):
        step()
    return step


#: Chapter 12's fusion ladder: (step, the ops taken from torch.ops.course, fused AdamW); each step keeps
#: the ones before it. None: eager PyTorch, the reference.
LIBRARY = tuple(registry.COURSE_CANDIDATES)
LADDER = [
    ("eager PyTorch", None, True),
    ("chapter 11's step (its ops, AdamW foreach)", (), False),
    (profile.FUSIONS[0], (), True),
    (profile.FUSIONS[1], ("attention",), True),
    (profile.FUSIONS[2], ("attention", "layer_norm", "add_layer_norm"), True),
    (profile.FUSIONS[3], ("attention", "layer_norm", "add_layer_norm", "linear_gelu"), True),
    (profile.FUSIONS[4], LIBRARY, True),
]


def ladder(cfg, data) -> pd.DataFrame:
    """Each step of :data:`LADDER` from Python: launches, GPU-busy and host time per training step, and
    launches and GPU milliseconds per kernel category."""
    rows = []
    for i, (what, library, fused) in enumerate(LADDER):
        ops = "torch" if library is None else registry.course_ops(library=library)
        model = _model(cfg, ops)
        opt = gpt.optimizer(model, fused=fused)
        x, y = _batch(cfg, data)

        def step(model=model, opt=opt, x=x, y=y):
            return gpt.train_step(model, opt, x, y)

        for _ in range(3):
            step()
        k = profile.step_kernels(step, steps=2)
        row = {"rung": i, "step": what, "launches": len(k) / 2, "gpu_busy_ms": k["us"].sum() / 2e3,
               "host_ms": host_ms(step)}
        for _, c in profile.by_category(k, 2).iloc[:-1].iterrows():
            row[f"launches {c['category']}"], row[f"gpu_ms {c['category']}"] = c["launches"], c["gpu_ms"]
        rows.append(row)
        del model, opt, step
        gc.collect()
        torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def _sync_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**30


def peak_alone(name: str, cfg, data) -> tuple[float, float]:
    """``(peak, resident)``: the peak GiB allocated by one steady step of ``name`` (after its warm-up),
    no other version resident: weights, gradients, optimizer state and the step's activations, above
    the ``resident`` GiB allocated before the model was built (cuBLAS's workspaces; under ``make
    bench``, whatever earlier topics keep)."""
    gc.collect()
    torch.cuda.empty_cache()
    before = _sync_gib()
    step = build(name, cfg, data)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 - before
    del step
    gc.collect()
    torch.cuda.empty_cache()
    return peak, before


def host_ms(fn, calls: int = 5) -> float:
    """Median host time to issue one call (the GPU idle at the start, not waited for at the end)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def _kernel_rows(name, kernels, steps, limit=20):
    if kernels.empty:
        return pd.DataFrame()
    g = kernels.groupby(["kernel", "category"])["us"].agg(["count", "sum"]).reset_index()
    g = g.assign(impl=name, calls=g["count"] / steps, gpu_ms_per_step=g["sum"] / steps / 1e3)
    g = g.sort_values("gpu_ms_per_step", ascending=False).head(limit)
    total = {"impl": name, "kernel": "(all kernels: GPU busy time per step)", "category": "",
             "calls": len(kernels) / steps, "gpu_ms_per_step": kernels["us"].sum() / steps / 1e3}
    return pd.concat([pd.DataFrame([total]), g[["impl", "kernel", "category", "calls", "gpu_ms_per_step"]]])


def losses(steps: int, cfg=None, data=None, device="cuda", sample: str = "") -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both versions from the same weights on the same batches: the loss of every step; for the first
    step beyond the tolerance, that batch replayed through both, layer by layer against float32.
    With a ``sample`` prompt, the trained course model's continuation of it is ``curve.attrs["sample"]``."""
    cfg, data = cfg or gpt.GPU, data if data is not None else gpt.tokens()
    a, b = gpt.twins(cfg, device)
    opt_a, opt_b = gpt.optimizer(a), gpt.optimizer(b)
    before = [[p.detach().clone() for p in m.parameters()] for m in (a, b)]   # each step's starting weights
    rows, report = [], pd.DataFrame()
    for s, (x, y) in enumerate(gpt.batches(data, BATCH, cfg.seq_len, steps, seed=0)):
        x, y = x.to(device), y.to(device)
        for m, keep in zip((a, b), before):
            torch._foreach_copy_(keep, [p.detach() for p in m.parameters()])
        la, lb = float(gpt.train_step(a, opt_a, x, y)), float(gpt.train_step(b, opt_b, x, y))
        rows.append({"step": s, "torch_ops": la, "course_ops": lb, "rel_diff": abs(lb - la) / la})
        if rows[-1]["rel_diff"] > LOSS_TOLERANCE and report.empty:
            report = layer_report(s, cfg, x, y, before)
    curve = pd.DataFrame(rows)
    if sample:
        curve.attrs["sample"] = gpt.generate(b, sample, min(SAMPLE_BYTES, cfg.seq_len - len(sample.encode())))
    return curve, report


def layer_report(step: int, cfg, x, y, weights) -> pd.DataFrame:
    """Replay one batch through both versions (bf16 autocast, each with its weights at that step) and
    through each one's float32 twin on PyTorch's ops: the relative error of every branch's output."""
    rows = []
    for ops, params in zip(("torch", "course"), weights):
        model = gpt.GPT(cfg).to(x.device).use(ops)
        with torch.no_grad():
            torch._foreach_copy_([p for p in model.parameters()], params)
        ref = copy.deepcopy(model).use("torch")
        outs = {}
        for tag, m in (("bf16", model), ("fp32", ref)):
            hooks = [mod.register_forward_hook(lambda _m, _i, o, key=(tag, name): outs.__setitem__(key, o.float()))
                     for name, mod in m.named_modules() if name.endswith((".proj", ".out"))]
            cast = gpt._autocast(x.device) if tag == "bf16" else torch.autocast(x.device.type, enabled=False)
            with torch.no_grad(), cast:
                _, loss = m(x, y)
                logits = m(x)   # the head alone: the course's loss op never writes the logits
            outs[(tag, "logits")], outs[(tag, "loss")] = logits.float(), loss.float()
            for h in hooks:
                h.remove()
        for key in [k for t, k in outs if t == "bf16"]:
            got, want = outs[("bf16", key)], outs[("fp32", key)]
            err = float((got - want).norm() / want.norm().clamp_min(1e-30))
            rows.append({"step": step, "version": ops, "output": key, "rel_err_vs_fp32": err})
    return pd.DataFrame(rows)


def sweep(quick: bool = False) -> pd.DataFrame:
    t0 = time.perf_counter()
    suffix = "_quick" if quick else ""
    cfg, data = gpt.GPU, gpt.tokens()
    flops = gpt.model_flops(cfg, BATCH)
    spec = hardware.current()
    peak_tflops = spec.peak_tflops("bfloat16") if spec is not None else float("nan")
    alone, resident = {}, {}
    for name in ("eager", "course"):
        alone[name], resident[name] = peak_alone(name, cfg, data)
    _log(f"peak memory alone: {alone}", t0)
    steps, own_peak, errors = {}, {}, {}
    for name in IMPLS:
        before = _sync_gib()
        torch.cuda.reset_peak_memory_stats()
        try:  # over the build (a graph's capture allocates its activations) and one more step
            steps[name] = build(name, cfg, data)
            steps[name]()
            torch.cuda.synchronize()
            own_peak[name] = torch.cuda.max_memory_allocated() / 2**30 - before
        except Exception as e:  # reported in the table, the other rows go on
            errors[name] = f"{type(e).__name__}: {e}"[:300]
        _log(f"built {name}", t0)
    times = bench.time_rounds(steps, rounds=3, errors=errors, warmup=2, rep=5 if quick else 10, flush_l2=False)
    _log("timed", t0)
    rows, categories, kernels, host = [], [], [], []
    for name in IMPLS:
        row = {"impl": name, "ops": IMPLS[name][0], "runs_as": IMPLS[name][1],
               "config": f"{cfg.n_layer}x{cfg.d_model} h{cfg.n_head} N={cfg.seq_len} B={BATCH}"}
        if name not in times:
            rows.append({**row, "error": errors.get(name, "not timed")})
            continue
        ms = times[name].median
        row.update(times[name].columns())
        row.update(tokens_per_s=flops["tokens"] / (ms / 1e3), model_flops=flops["flops"],
                   tflops=flops["flops"] / (ms / 1e3) / 1e12, peak_own_gib=own_peak.get(name),
                   peak_alone_gib=alone.get(name), resident_before_gib=resident.get(name), host_ms=host_ms(steps[name]))
        row["mfu_datasheet_pct"] = 100 * row["tflops"] / peak_tflops
        try:
            k = profile.step_kernels(steps[name], steps=2)
        except Exception as e:
            k, row["note"] = pd.DataFrame(), f"profiler: {type(e).__name__}: {e}"[:200]
        if not k.empty:
            row.update(gpu_busy_ms=k["us"].sum() / 2 / 1e3, launches=len(k) / 2)
            categories.append(profile.by_category(k, 2).assign(impl=name))
            kernels.append(_kernel_rows(name, k, 2))
        rows.append(row)
    _log("profiled", t0)
    for name in [n for n in ("eager", "course") if n in steps]:
        split = profile.host_split(steps[name])
        host.append(pd.DataFrame({"impl": name, "who": list(split), "ms_under_cprofile": list(split.values())}))
    steps.clear()
    gc.collect()
    torch.cuda.empty_cache()
    for name, frames in (("categories", categories), ("kernels", kernels), ("host", host)):
        if frames:
            bench.save(pd.concat(frames, ignore_index=True), f"training_{name}{suffix}")
    try:
        from course_utils import ops
        bench.save(ops.host_overhead_table(), f"training_overhead{suffix}")
    except Exception as e:
        _log(f"host_overhead_table failed: {type(e).__name__}: {e}", t0)
    bench.save(ladder(cfg, data), f"training_ladder{suffix}")
    _log("ladder", t0)
    curve, report = losses(QUICK_LOSS_STEPS if quick else LOSS_STEPS, cfg, data, sample=SAMPLE_PROMPT)
    bench.save(curve, f"training_loss{suffix}")
    bench.save(pd.DataFrame([{"prompt": SAMPLE_PROMPT, "text": curve.attrs.get("sample", ""), "version": "course",
                              "trained_steps": len(curve)}]), f"training_sample{suffix}")
    if not report.empty:
        bench.save(report, f"training_divergence{suffix}")
    _log("losses", t0)
    return pd.DataFrame(rows).assign(loss_steps=len(curve), loss_max_rel_diff=curve["rel_diff"].max(),
                                     loss_steps_over_tolerance=int((curve["rel_diff"] > LOSS_TOLERANCE).sum()),
                                     peak_tflops_datasheet=peak_tflops)


def _col(df, impl, col="ms") -> float:
    sel = df[df["impl"] == impl] if "impl" in df and col in df else df.iloc[0:0]
    return float(sel[col].iloc[0]) if len(sel) and sel[col].notna().all() else float("nan")


#: (claim, numerator impl, denominator impl, column, required): a ratio ours / theirs >= required
TARGETS = [
    ("both as whole-step CUDA graphs: course / eager (step time)", "eager + CUDA graph", "course + CUDA graph",
     "ms", 1.3),
    ("reduce-overhead: course + torch.compile / torch.compile of the torch version (step time)",
     "torch.compile reduce-overhead", "course + torch.compile reduce-overhead", "ms", 1.0),
    ("from Python: course / eager (step time)", "eager", "course", "ms", 1.1),
    ("from Python: course under torch.compile / torch.compile of the torch version (step time)", "torch.compile",
     "course + torch.compile", "ms", 1.0),
    ("GPU-busy time per step: eager / course (course <= 0.8x eager)", "eager", "course", "gpu_busy_ms", 1 / 0.8),
    ("peak memory, each alone: eager / course (course <= eager)", "eager", "course", "peak_alone_gib", 1.0),
]


def targets(df) -> list:
    out = [bench.Target(ISSUE, claim, _col(df, num, col) / _col(df, den, col), req)
           for claim, num, den, col, req in TARGETS]
    rel = float(df["loss_max_rel_diff"].iloc[0]) if "loss_max_rel_diff" in df else float("nan")
    n = f'{int(df["loss_steps"].iloc[0])}' if "loss_steps" in df else "the recorded"
    out.append(bench.Target(ISSUE, f"losses within {LOSS_TOLERANCE:.0%} at every one of {n} steps: "
                                   f"{LOSS_TOLERANCE:.0%} / largest relative difference",
                            LOSS_TOLERANCE / rel if rel > 0 else float("inf") if rel == 0 else float("nan"), 1.0))
    return out


def plot(df):
    import matplotlib.pyplot as plt

    shown = df[df["ms"].notna()] if "ms" in df else df.iloc[0:0]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(shown["impl"], shown["ms"], color=["C1" if i.startswith("course") else "C0" for i in shown["impl"]])
    if "gpu_busy_ms" in shown:
        ax.scatter(shown["gpu_busy_ms"], shown["impl"], color="k", marker="|", s=200, label="GPU-busy time")
        ax.legend()
    ax.invert_yaxis()
    ax.set_xlabel("ms per training step (median round)")
    ax.set_title(f"GPT {df['config'].iloc[0] if 'config' in df else ''}, bf16 autocast "
                 f"({df['gpu'].iloc[0] if 'gpu' in df else ''})")
    fig.tight_layout()
    return [fig]
