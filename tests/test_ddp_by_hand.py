"""benchmarks/multigpu.py's data-parallel step by hand (chapter 12's step without autograd, every gradient
averaged by one flat all-reduce) against DDP's autograd step, on the CPU with gloo: the same losses, on one
process and on two (where a gradient summed and not averaged, or not copied back, would part them)."""

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from course_utils import env

pytestmark = [pytest.mark.skipif(env.on_gpu(), reason="the CPU's float32 steps; a GPU runs it with torchrun"),
              pytest.mark.machinery]   # left out of the newest-Triton run (pyproject.toml says why)


def _rank(rank: int, world: int, store: str, out: str) -> None:
    """On each rank: DDP's averaged gradients and the step by hand's, after :func:`average_gradients`, for
    this rank's half of one batch; then both trainings' losses."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks import multigpu
    from course_utils import gpt, step
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = gpt.GPT(gpt.TINY, seed=1).use("course")
        twin = copy.deepcopy(model)
        x, y = (t[rank * 2:(rank + 1) * 2] for t in next(gpt.batches(gpt.tokens(), 4, gpt.TINY.seq_len, 1, seed=5)))
        ddp = DDP(model)   # kept while backward runs: its reducer averages the gradients
        ddp(x, y)[1].backward()
        step.HandStep(twin, None).grads(x, y)
        multigpu.average_gradients(list(twin.parameters()), world)
        worst = max(((a.grad - b.grad).abs().max() / a.grad.abs().max()).item()
                    for a, b in zip(model.parameters(), twin.parameters()))
        losses = {how: multigpu.ddp_run(world, rank, torch.device("cpu"), steps=2, cfg=gpt.TINY, per_gpu_batch=2,
                                        by_hand=how == "hand", warmup=WARMUP)["loss"].tolist()
                  for how in ("ddp", "hand")}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save({"worst_grad": worst, **losses}, out)


# One untimed step before the two compared ones, not the benchmark's five: the first step builds (and compiles)
# everything, and each step under the interpreter costs seconds. Two sequences a step, as on each of two ranks.
WARMUP, BATCH = 1, 2


@functools.cache
def _one_process(by_hand: bool, compiled: bool = False, profile_steps: int = 0, graphed: bool = False):
    """Two steps on one gloo process, eager, compiled or graphed (then ``profile_steps`` profiled ones); each run
    is made once per worker and shared by the tests below (the eager DDP run is also the profile's plain run).
    Graphed: one eager step before the capture (DDP on a GPU needs 11; here it costs seconds a step)."""
    from benchmarks import multigpu
    return multigpu.ddp_one_process(torch.device("cpu"), steps=2, per_gpu_batch=BATCH, by_hand=by_hand,
                                    compiled=compiled, warmup=WARMUP, profile_steps=profile_steps, graphed=graphed,
                                    graph_warmup=1)


def test_the_step_by_hand_data_parallel_follows_ddp_on_one_process():
    ddp, hand = _one_process(False), _one_process(True)
    assert len(hand) == len(ddp) == 2
    assert torch.allclose(torch.tensor(hand["loss"].values), torch.tensor(ddp["loss"].values), rtol=1e-5, atol=0)


def test_the_step_by_hand_data_parallel_follows_ddp_on_two_processes():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "losses.pt")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), out), nprocs=2, join=True)
        losses = torch.load(out)
    assert losses["worst_grad"] <= 1e-5, losses   # the mean over the ranks, as DDP's (not the sum, not local)
    assert len(losses["hand"]) == len(losses["ddp"]) == 2
    assert torch.allclose(torch.tensor(losses["hand"]), torch.tensor(losses["ddp"]), rtol=1e-5, atol=0), losses


@pytest.mark.slow
@pytest.mark.parametrize("by_hand", [False, True], ids=["ddp", "by-hand"])
def test_each_data_parallel_step_compiled_takes_the_same_steps(by_hand):
    """``--ddp-compiled``: DDP's model under torch.compile (its graph split at the buckets) and the step by
    hand compiled whole train like their eager selves (on the CPU the course's ops stay opaque custom ops)."""
    eager, compiled = _one_process(by_hand), _one_process(by_hand, compiled=True)
    assert len(compiled) == len(eager) == 2
    assert torch.allclose(torch.tensor(compiled["loss"].values), torch.tensor(eager["loss"].values), rtol=1e-4, atol=0)


def test_every_data_parallel_variant_is_judged_against_its_own_one_gpu_run():
    """Per-GPU tokens/s against the variant's own 1-GPU run at the same sequences a GPU; losses against the
    one-GPU reference at the same global batch; a run recorded at a fixed global batch (no per_gpu_batch
    column) or at another per-GPU batch is not compared."""
    import pandas as pd

    from benchmarks import multigpu

    def run(ms, world, loss=(3.0, 2.5), per=8):
        return pd.DataFrame({"loss": list(loss), "tokens_per_s_per_gpu": [1e3 / ms] * 2, "per_gpu_batch": per,
                             "global_batch": per * world})
    ref = pd.DataFrame({"loss": [3.0, 2.5, 3.0, 2.0], "global_batch": [16, 16, 32, 32]})
    tables = {("multigpu_ddp", 1): run(10, 1), ("multigpu_ddp", 2): run(20, 2),
              ("multigpu_ddp_hand_compiled", 1): run(4, 1), ("multigpu_ddp_hand_compiled", 2): run(4.2, 2, (3.0, 2.6)),
              ("multigpu_ddp_hand_compiled", 4): run(4.4, 4, (3.0, 2.1)),
              ("multigpu_ddp_hand", 1): run(5, 1), ("multigpu_ddp_hand", 2): run(5, 2, per=4),
              ("multigpu_ddp_compiled", 1): run(5, 1).drop(columns="per_gpu_batch"),
              ("multigpu_ddp_compiled", 2): run(5, 2).drop(columns="per_gpu_batch"),
              (multigpu.DDP_LOSS_REF, 1): ref}
    got = {t.claim: t.measured for t in multigpu.targets(tables)}
    assert got["DDP per-GPU tokens/s vs 1 GPU, 8 sequences a GPU, 2 GPUs"] == pytest.approx(0.5)
    hand = "step by hand + torch.compile, data-parallel"
    assert got[f"{hand} per-GPU tokens/s vs 1 GPU, 8 sequences a GPU, 2 GPUs"] == pytest.approx(4 / 4.2)
    assert got[f"{hand} per-GPU tokens/s vs 1 GPU, 8 sequences a GPU, 4 GPUs"] == pytest.approx(4 / 4.4)
    loss2 = f"{hand} losses within 2% of 1 GPU at the same global batch of 16 (1 - largest relative difference " \
            "over 2 steps), 2 GPUs"
    assert got[loss2] == pytest.approx(1 - 0.1 / 2.5)
    loss4 = loss2.replace("of 16", "of 32").replace("2 GPUs", "4 GPUs")
    assert got[loss4] == pytest.approx(1 - 0.1 / 2.0)   # against the reference at 32 sequences, not at 16
    assert not any("DDP + torch.compile" in name for name in got)   # recorded at a fixed global batch: not judged
    assert not any(name.startswith("step by hand, data-parallel") for name in got)   # 4 a GPU against 8: not judged


def test_a_scaling_ratio_above_one_is_suspect_not_a_pass():
    """A per-GPU throughput above one GPU's at the same work per GPU means the one-GPU baseline ran slow:
    judged "suspect", never a pass (the run must be repeated)."""
    import pandas as pd

    from benchmarks import multigpu
    from course_utils import bench

    def run(ms, world):
        return pd.DataFrame({"loss": [3.0, 2.5], "tokens_per_s_per_gpu": [1e3 / ms] * 2, "per_gpu_batch": 8,
                             "global_batch": 8 * world})
    tables = {("multigpu_ddp_hand", 1): run(35.6, 1), ("multigpu_ddp_hand", 2): run(25.2, 2),
              ("multigpu_ddp", 1): run(20.0, 1), ("multigpu_ddp", 2): run(20.5, 2)}
    got = {t.claim: t for t in multigpu.targets(tables)}
    hand = got["step by hand, data-parallel per-GPU tokens/s vs 1 GPU, 8 sequences a GPU, 2 GPUs"]
    assert hand.measured == pytest.approx(35.6 / 25.2)
    assert hand.status == bench.SUSPECT and not hand.passed
    assert got["DDP per-GPU tokens/s vs 1 GPU, 8 sequences a GPU, 2 GPUs"].status == "pass"   # 0.976: within 1.05


def test_profiled_steps_come_after_the_timed_ones_and_are_summarized():
    """``profile_steps``: the timed rows are the same as without it; the profile's summary has the totals first
    and the events that cost the most CPU time (on the CPU no event has GPU time)."""
    plain, profiled = _one_process(False), _one_process(False, profile_steps=2)
    assert "profile" not in plain.attrs
    assert profiled["loss"].tolist() == pytest.approx(plain["loss"].tolist(), rel=1e-6)
    summary = profiled.attrs["profile"]
    assert summary["event"].iloc[0] == "(all events)"
    assert summary["self_cpu_ms_per_step"].iloc[0] >= summary["self_cpu_ms_per_step"].iloc[1:].max() > 0
    assert summary["event"].is_unique and len(summary) > 5


def test_rank_tables_gather_each_ranks_steps_and_profile():
    """Every rank's timed steps (with the host's time to issue each) and profile come back with its rank."""
    from benchmarks import multigpu
    df = _one_process(False, profile_steps=2)   # the run of the test above
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            steps, profiles = multigpu.rank_tables(df, 1, 0)
            bare = df.copy()
            bare.attrs = {}   # a run without profiled steps
            plain_steps, none = multigpu.rank_tables(bare, 1, 0)
        finally:
            dist.destroy_process_group()
    assert list(steps["rank"]) == [0, 0] and list(steps["step"]) == list(df["step"])
    assert (steps["host_ms"] > 0).all() and (steps["host_ms"] <= steps["ms"]).all()
    assert set(profiles["rank"]) == {0} and len(profiles) == len(df.attrs["profile"])
    assert none is None and len(plain_steps) == 2


def test_rank_tables_strip_the_profile_from_each_ranks_steps_before_gathering():
    """On 2 GPUs the gathered steps were concatenated with the profile still in their attrs, and pandas
    compares attrs (pandas 2.x: a DataFrame's truth value is ambiguous): every rank's steps go without it."""
    import pandas as pd

    from benchmarks import multigpu
    captured = {}
    df = pd.DataFrame({"step": [0, 1], "ms": [2.0, 3.0], "host_ms": [1.0, 1.5]})
    df.attrs["profile"] = pd.DataFrame({"event": ["(all events)"], "self_cpu_ms_per_step": [1.0]})
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            real = dist.all_gather_object

            def gather(out, obj):   # as two ranks would send it
                real(out, obj)
                captured["sent"] = obj
                out.append(obj)
            dist.all_gather_object = gather
            multigpu.rank_tables(df, 1, 0)
        finally:
            dist.all_gather_object = real
            dist.destroy_process_group()
    assert captured["sent"][0].attrs == {}
    steps, profiles = multigpu.gathered_tables([captured["sent"], captured["sent"]])
    assert len(steps) == 4 and len(profiles) == 2 and list(profiles["rank"]) == [0, 1]


def test_rank_summary_names_the_rank_whose_host_paced_the_steps():
    """Per rank: its core, median step and host time, the steps on which its host was the slowest, and from its
    profile its host's time in events less the wait at the end, and that wait (NaN where its summary left the
    wait out); without profiles, the steps' columns alone."""
    import math

    import pandas as pd

    from benchmarks import multigpu
    steps = pd.DataFrame({"step": [0, 1, 2] * 2, "ms": [20.0, 30.0, 31.0, 21.0, 30.5, 31.0],
                          "host_ms": [15.0, 16.0, 15.5, 14.0, 28.0, 29.0], "host_threads_on_core": [4] * 3 + [7] * 3,
                          "host_core_loop_us": [250.0] * 3 + [260.0] * 3, "rank": [0] * 3 + [1] * 3})
    profiles = pd.DataFrame({"event": ["(all events)", "cudaDeviceSynchronize", "aten::mm", "(all events)", "aten::mm"],
                             "self_cpu_ms_per_step": [30.0, 12.0, 1.5, 33.0, 3.0], "rank": [0, 0, 0, 1, 1]})
    assert multigpu.slowest_host(steps).tolist() == [0, 1, 1]
    got = multigpu.rank_summary(steps, profiles)
    assert list(got.index) == [0, 1]
    assert got["core"].tolist() == [4, 7] and got["core_loop_us"].tolist() == [250.0, 260.0]
    assert got["median_ms"].tolist() == [30.0, 30.5] and got["median_host_ms"].tolist() == [15.5, 28.0]
    assert got["slowest_host_steps"].tolist() == [1, 2]
    assert got.loc[0, "sync_wait_ms"] == 12.0 and got.loc[0, "host_in_events_ms"] == 18.0
    assert math.isnan(got.loc[1, "sync_wait_ms"]) and got.loc[1, "host_in_events_ms"] == 33.0
    bare = multigpu.rank_summary(steps.drop(columns=["host_threads_on_core", "host_core_loop_us"]))
    assert list(bare.columns) == ["median_ms", "median_host_ms", "slowest_host_steps"]


@pytest.mark.parametrize("by_hand", [False, True], ids=["ddp", "by-hand"])
def test_each_data_parallel_step_graphed_takes_the_same_steps(by_hand):
    """``--ddp-graphed``: the eager step captured (a simulated graph on the CPU) and replayed on each batch trains
    like the eager step: the warm-up steps before the capture leave no trace, each replay sees its new batch
    and its optimizer's step count advances on the device (a host-side count would freeze the first step's
    bias correction; the replays' losses would part from the eager ones from the second step)."""
    eager, graphed = _one_process(by_hand), _one_process(by_hand, graphed=True)
    assert len(graphed) == len(eager) == 2
    assert torch.allclose(torch.tensor(graphed["loss"].values), torch.tensor(eager["loss"].values), rtol=1e-5, atol=0)


def test_a_graphed_step_refuses_an_optimizer_that_counts_on_the_host_and_a_compiled_one():
    from benchmarks import multigpu
    from course_utils import gpt
    model = gpt.GPT(gpt.TINY).use("course")
    opt = torch.optim.AdamW(model.parameters())   # capturable=False: its step count is a host number
    x, y = next(iter(gpt.batches(gpt.tokens(), 1, gpt.TINY.seq_len, 1, seed=0)))
    with pytest.raises(ValueError, match="capturable=False"):
        multigpu.graphed_train(lambda x, y: gpt.train_step(model, opt, x, y), x, y, model, opt, warmup=1)
    with pytest.raises(ValueError, match="one of them"):
        multigpu.ddp_run(1, 0, torch.device("cpu"), compiled=True, graphed=True)


def test_the_restorer_refuses_an_optimizer_that_has_stepped():
    """``_restorer`` puts a torch optimizer's state back to zero, as a new one starts: right only before its
    first step, so it refuses one that has stepped (as it does the course's MasterAdamW)."""
    from benchmarks import multigpu
    from course_utils import gpt
    model = gpt.GPT(gpt.TINY)
    opt = torch.optim.AdamW(model.parameters())
    multigpu._restorer(model, opt)   # no state yet: fine
    x, y = next(iter(gpt.batches(gpt.tokens(), 1, gpt.TINY.seq_len, 1, seed=0)))
    gpt.train_step(model, opt, x, y)
    with pytest.raises(RuntimeError, match="already stepped"):
        multigpu._restorer(model, opt)


@pytest.mark.parametrize("flags, names", [
    ([], ["multigpu_ddp"]),
    (["--ddp-by-hand", "--ddp-compiled"], ["multigpu_ddp", "multigpu_ddp_compiled", "multigpu_ddp_hand",
                                           "multigpu_ddp_hand_compiled"]),
    (["--ddp-by-hand", "--ddp-graphed"], ["multigpu_ddp", "multigpu_ddp_hand", "multigpu_ddp_graphed",
                                          "multigpu_ddp_hand_graphed"]),
    (["--ddp-by-hand", "--graphed-only"], ["multigpu_ddp_graphed", "multigpu_ddp_hand_graphed"]),
    (["--graphed-only"], ["multigpu_ddp_graphed"]),
    (["--ddp-by-hand", "--ddp-compiled", "--compiled-only", "--ddp-graphed"],
     ["multigpu_ddp_compiled", "multigpu_ddp_hand_compiled", "multigpu_ddp_graphed", "multigpu_ddp_hand_graphed"]),
], ids=["plain", "compiled", "graphed", "graphed-only", "graphed-only-ddp", "compiled-only-and-graphed"])
def test_the_options_pick_the_data_parallel_variants(flags, names):
    import argparse

    from benchmarks import multigpu
    args = argparse.Namespace(ddp_by_hand="--ddp-by-hand" in flags, ddp_compiled="--ddp-compiled" in flags,
                              compiled_only="--compiled-only" in flags, ddp_graphed="--ddp-graphed" in flags,
                              graphed_only="--graphed-only" in flags)
    assert [multigpu.ddp_table(*v) for v in multigpu.ddp_variants(args)] == names
    assert all(n in multigpu.DDP_NAMES for n in multigpu.DDP_TABLES)
