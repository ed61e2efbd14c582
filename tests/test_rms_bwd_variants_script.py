"""tools/gpu_checks/rms_bwd_variants.py's kernels under the interpreter: each variant it would time on a GPU gives
RMSNorm's dx and dw (float64 reference), so a GPU run times right kernels only."""

from __future__ import annotations

import pytest
import torch

import course_utils as cu

TOOL = "rms_bwd_variants"   # the gpu_check fixture (conftest.py) loads tools/gpu_checks/rms_bwd_variants.py


@pytest.mark.skipif(cu.on_gpu(), reason="the GPU run checks the same kernels at full size before it times them")
@pytest.mark.parametrize("m, n", [(48, 64), (37, 50)])   # even rows and a power of two; then neither
def test_every_variant_matches_float64(gpu_check, m, n):
    torch.manual_seed(0)
    x, dy = torch.randn(m, n), torch.randn(m, n)
    w = torch.randn(n)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
    table, dx, ws = gpu_check.variants(x, dy, w, rstd)
    names = set(table)
    assert any(k.startswith("inductor") for k in names) == (n == 64 and m % gpu_check.ROWS_PER_PROGRAM == 0)
    for name, run in gpu_check.runs(table, ws).items():
        if "w8" not in name:   # the warps change nothing under the interpreter: one of each kind
            continue
        bad_dx, bad_dw = gpu_check.errors(run, dx, x, dy, w, rstd)
        assert bad_dx < 1e-4 and bad_dw < 1e-5, (name, bad_dx, bad_dw)


def test_a_wrong_dx_is_caught(gpu_check):
    m, n = 16, 64
    device = "cuda" if cu.on_gpu() else "cpu"   # the tool's kernels run where its tensors are
    x, dy, w = (torch.randn(*shape, device=device) for shape in ((m, n), (m, n), (n,)))
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
    table, dx, ws = gpu_check.variants(x, dy, w, rstd)
    run = gpu_check.runs(table, ws)["w in loop even w8 sNone"]

    def half_dx():   # a kernel that leaves rows unwritten
        dw = run()
        dx[m // 2:] = float("nan")
        return dw
    assert not gpu_check.errors(half_dx, dx, x, dy, w, rstd)[0] < 1e-4
