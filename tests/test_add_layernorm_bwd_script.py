"""tools/gpu_checks/add_layernorm_bwd.py: its smoke run under the interpreter, and its check refuses a wrong launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import course_utils as cu

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "gpu_checks"))

import add_layernorm_bwd as S  # noqa: E402


def test_smoke_run_checks_every_candidate_and_prints_the_table():
    env = {**os.environ, "TRITON_INTERPRET": "1", "COURSE_MODE": "interpreter"}
    out = subprocess.run([sys.executable, str(ROOT / "tools/gpu_checks/add_layernorm_bwd.py"), "--smoke"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "every candidate right" in out.stdout
    for c in S.candidates(4, smoke=True):
        assert S.name(c) in out.stdout


def test_the_reference_and_formula_agree_and_a_wrong_launch_is_named(monkeypatch):
    device = "cuda" if cu.on_gpu() else "cpu"   # the tool's kernels run where the session's kernels run
    dy, ds, s, w, mean, rstd = S.inputs(5, 12, torch.float64, device)
    want = S.reference(dy, ds, s, w)
    for g, r in zip(S.formula(dy, ds, s, w, mean, rstd), want):
        assert torch.allclose(g.double(), r, atol=1e-10), (g, r)
    right = S.launch

    def dx_without_ds(dy, ds, *rest):   # a launch that forgets the residual's gradient
        return right(dy, torch.zeros_like(ds), *rest)
    monkeypatch.setattr(S, "launch", dx_without_ds)
    failures = S.check(device, 4, smoke=True)
    assert failures and all("p r" in f for f in failures) and len(failures) == 2 * len(S.candidates(4, True))
