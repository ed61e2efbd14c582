"""tools/gpu_checks/norm_fwd_forms.py's kernel under the interpreter: every form it would time on a GPU gives
LayerNorm's and RMSNorm's y (float64 reference), so a GPU run times right kernels only."""

from __future__ import annotations

import pytest
import torch

import course_utils as cu

TOOL = "norm_fwd_forms"   # the gpu_check fixture (conftest.py) loads tools/gpu_checks/norm_fwd_forms.py


@pytest.mark.skipif(cu.on_gpu(), reason="the GPU run checks every form against float64 before it times it")
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("m, n, rows", [(6, 64, 2), (7, 50, 2)])   # even: every form; ragged: masked forms only
def test_every_form_matches_float64(gpu_check, m, n, rows, rms):
    torch.manual_seed(0)
    x = torch.randn(m, n) * 3 - 1
    w, b = torch.randn(n), torch.randn(n)
    ref = gpu_check._reference(x, w, b, rms)
    forms = gpu_check.forms(m, n, rows)
    assert len(forms) == (8 if n == 64 else 4) and all(f[0] for f in forms) == (n != 64)
    for masked, i64, two in forms:
        y = torch.full_like(x, float("nan"))
        gpu_check.fwd_form[(-(-m // rows),)](y, x, w, b, m, n, gpu_check.EPS, BLOCK_N=triton_block(n), ROWS=rows,
                                             RMS=rms, MASKED=masked, I64=i64, TWO_PASS=two)
        assert (y.double() - ref).abs().max().item() < 1e-4, (masked, i64, two)


def triton_block(n: int) -> int:
    return 1 << (n - 1).bit_length()
