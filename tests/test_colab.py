"""Colab: detection, the install commands, the generated first cell and tools/notebook_header.py.

No network: the cell is executed with ``subprocess.run`` replaced by a recorder.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest

from course_utils import colab

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
URL = "https://github.com/example/kernel-fusion-triton"


def _load_header_tool():
    spec = importlib.util.spec_from_file_location("notebook_header", ROOT / "tools" / "notebook_header.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


header = _load_header_tool()


# ---------------------------------------------------------------- detection and commands

@pytest.mark.parametrize("modules, environ, expected", [
    ({}, {}, False),
    ({"google.colab": object()}, {}, True),
    ({}, {"COLAB_RELEASE_TAG": "release-colab_20260101"}, True),
    ({"google": object()}, {"COLAB_GPU": ""}, False),
])
def test_in_colab(modules, environ, expected):
    assert colab.in_colab(modules, environ) is expected


def test_not_colab_here():
    assert not colab.in_colab(), "the test machine is not Colab; detection is too eager"


def test_missing_deps_lists_only_the_missing():
    present = {"numpy", "pandas", "matplotlib", "nbformat"}
    got = colab.missing_deps(lambda m: object() if m in present else None)
    assert got == ["ipywidgets>=7.7,!=8.1.9", "tqdm>=4.60"]
    assert colab.missing_deps(lambda m: object()) == []


def test_light_deps_match_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    light = sorted(d.split(";")[0].strip() for d in deps if not d.startswith(colab.KEEP))
    assert sorted(colab.LIGHT_DEPS.values()) == light
    assert not any(k in colab.LIGHT_DEPS for k in colab.KEEP)


def test_install_commands_shape():
    cmds = colab.install_commands(URL, "/content/x", missing=["tqdm>=4.60"], python="py")
    assert cmds[0] == ["git", "clone", "-q", "--depth", "1", URL, "/content/x"]
    pkg, extra = cmds[1], cmds[2]
    assert pkg[:4] == ["py", "-m", "pip", "install"] and pkg[-3:] == ["--no-deps", "-e", "/content/x"]
    assert extra[:4] == ["py", "-m", "pip", "install"] and extra[-1] == "tqdm>=4.60"
    assert "--no-deps" not in extra
    for cmd in cmds:  # torch and triton are never named, and nothing is upgraded
        assert not any(a.startswith(("torch", "triton")) for a in cmd)
        assert "-U" not in cmd and "--upgrade" not in cmd
    assert colab.install_commands(URL, "/content/x", cloned=True, python="py") == [cmds[1]]


@pytest.mark.parametrize("bad", ["", "   ", None, "github.com/a/b", "https://x/a b"])
def test_install_commands_reject_bad_url(bad):
    with pytest.raises(ValueError, match="repo_url"):
        colab.install_commands(bad)


@pytest.mark.parametrize("req", ["torch", "triton>=3.3", "Torch==2.5"])
def test_install_commands_never_install_torch_or_triton(req):
    with pytest.raises(ValueError, match="never installs"):
        colab.install_commands(URL, missing=[req])


def test_badge():
    md = colab.badge_markdown(URL + ".git", "notebooks/01_launch_overhead.ipynb")
    assert md == ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
                  "(https://colab.research.google.com/github/example/kernel-fusion-triton/blob/main/"
                  "notebooks/01_launch_overhead.ipynb)")
    with pytest.raises(ValueError, match="GitHub"):
        colab.badge_markdown("https://gitlab.com/a/b", "x.ipynb")
    with pytest.raises(ValueError, match="ipynb"):
        colab.badge_markdown(URL, "notebooks/x.py")


# ---------------------------------------------------------------- the generated cell

def _run_cell(monkeypatch, *, in_colab: bool, missing=(), dest_exists=False):
    """Execute the generated cell with subprocess.run recorded; return the recorded commands."""
    calls = []

    def fake_run(cmd, **kw):
        calls.append(list(cmd))
        assert kw.get("check") is True, "every install step must stop the cell when it fails"
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    if in_colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else real_find_spec(name, *a))
    import os
    real_isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: dest_exists if p == colab.CLONE_DIR else real_isdir(p))
    exec(compile(colab.setup_cell_source(URL), "<colab-setup>", "exec"), {"__name__": "__main__"})
    return calls


def test_cell_does_nothing_outside_colab(monkeypatch):
    assert _run_cell(monkeypatch, in_colab=False) == []


def test_cell_on_colab_runs_the_install_commands(monkeypatch):
    calls = _run_cell(monkeypatch, in_colab=True)
    assert calls == colab.install_commands(URL, colab.CLONE_DIR)
    assert colab.CLONE_DIR in sys.path


def test_cell_on_colab_installs_only_missing_deps(monkeypatch):
    calls = _run_cell(monkeypatch, in_colab=True, missing={"tqdm"}, dest_exists=True)
    assert calls == colab.install_commands(URL, colab.CLONE_DIR, missing=["tqdm>=4.60"], cloned=True)


def test_cell_is_self_contained():
    tree = ast.parse(colab.setup_cell_source(URL))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"os", "sys", "importlib", "subprocess"}, imported
    assert "!pip" not in colab.setup_cell_source(URL)  # plain Python: runs and tests outside IPython


# ---------------------------------------------------------------- tools/notebook_header.py

def _nb(*cells):
    nb = nbformat.v4.new_notebook()
    for cell_id, kind, src in cells:
        c = nbformat.v4.new_code_cell(src) if kind == "code" else nbformat.v4.new_markdown_cell(src)
        c["id"] = cell_id
        nb.cells.append(c)
    return nb


def test_header_inserts_and_moves_banner_second(tmp_path):
    nb = _nb(("title", "md", "# Title"), ("setup", "code", "x = 1"),
             ("banner", "code", "import course_utils as cu\nprint(cu.banner())  # kept as written"))
    path = tmp_path / "01_x.ipynb"
    nbformat.write(nb, path)
    assert header.main([str(tmp_path), "--repo", URL]) == 0
    out = nbformat.read(path, as_version=4)
    assert [c.id for c in out.cells] == ["colab-setup", "banner", "title", "setup"]
    assert out.cells[0].source == colab.setup_cell_source(URL)
    assert out.cells[0].cell_type == "code" and out.cells[0].outputs == []
    assert out.cells[1].source.endswith("# kept as written")
    nbformat.validate(out)


def test_header_is_idempotent_and_check_mode(tmp_path, capsys):
    path = tmp_path / "02_y.ipynb"
    nbformat.write(_nb(("a", "code", "1 + 1")), path)
    assert header.main([str(path), "--repo", URL, "--check"]) == 1
    assert nbformat.read(path, as_version=4).cells[0].id == "a", "--check must not write"
    assert header.main([str(path), "--repo", URL]) == 0
    out = nbformat.read(path, as_version=4)
    assert [c.id for c in out.cells] == ["colab-setup", "banner", "a"]  # a missing banner is added
    assert out.cells[1].source == header.BANNER_SOURCE
    text = path.read_text()
    mtime = path.stat().st_mtime_ns
    capsys.readouterr()
    assert header.main([str(path), "--repo", URL]) == 0
    assert path.read_text() == text, "an up-to-date notebook changed"
    assert path.stat().st_mtime_ns == mtime, "an up-to-date notebook was rewritten"
    assert capsys.readouterr().out == ""
    assert header.main([str(path), "--repo", URL, "--check"]) == 0
    # a stale Colab cell (another URL) is refreshed in place, not duplicated
    assert header.main([str(path), "--repo", URL + "2", "--check"]) == 1
    header.main([str(path), "--repo", URL + "2"])
    out = nbformat.read(path, as_version=4)
    assert [c.id for c in out.cells].count("colab-setup") == 1
    assert URL + "2" in out.cells[0].source


def test_header_rejects_duplicate_banner(tmp_path):
    path = tmp_path / "03_z.ipynb"
    nbformat.write(_nb(("banner", "code", "1"), ("banner2", "code", "2")), path)
    nb = nbformat.read(path, as_version=4)
    nb.cells[1]["id"] = "banner"
    with pytest.raises(ValueError, match="unique"):
        header.apply_header(nb, URL)


def test_header_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        header.main([str(tmp_path / "nope.ipynb")])


def test_repo_url_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_REPO_URL", raising=False)
    assert header.repo_url(None, tmp_path) == colab.DEFAULT_REPO_URL
    (tmp_path / "pyproject.toml").write_text('[project]\nname="x"\n[project.urls]\nRepository="https://github.com/a/b"\n')
    assert header.repo_url(None, tmp_path) == "https://github.com/a/b"
    monkeypatch.setenv("COURSE_REPO_URL", "https://github.com/c/d")
    assert header.repo_url(None, tmp_path) == "https://github.com/c/d"
    assert header.repo_url("https://github.com/e/f", tmp_path) == "https://github.com/e/f"


def test_course_notebooks_have_the_header():
    """Every notebook of the course starts with the Colab cell, then the banner."""
    paths = header.notebooks_in([])
    if not paths:
        pytest.skip("no notebooks in notebooks/ or solutions/ yet")
    url = header.repo_url()
    stale = [str(p.relative_to(ROOT)) for p in paths
             if header.apply_header(nbformat.read(p, as_version=4), url)]
    assert not stale, f"run `python tools/notebook_header.py && make exercises`; stale headers: {stale}"


def test_badge_table(tmp_path, monkeypatch):
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    nb = _nb(("t", "md", "intro\n# Chapter 9: a title"), ("a", "code", "1"))
    nbformat.write(nb, nbdir / "09_x.ipynb")
    nbformat.write(_nb(("a", "code", "1")), nbdir / "10_y.ipynb")
    table = header.badge_table(header.notebooks_in([str(nbdir)]), URL, "main", root=tmp_path)
    lines = table.splitlines()
    assert len(lines) == 4
    assert "`notebooks/09_x.ipynb` | Chapter 9: a title |" in lines[2]
    assert lines[2].endswith("blob/main/notebooks/09_x.ipynb) |")
    assert "| 10_y |" in lines[3]  # no heading: the file name
