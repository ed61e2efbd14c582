"""Smoke test of chapter 13's all-reduces on real GPUs, every step under a watchdog: never a silent hang.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        timeout 120 torchrun --nproc_per_node=2 tools/gpu_checks/allreduce_smoke.py      # and 4

The teaching one-shot (course_utils/kernels/allreduce.py) and the fast path's one-shot and two-shot,
plain and fused with the residual + RMSNorm (course_utils/tuned/allreduce.py), over torch symmetric
memory (no multicast), bf16, at 1 MiB (rows of 768: 4 warps a program) and 16 MiB (rows of 4096: 16
warps a program at 4 ranks) per rank. Inputs are small integers, x_r = (i + call + 3 r) % 7 - 3, whose
sums are exact in bf16: every all-reduce must equal NCCL's ``all_reduce`` bit for bit, and the fused
epilogue's s too (its y within bf16 tolerance of RMSNorm in float64).

1. one call of each (impl, size) against NCCL;
2. 20 calls back to back, new data each (the barrier's flags reused call after call);
3. the same 20 calls captured in one CUDA graph and replayed twice on new data.

Rank 0 prints one ``PASS``/``FAIL`` line per (phase, impl, size), a verdict agreed by every rank. A step
that does not finish within ``--watchdog`` seconds (default 20; twice that for a first call, which
compiles) makes every rank print ``HUNG rank r ... at: <phase> <impl> <size>`` with its Python stacks and
exit 3 (benchmarks/multigpu.py's Watchdog). After its first call (which compiles, so the ranks may
arrive seconds apart) a wait gives up after SMOKE_SPINS polls (seconds, not the library's minute): a
wait that gives up ends its launch with NaN in the output, a FAIL that says so, while a kernel that
never ends at all (a deadlock) is a HUNG. A table last. About 30-60 s on healthy H100s, most of it
compiling.

Without torchrun (or under the interpreter) it only says so: the kernels' CPU tests are
tests/test_allreduce*.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MIB = 2**20
SIZES = ((1, 768), (16, 4096))   # (MiB per rank, row width)
CALLS = 20                        # back to back, and captured in one graph (even: the buffer halves alternate)
SMOKE_SPINS = 2**22               # a wait gives up after a few seconds here, not the library's minute
WATCHDOG_S = 20.0
EPS = 1e-6
Y_TOL = 3e-2                      # bf16 y against float64 RMSNorm of the same s, relative to |y| + 1
DEVICE, DTYPE = "cuda", torch.bfloat16   # tests/test_multigpu_watchdog.py: phases 1-2 on the course device


def sync() -> None:
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def impls(ranks, res, w) -> dict:
    """name -> f(x) returning (the sum, or s for the fused ones; y or None)."""
    from course_utils.kernels import allreduce as K
    from course_utils.tuned import allreduce as T

    def fused(algorithm):
        def run(x):
            y, s = T.all_reduce_add_rms_norm([x], [res], w, ranks, EPS, algorithm)[0]
            return s, y
        return run

    out = {"teaching one-shot": lambda x: (K.one_shot_all_reduce_teaching([x], ranks)[0], None)}
    for a in T.ALGORITHMS:
        out[f"tuned {a}"] = lambda x, a=a: (T.all_reduce([x], ranks, a)[0], None)
        out[f"tuned fused {a}"] = fused(a)
    return out


def inputs(rows: int, width: int, call: int, rank: int) -> torch.Tensor:
    """x_r = (i + call + 3 r) % 7 - 3: small integers, exact in bf16, new for every call."""
    i = torch.arange(rows * width, device=DEVICE).view(rows, width)
    return ((i + call + 3 * rank) % 7 - 3).to(DTYPE)


def expected(rows: int, width: int, call: int, world: int) -> torch.Tensor:
    return sum(inputs(rows, width, call, r).float() for r in range(world)).to(DTYPE)


def verdict(total: torch.Tensor, got, y, w) -> str:
    """'' if ``got`` (the sum, or s) equals ``total`` bit for bit and ``y`` is RMSNorm(s) * w, else why not."""
    if got.isnan().any():
        return f"{int(got.isnan().sum())} NaN (a wait gave up: a peer's signal never came)"
    wrong = int((got != total).sum())
    if wrong:
        return f"{wrong} of {got.numel()} elements differ from the exact sum (max {float((got - total).abs().max()):g})"
    if y is not None:
        s = got.double()
        want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
        excess = float(((y.double() - want).abs() - Y_TOL * (want.abs() + 1)).max())
        if not excess <= 0:
            return f"y off RMSNorm(s) * w by {excess:g} beyond tolerance"
    return ""


class Smoke:
    def __init__(self, args):
        import torch.distributed as dist

        from benchmarks.multigpu import Watchdog
        from course_utils import symmetric
        self.dist, self.rank, self.world = dist, dist.get_rank(), dist.get_world_size()
        self.dog = Watchdog(args.watchdog, self.rank)
        self.dog.step("symmetric buffers")
        self.ranks = symmetric.SymmetricRanks(max(m for m, _ in SIZES) * MIB // 2, torch.bfloat16)
        self.spins = args.spins
        self.table, self.compiled = [], set()

    def report(self, phase: str, name: str, mib: int, why: str, seconds: float) -> None:
        """Agree on the verdict over the ranks (any rank's failure fails it); rank 0 prints the line."""
        bad = torch.tensor([0 if not why else 1], device=DEVICE)
        self.dist.all_reduce(bad)
        status = "PASS" if int(bad) == 0 else "FAIL"
        line = f"{status}  {phase:<14} {name:<22} {mib:>2} MiB  {seconds * 1e3:8.1f} ms"
        if why:
            line += f"  rank {self.rank}: {why}"
        if self.rank == 0 or why:
            print(line, flush=True)
        self.table.append((phase, name, mib, status))

    def step(self, phase: str, name: str, mib: int) -> None:
        """A first call compiles its kernel, and the ranks may finish compiling seconds apart: it gets the
        library's patience (SPINS_GPU, about a minute) and twice the watchdog's time; later calls SMOKE_SPINS."""
        from course_utils.symmetric import SPINS_GPU
        first = (name, mib) not in self.compiled
        self.compiled.add((name, mib))
        self.ranks.max_spins = SPINS_GPU if first else self.spins
        self.dog.step(f"{phase} {name} {mib} MiB", allow=2.0 if first else 1.0)

    def run_checked(self, phase, name, mib, body) -> None:
        self.step(phase, name, mib)
        start = time.perf_counter()
        try:
            why = body()
        except Exception as e:  # noqa: BLE001  (the verdict says it; every rank goes on to the next check)
            why = f"{type(e).__name__}: {str(e)[:200]}"
        sync()
        self.report(phase, name, mib, why, time.perf_counter() - start)

    def one_call(self, name, fn, mib, width, w) -> str:
        rows = mib * MIB // (2 * width)
        x = inputs(rows, width, 0, self.rank)
        nccl = x.clone()
        self.dist.all_reduce(nccl)
        got, y = fn(x)
        sync()
        return verdict(nccl, got, y, w)

    def back_to_back(self, name, fn, mib, width, w) -> str:
        rows = mib * MIB // (2 * width)
        outs = [fn(inputs(rows, width, call, self.rank)) for call in range(CALLS)]
        sync()
        for call, (got, y) in enumerate(outs):
            why = verdict(expected(rows, width, call, self.world), got, y, w)
            if why:
                return f"call {call + 1}: {why}"
        return ""

    def graphed(self, name, fn, mib, width, w) -> str:
        rows = mib * MIB // (2 * width)
        xs = [inputs(rows, width, call, self.rank) for call in range(CALLS)]   # the graph's static inputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up off the capture, an even number of calls (the halves)
            for x in xs[:2]:
                fn(x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [fn(x) for x in xs]
        for replay in range(2):   # new data in the static inputs, then a replay
            base = 100 * (replay + 1)
            for call, x in enumerate(xs):
                x.copy_(inputs(rows, width, base + call, self.rank))
            self.dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            for call, (got, y) in enumerate(outs):
                why = verdict(expected(rows, width, base + call, self.world), got, y, w)
                if why:
                    return f"replay {replay + 1}, call {call + 1}: {why}"
        return ""

    def run(self, graphs: bool = True) -> int:
        start = time.perf_counter()
        phases = [("one call", self.one_call), (f"{CALLS} in a row", self.back_to_back)]
        for phase, body in phases + ([(f"CUDA graph x{CALLS}", self.graphed)] if graphs else []):
            for mib, width in SIZES:
                res = torch.zeros(mib * MIB // (2 * width), width, device=DEVICE, dtype=DTYPE)
                w = torch.ones(width, device=DEVICE, dtype=DTYPE)
                for name, fn in impls(self.ranks, res, w).items():
                    self.run_checked(phase, name, mib,
                                     lambda b=body, n=name, f=fn, m=mib, wd=width, w=w: b(n, f, m, wd, w))
        self.dog.step("done")
        failed = [row for row in self.table if row[3] != "PASS"]
        if self.rank == 0:
            device = torch.cuda.get_device_name() if torch.device(DEVICE).type == "cuda" else DEVICE
            print(f"\n{self.world} GPUs ({device}), {time.perf_counter() - start:.0f} s: "
                  f"{len(self.table) - len(failed)}/{len(self.table)} PASS")
            names = sorted({(n, m) for _, n, m, _ in self.table}, key=lambda t: (t[1], t[0]))
            phases = list(dict.fromkeys(p for p, _, _, _ in self.table))
            verdicts = {(p, n, m): s for p, n, m, s in self.table}
            print(f"{'impl':<22} {'MiB':>3}  " + "  ".join(f"{p:<16}" for p in phases))
            for n, m in names:
                print(f"{n:<22} {m:>3}  " + "  ".join(f"{verdicts.get((p, n, m), '-'):<16}" for p in phases))
        self.dist.barrier()
        self.dog.close()
        return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--watchdog", type=float, default=WATCHDOG_S, metavar="S",
                    help="seconds a step may take before every rank says where it was and exits (0: off)")
    ap.add_argument("--spins", type=int, default=SMOKE_SPINS, help="polls before a wait gives up")
    args = ap.parse_args(argv)
    if "WORLD_SIZE" not in os.environ or not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("allreduce_smoke: run it under torchrun on 2 or more GPUs (see its docstring); nothing to do here")
        return 0
    os.environ.update(NO_MULTICAST)   # before the process group: NCCL, symm_mem and NVSHMEM read them then
    import torch.distributed as dist
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    try:
        return Smoke(args).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
