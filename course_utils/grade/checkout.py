"""The instructor's checkout, kept out of reach of the notebooks being graded.

:func:`sandbox` gives each notebook a private copy of what it may read (the package, the recorded
results, the notebooks); nothing of the checkout is linked in, so a write through a relative path,
``course_utils.__file__`` or ``exercises.ROOT`` lands in the copy, and :func:`changed_files` names it.
:func:`snapshot` hashes the checkout itself before and after each notebook; :func:`differences`
names whatever changed (a write by absolute path where :mod:`.jail` could not forbid it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

# never copied into a sandbox: the environment, git's store, caches and build outputs
_NOT_COPIED = {".git", ".venv", "venv", "build", "test-artifacts", "__pycache__", ".pytest_cache", ".ruff_cache",
               ".mypy_cache", ".ipynb_checkpoints"}
_CACHES = {"__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".ipynb_checkpoints"}
# git's files that run code or change what git does (its object store and index change on every commit)
_GIT_FILES = ("config", "HEAD", "info/exclude", "info/attributes")


def _copied(name: str) -> bool:
    return name not in _NOT_COPIED and not name.startswith(".") and not name.endswith(".egg-info")


def sandbox(tmp: Path, course_root: Path) -> tuple[Path, dict[Path, str]]:
    """A private copy of the checkout for one notebook, and the hash of every file copied.

    Everything a notebook reads is copied (``course_utils/``, ``results/``, ``solutions/``,
    ``exercises/``, ``notebooks/``, ...); the environment and git's store are not, and nothing is
    linked: a write anywhere under the sandbox changes only the copy.
    """
    root = tmp / "course"
    root.mkdir()
    ignore = shutil.ignore_patterns(*_NOT_COPIED, "*.egg-info")
    for entry in sorted(course_root.iterdir()):
        if not _copied(entry.name):
            continue
        try:
            if entry.is_dir():
                shutil.copytree(entry, root / entry.name, ignore=ignore, ignore_dangling_symlinks=True)
            elif entry.is_file():
                shutil.copy2(entry, root / entry.name)
        except (OSError, shutil.Error):
            continue  # unreadable: the notebook cannot read it either
    return root, {f: _hash(f) for f in _files_under(root)}


def _files_under(root: Path) -> list[Path]:
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _CACHES]
        out += [Path(folder) / f for f in files]
    return sorted(out)


def _hash(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        return f"unreadable: {e.strerror}"


def changed_files(files: dict[Path, str], root: Path) -> list[str]:
    """The sandbox's files the notebook changed, deleted or added (relative to the sandbox)."""
    now = set(_files_under(root))
    out = [str(f.relative_to(root)) for f, h in files.items() if not f.exists() or _hash(f) != h]
    return out + [str(f.relative_to(root)) for f in sorted(now - set(files))]


def _listed(root: Path) -> list[str]:
    """The checkout's files: git's tracked and untracked-but-not-ignored files, else every file."""
    if (root / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                                  "--exclude-standard"], capture_output=True, timeout=60, check=True).stdout
            names = [n for n in out.decode("utf-8", "surrogateescape").split("\0") if n]
            git = root / ".git"
            hooks = [str(p.relative_to(root)) for p in (git / "hooks").rglob("*")] if (git / "hooks").is_dir() else []
            return names + [f".git/{n}" for n in _GIT_FILES] + hooks
        except (OSError, subprocess.SubprocessError):
            pass
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _NOT_COPIED]
        out += [os.path.relpath(os.path.join(folder, f), root) for f in files]
    return out


def snapshot(root: Path, environment: Path | None = None) -> dict[str, str]:
    """{path relative to the checkout: sha256} for the checkout's files (missing ones as 'absent').

    ``environment`` (a virtual environment inside the checkout, used where writes could not be
    forbidden) adds each of its files' size and change time: ``ctime`` moves on any write and no
    user can set it back, and reading 40,000 files' metadata takes a fraction of a second.
    """
    out = {}
    for name in _listed(root):
        p = root / name
        out[name] = _hash(p) if p.is_file() else "absent" if not p.exists() else "folder"
    if environment is not None and environment.is_dir():
        for folder, dirs, files in os.walk(environment):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                try:
                    s = os.lstat(os.path.join(folder, f))
                except OSError:
                    continue
                out[os.path.relpath(os.path.join(folder, f), root)] = f"{s.st_size}:{s.st_mtime_ns}:{s.st_ctime_ns}"
    return out


def differences(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What changed between two snapshots, e.g. ['solutions/03_triton_model.ipynb (changed)']."""
    out = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name, "absent"), after.get(name, "absent")
        if a != b:
            out.append(f"{name} ({'created' if a == 'absent' else 'deleted' if b == 'absent' else 'changed'})")
    return out
