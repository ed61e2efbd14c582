"""Running one merged notebook under nbval, inside its sandbox and write-protected, and reading the result."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from . import jail

_ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*[A-Za-z]")  # junit escapes ESC as #x1B
_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Failure|Interrupt|Exit)|KeyboardInterrupt)\b:?.*")
_DIED = re.compile(r"(the kernel process died while this cell ran: [^\n|]*)")  # kernel_watch's message


@dataclass
class Run:
    finished: bool       # pytest ended by itself, in time
    output: str
    protection: str      # "protected", or why the checkout could not be write-protected
    returncode: int      # pytest's: 0 or 1 when it ended normally (only then is its JUnit file its own)


def last_error_line(text: str) -> str:
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    errors = [ln.strip() for ln in lines if _ERROR_LINE.match(ln.strip())]
    if errors:
        # the message of the exception that was raised last, with any continuation lines
        last = errors[-1]
        start = max(i for i, ln in enumerate(lines) if ln.strip() == last)
        tail = []
        for ln in lines[start + 1:start + 4]:
            if not ln.strip() or ln.startswith(("---", "===", "  File", "Traceback")):
                break
            tail.append(ln.strip())
        return " ".join([last, *tail])[:600]
    if "outputs differ" in text.lower() or "mismatch" in text.lower():
        return "the check ran but printed something other than the expected verdict"
    return next((ln.strip() for ln in lines if ln.strip()), "failed")[:600]


def kernel_died(text: str) -> str:
    """'the kernel process died while this cell ran: killed by signal 11 (SIGSEGV)', or ''."""
    m = _DIED.search(_ANSI.sub("", text))
    return m.group(1).strip() if m else ""


def _environment(sandbox_root: Path, work: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(sandbox_root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for var, sub in (("TMPDIR", "tmp"), ("IPYTHONDIR", "ipython"), ("JUPYTER_RUNTIME_DIR", "runtime")):
        (work.parent / sub).mkdir(exist_ok=True)
        env[var] = str(work.parent / sub)
    return env


def _caches() -> None:
    """Create the caches the kernel writes (Triton's, ~/.cache) now: under a protected home it could not."""
    home = Path.home()
    for p in (os.environ.get("TRITON_CACHE_DIR") or home / ".triton" / "cache", home / ".cache", home / ".config",
              home / ".nv"):
        try:
            Path(p).mkdir(parents=True, exist_ok=True)
        except OSError:
            pass


# pytest, without the module rfc3987_syntax: nbval loads nbformat, whose jsonschema imports it where it is installed
# (jupyter-events' format-nongpl extra), and on import it builds an Earley parser of RFC 3987's grammar: 3 s of CPU
# in every graded notebook's process, for jsonschema's "iri" formats, which no notebook schema uses.
_PYTEST_MAIN = "import sys; sys.modules['rfc3987_syntax'] = None; import pytest; sys.exit(pytest.console_main())"


def run_nbval(nb_path: Path, junit: Path, cell_timeout: int, total_timeout: int, sandbox_root: Path,
              checkout: Path) -> Run:
    """Run pytest --nbval-lax on one notebook, with every write into ``checkout`` forbidden."""
    work = nb_path.parent
    ini = work / "pytest.ini"
    ini.write_text("[pytest]\n")
    shutil.copy(Path(__file__).with_name("kernel_watch.py"), work / "conftest.py")
    pytest = [sys.executable, "-c", _PYTEST_MAIN, "--nbval-lax", "--nbval-current-env",
              f"--nbval-cell-timeout={cell_timeout}", "-p", "no:cacheprovider", "-c", str(ini),
              "--rootdir", str(work), "-q", f"--junitxml={junit}", str(nb_path)]
    spec = work.parent / "jail.json"
    spec.write_text(json.dumps({"protect": jail.protected_trees(checkout), "allow": [str(work.parent)]}))
    _caches()
    # COURSE_GRADE_UNPROTECTED=1 skips the write protection (to debug it); the report then says so
    unprotected = os.environ.get("COURSE_GRADE_UNPROTECTED") == "1"
    cmd = pytest if unprotected else [sys.executable, "-I", str(Path(jail.__file__)), str(spec), "--", *pytest]
    proc = subprocess.Popen(cmd, cwd=work, env=_environment(sandbox_root, work), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=total_timeout)
        finished = True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        finished = False
    first, _, rest = out.partition("\n")
    if unprotected:
        protection = "COURSE_GRADE_UNPROTECTED=1 is set"
    elif first.startswith(jail.STATUS):
        protection, out = first.removeprefix(jail.STATUS).strip(), rest
    else:
        protection = "the write protection did not start"
    return Run(finished, out, protection, proc.returncode)


def junit_cases(junit: Path) -> dict[int, tuple[bool, str]]:
    """nbval's items by cell index: {index: (passed, failure text)}."""
    cases: dict[int, tuple[bool, str]] = {}
    if not junit.exists():
        return cases
    for tc in ET.parse(junit).getroot().iter("testcase"):
        m = re.search(r"Cell (\d+)", tc.get("name", ""))
        if not m:
            continue
        bad = tc.find("failure")
        if bad is None:
            bad = tc.find("error")
        if tc.find("skipped") is not None:
            cases[int(m.group(1))] = (False, "skipped")
        elif bad is None:
            cases[int(m.group(1))] = (True, "")
        else:
            cases[int(m.group(1))] = (False, (bad.get("message") or "") + "\n" + (bad.text or ""))
    return cases
