"""Chapter 11 benchmark: one training step of the capstone GPT, eager PyTorch vs torch.compile vs
the course's kernels, with the losses of the torch and course versions compared step by step.

Configuration: ``course_utils.gpt.GPU`` (6 layers, width 768, 12 heads, 1024 tokens per sequence),
batch 8, bf16 autocast with float32 master weights, AdamW. Also written: ``training_loss.csv`` (the
loss of each step for both versions, same initialization, same batches) and
``training_kernels.csv`` (where the course version's step spends its GPU time, by kernel).
"""

from __future__ import annotations

import pandas as pd
import torch

from course_utils import bench, gpt

TITLE = "GPT training step on the course's kernels (chapter 11)"
BATCH = 8
LOSS_STEPS = 200
LOSS_TOLERANCE = 0.02      # |loss_course - loss_torch| / loss_torch at every step: bf16's rounding, compounded
SMOOTH_STEPS = 20          # the same, on the running mean of 20 steps: what the loss curves show
SMOOTH_TOLERANCE = 0.01


def _failing(message: str):
    def fn():
        raise RuntimeError(message)
    return fn


def _models():
    cfg = gpt.GPU
    torch_model, course_model = gpt.twins(cfg, "cuda")
    return cfg, torch_model, course_model


def losses(steps: int = LOSS_STEPS) -> pd.DataFrame:
    """Both versions trained on the same batches from the same weights: the loss of every step."""
    _, a, b = _models()
    data = gpt.tokens()
    la = gpt.train(a, data, steps=steps, batch=BATCH, progress=False)
    lb = gpt.train(b, data, steps=steps, batch=BATCH, progress=False)
    return pd.DataFrame({"step": range(steps), "torch_ops": la, "course_ops": lb})


def _stepper(model, data):
    opt = gpt.optimizer(model)
    x, y = next(gpt.batches(data, BATCH, model.cfg.seq_len, 1, seed=7))
    x, y = x.cuda(), y.cuda()
    return lambda: gpt.train_step(model, opt, x, y)


def _graphed(model, data):
    x, y = next(gpt.batches(data, BATCH, model.cfg.seq_len, 1, seed=7))
    replay, _ = gpt.graphed_step(model, x.cuda(), y.cuda())
    return replay


def _peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def kernel_table(model, data, row_limit: int = 15) -> pd.DataFrame:
    """GPU time per kernel over 3 training steps (torch.profiler), the largest first."""
    from torch.profiler import ProfilerActivity, profile

    step = _stepper(model, data)
    step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:90], "calls": e.count // 3, "gpu_ms_per_step": e.device_time_total / 1e3 / 3}
            for e in prof.key_averages() if e.device_time_total > 0]
    df = pd.DataFrame(rows).sort_values("gpu_ms_per_step", ascending=False)
    total = {"kernel": "(all kernels: GPU busy time per step)", "calls": int(df["calls"].sum()),
             "gpu_ms_per_step": float(df["gpu_ms_per_step"].sum())}
    return pd.concat([pd.DataFrame([total]), df.head(row_limit)], ignore_index=True)


def sweep(quick: bool = False) -> pd.DataFrame:
    cfg, torch_model, course_model = _models()
    data = gpt.tokens()
    compiled = torch.compile(gpt.GPT(cfg).cuda().use("torch"))
    impls = {"eager": _stepper(torch_model, data), "torch.compile": _stepper(compiled, data),
             "course": _stepper(course_model, data)}
    # The same steps captured as CUDA graphs (chapter 1): the host's launch cost removed from both
    for name, model in (("eager + CUDA graph", gpt.GPT(cfg).cuda().use("torch")),
                        ("course + CUDA graph", gpt.GPT(cfg).cuda().use("course"))):
        try:
            impls[name] = _graphed(model, data)
        except Exception as e:  # reported in the table, the other rows go on
            impls[name] = _failing(f"{type(e).__name__}: {e}"[:300])
    errors: dict = {}
    times = bench.time_rounds(impls, rounds=3 if quick else 5, errors=errors, warmup=3, rep=10 if quick else 20,
                              flush_l2=False)
    tokens = BATCH * cfg.seq_len
    rows = []
    for name, fn in impls.items():
        row = {"impl": name, "config": f"{cfg.n_layer}x{cfg.d_model} h{cfg.n_head} N={cfg.seq_len} B={BATCH}"}
        if name in times:
            row.update(times[name].columns())
            row["tokens_per_s"] = tokens / (times[name].median / 1e3)
            row["peak_gib"] = _peak_gib(fn)
        else:
            row["error"] = errors.get(name, "not timed")
        rows.append(row)
    curve = losses(50 if quick else LOSS_STEPS)
    bench.save(curve, "training_loss")
    tables = [kernel_table(m, data).assign(impl=name) for name, m in (("course", course_model), ("eager", torch_model))]
    bench.save(pd.concat(tables, ignore_index=True), "training_kernels")
    rel = ((curve["course_ops"] - curve["torch_ops"]).abs() / curve["torch_ops"]).max()
    smooth = curve[["torch_ops", "course_ops"]].rolling(SMOOTH_STEPS).mean().dropna()
    rel_smooth = ((smooth["course_ops"] - smooth["torch_ops"]).abs() / smooth["torch_ops"]).max()
    for row in rows:
        row["loss_max_rel_diff"] = float(rel)
        row["loss_max_rel_diff_smoothed"] = float(rel_smooth)
    return pd.DataFrame(rows)


def _ms(df, impl) -> float:
    sel = df[df["impl"] == impl]
    return float(sel["ms"].iloc[0]) if len(sel) and "ms" in sel and sel["ms"].notna().all() else float("nan")


def targets(df) -> list:
    course = _ms(df, "course")
    rel = float(df["loss_max_rel_diff"].iloc[0]) if "loss_max_rel_diff" in df else float("nan")
    smooth = float(df["loss_max_rel_diff_smoothed"].iloc[0]) if "loss_max_rel_diff_smoothed" in df else float("nan")
    graphed = _ms(df, "course + CUDA graph")
    return [bench.Target(16, "training step: course / eager torch (step-time ratio)", _ms(df, "eager") / course, 1.3),
            bench.Target(16, "training step: course / torch.compile (step-time ratio)",
                         _ms(df, "torch.compile") / course, 1.0),
            bench.Target(16, "training step as CUDA graphs: course / eager torch (both graphed)",
                         _ms(df, "eager + CUDA graph") / graphed, 1.3),
            bench.Target(16, f"losses agree: {LOSS_TOLERANCE:.0%} / max relative loss difference over the steps",
                         LOSS_TOLERANCE / rel if rel > 0 else float("inf"), 1.0),
            bench.Target(16, f"losses agree: {SMOOTH_TOLERANCE:.0%} / max relative difference of the "
                             f"{SMOOTH_STEPS}-step running means",
                         SMOOTH_TOLERANCE / smooth if smooth > 0 else float("inf"), 1.0)]
