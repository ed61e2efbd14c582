"""Grading exercise notebooks with nbval.

nbval compares a notebook with its own saved outputs, so for each student notebook the grader
builds a merged notebook: the student's cell sources (matched to the solution's cells by id), and
the solution's check cells with their saved expected outputs. ``pytest --nbval-lax`` runs it in a
fresh kernel; a check passes when its cell runs and prints exactly what the solution printed.
Check cells always come from the solution (a student's edits to them are not graded), a check
cell the student deleted fails, and the student's file is only ever read.

    python -m course_utils.grade exercises/                       # every notebook in a folder
    python -m course_utils.grade exercises/01_launch_overhead.ipynb --junit grades.xml
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .exercises import ROOT, SOLUTIONS, is_check_cell, make_exercise, strip_outputs

CELL_TIMEOUT = 300  # seconds a single cell may run before it counts as hung
_ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*[A-Za-z]")  # junit escapes ESC as #x1B
_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Failure|Interrupt|Exit)|KeyboardInterrupt)\b:?.*")


@dataclass
class Check:
    name: str
    cell_id: str
    passed: bool = False
    reason: str = ""


@dataclass
class Report:
    notebook: str
    checks: list[Check] = field(default_factory=list)
    error: str = ""  # the notebook could not be graded at all

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.checks)

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.checks) and self.passed == len(self.checks)


def check_name(cell, k: int) -> str:
    """A check's name: the first comment line of its cell ('# Check: ...'), else its position."""
    for line in cell["source"].splitlines():
        s = line.strip()
        if s.startswith("#") and "NBVAL" not in s:
            return s.lstrip("#").strip().removeprefix("Check:").strip() or f"check {k}"
        if s:
            break
    return f"check {k}"


def read_student(path: Path):
    """The student's notebook, or raise ValueError saying why it cannot be graded."""
    if path.suffix != ".ipynb":
        raise ValueError(f"{path.name} is not a notebook (expected a .ipynb file)")
    try:
        nb = nbformat.read(path, as_version=4)
    except (json.JSONDecodeError, nbformat.reader.NotJSONError) as e:
        raise ValueError(f"{path.name} is not valid notebook JSON ({e.__class__.__name__}): "
                         "was it saved completely?") from e
    except Exception as e:  # nbformat raises several kinds for malformed files
        raise ValueError(f"{path.name} could not be read as a notebook: {e}") from e
    if not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path.name} has no list of cells")
    return nb


def merge(solution, student, label: str):
    """The merged notebook to run, and the checks it holds (missing ones already failed)."""
    exercise = make_exercise(solution, label)
    student_cells = {c.get("id"): c for c in student.cells if c.get("id")}
    sol_ids = {c.get("id") for c in solution.cells}
    extras: dict[str, list] = {}
    anchor = None
    for c in student.cells:
        if c.get("id") in sol_ids:
            anchor = c.get("id")
        elif c.get("cell_type") == "code":
            extras.setdefault(anchor, []).append(c)

    merged = copy.deepcopy(exercise)
    merged.cells = []
    checks: list[Check] = []

    def add_student_cell(c):
        c = copy.deepcopy(c)
        strip_outputs(c)
        tags = c.get("metadata", {}).get("tags", [])
        if tags:
            c["metadata"]["tags"] = [t for t in tags if t != "nbval-check-output"]
        merged.cells.append(c)

    for c in extras.get(None, []):
        add_student_cell(c)
    for sol_cell, ex_cell in zip(solution.cells, exercise.cells):
        cid = sol_cell.get("id")
        if is_check_cell(sol_cell):
            check = Check(check_name(sol_cell, len(checks) + 1), cid)
            checks.append(check)
            if cid not in student_cells:
                check.reason = ("this check cell is missing from your notebook (deleted?): copy it back "
                                "from the exercise notebook, unchanged")
            else:
                merged.cells.append(copy.deepcopy(sol_cell))
        elif cid in student_cells and student_cells[cid].get("cell_type") == sol_cell.get("cell_type"):
            cell = copy.deepcopy(ex_cell)
            cell["source"] = student_cells[cid]["source"]
            merged.cells.append(cell)
        else:
            merged.cells.append(copy.deepcopy(ex_cell))
        for c in extras.get(cid, []):
            add_student_cell(c)
    return merged, checks


def _last_error_line(text: str) -> str:
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


def _run_nbval(nb_path: Path, junit: Path, cell_timeout: int, total_timeout: int) -> tuple[bool, str]:
    """Run pytest --nbval-lax on one notebook; return (finished in time, combined output)."""
    ini = nb_path.parent / "pytest.ini"
    ini.write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env",
           f"--nbval-cell-timeout={cell_timeout}", "-p", "no:cacheprovider", "-c", str(ini),
           "--rootdir", str(nb_path.parent), "-q", f"--junitxml={junit}", str(nb_path)]
    envv = dict(os.environ)
    envv["PYTHONPATH"] = os.pathsep.join([str(ROOT), envv.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen(cmd, cwd=nb_path.parent, env=envv, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=total_timeout)
        return True, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return False, out


def _junit_cases(junit: Path) -> dict[int, tuple[bool, str]]:
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


def grade_notebook(path: Path, solutions: Path = SOLUTIONS, cell_timeout: int = CELL_TIMEOUT) -> Report:
    """Grade one student notebook against ``solutions/<same name>``."""
    report = Report(path.name)
    solution_path = solutions / path.name
    if not solution_path.exists():
        report.error = f"no solution named {path.name} in {solutions}: is the file name unchanged?"
        return report
    try:
        student = read_student(path)
    except (ValueError, OSError) as e:
        report.error = str(e)
        return report
    solution = nbformat.read(solution_path, as_version=4)
    merged, report.checks = merge(solution, student, path.name)
    to_run = [c for c in report.checks if not c.reason]
    if not to_run:
        return report
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        nb_path = Path(tmp) / path.name
        nb_path.write_text(nbformat.writes(merged))
        junit = Path(tmp) / "junit.xml"
        n_code = sum(c.get("cell_type") == "code" for c in merged.cells)
        finished, output = _run_nbval(nb_path, junit, cell_timeout, cell_timeout * 2 + 30 * n_code + 120)
        cases = _junit_cases(junit)
    last_failure = ""
    code_cells = [c for c in merged.cells if c.get("cell_type") == "code"]  # nbval numbers these
    for i, cell in enumerate(code_cells):
        passed, text = cases.get(i, (None, ""))
        check = next((c for c in to_run if c.cell_id == cell.get("id") and is_check_cell(cell)), None)
        if check is None:
            if passed is False and text != "skipped":
                last_failure = f"cell {i} failed first: {_last_error_line(text)}"
            continue
        if passed is None:
            check.reason = ("the grader stopped before this check ran (a cell hung past the time limit, "
                            "or the kernel died)" if not finished else "this check did not run")
        elif passed:
            check.passed = True
        else:
            check.reason = _last_error_line(text)
            if "timeout" in text.lower() and "exceeded" in text.lower():
                check.reason = f"the cell ran longer than {cell_timeout} s (does a loop never end?)"
            if last_failure and "NameError" in check.reason:  # a definition missing: say which cell broke
                check.reason += f" [{last_failure}]"
    if not cases and not finished:
        report.error = "grading timed out before any cell finished"
    elif not cases:
        report.error = "nbval did not run: " + _last_error_line(output)
    return report


def notebooks_in(targets: list[str]) -> list[Path]:
    paths: list[Path] = []
    for t in targets:
        p = Path(t)
        paths.extend(sorted(p.glob("*.ipynb")) if p.is_dir() else [p])
    return paths


def table(reports: list[Report]) -> str:
    width = max([len(r.notebook) for r in reports] + [8])
    lines = [f"{'exercise':<{width}}  checks  result", "-" * (width + 16)]
    for r in reports:
        total = len(r.checks)
        status = "PASS" if r.ok else "FAIL"
        lines.append(f"{r.notebook:<{width}}  {r.passed:>2}/{total:<3}  {status}")
        if r.error:
            lines.append(f"    ! {r.error}")
        for c in r.checks:
            if not c.passed:
                lines.append(f"    x {c.name}: {c.reason}")
    n_ok = sum(r.ok for r in reports)
    lines.append("-" * (width + 16))
    lines.append(f"{n_ok} of {len(reports)} exercise notebook(s) pass every check")
    return "\n".join(lines)


def write_junit(reports: list[Report], path: Path) -> None:
    suites = ET.Element("testsuites")
    for r in reports:
        suite = ET.SubElement(suites, "testsuite", name=r.notebook, tests=str(max(len(r.checks), 1)),
                              failures=str(len(r.checks) - r.passed + (1 if r.error else 0)))
        if r.error:
            case = ET.SubElement(suite, "testcase", classname=r.notebook, name="notebook")
            ET.SubElement(case, "failure", message=r.error)
        for c in r.checks:
            case = ET.SubElement(suite, "testcase", classname=r.notebook, name=c.name)
            if not c.passed:
                ET.SubElement(case, "failure", message=c.reason)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Grade exercise notebooks against the solutions' checks.")
    ap.add_argument("targets", nargs="*", default=["exercises"], help="notebooks or folders")
    ap.add_argument("--junit", type=Path, help="also write JUnit XML here")
    ap.add_argument("--solutions", type=Path, default=SOLUTIONS)
    ap.add_argument("--cell-timeout", type=int, default=CELL_TIMEOUT)
    args = ap.parse_args(argv)
    paths = notebooks_in(args.targets)
    if not paths:
        print(f"no notebooks found in {args.targets}")
        return 2
    reports = []
    try:
        from tqdm.auto import tqdm
        paths_iter = tqdm(paths, desc="grading", unit="notebook", file=sys.stderr)
    except ImportError:  # pragma: no cover
        paths_iter = paths
    for p in paths_iter:
        reports.append(grade_notebook(p, args.solutions, args.cell_timeout))
    print(table(reports))
    if args.junit:
        write_junit(reports, args.junit)
        print(f"JUnit XML written to {args.junit}")
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
