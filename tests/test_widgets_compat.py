"""The widget tests again, under ipywidgets 7.7.x: what Google Colab ships.

The project's environment has the newest ipywidgets 8 the dependency range allows, and the widget
tests run there as part of the normal suite. Here ipywidgets 7.7.x (with its matching
widgetsnbextension 3.6 and jupyterlab_widgets 1.x) is installed once into ``build/ipywidgets7``
(``pip install --target``; ``make clean`` removes it) and every test file that uses a course
widget is run again in a subprocess with that folder first on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.machinery   # left out of the newest-Triton run (pyproject.toml says why)

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "build" / "ipywidgets7"
REQUIREMENTS = ["ipywidgets==7.7.*", "widgetsnbextension==3.6.*", "jupyterlab_widgets>=1.0,<2",
                "ipython_genutils==0.2.*"]
USES_WIDGETS = re.compile(r"course_utils\.widgets|from course_utils import[^\n]*\bwidgets\b|^\s*import ipywidgets",
                          re.M)
THIS = Path(__file__).name
# A pytest plugin for the subprocess: proves that the widget tests really ran on ipywidgets 7.7.
GUARD = """
import os


def pytest_configure(config):
    import ipywidgets
    assert ipywidgets.__version__.startswith("7.7."), "expected ipywidgets 7.7, got " + ipywidgets.__version__
    with open(os.environ["IPYWIDGETS7_PROOF"], "w") as f:
        f.write(ipywidgets.__version__ + " " + ipywidgets.__file__)
"""
NOT_WIDGET_TESTS = {THIS, "test_browser.py"}


def widget_test_files() -> list[Path]:
    """Test files that import a course widget (or ipywidgets), other than this one and the browser test."""
    return sorted(p for p in (ROOT / "tests").glob("test_*.py")
                  if p.name not in NOT_WIDGET_TESTS and USES_WIDGETS.search(p.read_text()))


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TARGET), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_INTERPRET", "1")
    env.setdefault("COURSE_MODE", "interpreter")
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _installed_version() -> str | None:
    p = subprocess.run([sys.executable, "-c", "import ipywidgets; print(ipywidgets.__version__)"],
                       env=_env(), capture_output=True, text=True, timeout=120)
    return p.stdout.strip() if p.returncode == 0 else None


@pytest.fixture(scope="module")
def ipywidgets7() -> str:
    """Install ipywidgets 7.7.x into build/ipywidgets7 once; its version string."""
    version = _installed_version() if TARGET.exists() else None
    if not (version or "").startswith("7.7."):
        TARGET.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            "--no-deps", "--upgrade", "--target", str(TARGET), *REQUIREMENTS],
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            text = p.stdout + p.stderr
            unreachable = ("No matching distribution" in text or "Could not find a version" in text
                           or "NewConnectionError" in text or "Network is unreachable" in text
                           or "Temporary failure in name resolution" in text)
            if unreachable:
                pytest.skip(f"pip cannot reach a package index to install ipywidgets 7.7: {text.strip()[-300:]}")
            pytest.fail(f"pip install --target {TARGET} failed:\n{text[-2000:]}")
        version = _installed_version()
    assert (version or "").startswith("7.7."), f"ipywidgets 7.7 not importable from {TARGET}: got {version}"
    (TARGET / "_ipywidgets7_guard.py").write_text(GUARD)
    return version


def test_ipywidgets7_is_what_the_subprocess_imports(ipywidgets7):
    code = ("import ipywidgets, widgetsnbextension, traitlets; "
            "print(ipywidgets.__version__, ipywidgets.__file__)")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    version, path = p.stdout.split()
    assert version.startswith("7.7.") and Path(path).is_relative_to(TARGET)


def test_course_widget_modules_import_under_ipywidgets7(ipywidgets7):
    """Every module of course_utils.widgets imports (and builds nothing at import) under 7.7."""
    code = ("import importlib, pkgutil, course_utils.widgets as w\n"
            "names = [i.name for i in pkgutil.iter_modules(w.__path__)]\n"
            "for n in names: importlib.import_module('course_utils.widgets.' + n)\n"
            "print(len(names))")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]


@pytest.mark.slow
def test_widget_tests_pass_under_ipywidgets7(ipywidgets7, tmp_path):
    """Every widget test file in one subprocess (one interpreter start, one import of torch and the course, not
    one per file); no -x, so every file that fails is named."""
    files = widget_test_files()
    if not files:
        pytest.skip("no widget tests in tests/ yet")
    proof = tmp_path / "ipywidgets-version.txt"
    env = _env()
    env["IPYWIDGETS7_PROOF"] = str(proof)
    p = subprocess.run([sys.executable, "-m", "pytest", *map(str, files), "-q", "-rf", "-p", "no:cacheprovider",
                        "-p", "no:xdist", "-p", "_ipywidgets7_guard", "-m", "not slow and not browser and not gpu"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    # 5: every test was deselected (all slow): nothing ran, nothing failed
    assert proof.exists() and proof.read_text().startswith("7.7."), p.stdout[-2000:] + p.stderr[-2000:]
    failed = sorted({f.name for f in files if re.search(rf"^(FAILED|ERROR) tests/{re.escape(f.name)}", p.stdout, re.M)})
    assert p.returncode in (0, 5), (f"{', '.join(failed) or 'the widget tests'} fail(s) under ipywidgets "
                                    f"{ipywidgets7}:\n" + p.stdout[-4000:] + p.stderr[-2000:])
    ran = re.search(r"(\d+) passed", p.stdout)
    assert p.returncode == 5 or ran, p.stdout[-2000:]
