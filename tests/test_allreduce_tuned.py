"""The fast path of chapter 13's all-reduce (course_utils/tuned/allreduce.py), on simulated ranks: the
one-shot and the two-shot, plain and fused with the residual + RMSNorm, against float64 on odd sizes and
1 to 4 ranks, calls back to back with new data (and between calls of the teaching kernel on the same
pads), the checker's adversarial schedule for the one-shot, phases launched before anyone published,
and a peer that never comes."""

import re

import pytest
import torch

from course_utils import check, env
from course_utils import symmetric as S
from course_utils.checkers import allreduce as checks
from course_utils.kernels import allreduce as K
from course_utils.tuned import allreduce as T

SHAPES = [(1, 1), (7, 37), (13, 100), (3, 5, 129), (11, 16)]
DTYPES = list(env.supported_dtypes())
if env.on_gpu():
    # On a GPU the simulated ranks launch phase by phase, and each (algorithm, phase, world, dtype, tile width) is a
    # compile of its own: about 450 for the first test below alone (results/h200/test_gpu_s15.log: this file took
    # 675 test-seconds of make test-gpu). The interpreter runs every shape and dtype above; the GPU runs the compiled
    # code at three tile widths (1, an unmasked 16, a masked 256 over several leading dimensions), float32 and bf16.
    SHAPES, DTYPES = [(1, 1), (11, 16), (3, 5, 129)], [torch.float32, torch.bfloat16]


def _ranks(world, dtype, capacity=2000, programs=None):
    return S.SimulatedRanks(world, capacity, dtype, device=env.DEVICE, max_programs=programs)


def _pads_zero(ranks):
    return not any(bool(p.any()) for p in ranks.pads)


@pytest.mark.parametrize("algorithm", T.ALGORITHMS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_matches_float64_back_to_back(nan_empty, algorithm, world, dtype):
    ranks = _ranks(world, dtype)
    for shape in SHAPES + SHAPES[::-1]:          # every shape twice: both halves of the buffers
        xs = [check.randn(shape, dtype, scale=2.0) for _ in range(world)]
        outs = T.all_reduce(xs, ranks, algorithm)
        for out in outs:
            assert out.shape == xs[0].shape and out.dtype == dtype
            check.compare(f"{algorithm} all-reduce {shape}", out, K.all_reduce_ref(xs))
        assert all(torch.equal(out, outs[0]) for out in outs)   # the same sum order on every rank
        assert _pads_zero(ranks)


@pytest.mark.parametrize("algorithm", T.ALGORITHMS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_matches_float64(nan_empty, algorithm, world, dtype):
    ranks = _ranks(world, dtype)
    for shape in SHAPES:
        xs = [check.randn(shape, dtype, scale=2.0) for _ in range(world)]
        residual = check.randn(shape, dtype)
        weight = check.randn(shape[-1:], dtype, offset=1.0, scale=0.5)
        got = T.all_reduce_add_rms_norm(xs, [residual] * world, weight, ranks, 1e-6, algorithm)
        summed = K.all_reduce_ref(xs)
        if algorithm.startswith("two-shot"):   # the gathered sum is stored in x's dtype before the residual is added
            summed = summed.to(dtype).double()
        y64, s64 = K.all_reduce_add_rms_norm_ref([summed], residual, weight, 1e-6, dtype=dtype)
        for y, s in got:
            check.compare(f"{algorithm} s {shape}", s, s64)
            check.compare(f"{algorithm} y {shape}", y, y64)
        assert _pads_zero(ranks)


def test_tuned_and_teaching_calls_interleave_on_the_same_ranks():
    ranks = _ranks(4, torch.float32)
    for call in range(8):
        xs = [check.randn((9, 33)) for _ in range(4)]
        launch = (lambda: K.one_shot_all_reduce_teaching(xs, ranks),
                  *(lambda a=a: T.all_reduce(xs, ranks, a) for a in T.ALGORITHMS))[call % 4]
        for out in launch():
            check.compare(f"call {call}", out, K.all_reduce_ref(xs))
        assert _pads_zero(ranks)


class _CheckerLaunch:
    """The tuned one-shot launched as the checker launches a student's kernel (its argument list)."""

    def __init__(self, fused):
        self.fused = fused

    def __getitem__(self, grid):
        def launch(*args, WORLD, BLOCK_N, PUBLISH, REDUCE):
            if self.fused:
                y, s, x, r, w, bt, pt, rank, n_rows, n_cols, offset, eps, spins = args
            else:
                y, x, bt, pt, rank, n_rows, n_cols, offset, spins = args
                s, r, w, eps = y, x, x, 0.0
            T.one_shot_kernel[grid](y, s, x, r, w, bt, pt, rank, n_rows, n_cols, offset, 0, eps, spins, WORLD=WORLD,
                                    WORLD_P2=1 << (WORLD - 1).bit_length(), BLOCK_N=BLOCK_N, FUSED=self.fused,
                                    COPY=True, PUBLISH=PUBLISH, REDUCE=REDUCE)
        return launch


@pytest.mark.parametrize("fused", [False, True])
def test_tuned_one_shot_survives_the_checkers_adversarial_schedule(fused):
    checks.stress(_CheckerLaunch(fused), "tuned one-shot", fused=fused)


@pytest.mark.parametrize("algorithm, phase", [("one-shot", "REDUCE"), ("two-shot", "SCATTER"),
                                              ("two-shot", "GATHER"), ("two-shot-push", "SCATTER")])
def test_a_phase_launched_before_any_publish_reads_nothing_and_leaves_the_pads(algorithm, phase):
    ranks = _ranks(2, torch.float32)
    x = check.randn((5, 33))
    out = torch.full_like(x, float("nan"))
    names = ("PUBLISH", "REDUCE") if algorithm == "one-shot" else ("PUBLISH", "SCATTER", "GATHER")
    kernel = T.one_shot_kernel if algorithm == "one-shot" else T.two_shot_kernel
    with check.track_loads() as loads:
        kernel[(3,)](out, out, x, x, x, ranks.buf_table, ranks.pad_table, 0, 5, 33, 0, ranks.tuned_pad_offset, 0.0,
                     ranks.max_spins, WORLD=2, WORLD_P2=2, BLOCK_N=64, FUSED=False, COPY=True,
                     **{n: n == phase for n in names}, **({"PUSH": True} if algorithm == "two-shot-push" else {}))
    assert checks._peer_reads(loads, ranks, rank=0) == 0
    assert bool(out.isnan().all()) and _pads_zero(ranks)
    assert all(bool(b.isnan().all()) for b in ranks.buffers)   # no sum was stored either


@pytest.mark.parametrize("algorithm", T.ALGORITHMS)
def test_a_peer_that_never_signals_gives_nan_rows(algorithm):
    class Alone(S.SimulatedRanks):
        def schedule(self):
            return [(0, True, True)]   # one launch of rank 0, as on a GPU; rank 1 never runs

    ranks = Alone(2, 64, dtype=torch.float32, device=env.DEVICE, max_programs=2)
    xs = [check.randn((3, 7)), check.randn((3, 7))]
    assert torch.isnan(T.all_reduce(xs, ranks, algorithm)[0]).all()
    y, s = T.all_reduce_add_rms_norm(xs, [check.randn((3, 7))] * 2, check.randn((7,)), ranks, 1e-6, algorithm)[0]
    assert torch.isnan(y).all() and torch.isnan(s).all()


@pytest.mark.parametrize("algorithm", T.ALGORITHMS)
def test_inputs_written_into_the_staging_buffer_skip_the_copy(algorithm):
    world, dtype = 4, torch.float32
    ranks = _ranks(world, dtype)
    for call, shape in enumerate([(9, 33), (5, 129), (9, 33), (1, 7)]):
        xs = [check.randn(shape, dtype) for _ in range(world)]
        staged = [ranks.staging(shape, r) for r in range(world)]
        for x, view in zip(xs, staged):
            view.copy_(x)   # what a producer writing with out= does
        if call % 2:
            residual, weight = check.randn(shape), check.randn(shape[-1:], offset=1.0, scale=0.5)
            got = T.all_reduce_add_rms_norm(staged, [residual] * world, weight, ranks, 1e-6, algorithm, in_buffer=True)
            summed = K.all_reduce_ref(xs)
            if algorithm.startswith("two-shot"):   # the gathered sum is stored in x's dtype
                summed = summed.to(dtype).double()
            y64, s64 = K.all_reduce_add_rms_norm_ref([summed], residual, weight, 1e-6, dtype=dtype)
            for y, s in got:
                check.compare(f"staged fused {algorithm}, call {call}", y, y64)
                check.compare(f"staged fused {algorithm}, call {call}", s, s64)
        else:
            for out in T.all_reduce(staged, ranks, algorithm, in_buffer=True):
                check.compare(f"staged {algorithm}, call {call}", out, K.all_reduce_ref(xs))
        for out in T.all_reduce(xs, ranks, algorithm):   # and a call with the copy between staged calls
            check.compare(f"copied {algorithm}, call {call}", out, K.all_reduce_ref(xs))
        assert _pads_zero(ranks)


def test_in_buffer_refuses_tensors_that_are_not_the_staging_view():
    ranks = _ranks(2, torch.float32)
    xs = [check.randn((4, 8)) for _ in range(2)]
    with pytest.raises(ValueError, match="ranks.staging"):
        T.all_reduce(xs, ranks, in_buffer=True)
    stale = [ranks.staging((4, 8), r) for r in range(2)]
    T.all_reduce(xs, ranks)   # a call in between: the staging half is now the other one
    with pytest.raises(ValueError, match="ranks.staging"):
        T.all_reduce(stale, ranks, in_buffer=True)
    with pytest.raises(ValueError, match="do not fit"):
        ranks.staging((100, 100))


def test_two_shot_spreads_the_reduce_scatter_over_the_ranks_with_one_row_a_program():
    """Rows of 4096 at 1-8 MiB give each program one or two rows: the owners must still be spread over
    the ranks (rank r's buffer holds the sum in exactly the rows r reduced), not all on rank 0."""
    world, rows = 4, 8
    ranks = _ranks(world, torch.float32, programs=rows)
    xs = [check.randn((rows, 16)) for _ in range(world)]
    offset = ((ranks.calls + 1) % 2) * ranks.capacity
    T.all_reduce(xs, ranks, "two-shot")
    total = K.all_reduce_ref(xs).float()
    # float32 sums in another order than float64's: an element that cancels to ~0 is off by ~1e-7, far
    # below what tells the sum (held by the row's owner) from one rank's x (held by every other rank)
    owned = [[bool(torch.allclose(ranks.buffers[r][offset + i * 16: offset + (i + 1) * 16], total[i], atol=1e-5))
              for i in range(rows)] for r in range(world)]
    assert [sum(o) for o in owned] == [rows // world] * world
    assert all(sum(owned[r][i] for r in range(world)) == 1 for i in range(rows))


def test_pushed_two_shot_leaves_the_whole_sum_in_every_rank_s_buffer():
    """The owner of a row stores its sum into every rank's buffer (where the pulled two-shot keeps it in its
    own): after the call, every row of every rank's buffer is the sum."""
    world, rows = 4, 8
    ranks = _ranks(world, torch.float32, programs=rows)
    xs = [check.randn((rows, 16)) for _ in range(world)]
    offset = ((ranks.calls + 1) % 2) * ranks.capacity
    outs = T.all_reduce(xs, ranks, "two-shot-push")
    total = K.all_reduce_ref(xs).float()
    for r in range(world):
        held = ranks.buffers[r][offset: offset + rows * 16].view(rows, 16)
        assert torch.equal(held, outs[r]), f"rank {r}: its buffer does not hold the sum it returned"
        assert torch.allclose(held, total, atol=1e-5)


def test_auto_picks_two_shot_only_where_it_moves_fewer_bytes():
    assert T.pick_algorithm(64 * 2**20, 2) == "one-shot"          # W = 2: the same bytes, one barrier fewer
    assert T.pick_algorithm(2**19, 4) == "one-shot"               # latency-bound: 0.5 MiB, the one-shot measured faster
    assert T.pick_algorithm(2**20, 4) == "two-shot"               # 1 MiB: the two-shot measured faster on 4 H100s
    assert T.pick_algorithm(682 * 768 * 2, 4) == "two-shot"       # the benchmark's "1 MiB" of rows of 768
    assert T.pick_algorithm(16 * 2**20, 4) == "two-shot"          # half the one-shot's bytes
    with pytest.raises(ValueError, match="algorithm must be one of"):
        T.all_reduce([torch.zeros(2, 8, device=env.DEVICE)] * 2, _ranks(2, torch.float32), "ring")


def test_unaligned_tables_are_refused():
    ranks = _ranks(2, torch.float32)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        ranks.tables([ranks.buffers[0].data_ptr() + 4, ranks.buffers[1].data_ptr()],
                     [p.data_ptr() for p in ranks.pads], ranks.device)


def test_bad_inputs_get_the_teaching_launchers_errors():
    ranks = _ranks(2, torch.float32)
    with pytest.raises(ValueError, match="list of 2 tensors"):
        T.all_reduce([torch.zeros(4, 8, device=env.DEVICE)], ranks)
    with pytest.raises(ValueError, match="weight must be a tensor of shape"):
        zeros = [torch.zeros(4, 8, device=env.DEVICE)] * 2
        T.all_reduce_add_rms_norm(zeros, zeros, torch.ones(9, device=env.DEVICE), ranks)


def _ptx_tool():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "tools" / "allreduce_ptx.py"
    spec = importlib.util.spec_from_file_location("allreduce_ptx", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ptx_counter_reads_widths_atomics_and_barriers():
    ptx = ("@%p1 ld.global.b16 { %rs1 }, [ %rd1 + 0 ];\n@%p2 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd2 + 0 ];\n"
           "@%p3 st.global.b16 [ %rd3 + 0 ], { %rs2 };\n@%p4 ld.volatile.global.b32 { %r5 }, [ %rd4 + 0 ];\n"
           "@%p5 atom.global.release.sys.cas.b32 %r6, [ %rd5 + 0 ], %r7, %r8;\n"
           "@%p6 atom.global.sys.acquire.add.u32 %r9, [ %rd6 + 0 ], %r10;\nbar.sync \t0;\n")
    got = _ptx_tool().count(ptx)
    assert {k: v for k, v in got.items() if v} == {"ld_2B": 1, "ld_16B": 1, "st_2B": 1, "ld_volatile": 1,
                                                   "atom_cas": 1, "atom_add": 1, "bar_sync": 1}


def test_recorded_ptx_says_every_rank_is_loaded_16_bytes_at_a_time():
    """results/ptx/allreduce_ptx.csv (tools/allreduce_ptx.py): no 2-byte loads or stores left in any kernel;
    the teaching barrier's compare-and-swaps grow with W; the tuned barrier signals with one atomic add and
    takes one count per peer, and never waits on a volatile load (every warp would read it at its own moment)."""
    import pandas as pd

    from course_utils.bench import RESULTS
    df = pd.read_csv(RESULTS / "ptx" / "allreduce_ptx.csv").set_index("what")
    assert (df.ld_2B == 0).all() and (df.st_2B == 0).all()
    for world in (2, 4):
        assert df.loc[f"teaching one-shot, W={world}", "ld_16B"] >= world
        assert df.loc[f"tuned one-shot, W={world}", "atom_add"] == 1 + (world - 1)
        assert df.loc[f"tuned two-shot, W={world}", "atom_add"] == 2 * (1 + (world - 1))
        assert df.loc[f"tuned one-shot, W={world}", "atom_cas"] == 0
    assert (df.loc[df.index.str.startswith("tuned"), "ld_volatile"] == 0).all()
    assert df.loc["teaching one-shot, W=4", "atom_cas"] > df.loc["teaching one-shot, W=2", "atom_cas"]


@pytest.mark.parametrize("algorithm", T.ALGORITHMS)
def test_a_rank_running_a_call_ahead_never_spoils_a_slow_peers_reads(algorithm):
    """Rank 0 finishes call 1 and publishes (and signals) call 2 before rank 1 has read call 1: the counters
    hold two signals at once, and call 2 writes the other half, so rank 1 still reads call 1's data."""
    world, n_rows, n_cols = 2, 6, 24
    ranks = _ranks(world, torch.float32, programs=3)
    kernel = T.one_shot_kernel if algorithm == "one-shot" else T.two_shot_kernel
    names = ("PUBLISH", "REDUCE") if algorithm == "one-shot" else ("PUBLISH", "SCATTER", "GATHER")
    calls = [[check.randn((n_rows, n_cols), device=env.DEVICE) for _ in range(world)] for _ in range(2)]
    outs = [[torch.full((n_rows, n_cols), float("nan"), device=env.DEVICE) for _ in range(world)] for _ in range(2)]
    offsets = [ranks.next_offset() for _ in range(2)]

    def run(call, rank, phase):
        x, out = calls[call][rank], outs[call][rank]
        kernel[(3,)](out, out, x, x, x, ranks.buf_table, ranks.pad_table, rank, n_rows, n_cols, offsets[call],
                     ranks.tuned_pad_offset, 0.0, ranks.max_spins, WORLD=world, WORLD_P2=world, BLOCK_N=32,
                     FUSED=False, COPY=True, **{n: n == phase for n in names})

    *early, last = names
    for phase in early:                  # call 1 up to its last phase, on both ranks
        for rank in range(world):
            run(0, rank, phase)
    run(0, 0, last)                      # rank 0 finishes call 1 ...
    run(1, 0, "PUBLISH")                 # ... and publishes call 2, as far as it gets alone
    run(0, 1, last)                      # rank 1, slow, reads call 1 now
    run(1, 1, "PUBLISH")
    for phase in names[1:]:
        for rank in reversed(range(world)):
            run(1, rank, phase)
    for call in range(2):
        for rank in range(world):
            check.compare(f"call {call + 1}, rank {rank}", outs[call][rank], K.all_reduce_ref(calls[call]))
    assert _pads_zero(ranks)


_COMPILE_TUNED = r"""
import json, os, re, subprocess, sys, tempfile
import triton, triton.language
import course_utils
os.environ.pop("TRITON_INTERPRET", None)
import torch
from course_utils import aot_compile
from course_utils.kernels.allreduce import _GpuRank
from course_utils.tuned import allreduce as T
def release(path):   # a Triton may ship several ptxas (3.9: CUDA 12.9's and 13.4's); its PTX may need the newest
    m = re.search(r"release (\d+)\.(\d+)", subprocess.run([path, "--version"], capture_output=True, text=True).stdout)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ptxas = max((os.path.join(bin_dir, f) for f in os.listdir(bin_dir) if f.startswith("ptxas")), key=release)
rows = []
for world in (2, 4):
    for n_cols in (768, 4096):   # 4096 at W = 4: the widest tile, 16 warps a program
        x, w = torch.empty(64, n_cols, dtype=torch.bfloat16), torch.empty(n_cols, dtype=torch.bfloat16)
        for a in T.ALGORITHMS:
            for fused in (False, True):
                ranks = _GpuRank(world, 64 * n_cols, torch.bfloat16)
                call = ((lambda: T.all_reduce_add_rms_norm([x], [x], w, ranks, 1e-6, a)) if fused
                        else (lambda: T.all_reduce([x], ranks, a)))
                for launch in aot_compile.ptx_of(call, 90):
                    with tempfile.TemporaryDirectory() as d:
                        path = os.path.join(d, "k.ptx")
                        open(path, "w").write(launch["ptx"])
                        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                                             capture_output=True, text=True, check=True).stderr
                    rows.append({"what": f"{a} fused={fused} W={world} n={n_cols}", "ptx": launch["ptx"],
                                 "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
                                 "threads": int(re.search(r"\.(?:req|max)ntid (\d+)", launch["ptx"]).group(1))})
print(json.dumps(rows))
"""


@pytest.mark.skipif(env.on_gpu(), reason="compiles in a fresh process without the interpreter; on a GPU the "
                                         "smoke test (tools/gpu_checks/allreduce_smoke.py) runs the kernels")
def test_compiled_wait_is_one_thread_s_read_shared_and_every_program_fits_at_once():
    """The tuned kernels compiled for sm_90 here (no GPU needed), two faults the interpreter cannot show (it
    runs a program as one thread, one program at a time), each of which hung 2 and 4 H100s:

    - the wait decides on a flag that one thread read and handed to every warp (a scalar atomic: a strong
      ``ld.global.sys.relaxed`` or ``atom``, then shared memory), never on a ``ld.volatile`` of a tensor of
      flags, which every warp loads again at its own moment: one warp saw the count reach 1 and took it
      back to 0 while another, which had read it just before, spun on the 0 for ``max_spins`` rounds;
    - a program needs at most 65536 / 512 = 128 registers a thread, so that RESIDENT_WARPS_PER_SM warps'
      worth of programs (``Ranks.programs``) are resident on an SM together: a waiting program keeps its SM.
    """
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not any((Path(triton.__file__).parent / "backends" / "nvidia" / "bin").glob("ptxas*")):
        pytest.skip("Triton's CUDA backend (with its ptxas) ships in the Linux wheel only")
    from course_utils import aot
    out = subprocess.run([sys.executable, "-c", _COMPILE_TUNED], env=aot.subprocess_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * 2 * len(T.ALGORITHMS) * 2   # worlds x widths x algorithms x (plain, fused)
    for row in rows:
        ptx = row["ptx"]
        assert "ld.volatile" not in ptx, row["what"]
        polls = re.findall(r"ld\.global\.sys\.(?:relaxed|acquire)\.b32|atom\.global\.sys\.\w+\.add", ptx)
        assert polls and "st.shared" in ptx, row["what"]
        per_sm = S.RESIDENT_WARPS_PER_SM * 32 // row["threads"]
        allocated = -(-row["registers"] // 8) * 8   # registers are handed out 8 a thread at a time
        assert per_sm >= 1 and per_sm * row["threads"] * allocated <= 65536, row


def test_a_gpu_launch_has_no_more_programs_than_the_sms_hold_at_once():
    """SymmetricRanks.programs: RESIDENT_WARPS_PER_SM warps an SM (4 programs of 4 warps, 1 of 16), capped by
    the pads' flags; the tuned launcher asks it with the warps it launches."""
    ranks = S.SymmetricRanks.__new__(S.SymmetricRanks)   # the arithmetic alone: no process group here
    ranks.sms, ranks.max_programs = 132, S.PROGRAMS_PER_SM * 132
    assert [ranks.programs(w) for w in (1, 4, 8, 16)] == [528, 528, 264, 132]

    class Asked(S.SimulatedRanks):
        def programs(self, num_warps):
            self.asked = num_warps
            return 1   # one program does every row

    asked = Asked(2, 2000, torch.float32, device=env.DEVICE)
    xs = [check.randn((5, 300)) for _ in range(2)]
    for out in T.all_reduce(xs, asked, "two-shot"):
        check.compare("one program", out, K.all_reduce_ref(xs))
    assert asked.asked == T.num_warps_for(2, 512)
