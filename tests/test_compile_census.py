"""tools/compile_census.py: the compile key it counts a launch under, and its files read back."""

import importlib.util
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.machinery   # left out of the newest-Triton run (pyproject.toml says why)

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("compile_census", ROOT / "tools" / "compile_census.py")
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)


@triton.jit
def _k(x_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


def test_a_launch_is_keyed_as_triton_specializes_it():
    x = torch.zeros(64)
    key = lambda *a, **kw: cc.launch_key(_k, a, kw)   # noqa: E731
    base = key(x, 40, 2.0, BLOCK=16)
    assert base == key(x, 41 + 15, 3.0, BLOCK=16) == key(torch.ones(64), 40, 2.0, BLOCK=16)   # same ints' class
    others = [key(x, 1, 2.0, BLOCK=16), key(x, 48, 2.0, BLOCK=16), key(x, 2**40, 2.0, BLOCK=16),
              key(x.half(), 40, 2.0, BLOCK=16), key(x[1:], 40, 2.0, BLOCK=16), key(x, 40, 2.0, BLOCK=32),
              key(x, 40, 2.0, BLOCK=16, num_warps=8)]
    assert len({base, *others}) == 1 + len(others)   # 1, divisible by 16, 64-bit, dtype, alignment, constexpr, warps
    assert base[0].startswith(f"{__name__}._k@")


def test_the_census_counts_a_tests_launches(tmp_path):
    """One real run through the plugin: the distinct keys per test, and those new to the process."""
    (tmp_path / "test_x.py").write_text(
        "import torch\nfrom tests.test_compile_census import _k\n\n"
        "def test_a():\n    x = torch.zeros(64)\n    for n in (40, 56, 48):\n        _k[(4,)](x, n, 2.0, BLOCK=16)\n\n"
        "def test_b():\n    _k[(4,)](torch.zeros(64), 40, 2.0, BLOCK=32)\n"
        "    _k[(4,)](torch.zeros(64), 40, 2.0, BLOCK=16)\n")
    out = tmp_path / "census.tsv"
    assert cc.main(["--out", str(out), "--", "-q", "-p", "no:xdist", "--rootdir", str(ROOT),
                    str(tmp_path / "test_x.py")]) == 0
    rows = {k.rsplit("::", 1)[-1]: v[:3] for k, v in cc.read(str(out)).items()}
    assert rows == {"test_a": (2, 2, 3), "test_b": (2, 1, 2)}


def test_gpu_seconds_are_read_from_either_file(tmp_path):
    tsv = tmp_path / "t.tsv"
    tsv.write_text("1.5\tsetup\ttests/a.py::t[x]\tpassed\n2.0\tcall\ttests/a.py::t[x]\tpassed\n")
    table = tmp_path / "t.log"
    table.write_text(" seconds  test\n   329.4  tests/b.py::t[(1, 3) -tuned]\n    87.7  tests/c.py::u\n")
    assert cc.read_times(str(tsv)) == {"tests/a.py::t[x]": 3.5}
    assert cc.read_times(str(table)) == {"tests/b.py::t[(1, 3) -tuned]": 329.4, "tests/c.py::u": 87.7}
    assert cc._spearman([(1, 10), (2, 20), (3, 30)]) == pytest.approx(1.0)
