"""Chapter 13's data parallelism (benchmarks/multigpu.py's ``--ddp-*`` runs): chapter 12's GPT step on W GPUs
at a fixed number of sequences a GPU, under DDP and by hand, eager, compiled or captured as one CUDA graph per
rank; each rank's steps and profile; issue 28's data-parallel targets; a world of one for the CPU and the tests."""
from __future__ import annotations

import os
import time

import pandas as pd
import torch
import torch.distributed as dist

from benchmarks.multigpu_watchdog import QUIET, Watchdog
from course_utils import gpt

ISSUE = 28
#: data parallelism: sequences per GPU (fixed: the work of each GPU does not shrink as GPUs are added), timed
#: steps after warm-up; the one-GPU references at the W-GPU runs' global batches run DDP_LOSS_STEPS steps
DDP_PER_GPU_BATCH, DDP_STEPS, DDP_WARMUP, DDP_LOSS_STEPS = 8, 30, 5, 10
DDP_PROFILE_STEPS = 5   # --ddp-profile: steps under torch.profiler after the timed ones
DDP_WORLDS = (2, 4)
#: per-GPU throughput against one GPU at the same work per GPU cannot exceed 1.0 but by the run's drift;
#: above this the one-GPU baseline ran slow and the ratio is judged "suspect", not a pass
SCALING_MOST = 1.05


def ddp_run(world: int, rank: int, device, steps: int = DDP_STEPS, cfg=None, per_gpu_batch: int = DDP_PER_GPU_BATCH,
            dog: Watchdog = QUIET, by_hand: bool = False, compiled: bool = False, pin: bool = True,
            profile_steps: int = 0, warmup: int = DDP_WARMUP, graphed: bool = False, graph_warmup: int | None = None):
    """Chapter 12's GPT step (GPT-2 small on a GPU) data-parallel over ``world`` ranks, ``per_gpu_batch``
    sequences on each (a global batch of ``world * per_gpu_batch``): per step the mean loss over all ranks
    (= the loss of the whole global batch) and the step's wall time.

    The versions are chapter 12's: ``course`` (one autograd node a block) under DDP, or the step by hand
    (``by_hand``: no autograd engine, so no DDP hooks; every gradient averaged over the ranks by one
    all-reduce of all of them, flattened into one buffer, after the backward); bf16 weights with float32
    masters on a GPU. ``compiled``: under ``torch.compile`` (DDP's model compiled, Dynamo splitting its
    graph at the gradient buckets, on the op-by-op course ops as chapter 12's ``course + torch.compile``;
    the step by hand's forward and backward compiled as one function). ``pin``: after the warm-up every
    thread of this process on a core of its own (:mod:`course_utils.affinity`: the fastest of the rank's share of
    the host's cores), as
    chapter 12's benchmark times its steps. ``profile_steps``: that many more steps after the timed ones,
    under torch.profiler; their summary (:func:`profile_summary`) in the result's ``attrs["profile"]``.
    ``warmup``: the untimed steps before the timed ones (fewer in the CPU tests, where every step costs seconds).
    ``graphed``: the eager step (DDP's, or by hand) with its all-reduces captured as one CUDA graph per rank and
    replayed on each batch (:func:`graphed_train`; simulated on the CPU): the host's part of a step is one
    launch, so the ratio to one GPU measures the GPUs and the links, not how fast each rank's host issues.
    ``graph_warmup``: the eager steps before the capture (default :data:`GRAPH_WARMUP` on a GPU, as DDP needs;
    one on the CPU, whose simulated graph needs only the first-use work done)."""
    import contextlib

    from course_utils import affinity
    if graphed and compiled:
        raise ValueError("graphed=True captures the eager step (DDP's or by hand) in a CUDA graph; compiled=True "
                         "is another version: ask for one of them")
    cfg = cfg or (gpt.GPT2 if device.type == "cuda" else gpt.TINY)
    ops = "course" if by_hand or compiled else "course-blocks"
    model = gpt.GPT(cfg).to(device).use(ops)
    if device.type == "cuda":
        gpt.bf16_weights(model)
    stream = torch.cuda.Stream(device) if graphed and device.type == "cuda" else None
    if by_hand:
        from course_utils.step import HandStep
        opt = _optimizer(model, graphed)
        hand = HandStep(model, opt, compiled=compiled)
        train = lambda x, y: _hand_data_parallel_step(hand, opt, x, y, world)  # noqa: E731
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # to be captured, DDP is built on the stream that warms it up and captures it (PyTorch's CUDA notes)
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = _optimizer(model, graphed)   # the model's own parameters (DDP's), with the float32 masters it kept
        run = torch.compile(ddp, fullgraph=False) if compiled else ddp   # DDP's graph breaks at its buckets
        train = lambda x, y: gpt.train_step(run, opt, x, y)  # noqa: E731
    global_batch = per_gpu_batch * world
    data = gpt.tokens()
    rows, core, prof, timed = [], None, None, steps + warmup
    with contextlib.ExitStack() as pinned:
        for step, (x, y) in enumerate(gpt.batches(data, global_batch, cfg.seq_len, timed + profile_steps, seed=0)):
            if step == warmup and pin and device.type == "cuda":   # built and compiled: now one core
                core = pinned.enter_context(affinity.one_core(int(os.environ.get("LOCAL_RANK", rank)),
                                                              int(os.environ.get("LOCAL_WORLD_SIZE", world))))
            if step == timed:   # the timed steps are done: the profiled ones follow
                prof = pinned.enter_context(_profiler(device))
            first = step < 2   # the first steps compile the course's kernels
            dog.step(f"DDP step {step + 1}/{timed + profile_steps}", sync=False, allow=5.0 if first else 1.0)
            x, y = (t[rank * per_gpu_batch:(rank + 1) * per_gpu_batch].to(device) for t in (x, y))
            if graphed and step == 0:   # warmed up and captured on the first batch; the model then as it was
                warm = graph_warmup or (GRAPH_WARMUP if device.type == "cuda" else 1)   # the CPU's graph is simulated
                train = graphed_train(train, x, y, model, opt, stream, warmup=warm)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = train(x, y)
            issued = time.perf_counter()   # this rank's host has issued its step (the GPU may still run it)
            dist.all_reduce(loss)   # the mean over ranks: every rank's batch has the same size
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step < timed:
                rows.append({"step": step - warmup, "loss": float(loss) / world,
                             "ms": (time.perf_counter() - t0) * 1e3, "host_ms": (issued - t0) * 1e3})
    df = pd.DataFrame(rows[warmup:])
    step_s = df["ms"].median() / 1e3
    df["tokens_per_s_per_gpu"] = per_gpu_batch * cfg.seq_len / step_s
    df["per_gpu_batch"], df["global_batch"], df["world_size"] = per_gpu_batch, global_batch, world
    df["model"], df["host_threads_on_core"] = f"{cfg.n_layer}x{cfg.d_model} V={cfg.vocab}", core
    if core is not None:   # the chosen core's Python loop against the median of the cores this rank probed
        df["host_core_loop_us"] = affinity.LAST_CHOICE.get("loop_us")
        df["host_median_core_loop_us"] = affinity.LAST_CHOICE.get("median_us")
    if prof is not None:
        df.attrs["profile"] = profile_summary(prof, profile_steps).assign(world_size=world)
    return df


RANK_COLUMNS = ("step", "ms", "host_ms", "host_threads_on_core", "host_core_loop_us", "host_median_core_loop_us")


def rank_tables(df: pd.DataFrame, world: int, rank: int):
    """(steps, profiles): every rank's own timed steps (its host's time to issue each, the core it ran on and
    that core's loop time) and its profile summary (None without one), gathered from all ranks, each row
    with its ``rank``: which rank paced a step, where one rank's profile cannot tell. Every rank calls it."""
    steps = df[[c for c in RANK_COLUMNS if c in df.columns]].assign(rank=rank)
    steps.attrs = {}   # a column selection keeps df's attrs (its profile): concat would compare them, frame to frame
    got = [None] * world
    dist.all_gather_object(got, (steps, df.attrs.get("profile")))
    return gathered_tables(got)


def gathered_tables(got: list):
    """(steps, profiles) from every rank's (steps, profile or None), in rank order."""
    steps = pd.concat([g[0] for g in got], ignore_index=True)
    profiles = [g[1].assign(rank=r) for r, g in enumerate(got) if g[1] is not None]
    return steps, pd.concat(profiles, ignore_index=True) if profiles else None


def slowest_host(steps: pd.DataFrame) -> pd.Series:
    """Per timed step (``steps``: a ``*_ranks_w<W>`` table), the rank whose host took the longest to issue it.
    Every rank waits in the all-reduces for the last to join, so where the hosts set the pace this rank did."""
    return steps.loc[steps.groupby("step")["host_ms"].idxmax()].set_index("step")["rank"]


def rank_summary(steps: pd.DataFrame, profiles: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per rank of one data-parallel run (``steps``: its ``*_ranks_w<W>`` table): the core its threads ran on and
    that core's loop time when chosen (us), its median step and median host time to issue a step (ms), and on
    how many steps its host was the slowest (:func:`slowest_host`); with ``profiles`` (the run's
    ``*_profile_ranks_w<W>`` table), from each rank's profile summary in ms a step: the host's time in events
    less its wait at the end, and that wait (``cudaDeviceSynchronize``: the host, with its step issued, waiting
    for its GPU; NaN where the summary left it out, below every listed event)."""
    by = steps.groupby("rank")
    out = pd.DataFrame(index=by.size().index)
    for column, name in (("host_threads_on_core", "core"), ("host_core_loop_us", "core_loop_us")):
        if column in steps.columns:
            out[name] = by[column].first()
    out["median_ms"], out["median_host_ms"] = by["ms"].median(), by["host_ms"].median()
    out["slowest_host_steps"] = slowest_host(steps).value_counts().reindex(out.index, fill_value=0)
    if profiles is not None:
        cpu = profiles.pivot_table(index="rank", columns="event", values="self_cpu_ms_per_step").reindex(out.index)
        wait = cpu["cudaDeviceSynchronize"] if "cudaDeviceSynchronize" in cpu else pd.Series(float("nan"), out.index)
        out["host_in_events_ms"] = cpu["(all events)"] - wait.fillna(0.0)
        out["sync_wait_ms"] = wait
    return out


def _profiler(device):
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=acts)


#: rows of a profile's summary: the events with the most device time, then those with the most CPU time
PROFILE_TOP = 25


def profile_summary(prof, steps: int) -> pd.DataFrame:
    """Per step of a profiled data-parallel run: each event's calls and its own CPU and GPU milliseconds (the
    :data:`PROFILE_TOP` with the most GPU time and the most CPU time), and the totals over all events."""
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        rows.append({"event": e.key, "calls_per_step": e.count / steps,
                     "self_cpu_ms_per_step": e.self_cpu_time_total / steps / 1e3,
                     "self_gpu_ms_per_step": device_us / steps / 1e3})
    df = pd.DataFrame(rows, columns=["event", "calls_per_step", "self_cpu_ms_per_step", "self_gpu_ms_per_step"])
    top = pd.concat([df.nlargest(PROFILE_TOP, col) for col in ("self_gpu_ms_per_step", "self_cpu_ms_per_step")])
    total = {"event": "(all events)", "calls_per_step": df["calls_per_step"].sum(),
             "self_cpu_ms_per_step": df["self_cpu_ms_per_step"].sum(),
             "self_gpu_ms_per_step": df["self_gpu_ms_per_step"].sum()}
    return pd.concat([pd.DataFrame([total]), top.drop_duplicates("event")], ignore_index=True)


def ddp_loss_reference(device, worlds=DDP_WORLDS, per_gpu_batch: int = DDP_PER_GPU_BATCH,
                       steps: int = DDP_LOSS_STEPS, dog: Watchdog = QUIET, cfg=None) -> pd.DataFrame:
    """One GPU at each W-GPU run's global batch (``W * per_gpu_batch`` sequences, the same batches): the
    losses that the data-parallel runs must reproduce (chapter 12's ``course`` under DDP on a world of one)."""
    runs = [ddp_run(1, 0, device, steps=steps, cfg=cfg, per_gpu_batch=w * per_gpu_batch, dog=dog, pin=False)
            for w in worlds]
    return pd.concat(runs, ignore_index=True)


def ddp_table(by_hand: bool = False, compiled: bool = False, graphed: bool = False) -> str:
    """The CSV name of a data-parallel variant: multigpu_ddp, multigpu_ddp_hand, ..._compiled, ..._graphed."""
    return "multigpu_ddp" + ("_hand" if by_hand else "") + ("_compiled" if compiled else "") + (
        "_graphed" if graphed else "")


#: every data-parallel variant (by_hand, compiled, graphed): eager and compiled, then the eager steps graphed
DDP_VARIANTS = tuple((h, c, False) for h in (False, True) for c in (False, True)) + ((False, False, True),
                                                                                     (True, False, True))
#: every data-parallel variant's table, each judged against its own one-GPU run
DDP_TABLES = tuple(ddp_table(*v) for v in DDP_VARIANTS)
#: the one-GPU losses at the multi-GPU runs' global batches (:func:`ddp_loss_reference`)
DDP_LOSS_REF = "multigpu_ddp_loss_ref"


def average_gradients(params, world: int) -> None:
    """Every ``.grad`` of ``params`` replaced by its mean over the ranks: one all-reduce of a flat copy of all
    of them (one launch and one message, not one per parameter)."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(mean.view_as(g))


#: eager steps before a data-parallel step is captured: DDP needs at least 11 (PyTorch's CUDA notes: its
#: buckets are rebuilt after the first steps)
GRAPH_WARMUP = 11


def graphed_train(train, x: torch.Tensor, y: torch.Tensor, model, opt, stream=None, warmup: int = GRAPH_WARMUP):
    """``train(x, y) -> loss`` (one data-parallel step) as a CUDA graph: ``warmup`` eager steps on
    the batch ``(x, y)``, then one captured (on ``stream``, where DDP was built); returns a ``train`` that
    copies its batch into the captured one and replays. The warm-up steps leave no trace: the weights and the
    optimizer's state are put back (in place: the graph reads their addresses), so the graphed run trains
    from the same start as the eager ones."""
    from course_utils import graphs
    if isinstance(opt, torch.optim.Optimizer) and not opt.defaults.get("capturable"):
        raise ValueError(f"{type(opt).__name__} was built with capturable=False: torch refuses to capture its step() "
                         "(unfused, it counts its steps on the host, so a replay would repeat the captured step's "
                         "bias correction); build it with capturable=True (a GPU) or use the course's MasterAdamW")
    bx, by = x.clone(), y.clone()
    restore = _restorer(model, opt)
    g = graphs.capture(lambda: train(bx, by), warmup=warmup, stream=stream)
    restore()

    def replay(x, y):
        bx.copy_(x)
        by.copy_(y)
        return g.replay()
    return replay


def _optimizer(model, graphed: bool):
    """Chapter 12's optimizer (:func:`course_utils.gpt.optimizer`); for a graphed step on float32 weights (the
    CPU's) the course's MasterAdamW with the same settings, since torch's AdamW can be captured only on a GPU."""
    if not (graphed and gpt.uses_autocast(model)):
        return gpt.optimizer(model)
    from course_utils.tuned.adamw import MasterAdamW
    return MasterAdamW(list(model.parameters()), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)


def _restorer(model, opt):
    """A function that puts ``model``'s weights and ``opt``'s state back as they are now, in place: the
    course's MasterAdamW (float32 masters; moments and step count zero until its first step) or torch's AdamW
    (no state until its first step: zeroed, as a new one starts)."""
    from course_utils.tuned.adamw import MasterAdamW
    weights = [p.detach().clone() for p in model.parameters()]
    masters = opt.master.clone() if isinstance(opt, MasterAdamW) else None
    if (int(opt.step_count.item()) != 0) if masters is not None else any(opt.state.values()):
        raise RuntimeError("the optimizer has already stepped: build the graph before the first step")

    @torch.no_grad()
    def restore():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
        if masters is not None:
            opt.master.copy_(masters)
            for t in (opt.exp_avg, opt.exp_avg_sq, opt.step_count):
                t.zero_()
        else:
            for state in opt.state.values():
                for t in state.values():
                    if torch.is_tensor(t):
                        t.zero_()
    return restore


def _hand_data_parallel_step(hand, opt, x, y, world: int) -> torch.Tensor:
    """One data-parallel step by hand: this rank's gradients, their mean over the ranks, the optimizer's step."""
    loss = hand.grads(x, y)
    average_gradients(list(hand.model.parameters()), world)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def ddp_variants(args) -> list:
    """The data-parallel variants (by_hand, compiled, graphed) that the options ask for: DDP eager, then by hand
    (``--ddp-by-hand``), each compiled too (``--ddp-compiled``; only compiled: ``--compiled-only``), each eager
    one graphed too (``--ddp-graphed``; only graphed: ``--graphed-only``)."""
    if args.graphed_only:
        return [v for v in DDP_VARIANTS if v[2] and (args.ddp_by_hand or not v[0])]
    compiled = (True,) if args.compiled_only else (False, True) if args.ddp_compiled else (False,)
    return [v for v in DDP_VARIANTS if (args.ddp_by_hand or not v[0]) and (v[1] in compiled and not v[2]
                                                                              or args.ddp_graphed and v[2])]


def _per_gpu(d: pd.DataFrame):
    """The sequences per GPU of a data-parallel run, or None for a run recorded before the column (at a fixed
    global batch: a per-GPU throughput that is not comparable across world sizes)."""
    return int(d["per_gpu_batch"].iloc[0]) if "per_gpu_batch" in d else None


def ddp_targets(tables: dict, world: int) -> list:
    """Each data-parallel variant at ``world`` GPUs: its per-GPU tokens/s against its own one-GPU run at the
    same sequences per GPU (weak scaling: only the communication and the hosts' interference can cost), and
    its losses against one GPU's at the same global batch (:data:`DDP_LOSS_REF`)."""
    from course_utils.bench import Target
    found, ref = [], tables.get((DDP_LOSS_REF, 1))
    for name in DDP_TABLES:
        one, d = tables.get((name, 1)), tables.get((name, world))
        if one is None or d is None or _per_gpu(d) is None or _per_gpu(d) != _per_gpu(one):
            continue
        what, per = DDP_NAMES[name], _per_gpu(d)
        found.append(Target(ISSUE, f"{what} per-GPU tokens/s vs 1 GPU, {per} sequences a GPU, {world} GPUs",
                            d["tokens_per_s_per_gpu"].iloc[0] / one["tokens_per_s_per_gpu"].iloc[0], 0.9,
                            most=SCALING_MOST))
        gb = int(d["global_batch"].iloc[0])
        want = None if ref is None else ref.loc[ref["global_batch"] == gb, "loss"].values
        if want is None or not len(want):
            continue
        n = min(len(d), len(want))
        rel = abs((d["loss"].values[:n] - want[:n]) / want[:n]).max()
        found.append(Target(ISSUE, f"{what} losses within 2% of 1 GPU at the same global batch of {gb} "
                                   f"(1 - largest relative difference over {n} steps), {world} GPUs", 1 - rel, 0.98))
    return found


DDP_NAMES = {"multigpu_ddp": "DDP", "multigpu_ddp_compiled": "DDP + torch.compile",
             "multigpu_ddp_hand": "step by hand, data-parallel",
             "multigpu_ddp_hand_compiled": "step by hand + torch.compile, data-parallel",
             "multigpu_ddp_graphed": "DDP + CUDA graph",
             "multigpu_ddp_hand_graphed": "step by hand + CUDA graph, data-parallel"}


def ddp_one_process(device, steps: int = 3, per_gpu_batch: int = 4, by_hand: bool = False, compiled: bool = False,
                    warmup: int = DDP_WARMUP, profile_steps: int = 0, graphed: bool = False,
                    graph_warmup: int | None = None):
    """:func:`ddp_run` on a world of one (a FileStore in a temporary folder, so no port; gloo on the CPU, NCCL on
    a GPU, whose all-reduce a CUDA graph can hold): the same code path as the GPUs', at the TINY size."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            return ddp_run(1, 0, device, steps=steps, cfg=gpt.TINY, per_gpu_batch=per_gpu_batch, by_hand=by_hand,
                           compiled=compiled, warmup=warmup, profile_steps=profile_steps, graphed=graphed,
                           graph_warmup=graph_warmup)
        finally:
            dist.destroy_process_group()
