"""The compile matrix: every course kernel compiles ahead of time for sm_75 (T4), sm_80 (A100) and
sm_90 (H100), as its launcher configures it for that GPU, on this CPU-only machine.

Compiling needs real ``JITFunction`` objects, so everything that compiles runs in a subprocess
where ``TRITON_INTERPRET`` is unset (``python -m course_utils.aot``). The machinery itself is tested
on small kernels of this file, including kernels that must be reported as failing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from course_utils import aot, env, hardware

ROOT = Path(__file__).resolve().parent.parent


def _compile_env() -> dict:
    return aot.subprocess_env()  # no TRITON_INTERPRET, no GPU (compile, never run), the repo on the path


def _ptxas_available() -> bool:
    import triton
    return any((Path(triton.__file__).parent / "backends" / "nvidia" / "bin").glob("ptxas*"))


pytestmark = pytest.mark.skipif(sys.platform != "linux" or not _ptxas_available(),
                                reason="Triton's CUDA backend (with its ptxas) ships in the Linux wheel only")


# ------------------------------------------------------------------------- pure parts, in-process

def test_dtypes_per_arch():
    assert torch.bfloat16 not in aot.dtypes_for(hardware.DeviceInfo.for_arch(75))
    for arch in (80, 90):
        assert aot.dtypes_for(hardware.DeviceInfo.for_arch(arch)) == (torch.float32, torch.float16, torch.bfloat16)


def test_pretend_restores_everything():
    from course_utils import env
    before = (hardware.device_info, env.on_gpu, env.supported_dtypes)
    t4 = hardware.DeviceInfo.for_arch(75)
    with pytest.raises(RuntimeError, match="boom"), aot.pretend(t4):
        assert hardware.device_info() == t4 and env.on_gpu()
        assert env.supported_dtypes() == (torch.float32, torch.float16)
        raise RuntimeError("boom")
    assert (hardware.device_info, env.on_gpu, env.supported_dtypes) == before


def test_failures_lists_every_problem():
    matrix = {"results": [{"arch": 75, "kernel": "k", "case": "c", "ok": False, "error": "too big"},
                          {"arch": 80, "kernel": "k", "case": "c", "ok": True, "error": ""}],
              "case_errors": [{"arch": 90, "case": "m: x", "error": "TypeError: no"}],
              "uncovered": {"75": ["m._lost_kernel"], "80": []}}
    lines = aot.failures(matrix)
    assert len(lines) == 3
    assert "too big" in lines[0] and "TypeError" in lines[1] and "_lost_kernel" in lines[2]


def test_cases_come_from_the_modules_and_defaults_only_for_shelves_without_any(monkeypatch):
    import types
    info = hardware.DeviceInfo.for_arch(90)

    def module(name, cases=None):
        m = types.ModuleType(name)
        if cases is not None:
            m.compile_cases = cases
        monkeypatch.setitem(sys.modules, name, m)
        return m

    own = module("course_utils.tuned.fakeop", lambda info: [("tuned case", lambda: None)])
    teaching = module("course_utils.kernels.fakeop")
    lonely = module("course_utils.kernels.lonelyop")
    monkeypatch.setitem(aot.DEFAULT_CASES, "course_utils.kernels.fakeop", lambda m, info: [("default", None)])
    monkeypatch.setitem(aot.DEFAULT_CASES, "course_utils.kernels.lonelyop", lambda m, info: [("default", None)])
    assert [c[0] for c in aot.cases_for(own, info)] == ["tuned case"]
    assert aot.cases_for(teaching, info) == []      # its tuned shelf has cases: no defaults on top of them
    assert [c[0] for c in aot.cases_for(lonely, info)] == ["default"]
    assert aot.async_copies("  cp.async.cg.shared.global [%r1], [%rd2], 16;\n@%p3 cp.async.ca.shared.global "
                            "[%r4], [%rd5], 4;\n cp.async.commit_group;\n cp.async.wait_group 0;\n"
                            " cp.async.bulk.tensor.2d.shared::cluster.global [%r1], [%rd2, {%r3, %r4}];\n"
                            " cp.async.bulk.commit_group;") == {"cp_async": 2, "cp_async_bulk": 1}


# ------------------------------------------------------------------------- the machinery, on kernels of this file

FIXTURE_KERNELS = '''
import triton
import triton.language as tl
import torch
from course_utils import hardware

SCALE = 3.0                      # NOT a constexpr: a kernel reading it does not compile for a GPU
GOOD_SCALE = tl.constexpr(3.0)


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _good_kernel(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    tl.store(y_ptr + offsets, _twice(tl.load(x_ptr + offsets, mask=mask)) * GOOD_SCALE, mask=mask)


@triton.jit
def _global_kernel(x_ptr, y_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * SCALE, mask=mask)


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    tile = tl.load(x_ptr + r[:, None] * BLOCK + r[None, :])
    tl.store(y_ptr + r[:, None] * BLOCK + r[None, :], tl.trans(tile))   # goes through shared memory


@triton.jit
def _never_launched_kernel(x_ptr):
    pass


def good(x):
    info = hardware.device_info()
    block = 2048 if info.arch >= 80 else 512          # a pure function of the device
    y = torch.empty_like(x)
    _good_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK_SIZE=block, num_warps=4)
    return y


def uses_global(x):
    y = torch.empty_like(x)
    _global_kernel[(1,)](x, y, x.numel(), BLOCK_SIZE=1024)
    return y


def transpose(x):
    y = torch.empty_like(x)
    _transpose_kernel[(1,)](x, y, BLOCK=64)
    return y
'''

DRIVER = '''
import json, os, sys
import triton.language                                # Triton's own library first, not interpreted
import course_utils                                   # switches the interpreter on (no GPU) ...
os.environ.pop("TRITON_INTERPRET", None)              # ... and off again before kernels exist
import torch
import fixture_kernels as m
from course_utils import aot, hardware

out = {"kernels": sorted(aot.launched_kernels([m])), "all": sorted(aot.jit_functions([m]))}
for arch in (75, 80, 90):
    info = hardware.DeviceInfo.for_arch(arch)
    tiny = hardware.DeviceInfo(arch, info.sms, 16, "16-byte shared memory")
    with aot.pretend(info, [m]) as launches:
        m.good(torch.empty(5000, dtype=torch.float16))
        m.uses_global(torch.empty(100))
    with aot.pretend(tiny, [m]) as small:
        m.transpose(torch.empty(64, 64))
    out[arch] = {
        "blocks": [l.kwargs.get("BLOCK_SIZE") for l in launches],
        "results": [vars(r) for r in aot.compile_launches(launches, info)],
        "small": [vars(r) for r in aot.compile_launches(small, tiny)],
        "transpose_real": [vars(r) for r in aot.compile_launches(small, info)],
    }
print("JSON" + json.dumps(out, default=str))
'''


@pytest.fixture(scope="module")
def fixture_matrix(tmp_path_factory):
    d = tmp_path_factory.mktemp("aot")
    (d / "fixture_kernels.py").write_text(textwrap.dedent(FIXTURE_KERNELS))
    env = _compile_env()
    env["PYTHONPATH"] = os.pathsep.join([str(d), env["PYTHONPATH"]])
    p = subprocess.run([sys.executable, "-c", DRIVER], cwd=d, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("JSON"))
    return json.loads(line[4:])


def test_kernels_and_helpers_are_told_apart(fixture_matrix):
    assert "fixture_kernels._twice" in fixture_matrix["all"]
    assert fixture_matrix["kernels"] == ["fixture_kernels._global_kernel", "fixture_kernels._good_kernel",
                                         "fixture_kernels._never_launched_kernel",
                                         "fixture_kernels._transpose_kernel"]


@pytest.mark.parametrize("arch", [75, 80, 90])
def test_launcher_choices_are_recorded_per_device(fixture_matrix, arch):
    m = fixture_matrix[str(arch)]
    assert m["blocks"] == [2048 if arch >= 80 else 512, 1024]
    good = [r for r in m["results"] if r["kernel"].endswith("_good_kernel")]
    assert len(good) == 1 and good[0]["ok"], good
    assert good[0]["cubin_bytes"] > 0 and good[0]["ptx_bytes"] > 0 and good[0]["num_warps"] == 4
    assert "x_ptr: *fp16" in good[0]["signature"] and "BLOCK_SIZE=" in good[0]["constexprs"]


@pytest.mark.parametrize("arch", [75, 80, 90])
def test_a_kernel_that_only_runs_in_the_interpreter_is_caught(fixture_matrix, arch):
    bad = [r for r in fixture_matrix[str(arch)]["results"] if r["kernel"].endswith("_global_kernel")]
    assert len(bad) == 1 and not bad[0]["ok"]
    assert "SCALE" in bad[0]["error"] or "global" in bad[0]["error"].lower(), bad[0]["error"]


@pytest.mark.parametrize("arch", [75, 80, 90])
def test_shared_memory_over_the_device_limit_is_caught(fixture_matrix, arch):
    m = fixture_matrix[str(arch)]
    (small,) = m["small"]
    (real,) = m["transpose_real"]
    assert real["ok"] and real["shared_bytes"] > 16, real
    assert not small["ok"] and "shared memory" in small["error"], small


# ------------------------------------------------------------------------- the course's kernels

@pytest.mark.slow
@pytest.mark.skipif(env.on_gpu(), reason="compile-only for sm_75/80/90, no GPU needed: the CPU suite (make test, "
                    "CI) runs it; on a GPU host the GPU tests compile and run every kernel for the GPU in hand")
@pytest.mark.parametrize("arch", aot.ARCHS)
def test_course_kernels_compile(arch, tmp_path):
    """Every kernel at its smallest and largest tile choice (``--smoke``); every choice with
    COURSE_COMPILE_MATRIX=full (``make compile-matrix`` builds the whole matrix as its own job)."""
    out = tmp_path / f"sm_{arch}.json"
    scope = [] if os.environ.get("COURSE_COMPILE_MATRIX") == "full" else ["--smoke"]
    p = subprocess.run([sys.executable, "-m", "course_utils.aot", "--arch", str(arch), "--json", str(out),
                        "--quiet", *scope], cwd=ROOT, env=_compile_env(), capture_output=True, text=True,
                       timeout=1500)
    if not out.exists():
        pytest.fail(f"the compile matrix did not run (exit {p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    matrix = json.loads(out.read_text())
    if not matrix["kernels"]:
        pytest.skip("no kernels in course_utils/kernels yet")
    problems = aot.failures(matrix)
    assert not problems, f"{len(problems)} problems on sm_{arch}:\n" + "\n".join(problems[:40])
    assert p.returncode == 0, p.stdout[-2000:]
    assert all(r["shared_bytes"] <= r["smem_limit"] for r in matrix["results"])


@pytest.mark.skipif(env.on_gpu(), reason="on a GPU the kernels are compiled ones: nothing to refuse")
def test_matrix_refuses_interpreted_kernels():
    """In this (interpreter) process the kernels are InterpretedFunctions: a clear error, not a crash."""
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        aot.run_matrix([80])


# ------------------------------------------------------------------------- what the PTX says (softmax)

@pytest.mark.slow
def test_only_tl_range_loops_are_pipelined_and_aligned_rows_get_vector_loads(tmp_path):
    """Issue 18, items 1 and 10, on sm_90 PTX: a tile loop written ``for ... in tl.range(...,
    num_stages=3)`` has async copies, the same loop as ``while`` has none (whatever num_stages says);
    rows of 1000 load one element per instruction unless n_cols and strides come in units of ALIGN."""
    import pandas as pd
    p = subprocess.run([sys.executable, "-m", "benchmarks.softmax", "ptx", "--out", str(tmp_path)], cwd=ROOT,
                       env=_compile_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    df = pd.read_csv(tmp_path / "softmax_ptx.csv")
    copies = df.cp_async + df.cp_async_bulk
    loops = df[df.what.str.startswith("persistent grid")]
    assert len(loops) == 12
    for what, rows in loops.groupby("what"):
        if "tl.range num_stages=3" in what:
            assert (copies[rows.index] > 0).all(), rows
        else:  # num_stages=1, or a while loop with num_stages=3
            assert (copies[rows.index] == 0).all(), rows
    online = df[df.kernel == "softmax_online_kernel"]
    assert len(online) == 2 and (copies[online.index] > 0).all()
    plans = df[df.what.str.startswith("tuned plan")].set_index(["dtype", "n_cols", "what"]).widest_load_bytes
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        assert plans[(dtype, 1000, "tuned plan, ALIGN hint off")] == itemsize   # one element per load
        assert plans[(dtype, 1000, "tuned plan, ALIGN hint on")] == 16
        for n in (1024, 12000):   # multiples of 16: Triton's own specialization sees them
            for hint in ("off", "on"):
                assert plans[(dtype, n, f"tuned plan, ALIGN hint {hint}")] == 16
