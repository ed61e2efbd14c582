"""The execution mode, chosen on import: interpreter without a GPU, cuda with one; banner; pick."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import course_utils as cu
from course_utils import env


def _import_in_fresh_python(**environ):
    e = {k: v for k, v in os.environ.items() if k not in ("COURSE_MODE", "TRITON_INTERPRET")}
    e.update(environ)
    return subprocess.run([sys.executable, "-c", "import course_utils as cu; print(cu.MODE, cu.DEVICE)"],
                          capture_output=True, text=True, env=e, timeout=120)


def test_mode_and_device_agree():
    assert cu.MODE in env.MODES
    assert cu.on_gpu() == (cu.MODE == "cuda")
    assert cu.DEVICE.type == ("cuda" if cu.on_gpu() else "cpu")
    if not cu.on_gpu():
        assert os.environ.get("TRITON_INTERPRET") == "1"


def test_pick():
    assert cu.pick(gpu=1_000_003, cpu=7) == (1_000_003 if cu.on_gpu() else 7)


def test_banner_is_one_line_with_mode_device_and_versions():
    b = cu.banner()
    assert "\n" not in b
    assert f"mode: {cu.MODE}" in b
    assert f"torch {torch.__version__}" in b
    assert "triton " in b and env.device_name() in b


def test_supported_dtypes():
    dts = env.supported_dtypes()
    assert dts[:2] == (torch.float32, torch.float16)
    if not cu.on_gpu():
        assert torch.bfloat16 not in dts  # the interpreter's bf16 arithmetic is wrong


def test_in_colab_is_false_here(monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert not env.in_colab() or "google.colab" in sys.modules
    monkeypatch.setenv("COLAB_RELEASE_TAG", "x")
    assert env.in_colab()


@pytest.mark.slow
def test_bad_course_mode_is_refused_with_the_choices():
    r = _import_in_fresh_python(COURSE_MODE="gpu")
    assert r.returncode != 0
    assert "COURSE_MODE must be one of" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_without_a_gpu_import_sets_the_interpreter_and_says_so():
    r = _import_in_fresh_python()
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("interpreter cpu")
    assert "TRITON_INTERPRET=1" in r.stdout
    forced = _import_in_fresh_python(COURSE_MODE="cuda")
    assert forced.returncode != 0 and "sees no CUDA GPU" in forced.stderr


def test_range_loops_with_runtime_bounds_run_under_the_interpreter():
    """Triton 3.6's interpreter + NumPy >= 2.4 needs env's patch for `range(0, n, BLOCK)`."""
    import pytest
    import torch
    import triton
    import triton.language as tl

    from course_utils import env

    if env.on_gpu():
        pytest.skip("interpreter only")

    @triton.jit
    def _sum_tiles(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        acc = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, n, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
        tl.store(out_ptr + tl.arange(0, BLOCK), acc)

    x = torch.randn(100)
    out = torch.empty(16)
    _sum_tiles[(1,)](x, out, x.numel(), BLOCK=16)
    expected = torch.nn.functional.pad(x, (0, 12)).view(-1, 16).sum(0)
    torch.testing.assert_close(out, expected)


# ------------------------------------------------------------------ versions: floors and the one-line message


def test_version_problem_names_installed_and_needed_versions_in_one_line():
    from course_utils import versions as v
    assert v.problem("2.13.0+cpu", "3.6.0") is None and v.problem("2.8.0", "3.4.0") is None
    old = v.problem("2.5.1+cu121", "3.1.0")
    assert "\n" not in old and "torch 2.5.1+cu121" in old and "triton 3.1.0" in old
    assert "torch >= 2.8" in old and "triton >= 3.4" in old
    assert "torch 2.9.0" not in v.problem("2.9.0", "3.3.1")  # only what does not fit is named
    missing = v.problem("2.13.0", None)
    assert "\n" not in missing and "Linux wheels only" in missing and "Colab" in missing and "WSL" in missing
    assert v.parse("3.4.0rc1") == (3, 4) and v.parse("2.13.0+cpu") == (2, 13) and v.parse("dev") is None


def test_declared_floors_are_the_checked_ones():
    import re
    from pathlib import Path

    from course_utils import versions as v
    root = Path(__file__).resolve().parent.parent
    torch_min, triton_min = ".".join(map(str, v.TORCH_MIN)), ".".join(map(str, v.TRITON_MIN))
    for name in ("pyproject.toml", "environment.yml"):
        text = (root / name).read_text()
        assert re.search(rf"torch(-cpu)?>={re.escape(torch_min)}\b", text), f"{name}: torch floor is not {torch_min}"
        assert f"triton>={triton_min}" in text, f"{name}: triton floor is not {triton_min}"


@pytest.mark.slow
def test_import_without_triton_says_what_to_do():
    e = {k: v for k, v in os.environ.items() if k not in ("COURSE_MODE", "TRITON_INTERPRET")}
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['triton'] = None; import course_utils"],
                       capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "Triton is not installed" in ln]
    assert len(lines) == 1 and "Colab" in lines[0] and "WSL" in lines[0]
