"""benchmarks/multigpu.py's watchdog and impl filter, on the CPU: a step that outruns ``--watchdog`` makes
the rank say where it was and exit with HUNG_EXIT (never a silent hang); steps that keep coming never
trip it; ``--only-impls`` keeps names by case-blind parts."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import multigpu as M

pytestmark = pytest.mark.machinery   # left out of the newest-Triton run (pyproject.toml says why)

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    return run, time.monotonic() - start


def test_a_step_that_outruns_the_watchdog_says_where_and_exits():
    code = ("import time\nfrom benchmarks.multigpu import Watchdog\n"
            "dog = Watchdog(1.0, rank=3); print(time.time(), flush=True)\n"
            "dog.step('width 768, 1 MiB: reference check: tuned one-shot')\n"
            "time.sleep(120)\n")
    run, _ = _run(code)
    took = time.time() - float(run.stdout.split()[0])   # from the first step to the exit, not the imports
    assert run.returncode == M.HUNG_EXIT, run.stderr[-2000:]
    assert "HUNG rank 3" in run.stderr and "reference check: tuned one-shot" in run.stderr
    assert "File \"<string>\", line 5" in run.stderr   # every thread's stack: the main thread in its sleep
    assert took < 30    # the watchdog's 1 s and the stacks, not the step's 120 s sleep


def test_steps_that_keep_coming_never_trip_it_and_a_slow_step_may_be_allowed_more():
    code = ("import time\nfrom benchmarks.multigpu import Watchdog\n"
            "dog = Watchdog(1.0, rank=0, echo=True)\n"
            "for i in range(8):\n    dog.step(f'step {i}')\n    time.sleep(0.3)\n"
            "dog.step('compiling', allow=4.0)\ntime.sleep(2.0)\ndog.close()\ntime.sleep(1.5)\nprint('finished')\n")
    run, _ = _run(code)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "finished" in run.stdout and "HUNG" not in run.stderr
    assert "step 7" in run.stderr and "compiling" in run.stderr   # rank 0 echoes its steps to stderr


def test_only_impls_keeps_names_by_case_blind_parts():
    keep = M.keeper("Tuned one-shot, NCCL all_reduce")
    assert keep("tuned one-shot") and keep("tuned one-shot, x in buffer") and keep("nccl all_reduce")
    assert not keep("tuned two-shot") and not keep("course one-shot") and not keep("nccl + add + F.rms_norm")
    assert all(M.keeper(None)(name) for name in ("anything", "course one-shot"))
    assert all(M.keeper(" , ")(name) for name in ("anything",))


def _smoke_module():
    import importlib.util
    path = ROOT / "tools" / "gpu_checks" / "allreduce_smoke.py"
    spec = importlib.util.spec_from_file_location("allreduce_smoke", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _OneRank:
    """torch.distributed for a group of one: the collectives are no-ops."""

    def all_reduce(self, t):
        return t

    def barrier(self):
        pass


def test_the_gpu_smoke_runs_its_first_two_phases_on_one_simulated_rank(monkeypatch, capsys):
    """tools/gpu_checks/allreduce_smoke.py's plumbing (impls, inputs, verdicts, the table) on the course's
    device (the CPU in CI): one simulated rank, float32, tiny sizes; the CUDA-graph phase is left out."""
    import torch

    from course_utils import symmetric as S
    sm = _smoke_module()
    from course_utils import env
    for name, value in (("DEVICE", env.DEVICE), ("DTYPE", torch.float32), ("MIB", 2**12), ("CALLS", 3)):
        monkeypatch.setattr(sm, name, value)
    smoke = sm.Smoke.__new__(sm.Smoke)
    smoke.dist, smoke.rank, smoke.world, smoke.dog = _OneRank(), 0, 1, M.Watchdog(0)
    smoke.ranks = S.SimulatedRanks(1, 16 * 2**12, torch.float32, device=env.DEVICE)   # the interpreter's CPU
    smoke.spins, smoke.table, smoke.compiled = 2, [], set()
    assert smoke.run(graphs=False) == 0
    out = capsys.readouterr().out
    from course_utils.tuned import allreduce as T
    n_impls = 1 + 2 * len(T.ALGORITHMS)   # the teaching one-shot, then each tuned algorithm plain and fused
    checks = 2 * len(sm.SIZES) * n_impls   # two phases, each size, every impl
    lines = out.splitlines()
    assert sum(ln.startswith("PASS  ") for ln in lines) == checks and "FAIL" not in out
    assert f"{checks}/{checks} PASS" in out
    assert sum(ln.startswith(("teaching one-shot", "tuned")) for ln in lines) == n_impls * len(sm.SIZES)   # the table


def test_the_gpu_smoke_verdict_names_each_fault():
    import torch
    sm = _smoke_module()
    total = torch.tensor([[1.0, -2.0, 3.0]], dtype=torch.bfloat16)
    w = torch.ones(3, dtype=torch.bfloat16)
    assert sm.verdict(total, total.clone(), None, w) == ""
    assert "NaN" in sm.verdict(total, torch.full_like(total, float("nan")), None, w)
    one_off = total + torch.tensor([[0.0, 0.0, 1.0]]).bfloat16()
    assert "1 of 3 elements differ from the exact sum" in sm.verdict(total, one_off, None, w)
    s = total.double()
    y = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + sm.EPS)).bfloat16()
    assert sm.verdict(total, total.clone(), y, w) == ""
    assert "y off" in sm.verdict(total, total.clone(), y * 2, w)
