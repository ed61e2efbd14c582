"""Triton's internals: used in one documented place only, each assumption checked on every run.

(a) Every internal the package ``course_utils/triton_internals/`` relies on is checked against the installed
    Triton; a missing or changed one fails here, naming the assumption (not later, as a wrong launch).
(b) No other module under ``course_utils`` imports a private Triton name: anything underscored, or
    anything from ``triton.runtime`` / ``triton.backends`` / ``triton.compiler``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from course_utils import triton_internals as ti

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "course_utils"
THE_PLACE = PACKAGE / "triton_internals"   # a package: its modules split the one place by job
PRIVATE_MODULES = ("triton.runtime", "triton.backends", "triton.compiler")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Triton ships Linux wheels only")


# ------------------------------------------------------------------------- (a) the assumptions hold

@pytest.mark.parametrize("name", sorted(ti.INTERNALS))
def test_assumption_holds_in_the_installed_triton(name):
    broken = ti._check(name)
    internal = ti.INTERNALS[name]
    assert not broken, (f"Triton internal {name} changed: {broken}\n  assumed: {internal.assumption}\n  used by: "
                        f"{internal.used_by}\n  -> update course_utils/triton_internals/ for Triton "
                        f"{'.'.join(map(str, ti.triton_version()))}, or pin Triton to "
                        f"{'.'.join(map(str, internal.written_for))}")


def test_the_checks_can_fail_and_name_the_assumption(monkeypatch):
    """A check that cannot fail proves nothing: remove or change each internal, the check says which."""
    from triton.runtime import interpreter, jit
    monkeypatch.delattr(jit.JITFunction, "_pack_args")
    assert "JITFunction._pack_args is gone" in ti._check("JITFunction._pack_args")
    monkeypatch.setattr(jit, "create_function_from_signature", lambda signature, params: None)
    assert "parameters are now ['signature', 'params']" in ti._check("create_function_from_signature")
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", lambda tensor: None)
    assert "parameters are now ['tensor']" in ti._check("interpreter._patch_lang_tensor")
    lines = ti.problems()
    assert any(line.startswith("JITFunction._pack_args (written for Triton 3.6") and "Assumed:" in line
               for line in lines), lines


def test_require_gates_on_the_version(monkeypatch):
    """On the version written for, nothing is checked at run time; on another, a broken one raises."""
    from triton.runtime import jit
    monkeypatch.delattr(jit.JITFunction, "_pack_args")
    monkeypatch.setattr(ti, "triton_version", lambda: ti.WRITTEN_FOR)
    ti.require("JITFunction._pack_args")
    monkeypatch.setattr(ti, "triton_version", lambda: (9, 99))
    with pytest.raises(ti.TritonInternalsError, match=r"_pack_args.*installed 9\.99"):
        ti.require("JITFunction._pack_args")
    ti.require("knobs")  # an intact internal passes on any version


def test_interpreter_patch_is_idempotent():
    from triton.runtime import interpreter
    assert ti.patch_interpreter_index() and ti.patch_interpreter_index()
    patched = interpreter._patch_lang_tensor
    assert patched._course_patched  # once, whether env.py or this test applied it first
    assert not getattr(getattr(patched, "_course_original", None), "_course_patched", False)


def _noop():  # a named function: the JIT reads its source (a lambda's fails to compile on a GPU)
    pass


INTERPRETER = pytest.mark.skipif(not ti.is_interpreted(__import__("triton").jit(_noop)),
                                 reason="for the interpreter (TRITON_INTERPRET=1)")


@INTERPRETER
def test_interpreter_load_hook_sees_every_load_and_restores():
    import numpy as np
    import torch
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    @triton.jit
    def copy_kernel(x_ptr, y_ptr, n, BLOCK_SIZE: tl.constexpr):
        offsets = tl.arange(0, BLOCK_SIZE)
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)

    before = InterpreterBuilder.create_masked_load
    seen = []
    x, y = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    with ti.interpreter_load_hook(lambda ptrs, mask: seen.append(int(np.asarray(mask.data).sum()))) as hooked:
        copy_kernel[(1,)](x, y, 10, BLOCK_SIZE=16)
    assert hooked and seen == [10] and torch.equal(x, y)
    assert InterpreterBuilder.create_masked_load is before


@INTERPRETER
def test_interpreter_runs_range_over_a_runtime_bound():
    """What the patch is for: ``for start in range(0, n_cols, BLOCK_SIZE)`` with n_cols a kernel argument."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def row_sum_kernel(x_ptr, out_ptr, n_cols, BLOCK_SIZE: tl.constexpr):
        acc = tl.zeros((BLOCK_SIZE,), tl.float32)
        for start in range(0, n_cols, BLOCK_SIZE):
            offsets = start + tl.arange(0, BLOCK_SIZE)
            acc += tl.load(x_ptr + offsets, mask=offsets < n_cols, other=0.0)
        tl.store(out_ptr, tl.sum(acc, axis=0))

    ti.patch_interpreter_index()
    x, out = torch.arange(1000, dtype=torch.float32), torch.zeros(1)
    row_sum_kernel[(1,)](x, out, 1000, BLOCK_SIZE=128)
    assert out.item() == 999 * 1000 / 2


# ------------------------------------------------------------------------- (b) one place only

def private_triton_uses(path: Path) -> list[str]:
    """``file:line what`` for every private Triton name ``path`` imports or reaches through a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = {}  # local name -> the triton module it is bound to
    found = []

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] == "triton" and (dotted.startswith(PRIVATE_MODULES) or any(
            p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "triton":
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "triton"
                    if private(a.name):
                        found.append(f"{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "triton":
            for a in node.names:
                dotted = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = dotted
                if private(dotted):
                    found.append(f"{node.lineno}: from {node.module} import {a.name}")
    inner_nodes = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):  # triton.runtime.driver, tl._x, triton._C...: reached through an alias
        if isinstance(node, ast.Attribute) and id(node) not in inner_nodes:  # the whole chain, once
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in aliases:
                dotted = ".".join([aliases[inner.id], *reversed(chain)])
                if private(dotted) and not private(aliases[inner.id]):
                    found.append(f"{node.lineno}: {ast.unparse(node)} ({dotted})")
    return [f"{path.relative_to(ROOT)}:{f}" for f in sorted(set(found), key=lambda f: int(f.split(":")[0]))]


def test_the_scan_finds_what_it_must(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text("import triton\nimport triton.language as tl\nfrom triton.runtime import driver\n"
                   "from triton.runtime.jit import JITFunction as J\nimport triton.compiler\n"
                   "from triton import _utils\nx = triton.runtime.driver.active\ny = tl._x\n"
                   "z = triton.__version__\nw = tl.constexpr\nfrom triton.language.extra import libdevice\n")
    uses = private_triton_uses(bad)
    assert [u.split(":")[1] for u in uses] == ["3", "4", "5", "6", "7", "8"], uses


def test_no_private_triton_api_outside_the_one_place():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if THE_PLACE not in path.parents:
            offenders += private_triton_uses(path)
    assert not offenders, (
        f"{len(offenders)} use(s) of Triton internals outside course_utils/triton_internals/ (the one "
        "documented place, gated by version and checked above). Move each into it, or use the public API "
        "(kernel[grid](...), triton.testing, triton.language, triton.set_allocator):\n  " + "\n  ".join(offenders))
