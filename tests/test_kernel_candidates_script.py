"""tools/gpu_checks/kernel_candidates.py runs end to end under the interpreter (--smoke: tiny shapes, no timing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.machinery   # a tool around the kernels: their own tests run them under the newest Triton
def test_smoke_run_checks_every_candidate_and_writes_the_csvs(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "COURSE_MODE": "interpreter"}
    out = subprocess.run([sys.executable, str(ROOT / "tools/gpu_checks/kernel_candidates.py"), "--smoke",
                          "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "SUMMARY" in out.stdout and "FAILED" not in out.stdout
    for name in ("ln_candidates", "ln_times", "attn_checks", "attn_times"):
        assert len(pd.read_csv(tmp_path / f"{name}.csv")), name
    for name in ("ln_candidates", "attn_checks"):  # every candidate checked against float32, and right
        df = pd.read_csv(tmp_path / f"{name}.csv")
        assert df.ok.astype(bool).all() and (df.err < 1e-2).all(), df.to_string()
