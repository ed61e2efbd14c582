"""The shell scripts make test runs: the browser step never needs root (it uses the Chromium that is
there, else skips with the reason, and fails only under CI=true), and the newest-Triton step parses."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "tools" / "install_chromium.sh"
BASH = shutil.which("bash") or "/bin/bash"


def _run(script: Path, **environ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "CHROMIUM", "COURSE_INSTALL_CHROMIUM")}
    env.update(environ)
    return subprocess.run([BASH, str(script)], capture_output=True, text=True, env=env, timeout=60)


def test_a_chromium_that_is_there_is_used_without_installing(tmp_path):
    fake = tmp_path / "my-chromium"
    fake.write_text("#!/bin/sh\necho fake\n")
    fake.chmod(0o755)
    r = _run(INSTALL, CHROMIUM=str(fake), CI="true")
    assert r.returncode == 0 and r.stdout.strip() == str(fake) and "install" not in r.stderr


@pytest.mark.parametrize("ci, code", [("", 0), ("true", 1)])
def test_a_missing_chromium_is_skipped_with_a_reason_and_fails_only_in_ci(tmp_path, ci, code):
    r = _run(INSTALL, CHROMIUM=str(tmp_path / "missing"), CI=ci)
    assert r.returncode == code, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not an executable" in lines[0]
    assert ("must run" in lines[0]) == (ci == "true") and ("will be skipped" in lines[0]) == (ci != "true")


def test_no_install_when_told_not_to(tmp_path):
    r = _run(INSTALL, COURSE_INSTALL_CHROMIUM="0", PATH=str(tmp_path))  # no chromium on this PATH
    if Path("/usr/bin/chromium").exists():
        assert r.returncode == 0 and r.stdout.strip() == "/usr/bin/chromium"
    else:
        assert r.returncode == 0 and "COURSE_INSTALL_CHROMIUM=0" in r.stderr


@pytest.mark.parametrize("script", ["install_chromium.sh", "triton_next.sh", "setup_env.sh"])
def test_scripts_parse(script):
    assert subprocess.run([BASH, "-n", str(ROOT / "tools" / script)]).returncode == 0
