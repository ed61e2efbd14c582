"""The lectures in JupyterLab, in a real browser: every cell runs, every widget renders and answers.

For each ``notebooks/*.ipynb`` (a copy, so the repository is never written): start JupyterLab on
127.0.0.1 (a free port) from the project's environment in interpreter mode, open the notebook in
Debian's Chromium (headless, driven by Playwright for Python; no browser download), run all cells,
save, and assert that no cell raised and that no widget failed to display. Then move one control of
every widget on the page (a slider with the arrow keys, a dropdown, a toggle button) and assert that
its view changes, and that it now shows exactly what the widget's own tested ``render()``
computes for the new control values, asked in the same kernel through a second client. A
screenshot of each notebook (and of each widget) goes to ``test-artifacts/browser/``.

    make test-browser          # or: TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_browser.py -m browser
    NB=07 make test-browser    # COURSE_BROWSER_NB=07: only notebooks whose name contains it
    make test                  # runs it with COURSE_BROWSER_NB=widgets: the lectures with a course widget

Needs a Chromium (``$CHROMIUM``, else ``/usr/bin/chromium`` or one on PATH; ``bash
tools/install_chromium.sh`` installs Debian's when it can) and ``playwright`` (the dev extra).
Without a Chromium the test is skipped with the reason, except with ``CI=true``, where it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
RUN_TIMEOUT_S = float(os.environ.get("COURSE_BROWSER_TIMEOUT", 900))   # one notebook, all cells
ONLY = os.environ.get("COURSE_BROWSER_NB", "")
WIDGET_TEXT_ERRORS = ("Error displaying widget", "Failed to load model class", "Loading widget...",
                      "Error rendering output")


WIDGETS_ONLY = "widgets"  # COURSE_BROWSER_NB=widgets (make test): the lectures that show a course widget


def lecture_notebooks() -> list[Path]:
    """Every lecture, or those whose name contains COURSE_BROWSER_NB; with ``widgets``, the lectures
    that import ``course_utils.widgets`` (every lecture's cells also run under nbval in make test,
    so the browser adds what nbval cannot see: widgets rendering and answering in JupyterLab)."""
    lectures = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
    if ONLY == WIDGETS_ONLY:
        return [p for p in lectures if "course_utils.widgets" in p.read_text() or
                "from course_utils import widgets" in p.read_text()]
    return [p for p in lectures if ONLY in p.name]


# ------------------------------------------------------------------------------------ helpers

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
        return json.loads(r.read().decode())


def _request(url: str, method: str) -> None:
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=30):  # noqa: S310 - loopback only
        pass


class _Text(HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts: list[str] = []

    def handle_data(self, data):
        self.parts.append(data)


def html_text(markup: str) -> str:
    """The text a browser shows for ``markup`` (tags dropped, entities decoded)."""
    p = _Text()
    p.feed(markup)
    p.close()
    return "".join(p.parts)


def squash(text: str) -> str:
    """Text with all whitespace removed: innerText and HTML source lay out spaces differently."""
    return re.sub(r"\s+", "", text or "")


# What the kernel says about every course widget alive in it: control values and render() text.
PROBE = r'''
def _course_probe():
    import gc, json
    out = []
    for o in gc.get_objects():
        t = type(o)
        module = getattr(t, "__module__", None)
        if not (isinstance(module, str) and module.startswith("course_utils.widgets")):
            continue
        controls = getattr(o, "controls", None)
        if isinstance(controls, (list, tuple)):
            controls = {str(i): c for i, c in enumerate(controls)}
        if not isinstance(controls, dict):
            continue
        entry = {"cls": t.__name__, "id": id(o),
                 "values": {k: repr(getattr(c, "value", None)) for k, c in controls.items()}}
        try:
            r = o.render() if callable(getattr(o, "render", None)) else None
        except Exception as e:  # the widget's own function fails: report it
            entry["render_error"] = repr(e)
            r = None
        entry["render"] = r if isinstance(r, str) else None
        view = getattr(o, "output", None) or getattr(o, "view", None)  # the HTML it shows render() in
        shown = getattr(view, "value", None)
        entry["shown_matches"] = (shown == r) if isinstance(shown, str) and isinstance(r, str) else None
        out.append(entry)
    print("PROBE" + json.dumps(out))
_course_probe()
del _course_probe
'''


def probe_kernel(connection_file: Path) -> list[dict]:
    """Run :data:`PROBE` in the notebook's kernel through a second client (outputs stay out of the page)."""
    from jupyter_client import BlockingKernelClient
    client = BlockingKernelClient(connection_file=str(connection_file))
    client.load_connection_file()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        chunks: list[str] = []

        def hook(msg):
            if msg["header"]["msg_type"] == "stream":
                chunks.append(msg["content"]["text"])
            elif msg["header"]["msg_type"] == "error":
                chunks.append("ERROR " + msg["content"]["ename"] + ": " + msg["content"]["evalue"])

        reply = client.execute_interactive(PROBE, store_history=False, output_hook=hook, timeout=120)
        assert reply["content"]["status"] == "ok", "".join(chunks)
    finally:
        client.stop_channels()
    text = "".join(chunks)
    line = next((x for x in text.splitlines() if x.startswith("PROBE")), None)
    assert line is not None, f"the kernel probe printed no result: {text[-2000:]}"
    return json.loads(line[5:])


# ------------------------------------------------------------------------------------ fixtures

def find_chromium() -> tuple[str | None, str]:
    """(path, what was tried): ``$CHROMIUM`` when set (that path only), else /usr/bin/chromium or a
    Chromium on PATH; the same rules as tools/install_chromium.sh."""
    forced = os.environ.get("CHROMIUM")
    if forced:
        return (forced if os.access(forced, os.X_OK) else None), f"CHROMIUM={forced}"
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium", ""
    for name in CHROMIUM_NAMES:
        if shutil.which(name):
            return shutil.which(name), ""
    return None, "/usr/bin/chromium, " + ", ".join(CHROMIUM_NAMES) + " on PATH"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path, tried = find_chromium()
    if path is None:
        why = (f"no Chromium ({tried}); install one as root with `bash tools/install_chromium.sh` "
               "(make test does when it can)")
        if in_ci():
            pytest.fail(f"CI=true and {why}: CI must run the browser test")
        pytest.skip(f"browser test skipped: {why}")
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a free loopback port, serving a copy of the repository's notebooks."""
    pytest.importorskip("jupyterlab", reason="JupyterLab is in the dev extra: pip install -e '.[dev]'")
    work = tmp_path_factory.mktemp("lab")
    for entry in ROOT.iterdir():  # everything but the notebooks by reference; the notebooks as copies
        if entry.name in (".git", ".venv", "notebooks", "test-artifacts"):
            continue
        (work / entry.name).symlink_to(entry)
    (work / "notebooks").mkdir()
    for nb in lecture_notebooks():
        shutil.copy2(nb, work / "notebooks" / nb.name)
    settings = work / ".lab-settings"
    for plugin, values in {
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    }.items():
        path = settings / (plugin + ".jupyterlab-settings")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    runtime = Path(tempfile.mkdtemp(prefix="jprt-"))  # short: kernel sockets live here
    port = _free_port()
    env = dict(os.environ, TRITON_INTERPRET="1", COURSE_MODE="interpreter", PYTHONUNBUFFERED="1",
               JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(work / ".lab-workspaces"),
               JUPYTER_RUNTIME_DIR=str(runtime), MPLBACKEND="module://matplotlib_inline.backend_inline",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--port={port}",
           "--ServerApp.port_retries=0", "--ServerApp.token=", "--ServerApp.password=",
           "--ServerApp.disable_check_xsrf=True", f"--ServerApp.root_dir={work}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(work / "jupyterlab.log", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            _get_json(f"{base}/api/status", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("JupyterLab did not start:\n" + (work / "jupyterlab.log").read_text()[-3000:])
            time.sleep(0.5)
    yield {"base": base, "work": work, "runtime": runtime, "log": work / "jupyterlab.log"}
    try:
        for k in _get_json(f"{base}/api/kernels"):
            _request(f"{base}/api/kernels/{k['id']}", "DELETE")
    except OSError:
        pass
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()
    shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(chromium_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


# ------------------------------------------------------------------------------------ the page

def _dismiss_toasts(page) -> None:
    for label in ("No", "Dismiss", "Close"):
        for button in page.locator(f".Toastify__toast button:has-text('{label}')").all():
            try:
                button.click(timeout=1000)
            except Exception:  # noqa: BLE001 - a toast that went away by itself
                pass


def _session(lab, name: str) -> dict | None:
    for s in _get_json(f"{lab['base']}/api/sessions"):
        if s.get("path", "").endswith(f"notebooks/{name}"):
            return s
    return None


def _kernel_state(lab, name: str) -> str | None:
    s = _session(lab, name)
    if s is None:
        return None
    return _get_json(f"{lab['base']}/api/kernels/{s['kernel']['id']}").get("execution_state")


def _wait(cond, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _run_all(page) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()


PANEL = ".jp-NotebookPanel:visible"  # the notebook on show (other tabs, if any, are hidden)


def _prompts(page) -> list[str]:
    return page.locator(f"{PANEL} .jp-CodeCell .jp-InputPrompt").all_inner_texts()


def _saved_notebook(path: Path, n_before: float, page) -> nbformat.NotebookNode:
    page.keyboard.press("Control+s")
    _wait(lambda: path.stat().st_mtime > n_before, 60, f"{path.name} to be saved")
    time.sleep(0.5)
    return nbformat.read(path, as_version=4)


def _cell_errors(nb) -> list[str]:
    errors = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append(f"cell {i} (id {cell.get('id')}): {out.get('ename')}: {out.get('evalue')}")
        if cell.source.strip() and cell.get("execution_count") is None:
            errors.append(f"cell {i} (id {cell.get('id')}) did not run")
    return errors


WIDGET_ROOTS = (f"{PANEL} .jp-OutputArea-output > .jupyter-widgets, "
                f"{PANEL} .jp-OutputArea-output > .widget-container")


def _view_text(root) -> str:
    """What the widget shows besides its controls: the text of its HTML and Output children."""
    texts = root.locator(".widget-html-content, .widget-output").all_inner_texts()
    return "\n".join(texts) if texts else root.inner_text()


VIEW_STATE_JS = """el => [...el.querySelectorAll('.widget-html-content, .widget-output')].map(
    e => e.innerText + '|' + [...e.querySelectorAll('img')].map(i => i.src.length + ':' + i.src.slice(-80)).join(',')
).join('\\n') || el.innerText"""


def _view_state(root) -> str:
    """The view's text and its images (a plot redrawn changes an image, not the text)."""
    return root.evaluate(VIEW_STATE_JS)


def _moves(root):
    """Ways to move this widget's controls, each a (label, zero-argument callable)."""
    moves = []
    for i, h in enumerate(root.locator(".widget-slider .noUi-handle, .widget-slider .ui-slider-handle").all()):
        for key in ("ArrowRight", "ArrowLeft"):
            moves.append((f"slider {i} {key}", lambda h=h, key=key: (h.focus(), h.press(key))))
    for i, sel in enumerate(root.locator(".widget-dropdown select").all()):
        def pick(sel=sel):
            n = sel.locator("option").count()
            current = sel.evaluate("s => s.selectedIndex")
            sel.select_option(index=(current + 1) % n)
        moves.append((f"dropdown {i}", pick))
    for i, group in enumerate(root.locator(".widget-toggle-buttons").all()):
        moves.append((f"toggle {i}", lambda g=group: g.locator("button:not(.mod-active)").first.click()))
    return moves


def _move_one_control(root, timeout: float = 15):
    """Move controls one at a time until the view changes; (label, text before, text after)."""
    before, text0 = _view_state(root), _view_text(root)
    for label, move in _moves(root):
        try:
            move()
        except Exception:  # noqa: BLE001 - a disabled or hidden control: try the next one
            continue
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _view_state(root) != before:
                time.sleep(0.5)  # let the rest of the update land
                return label, text0, _view_text(root)
            time.sleep(0.2)
    return None, text0, text0


# ------------------------------------------------------------------------------------ the test

def exercise_notebook(lab, browser, name: str, stem: str, move_timeout: float = 15) -> tuple[list[str], list[str]]:
    """Open ``notebooks/<name>`` of the lab's work folder, run all, check it; (problems, report).

    Problems are what a student would see go wrong: a cell that raised or did not run, a widget that
    did not display, a control that changes nothing, a view that disagrees with its ``render()``.
    Infrastructure failures (a server that never answers) raise instead.
    """
    path = lab["work"] / "notebooks" / name
    mtime0 = path.stat().st_mtime
    page = browser.new_page(viewport={"width": 1500, "height": 1000})
    console_errors: list[str] = []
    page.on("pageerror", lambda e: console_errors.append(str(e)))
    problems: list[str] = []
    report: list[str] = []
    t_start = time.monotonic()

    def step(what):
        print(f"[browser {name} +{time.monotonic() - t_start:.0f}s] {what}", flush=True)
    try:
        # a workspace of its own, reset: only this notebook's tab is open (no tabs restored from before)
        workspace = re.sub(r"[^A-Za-z0-9_-]", "-", stem)
        page.goto(f"{lab['base']}/lab/workspaces/{workspace}/tree/notebooks/{name}?reset",
                  wait_until="domcontentloaded", timeout=120_000)
        page.locator(f"{PANEL} .jp-Cell").first.wait_for(timeout=120_000)

        def kernel_ready():
            accept = page.locator(".jp-Dialog .jp-mod-accept")  # "Select Kernel" (no kernelspec saved)
            if accept.count():
                accept.first.click()
            return _kernel_state(lab, name) == "idle"
        _wait(kernel_ready, 180, "the kernel to start")
        step("kernel idle; running all cells")
        _dismiss_toasts(page)
        t0 = time.monotonic()
        _run_all(page)
        idle_polls = [0]

        def finished():
            busy = any("*" in p for p in _prompts(page)) or _kernel_state(lab, name) != "idle"
            idle_polls[0] = 0 if busy else idle_polls[0] + 1
            return idle_polls[0] >= 4  # idle for 2 s in a row: the queue of Run All is empty
        time.sleep(2)
        _wait(finished, RUN_TIMEOUT_S, f"all cells of {name} to run")
        run_s = time.monotonic() - t0
        step(f"all cells ran in {run_s:.0f} s; saving")
        nb = _saved_notebook(path, mtime0, page)
        problems += _cell_errors(nb)
        banner = [c for c in nb.cells if c.get("id") == "banner"]
        if banner:
            shown = "".join(o.get("text", "") for o in banner[0].outputs)
            if "mode: interpreter" not in shown:
                problems.append(f"the banner cell should say 'mode: interpreter', it says {shown!r}")
        body = page.locator(f"{PANEL} .jp-Notebook").inner_text()
        problems += [f"a widget did not display: {t!r} on the page" for t in WIDGET_TEXT_ERRORS if t in body]

        # ---- widgets: rendered, and they answer to their controls as their render() says
        roots = page.locator(WIDGET_ROOTS).all()
        open_tabs = page.locator(".jp-NotebookPanel").count()
        if open_tabs != 1:
            problems.append(f"{open_tabs} notebooks open in the page; expected only {name}")
        step(f"{len(roots)} widgets on the page")
        session = _session(lab, name)
        connection = lab["runtime"] / f"kernel-{session['kernel']['id']}.json"
        before = probe_kernel(connection) if roots else []
        problems += [f"{e['cls']}.render() raised {e['render_error']}" for e in before if "render_error" in e]
        for k, root in enumerate(roots):
            root.scroll_into_view_if_needed()
            box = root.bounding_box()
            if not (box and box["width"] > 50 and box["height"] > 20):
                problems.append(f"widget {k} is not rendered (bounding box {box})")
                continue
            if not _moves(root):
                report.append(f"widget {k}: no control to move")
                continue
            label, text0, text1 = _move_one_control(root, move_timeout)
            root.screenshot(path=str(ARTIFACTS / f"{stem}-widget{k}.png"))
            if label is None:
                problems.append(f"widget {k}: no control changed its view (it shows {text0[:200]!r})")
                continue
            after = probe_kernel(connection)
            old = {e["id"]: e["values"] for e in before}
            moved = [e for e in after if old.get(e["id"]) not in (None, e["values"])]
            before = after
            if not moved:
                report.append(f"widget {k}: {label} changed the view (not a course widget: no render() to check)")
                continue
            for e in moved:
                if e["shown_matches"] is False:
                    problems.append(f"widget {k} ({e['cls']}): its output is not its render() for {e['values']}")
            with_render = [e for e in moved if e["render"] is not None]
            want = [squash(html_text(e["render"])) for e in with_render]
            if want and not any(w in squash(text1) for w in want):
                problems.append(f"widget {k} ({with_render[0]['cls']}) after {label} shows {text1[:300]!r} but its "
                                f"render() says {html_text(with_render[0]['render'])[:300]!r}")
            else:
                report.append(f"widget {k} ({moved[0]['cls']}): {label} -> view matches render()")
        if roots:
            roots[0].scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / f"{stem}.png"))
        problems += [f"JavaScript error: {e}" for e in console_errors[:5]]
        step(f"done: {len(roots)} widgets, {len(problems)} problems")
        report.insert(0, f"{name}: cells ran in {run_s:.0f} s; {len(roots)} widgets")
        return problems, report
    except Exception:
        try:
            page.screenshot(path=str(ARTIFACTS / f"{stem}-FAILED.png"))
        except Exception:  # noqa: BLE001
            pass
        raise
    finally:
        page.close()
        s = _session(lab, name)
        if s is not None:
            try:
                _request(f"{lab['base']}/api/sessions/{s['id']}", "DELETE")
            except OSError:
                pass


@pytest.mark.parametrize("notebook", lecture_notebooks() or [None], ids=lambda p: p.stem if p else "none")
def test_notebook_in_jupyterlab(notebook, lab, browser):
    if notebook is None:
        pytest.skip("no lecture notebooks in notebooks/ yet")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems, report = exercise_notebook(lab, browser, notebook.name, notebook.stem)
    print("; ".join(report))
    assert not problems, f"{notebook.name} in JupyterLab:\n" + "\n".join(problems)


SELFTEST_CELLS = [
    ("selftest-widgets", """import ipywidgets as w


class Lying:  # its view says n + 1 while render() says n
    def __init__(self):
        self.controls = {"n": w.IntSlider(value=1, min=0, max=10, description="n")}
        self.output = w.HTML(self.render())
        self.controls["n"].observe(lambda ch: setattr(self.output, "value", f"<b>n is {ch['new'] + 1}</b>"),
                                   names="value")
        self.widget = w.VBox([self.controls["n"], self.output])

    def render(self):
        return f"<b>n is {self.controls['n'].value}</b>"


class Frozen(Lying):  # its controls change nothing on the page
    def __init__(self):
        self.controls = {"m": w.IntSlider(value=1, min=0, max=10, description="m")}
        self.output = w.HTML(self.render())
        self.widget = w.VBox([self.controls["m"], self.output])

    def render(self):
        return f"<b>m is {self.controls['m'].value}</b>"


Lying.__module__ = Frozen.__module__ = "course_utils.widgets.selftest"   # the probe looks there
lying, frozen = Lying(), Frozen()
display(lying.widget, frozen.widget)"""),
    ("selftest-error", "1 / 0"),
]


def test_the_browser_test_catches_broken_notebooks(lab, browser):
    """A notebook with a widget that lies, a widget that ignores its slider and a cell that raises."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for cell_id, source in SELFTEST_CELLS:
        cell = nbformat.v4.new_code_cell(source)
        cell["id"] = cell_id
        nb.cells.append(cell)
    nbformat.write(nb, lab["work"] / "notebooks" / "00_selftest.ipynb")
    problems, report = exercise_notebook(lab, browser, "00_selftest.ipynb", "00_selftest", move_timeout=4)
    text = "\n".join(problems)
    assert "ZeroDivisionError" in text, text
    assert "widget 0 (Lying): its output is not its render()" in text, text
    assert "but its render() says 'n is" in text, text
    assert "widget 1: no control changed its view (it shows 'm is 1')" in text, text
    assert len(problems) == 4, text
