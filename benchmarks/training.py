"""Chapter 12 benchmark: one training step of the GPT, eager PyTorch and ``torch.compile`` against the
course's ops, like with like, in one run.

Configurations (:data:`CONFIGS`): GPT-2 small (12 layers, width 768, 12 heads, vocabulary 50304, 1024
tokens per sequence) at batch 8 (the headline) and 16, and chapter 12's first 6x768 toy (vocabulary 256)
at batch 8, kept for continuity and not judged; ``COURSE_TRAINING_CONFIGS`` (keys of :data:`CONFIGS`,
comma-separated) runs a subset, whose rows replace that subset's rows in the recorded ``training.csv``
(each row keeps its own date). The torch versions follow nanoGPT: float32 weights under bf16 autocast,
torch's fused AdamW. The course's version follows llm.c: bf16 weights, float32 masters and moments in
the course's one-launch AdamW. Fourteen ways to run the same step (:data:`IMPLS`; ``course`` records one
autograd node a block (:mod:`course_utils.ops.block`), ``course, one autograd node an op`` one a kernel op,
``course, one autograd node the model`` one for the whole model (:class:`course_utils.step.OneNode`);
``..., backward on the calling thread`` runs the backward on the thread that calls it instead of the autograd
engine's GPU worker thread, PyTorch's default; ``course, step by hand``
calls the course's forward and backward functions without the autograd engine, llm.c's way:
:mod:`course_utils.step`; ``course, step by hand + torch.compile`` compiles that forward and backward, a
graph with no autograd in it), timed in interleaved rounds once all are built, with every thread of the
process on one core (:mod:`course_utils.affinity`: on the lent virtual machines the cores a step's threads
ran on changed its time); for each one the host's time to issue a step (before any profiling),
the GPU-busy time (sum of its kernels' durations, torch.profiler), its kernels by category and its own
peak memory; MFU. For the headline configuration also (``_quick`` appended to the names under
``--quick``, so a quick run never overwrites a full one's side files): ``training_categories.csv``
(launches and GPU ms per step by category, per version), ``training_kernels.csv`` (the largest kernels
of each), ``training_host.csv`` (one step's host time by who spends it, cProfile, eager and course),
``training_overhead.csv`` (host us per call of each course op against aten's, forward and backward),
``training_ladder.csv`` (the fusions added one at a time, :data:`LADDER`), ``training_loss.csv`` (every
step's loss of the course's version, of eager, and of the noise floor: eager from another initialization
seed, and torch.compile, on the same batches), ``training_divergence.csv`` (when a step differs by more
than :data:`LOSS_TOLERANCE`: that batch replayed through both versions, each layer against float32) and
``training_sample.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import faulthandler
import functools
import gc
import os
import signal
import sys
import time

import pandas as pd

# Inductor compiles in a pool of worker processes that starts with the first torch.compile and keeps the host's
# cores busy for seconds after a build served from its cache: the host-bound versions, timed right after the
# builds, ran up to 1.6x slower in some rounds (p80 against p20 in training.csv). One compile thread: no pool.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch  # noqa: E402

from course_utils import affinity, bench, gpt, hardware, profile
from course_utils.autograd import registry

TITLE = "GPT training step: eager, torch.compile and the course's ops (chapter 12)"
BATCH = 8
#: key -> (configuration, batch, judged): the headline first
CONFIGS = {"gpt2-b8": (gpt.GPT2, 8, True), "gpt2-b16": (gpt.GPT2, 16, True), "toy-b8": (gpt.GPU, 8, False)}
HEADLINE = "gpt2-b8"
LOSS_STEPS, QUICK_LOSS_STEPS = 200, 50
LOSS_TOLERANCE = 0.02      # |loss_course - loss_torch| / loss_torch at every step
FLOOR_FROM = 0.5           # the whole-curve comparison: the last half of the steps
ISSUE = 27
SAMPLE_PROMPT, SAMPLE_BYTES = "Fusion ", 300
#: name -> (ops, how the step runs)
IMPLS = {
    "eager": ("torch", "python"),
    "torch.compile": ("torch", "compile"),
    "eager, backward on the calling thread": ("torch", "python-1thread"),
    "course": ("course-blocks", "python"),
    "course, backward on the calling thread": ("course-blocks", "python-1thread"),
    "course, one autograd node an op": ("course", "python"),
    "course, one autograd node the model": ("course", "python-model"),
    "course, step by hand": ("course", "hand"),
    "course, step by hand + torch.compile": ("course", "hand-compile"),
    "course + torch.compile": ("course", "compile"),
    "eager + CUDA graph": ("torch", "graph"),
    "course + CUDA graph": ("course", "graph"),
    "torch.compile reduce-overhead": ("torch", "reduce-overhead"),
    "course + torch.compile reduce-overhead": ("course", "reduce-overhead"),
}


BUILD_LIMIT_S = 120       # a version that has not compiled and warmed up by then is reported, not waited for


class BuildTimeout(RuntimeError):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int):
    """Raise :class:`BuildTimeout` in the main thread after ``seconds`` (SIGALRM), and print every thread's
    stack to stderr just before, so the log says where a build was stuck."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise BuildTimeout(f"did not build (compile and warm up) within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    faulthandler.dump_traceback_later(max(seconds - 2, 1), exit=False)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)


def _log(msg: str, t0: float) -> None:  # what took how long, on stderr (make bench's log)
    print(f"[training {time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=2)
def _weights(cfg) -> gpt.GPT:
    return gpt.GPT(cfg)  # initialized once on the CPU (43M normal draws); every version copies it


def _model(cfg, ops, bf16: bool | None = None):
    """A fresh copy of the configuration's weights on the GPU; the course's in bf16 with float32 masters."""
    model = copy.deepcopy(_weights(cfg)).cuda().use(ops)
    if bf16 if bf16 is not None else ops.startswith("course"):
        gpt.bf16_weights(model)
    return model


def _batch(cfg, data, seed: int = 7, batch: int = BATCH):
    x, y = next(gpt.batches(data, batch, cfg.seq_len, 1, seed=seed))
    return x.cuda(), y.cuda()


def round_args(rounds: int):
    """``(args, cfg, batch)`` of a GPU check that times chapter 12's steps in rounds (tools/gpu_checks):
    ``--config`` (a key of :data:`CONFIGS`), ``--rounds`` (default ``rounds``) and ``--steps`` a round."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=HEADLINE, choices=sorted(CONFIGS))
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    cfg, batch, _ = CONFIGS[a.config]
    return a, cfg, batch


def build(name: str, cfg, data, warmup: int = 3, batch: int = BATCH):
    """The zero-argument step of version ``name``, warmed up (compiled, tiles chosen, graph captured)."""
    ops, how = IMPLS[name]
    model = _model(cfg, ops)
    x, y = _batch(cfg, data, batch=batch)
    if how == "graph":
        replay, _ = gpt.graphed_step(model, x, y, warmup=warmup)
        return replay
    opt = gpt.optimizer(model)
    if how in ("hand", "hand-compile"):   # llm.c's way: forward and backward by hand, no autograd engine
        from course_utils.step import HandStep
        hand = HandStep(model, opt, compiled=how == "hand-compile")
        for _ in range(warmup):
            hand(x, y)

        def hand_step():
            return hand(x, y)
        hand_step.optimizer = opt
        return hand_step
    mode = {"compile": "default", "reduce-overhead": "reduce-overhead"}.get(how)
    run = model if mode is None else torch.compile(model, fullgraph=True, mode=mode)
    if how == "python-model":   # the step by hand behind autograd's interface (course_utils.step.OneNode)
        from course_utils.step import OneNode
        run = OneNode(model)
    # "python-1thread": the backward on this thread, not on the autograd engine's GPU worker (chapter 12)
    engine_threads = how != "python-1thread"

    def step():
        with torch.autograd.set_multithreading_enabled(engine_threads):
            return gpt.train_step(run, opt, x, y)

    for _ in range(warmup):
        step()
    step.optimizer = opt   # the bench logs how often MasterAdamW rebuilt its gradient table
    return step


#: Chapter 12's fusion ladder: (step, the ops taken from torch.ops.course, fused AdamW, bf16 weights); each
#: step keeps the ones before it. None: eager PyTorch, the reference.
LIBRARY = tuple(registry.COURSE_CANDIDATES)
LADDER = [
    ("eager PyTorch", None, True, False),
    ("chapter 11's step (its ops, AdamW foreach)", (), False, False),
    (profile.FUSIONS[0], (), True, False),
    (profile.FUSIONS[1], ("attention",), True, False),
    (profile.FUSIONS[2], ("attention", "layer_norm", "add_layer_norm"), True, False),
    (profile.FUSIONS[3], ("attention", "layer_norm", "add_layer_norm", "linear_gelu"), True, False),
    (profile.FUSIONS[4], ("attention", "layer_norm", "add_layer_norm", "linear_gelu", "cross_entropy"), True, False),
    (profile.FUSIONS[5], LIBRARY, True, False),
    (profile.FUSIONS[6], LIBRARY, True, True),
]


def ladder(cfg, data, batch: int = BATCH) -> pd.DataFrame:
    """Each step of :data:`LADDER` from Python: launches, GPU-busy and host time per training step, and
    launches and GPU milliseconds per kernel category."""
    rows = []
    for i, (what, library, fused, bf16) in enumerate(LADDER):
        ops = "torch" if library is None else registry.course_ops(library=library)
        model = _model(cfg, ops, bf16=bf16)
        opt = gpt.optimizer(model, fused=fused)
        x, y = _batch(cfg, data, batch=batch)

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


def peak_alone(name: str, cfg, data, batch: int = BATCH) -> tuple[float, float]:
    """``(peak, resident)``: the peak GiB allocated by one steady step of ``name`` (after its warm-up),
    no other version resident: weights, gradients, optimizer state and the step's activations, above
    the ``resident`` GiB allocated before the model was built (cuBLAS's workspaces; under ``make
    bench``, whatever earlier topics keep)."""
    gc.collect()
    torch.cuda.empty_cache()
    before = _sync_gib()
    step = build(name, cfg, data, batch=batch)
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


def losses(steps: int, cfg=None, data=None, device="cuda", sample: str = "",
           batch: int = BATCH, floor: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The course's version and eager from the same weights on the same batches: the loss of every step,
    beside the noise floor measured torch against torch on the same batches (eager from another
    initialization seed; torch.compile from the same weights). For the first step beyond the tolerance,
    that batch replayed through both, layer by layer against float32. With a ``sample`` prompt, the
    trained course model's continuation of it is ``curve.attrs["sample"]``."""
    cfg, data = cfg or gpt.GPU, data if data is not None else gpt.tokens()
    a, b = gpt.twins(cfg, device)
    # the course's step with a float32 residual stream (eager's under autocast): is the stream the gap?
    c = gpt.bf16_weights(copy.deepcopy(a).use("course"), torch.float32) if floor and b.residual_dtype is None \
        and not gpt.uses_autocast(b) else None
    opt_a, opt_b = gpt.optimizer(a), gpt.optimizer(b)
    opt_c = gpt.optimizer(c) if c is not None else None
    before = [[p.detach().clone() for p in m.parameters()] for m in (a, b)]   # each step's starting weights
    rows, report = [], pd.DataFrame()
    for s, (x, y) in enumerate(gpt.batches(data, batch, cfg.seq_len, steps, seed=0)):
        x, y = x.to(device), y.to(device)
        for m, keep in zip((a, b), before):
            torch._foreach_copy_(keep, [p.detach() for p in m.parameters()])
        la, lb = float(gpt.train_step(a, opt_a, x, y)), float(gpt.train_step(b, opt_b, x, y))
        rows.append({"step": s, "torch_ops": la, "course_ops": lb, "rel_diff": abs(lb - la) / la,
                     "signed_rel_diff": (lb - la) / la})
        if c is not None:
            lc = float(gpt.train_step(c, opt_c, x, y))
            rows[-1].update(course_fp32_residual=lc, course_fp32_residual_rel_diff=abs(lc - la) / la,
                            course_fp32_residual_signed_rel_diff=(lc - la) / la)
        if rows[-1]["rel_diff"] > LOSS_TOLERANCE and report.empty:
            report = layer_report(s, cfg, x, y, before)
    curve = pd.DataFrame(rows)
    if sample:
        curve.attrs["sample"] = gpt.generate(b, sample, min(SAMPLE_BYTES, cfg.seq_len - len(sample.encode())))
    del a, b, c, opt_a, opt_b, opt_c, before
    gc.collect()
    for col, (seed, compiled) in (("torch_seed1", (1, False)), ("torch_compile", (0, True))) if floor else ():
        m = gpt.GPT(cfg, seed).to(device).use("torch")
        run = torch.compile(m, fullgraph=True) if compiled else m
        opt = gpt.optimizer(m)
        got = [float(gpt.train_step(run, opt, x.to(device), y.to(device)))
               for x, y in gpt.batches(data, batch, cfg.seq_len, steps, seed=0)]
        curve[col] = got
        curve[f"{col}_rel_diff"] = (curve[col] - curve["torch_ops"]).abs() / curve["torch_ops"]
        curve[f"{col}_signed_rel_diff"] = (curve[col] - curve["torch_ops"]) / curve["torch_ops"]
        del m, run, opt
        gc.collect()
        torch.cuda.empty_cache()
    return curve, report


def loss_agreement(curve: pd.DataFrame) -> dict:
    """The course's curve against eager's, beside the torch-against-torch noise floor, over the last
    ``FLOOR_FROM`` of the steps: mean |relative difference| and mean signed relative difference (a
    curve that runs higher throughout has a mean signed difference far from zero)."""
    tail = curve[curve["step"] >= curve["step"].max() * FLOOR_FROM]
    out = {"course_mean_abs": tail["rel_diff"].mean(), "course_mean_signed": tail["signed_rel_diff"].mean(),
           "course_max": curve["rel_diff"].max()}
    for col in ("torch_seed1", "torch_compile", "course_fp32_residual"):
        if f"{col}_rel_diff" in tail:
            out[f"{col}_mean_abs"] = tail[f"{col}_rel_diff"].mean()
            out[f"{col}_mean_signed"] = tail[f"{col}_signed_rel_diff"].mean()
            out[f"{col}_max"] = curve[f"{col}_rel_diff"].max()
    return out


def summarize_losses(curve: pd.DataFrame, day: str) -> dict:
    """The headline rows' loss columns from a recorded curve (``training_loss.csv``) run on ``day``."""
    return {"loss_steps": len(curve), "loss_max_rel_diff": curve["rel_diff"].max(), "loss_date": day,
            "loss_steps_over_tolerance": int((curve["rel_diff"] > LOSS_TOLERANCE).sum()),
            **{f"loss_{k}": v for k, v in loss_agreement(curve).items()}}


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


PARTS = ("versions", "ladder", "losses")


def _parts() -> set[str]:
    """``COURSE_TRAINING_PARTS`` (comma-separated :data:`PARTS`, default all): what a call records (the
    headline's ladder and losses take minutes, a lent GPU's call at most ten)."""
    got = {p.strip() for p in os.environ.get("COURSE_TRAINING_PARTS", ",".join(PARTS)).split(",") if p.strip()}
    if got - set(PARTS):
        raise ValueError(f"COURSE_TRAINING_PARTS: unknown {sorted(got - set(PARTS))}; the parts are {PARTS}")
    return got


def _selected() -> list[str]:
    keys = [k.strip() for k in os.environ.get("COURSE_TRAINING_CONFIGS", ",".join(CONFIGS)).split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        raise ValueError(f"COURSE_TRAINING_CONFIGS: unknown {unknown}; the configurations are {list(CONFIGS)}")
    return keys


def config_name(cfg, batch: int) -> str:
    return f"{cfg.n_layer}x{cfg.d_model} h{cfg.n_head} V={cfg.vocab} N={cfg.seq_len} B={batch}"


def _time_config(key: str, quick: bool, t0: float):
    """The versions of one configuration: timed, profiled, their peaks; (rows, categories, kernels, steps)."""
    cfg, batch, judged = CONFIGS[key]
    torch.compiler.reset()   # each configuration compiles afresh: a second one would hit dynamo's recompile limit
    data = gpt.tokens()
    alone, resident = {}, {}
    for name in ("eager", "torch.compile", "course"):
        alone[name], resident[name] = peak_alone(name, cfg, data, batch)
    _log(f"{key}: peak memory alone: {alone}", t0)
    steps, own_peak, errors = {}, {}, {}
    for name in IMPLS:
        before = _sync_gib()
        torch.cuda.reset_peak_memory_stats()
        try:  # over the build (a graph's capture allocates its activations) and one more step
            with _time_limit(BUILD_LIMIT_S):
                steps[name] = build(name, cfg, data, batch=batch)
                steps[name]()
            torch.cuda.synchronize()
            own_peak[name] = torch.cuda.max_memory_allocated() / 2**30 - before
        except Exception as e:  # reported in the table, the other rows go on
            errors[name] = f"{type(e).__name__}: {e}"[:300]
            _log(f"{key}: FAILED {name}: {errors[name]}", t0)   # in the log at once: a CUDA fault ends the run
            continue
        _log(f"{key}: built {name}", t0)
    with affinity.one_core() as core:   # every version timed with all its threads on one core (affinity.py)
        c = affinity.LAST_CHOICE
        _log(f"{key}: timing with every thread on core {core} (the fastest of {c.get('cores_probed')} by a Python "
             f"loop: {c.get('loop_us', float('nan')):.0f} us, median core {c.get('median_us', float('nan')):.0f})", t0)
        return _time_built(key, steps, errors, own_peak, alone, resident, quick, t0, core)


def _time_built(key: str, steps: dict, errors: dict, own_peak: dict, alone: dict, resident: dict, quick: bool,
                t0: float, core: int | None):
    """:func:`_time_config`'s second half: the built versions timed in interleaved rounds and profiled."""
    cfg, batch, judged = CONFIGS[key]
    flops = gpt.model_flops(cfg, batch)
    first_choice = dict(affinity.LAST_CHOICE)   # the core the whole timing started on (profiles, host times)
    spec = hardware.current()
    peak_tflops = spec.peak_tflops("bfloat16") if spec is not None else float("nan")
    # before each round every thread moves to the fastest core of that moment (affinity.one_core again, nested:
    # the exits put the masks back in turn); the cores and their loop times go in the rows
    chosen, pins = [], contextlib.ExitStack()
    with pins:
        def repin(i):
            if core is not None:
                chosen.append((pins.enter_context(affinity.one_core()), affinity.LAST_CHOICE.get("loop_us"),
                               affinity.LAST_CHOICE.get("median_us")))
        times = bench.time_rounds(steps, rounds=3, errors=errors, before_round=repin, warmup=2,
                                  rep=5 if quick else 10, flush_l2=False)
    _log(f"{key}: rounds timed on cores {[c for c, _, _ in chosen]} (loop us {[round(u or 0) for _, u, _ in chosen]}, "
         f"median core {[round(m or 0) for _, _, m in chosen]})", t0)
    rebuilds = {n: s.optimizer.rebuilds for n, s in steps.items() if hasattr(getattr(s, "optimizer", None), "rebuilds")}
    _log(f"{key}: timed (MasterAdamW gradient tables built, per version: {rebuilds})", t0)
    # the host's times before any profiling, and (host_ms_after_profiler) again after each version's: in the
    # run of c710c7f, taken between profiles, the course's step read 49.2 ms of host from an idle GPU while
    # it ran 18.8 ms a step back to back; whether torch.profiler leaves the host slower, these two columns tell
    hosts = {name: host_ms(steps[name]) for name in times}
    rows, categories, kernels = [], [], []
    for name in IMPLS:
        row = {"impl": name, "ops": IMPLS[name][0], "runs_as": IMPLS[name][1], "config": config_name(cfg, batch),
               "config_key": key, "judged": judged, "course_kernel_ops": _registration(name),
               "host_threads_on_core": core, "host_core_loop_us": first_choice.get("loop_us"),
               "host_median_core_loop_us": first_choice.get("median_us"),
               "round_cores": " ".join(str(c) for c, _, _ in chosen),
               "round_core_loop_us": " ".join(f"{u:.0f}" for _, u, _ in chosen if u is not None)}
        if name not in times:
            rows.append({**row, "error": errors.get(name, "not timed")})
            continue
        ms = times[name].median
        row.update(times[name].columns())
        row.update(tokens_per_s=flops["tokens"] / (ms / 1e3), model_flops=flops["flops"],
                   tflops=flops["flops"] / (ms / 1e3) / 1e12, peak_own_gib=own_peak.get(name),
                   peak_alone_gib=alone.get(name), resident_before_gib=resident.get(name), host_ms=hosts[name])
        row["mfu_datasheet_pct"] = 100 * row["tflops"] / peak_tflops
        row["peak_tflops_datasheet"] = peak_tflops
        try:
            k = profile.step_kernels(steps[name], steps=2)
        except Exception as e:
            k, row["note"] = pd.DataFrame(), f"profiler: {type(e).__name__}: {e}"[:200]
        if not k.empty:
            row.update(gpu_busy_ms=k["us"].sum() / 2 / 1e3, launches=len(k) / 2)
            categories.append(profile.by_category(k, 2).assign(impl=name, config_key=key))
            kernels.append(_kernel_rows(name, k, 2).assign(config_key=key))
        row["host_ms_after_profiler"] = host_ms(steps[name])
        rows.append(row)
    _log(f"{key}: profiled", t0)
    return rows, categories, kernels, steps


def _registration(name: str) -> str:
    """How torch.compile sees the course's ops in version ``name`` ('' where it does not compile them)."""
    ops, how = IMPLS[name]
    if ops != "course" or how not in ("compile", "reduce-overhead", "hand-compile"):
        return ""
    from course_utils.ops import _lib, attn
    if not _lib.INDUCTOR_SEES_KERNELS:
        return "custom_op"
    opaque = sorted(_lib.OPAQUE_NAMES | (set() if attn._VISIBLE else {"attention"}))
    return f"triton_op ({', '.join(opaque)}: custom_op)" if opaque else "triton_op"


def _folder(df: pd.DataFrame | None = None) -> str | None:
    """The results folder of the GPU that rows come from: a recorded table's own folder (or its ``gpu``
    column) when judging one, else the GPU in hand. A call on one GPU never reads another GPU's records:
    an H200's first run merged with, or judged against, the H100's rows would be a table of two machines."""
    if df is None:
        return bench.gpu_slug()
    if df.attrs.get("gpu_folder"):
        return df.attrs["gpu_folder"]
    if "gpu" in df and len(df) and isinstance(df["gpu"].iloc[0], str):
        return bench.gpu_slug(df["gpu"].iloc[0])
    return None   # a recording without provenance: the first folder that has the file, as before


def _recorded_here(name: str, df: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """``results/<that GPU>/<name>.csv`` (see :func:`_folder`), or None when that GPU has none recorded."""
    try:
        return bench.recorded(name, gpu=_folder(df))
    except FileNotFoundError:
        return None


def _merge_recorded(df: pd.DataFrame, name: str, keys: list[str]) -> pd.DataFrame:
    """``df`` (this run's configurations, with provenance) plus the recorded rows of the other configurations."""
    from course_utils.results import provenance
    for k, v in provenance().items():
        df[k] = v
    old = _recorded_here(name)
    if old is None or "config_key" not in old:
        return df
    return pd.concat([old[~old["config_key"].isin(keys)], df], ignore_index=True)


def sweep(quick: bool = False) -> pd.DataFrame:
    t0 = time.perf_counter()
    suffix = "_quick" if quick else ""
    keys, parts = _selected(), _parts()
    rows, categories, kernels, host = [], [], [], []
    loss_summary = {}
    for key in keys:
        cfg, batch, _ = CONFIGS[key]
        if "versions" in parts:
            r, c, k, steps = _time_config(key, quick, t0)
            rows += r
            categories += c
            kernels += k
            if key == HEADLINE:
                with affinity.one_core():
                    for name in [n for n in ("eager", "course") if n in steps]:
                        split = profile.host_split(steps[name])
                        host.append(pd.DataFrame({"impl": name, "who": list(split),
                                                  "ms_under_cprofile": list(split.values())}))
            steps.clear()
            gc.collect()
            torch.cuda.empty_cache()
            if key == HEADLINE:
                try:
                    from course_utils import ops
                    with affinity.one_core():   # as the steps are timed: aten's and the course's calls alike
                        table = ops.host_overhead_table()
                    bench.save(table, f"training_overhead{suffix}")
                except Exception as e:
                    _log(f"host_overhead_table failed: {type(e).__name__}: {e}", t0)
        if key != HEADLINE:
            continue
        data = gpt.tokens()
        if "ladder" in parts:
            bench.save(ladder(cfg, data, batch), f"training_ladder{suffix}")
            _log("ladder", t0)
        if "losses" in parts:
            curve, report = losses(QUICK_LOSS_STEPS if quick else LOSS_STEPS, cfg, data, sample=SAMPLE_PROMPT,
                                   batch=batch)
            bench.save(curve, f"training_loss{suffix}")
            bench.save(pd.DataFrame([{"prompt": SAMPLE_PROMPT, "text": curve.attrs.get("sample", ""),
                                      "version": "course", "trained_steps": len(curve)}]), f"training_sample{suffix}")
            if not report.empty:
                bench.save(report, f"training_divergence{suffix}")
            loss_summary = summarize_losses(curve, datetime.date.today().isoformat())
            _log("losses", t0)
    for name, frames in (("categories", categories), ("kernels", kernels), ("host", host)):
        if frames:
            df = pd.concat(frames, ignore_index=True)
            if name != "host" and not quick:
                df = _merge_recorded(df, f"training_{name}", keys)
            bench.save(df, f"training_{name}{suffix}")
    df = pd.DataFrame(rows)
    if df.empty:   # no versions timed in this call: the recorded table (its provenance kept), this call's losses
        df = _recorded_here("training")
        if df is None or "config_key" not in df:
            raise RuntimeError("COURSE_TRAINING_PARTS without 'versions' needs a recorded training.csv")
        return with_headline(df, loss_summary)
    if not loss_summary and not quick and HEADLINE in keys:
        loss_summary = _recorded_losses()   # versions re-timed without the losses: keep the recorded curve's
    df = with_headline(df, loss_summary)
    return df if quick else _merge_recorded(df, "training", keys)


def with_headline(df: pd.DataFrame, summary: dict) -> pd.DataFrame:
    """``summary``'s values in the headline's rows of ``df``. A column that a recorded CSV read as floats (all
    empty, as ``loss_date`` where no curve was recorded) takes text too: pandas refuses a string in a float
    column."""
    for k, v in summary.items():
        if isinstance(v, str) and k in df and df[k].dtype != object:
            df[k] = df[k].astype(object)
        df.loc[df["config_key"] == HEADLINE, k] = v
    return df


def _recorded_losses() -> dict:
    """The loss columns of the recorded headline rows (``loss_*``, with ``loss_date``: the day of that curve's
    run), or {} when none are recorded: a call that re-times the versions alone keeps the loss targets."""
    old = _recorded_here("training")
    if old is None or "config_key" not in old:
        return {}
    head = old[old["config_key"] == HEADLINE]
    cols = [c for c in head.columns if c.startswith("loss_") and c != "loss_date"]
    if head.empty or not cols or head[cols].isna().all(axis=None):
        return {}
    row = head.iloc[0]
    return {**{c: row[c] for c in cols}, "loss_date": row.get("loss_date", row.get("date"))}


def _col(df, impl, col="ms") -> float:
    sel = df[df["impl"] == impl] if "impl" in df and col in df else df.iloc[0:0]
    return float(sel[col].iloc[0]) if len(sel) and sel[col].notna().all() else float("nan")


#: (claim, numerator impl, denominator impl, column, required): a ratio theirs / ours >= required
#: The autograd step judged from Python: the whole model one autograd node, as torch.compile's AOTAutograd makes
#: the compiled model one node (its forward and backward graphs behind one autograd.Function). ``course`` (one
#: node a block) and ``course, one autograd node an op`` are recorded beside it, the ladder's earlier rungs.
AUTOGRAD_STEP = "course, one autograd node the model"
TARGETS = [
    ("from Python, autograd (the model one node): course / torch.compile (step time)", "torch.compile",
     AUTOGRAD_STEP, "ms", 1.0),
    ("from Python, autograd (the model one node): course / eager (step time)", "eager", AUTOGRAD_STEP, "ms", 1.3),
    ("from Python, no autograd engine: course step by hand / torch.compile (step time)", "torch.compile",
     "course, step by hand", "ms", 1.0),
    ("from Python, no autograd engine: course step by hand / eager (step time)", "eager", "course, step by hand",
     "ms", 1.3),
    ("whole step graphed: course + CUDA graph / torch.compile reduce-overhead (step time)",
     "torch.compile reduce-overhead", "course + CUDA graph", "ms", 1.0),
    ("from Python: course under torch.compile / torch.compile of the torch version (step time)", "torch.compile",
     "course + torch.compile", "ms", 1.0),
    ("from Python: course step by hand under torch.compile / torch.compile of the torch version (step time)",
     "torch.compile", "course, step by hand + torch.compile", "ms", 1.0),
    ("reduce-overhead: course + torch.compile / torch.compile of the torch version (step time)",
     "torch.compile reduce-overhead", "course + torch.compile reduce-overhead", "ms", 1.0),
    ("GPU-busy time per step: torch.compile / course (course <= compile's)", "torch.compile", "course",
     "gpu_busy_ms", 1.0),
    ("peak memory, each alone: torch.compile / course (course <= compile's)", "torch.compile", "course",
     "peak_alone_gib", 1.0),
]
HOST_OVER_ATEN = 1.5       # each op's host cost per call <= 1.5x its aten counterpart's


FLOORS = ("torch_seed1", "torch_compile")   # torch against torch: eager from another seed, compile from the same


def _floor(first, stat: str) -> tuple[float, str]:
    """The noise floor of ``stat`` (``mean_abs`` or ``max``): the larger of the two torch-against-torch
    differences (issue 27: "two seeds of eager, or eager against compile"), and which one it is."""
    got = [(float(first.get(f"loss_{c}_{stat}", float("nan"))), c) for c in FLOORS]
    got = [(v, c) for v, c in got if v == v]
    return max(got) if got else (float("nan"), "")


def _loss_targets(df) -> list:
    """The course's loss curve against the noise floor measured torch against torch on the same batches, per
    step (largest difference) and over the last half of the steps (mean |difference|, mean signed
    difference). ``LOSS_TOLERANCE`` is not a target: at this learning rate two torch runs part by more than
    it (the layer replay still starts at the first step beyond it)."""
    if "loss_max_rel_diff" not in df or df["loss_max_rel_diff"].isna().all():
        return []
    first = df[df["loss_max_rel_diff"].notna()].iloc[0]
    steps = int(first["loss_steps"])
    out = []
    top, top_of = _floor(first, "max")
    if top == top:
        out.append(bench.Target(ISSUE, f"loss, every one of {steps} steps: noise floor (largest |rel. diff| of "
                                       f"{top_of} vs eager) / course's largest",
                                top / float(first["loss_max_rel_diff"]), 1.0))
    floor, of = _floor(first, "mean_abs")
    if floor == floor:
        out.append(bench.Target(ISSUE, f"loss curve, last half of the steps: noise floor (mean |rel. diff| of {of} "
                                       "vs eager) / course vs eager (mean |rel. diff|)",
                                floor / float(first["loss_course_mean_abs"]), 1.0))
        out.append(bench.Target(ISSUE, f"loss curve, last half: noise floor (mean |rel. diff| of {of}) / |course's "
                                       "mean signed rel. diff| (a curve that runs higher throughout fails)",
                                floor / max(abs(float(first["loss_course_mean_signed"])), 1e-12), 1.0))
    return out


def _host_targets(judged: pd.DataFrame | None = None) -> list:
    """One target an op: course <= HOST_OVER_ATEN x aten. When the table has the autograd floor (a Python
    autograd.Function around one launch each way; recorded since 2026-11-28), the bound is HOST_OVER_ATEN x (aten
    + the floor's extra): on an H100 the floor alone costs 2.7x aten's neg forward and 2.0x forward + backward,
    so no op built that way can meet 1.5x aten, however little Python of its own it runs (chapter 12 says so).
    ``judged``: the training table being judged; the overhead table is read from its GPU's folder."""
    from course_utils.ops import overhead

    over = _recorded_here("training_overhead", judged)
    if over is None or "course_over_aten" not in over:
        return []
    over = overhead.over_aten_past_the_floor(over)
    ops_rows = over[~over["op"].str.startswith("(")]
    out = []
    for _, r in ops_rows.iterrows():
        if r["course_over_aten_floor"] == r["course_over_aten_floor"]:
            claim = f"host cost per call, {r['op']}: {HOST_OVER_ATEN}x (aten + the autograd floor's extra) / course's"
            out.append(bench.Target(ISSUE, claim, HOST_OVER_ATEN / float(r["course_over_aten_floor"]), 1.0))
        else:
            out.append(bench.Target(ISSUE, f"host cost per call, {r['op']}: {HOST_OVER_ATEN}x aten / course's "
                                           f"(course <= {HOST_OVER_ATEN}x aten)",
                                    HOST_OVER_ATEN / float(r["course_over_aten"]), 1.0))
    return out


def targets(df) -> list:
    out = []
    if "config_key" not in df:    # a recording from before the configurations: judged as it was
        df = df.assign(config_key=HEADLINE, judged=True)
    for key, g in df.groupby("config_key", sort=False):
        if not bool(g["judged"].iloc[0]):
            continue
        cfg_name = g["config"].iloc[0] if "config" in g else key
        out += [bench.Target(ISSUE, f"{cfg_name}: {claim}", _col(g, num, col) / _col(g, den, col), req)
                for claim, num, den, col, req in TARGETS]
    out += _loss_targets(df)
    out += _host_targets(df)
    return out


def plot(df):
    import matplotlib.pyplot as plt

    shown = df[df["ms"].notna()] if "ms" in df else df.iloc[0:0]
    if "config_key" in shown:
        shown = shown[shown["config_key"] == HEADLINE]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(shown["impl"], shown["ms"], color=["C1" if i.startswith("course") else "C0" for i in shown["impl"]])
    if "gpu_busy_ms" in shown:
        ax.scatter(shown["gpu_busy_ms"], shown["impl"], color="k", marker="|", s=200, label="GPU-busy time")
        ax.legend()
    ax.invert_yaxis()
    ax.set_xlabel("ms per training step (median round)")
    ax.set_title(f"GPT {shown['config'].iloc[0] if 'config' in shown and len(shown) else ''} "
                 f"({shown['gpu'].iloc[0] if 'gpu' in shown and len(shown) else ''})")
    fig.tight_layout()
    return [fig]
