"""Chapter 13 on real GPUs: the one-shot all-reduce and its fused epilogue over torch symmetric memory,
one process per GPU under torchrun (``make test-gpu-multi``): float64 checks at 1 and 16 MiB per rank
and a stress loop of calls back to back (benchmarks/multigpu.py --check-only). Skipped, with the
reason, under the interpreter and on fewer than two GPUs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import course_utils as cu

ROOT = Path(__file__).resolve().parent.parent
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cu.MODE != "cuda", reason="multi-GPU tests need CUDA GPUs (the interpreter has one process "
                                                 "and no NVLink; tests/test_allreduce.py simulates the ranks)"),
    pytest.mark.skipif(GPUS < 2, reason=f"multi-GPU tests need at least 2 GPUs, this host has {GPUS}"),
]


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_on_real_ranks(world, tmp_path):
    if GPUS < world:
        pytest.skip(f"needs {world} GPUs, this host has {GPUS}")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "-m", "benchmarks.multigpu",
           "--check-only", "--out", str(tmp_path / "gpu")]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("correctness:"))
    got, total = line.split()[1].split("/")
    assert got == total, out[-4000:]
    assert "stress: 0 wrong elements" in line, line
