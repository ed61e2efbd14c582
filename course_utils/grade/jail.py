"""Write-protect the instructor's checkout while a student's notebook runs (Linux Landlock).

Copies are not enough on their own: a notebook can find the checkout (``sys.executable`` lives in
its ``.venv``) and write there by absolute path, and file mode bits do not stop root. Landlock is
a Linux security module that any process, root included, can use to give up rights for itself
and every process it starts; nothing can give them back. The grader runs nbval (and so the
student's kernel) as

    python -m course_utils.grade.jail SPEC.json -- python -m pytest ...

which forbids every kind of write (create, write, truncate, delete, rename, link) inside the
protected trees (the checkout and the Python environment's site-packages) and leaves everything
else as it was: the sandbox, the temporary folder, caches (Triton's, torch's) and the GPU's device
files stay writable. Landlock can only allow, so "everything else" is spelled out: for each folder
above a protected tree, every entry beside the path down to it. The first line the command prints
is ``GRADER-PROTECTION: protected``, or why not: where Landlock is missing (not Linux, an old
kernel, a container that blocks it) the command runs unprotected, the grader says so, and its hash
comparison is the only guard. (That line comes first, before any student code runs, so a notebook
cannot forge it.)
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

STATUS = "GRADER-PROTECTION: "
_CREATE, _ADD, _RESTRICT = 444, 445, 446  # the same syscall numbers on x86_64 and aarch64
_PATH_BENEATH, _VERSION, _NO_NEW_PRIVS = 1, 1, 38
_WRITE_FILE, _TRUNCATE, _REFER, _SCOPE_SIGNAL = 1 << 1, 1 << 14, 1 << 13, 1 << 1
# remove dir/file, make char/dir/reg/sock/fifo/block/sym
_DIR_WRITES = (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12)


def abi() -> int:
    """Landlock's ABI version on this machine, 0 where it is unavailable."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return max(0, libc.syscall(_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION)))
    except (OSError, AttributeError):
        return 0


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def writable_roots(protected: list[str]) -> list[str]:
    """Every path beside the protected trees: for each folder above one, its other entries."""
    protected = [os.path.realpath(p) for p in protected]
    out: list[str] = []

    def walk(folder: str) -> None:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for e in entries:
            real = os.path.realpath(e.path)
            if any(_within(real, p) for p in protected):
                continue  # a protected tree, or a link into one
            if any(_within(p, real) for p in protected):
                if real == os.path.normpath(e.path):
                    walk(e.path)  # a folder above a protected tree: go down (a link to one is skipped)
                continue
            out.append(e.path)

    walk(os.sep)
    return out


def protect(protected: list[str], allowed: list[str]) -> str:
    """Forbid writes under ``protected`` for this process and its children; '' on success, else why not."""
    version = abi()
    if version < 1:
        return "Landlock is not available on this machine"
    handled = _WRITE_FILE | _DIR_WRITES | (_REFER if version >= 2 else 0) | (_TRUNCATE if version >= 3 else 0)
    libc = ctypes.CDLL(None, use_errno=True)
    # from ABI 6 on, also no signals to processes outside: the grader itself cannot be killed from a notebook
    attr = (ctypes.c_uint64 * 3)(handled, 0, _SCOPE_SIGNAL if version >= 6 else 0)
    ruleset = libc.syscall(_CREATE, attr, ctypes.c_size_t(24 if version >= 6 else 8), ctypes.c_uint32(0))
    if ruleset < 0:
        return f"landlock_create_ruleset failed: {os.strerror(ctypes.get_errno())}"
    try:
        for path in [*writable_roots(protected), *allowed]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                is_dir = os.path.isdir(path)
                rights = handled if is_dir else handled & (_WRITE_FILE | _TRUNCATE)
                rule = ctypes.create_string_buffer(rights.to_bytes(8, "little") + fd.to_bytes(4, "little", signed=True))
                if libc.syscall(_ADD, ruleset, _PATH_BENEATH, rule, ctypes.c_uint32(0)) < 0:
                    err = ctypes.get_errno()
                    if err not in (22, 95):  # EINVAL/EOPNOTSUPP: a special file that takes no rule (stays closed)
                        return f"landlock_add_rule({path}) failed: {os.strerror(err)}"
            finally:
                os.close(fd)
        if libc.prctl(_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}"
        if libc.syscall(_RESTRICT, ruleset, ctypes.c_uint32(0)) < 0:
            return f"landlock_restrict_self failed: {os.strerror(ctypes.get_errno())}"
    finally:
        os.close(ruleset)
    return ""


def protected_trees(checkout: Path) -> list[str]:
    """The checkout and the site-packages the grader imports from (a .pth file there runs at every start)."""
    import site
    import sysconfig
    trees = [str(checkout)]
    for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages(),
              site.getusersitepackages()}:
        if os.path.isdir(p):
            trees.append(p)
    return trees


def main(argv: list[str]) -> None:
    """``SPEC.json -- command...``: protect, write the status file, then become the command."""
    spec_path, sep, *cmd = argv
    if sep != "--" or not cmd:
        raise SystemExit("usage: python -m course_utils.grade.jail SPEC.json -- command ...")
    spec = json.loads(Path(spec_path).read_text())
    why_not = protect(spec["protect"], spec["allow"])
    print(f"{STATUS}{why_not or 'protected'}", flush=True)
    os.execvpe(cmd[0], cmd, os.environ)


if __name__ == "__main__":
    main(sys.argv[1:])
