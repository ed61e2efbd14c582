"""Grading exercise notebooks with nbval (the threat model is in README.md, "For instructors: grading").

nbval compares a notebook with its own saved outputs, so for each student notebook the grader
builds a merged notebook: the student's cell sources (matched to the solution's cells by id, else by
content: see :mod:`.match`), and the solution's check cells with their saved expected outputs. Before
anything runs, :func:`course_utils.integrity.scan` reads the student's code for tampering (the
"integrity" check); while it runs, each check cell verifies the course's code is what was imported.
``pytest --nbval-lax`` runs it in a fresh kernel; a check passes when its cell runs and prints
exactly what the solution printed.
Check cells always come from the solution (a student's edits to them are not graded; one they moved
is found), a check cell the student deleted fails, and the student's file is only ever read. Each
notebook runs in a private copy of the checkout that is write-protected (:mod:`.checkout`, :mod:`.jail`).

    python -m course_utils.grade exercises/                       # every notebook in a folder
    python -m course_utils.grade exercises/01_launch_overhead.ipynb --junit grades.xml
    python -m course_utils.grade --class submissions/ --csv grades.csv --junit grades.xml  # a class
"""

from __future__ import annotations

import ast
import copy
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .. import integrity
from ..exercises import ROOT, SOLUTIONS, is_check_cell, make_exercise
from . import checkout, jail
from .match import Cell, align, coerce, exercise_cells_for, identify, import_source, names_used, normalized, read_cells
from .runner import junit_cases, kernel_died, last_error_line, run_nbval

CELL_TIMEOUT = 300  # seconds a single cell may run before it counts as hung


@dataclass
class Check:
    name: str
    cell_id: str
    passed: bool = False
    reason: str = ""
    look_at: str = ""   # the student's cell(s) this check judges, for the report
    moved_from: int = 0  # the student moved this check cell: its position in their notebook


@dataclass
class Report:
    notebook: str
    checks: list[Check] = field(default_factory=list)
    error: str = ""  # the notebook could not be graded at all
    integrity: Check | None = None
    exercise: str = ""  # the solution it was graded against
    student: str = ""
    infra: bool = False  # the grader itself failed (not the student's notebook)
    protection: str = ""  # "protected", or why the checkout could not be write-protected
    checkout_changed: list[str] = field(default_factory=list)  # the instructor's files changed meanwhile

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.checks)

    @property
    def ok(self) -> bool:
        return (not self.error and bool(self.checks) and self.passed == len(self.checks)
                and (self.integrity is None or self.integrity.passed))

    def rows(self) -> list[Check]:
        """Every graded line: the integrity check first, then the exercise's checks."""
        if self.error:
            return [Check("notebook", "", False, self.error)]
        return ([self.integrity] if self.integrity else []) + self.checks


def check_name(cell, k: int) -> str:
    """A check's name: the first comment line of its cell ('# Check: ...'), else its position."""
    for line in cell["source"].splitlines():
        s = line.strip()
        if s.startswith("#") and "NBVAL" not in s:
            return s.lstrip("#").strip().removeprefix("Check:").strip() or f"check {k}"
        if s:
            break
    return f"check {k}"


def read_student(path: Path) -> list[Cell]:
    """The student's cells, or raise ValueError saying why it cannot be graded."""
    return read_cells(path)


def _code_cell(source: str, cid: str):
    c = nbformat.v4.new_code_cell(source)
    c["id"] = cid
    return c


def merge(solution, student: list[Cell], label: str):
    """The merged notebook to run, its checks (missing ones already failed) and the integrity check.

    A cell put first records the course's code (:func:`course_utils.integrity.arm`) before any of
    the student's cells runs; each check cell re-binds the names it uses to the recorded objects
    and verifies, before and after it runs, that nothing it relies on was changed.
    """
    exercise = make_exercise(solution, label)
    sol = [coerce(c, k + 1) for k, c in enumerate(solution.cells)]
    ex_sources = [c.get("source", "") for c in exercise.cells]
    pairs = align(sol, ex_sources, student)
    moved = moved_checks(sol, student, pairs)
    matched_students = set(pairs.values()) | set(moved.values())
    anchors: dict[int, list[Cell]] = {}
    anchor = -1
    by_student = {j: i for i, j in pairs.items()}
    for j, c in enumerate(student):
        if j in by_student:
            anchor = by_student[j]
        elif j not in matched_students and c.cell_type == "code" and c.source.strip():
            anchors.setdefault(anchor, []).append(c)

    token = secrets.token_hex(6)
    guard = f"__grader_{token}"
    imports = import_source(sol)
    merged = copy.deepcopy(exercise)
    merged.cells = [_code_cell(f"import course_utils.grade.guard as _ci_{token}\n"
                               f"{guard} = _ci_{token}.arm({imports!r})\ndel _ci_{token}", "grader-arm")]
    bound = {n.asname or n.name.split(".")[0] for stmt in ast.parse(imports).body for n in stmt.names}
    checks: list[Check] = []

    positions: dict[str, int] = {}  # merged cell id -> the student's cell number

    def add_student_cell(c: Cell):
        cell = _code_cell(c.source, f"student-{c.position}")
        positions[cell["id"]] = c.position
        merged.cells.append(cell)

    for c in anchors.get(-1, []):
        add_student_cell(c)
    for i, (sol_cell, ex_cell) in enumerate(zip(solution.cells, exercise.cells)):
        if sol[i].is_check:
            check = Check(check_name(sol_cell, len(checks) + 1), sol_cell.get("id"))
            check.look_at = _look_at(sol, i, pairs, student)
            checks.append(check)
            if i not in pairs and i not in moved:
                check.reason = ("this check cell is missing from your notebook (deleted, or its code edited?): "
                                "copy it back from the exercise notebook, unchanged")
            else:
                cell = copy.deepcopy(sol_cell)
                if i in moved:
                    check.moved_from = student[moved[i]].position
                names = sorted(names_used(sol_cell["source"]) & bound)
                where = f"check {check.name!r}"
                cell["source"] = (f"{guard}.bind({names!r}); {guard}.verify({where!r})\n" + sol_cell["source"]
                                  + f"\n{guard}.verify({where + ' (after it ran)'!r})")
                merged.cells.append(cell)
        elif i in pairs and sol[i].cell_type == "code":
            cell = copy.deepcopy(ex_cell)
            cell["source"] = student[pairs[i]].source
            positions[cell.get("id")] = student[pairs[i]].position
            merged.cells.append(cell)
        elif sol[i].cell_type == "code" and sol[i].is_exercise:
            pass  # the student deleted this exercise's cell: their answer, if any, is in a cell of their own
        else:
            merged.cells.append(copy.deepcopy(ex_cell))
        for c in anchors.get(i, []):
            add_student_cell(c)

    scanned = [(c.position, c.source) for j, c in enumerate(student) if c.cell_type == "code"
               and j not in moved.values() and not (j in by_student and sol[by_student[j]].is_check)]
    findings = integrity.scan(scanned)
    integ = Check("integrity", "", not findings)
    if findings:
        integ.reason = "tampering with the checks: " + "; ".join(
            f"{f} ({_preview(student, f.cell)})" for f in findings[:6])
    merged.metadata["grader_positions"] = positions  # (nbformat copies a dict it is given: set it when full)
    return merged, checks, integ


def moved_checks(sol: list[Cell], student: list[Cell], pairs: dict[int, int]) -> dict[int, int]:
    """{solution index: student index} for check cells the order-keeping alignment left out because the
    student moved them: the same cell id, or the same code, anywhere else in the notebook."""
    used, out = set(pairs.values()), {}
    for i, c in enumerate(sol):
        if not c.is_check or i in pairs:
            continue
        for j, st in enumerate(student):
            if j not in used and st.cell_type == "code" and (
                    (c.id and st.id == c.id) or normalized(st.source) == normalized(c.source)):
                out[i] = j
                used.add(j)
                break
    return out


def _preview(student: list[Cell], position: int) -> str:
    c = next((c for c in student if c.position == position), None)
    return f"starts {c.preview()!r}" if c else "?"


def _look_at(sol: list[Cell], k: int, pairs: dict[int, int], student: list[Cell]) -> str:
    parts = []
    for i in exercise_cells_for(sol, k):
        if i in pairs:
            c = student[pairs[i]]
            parts.append(f"your cell {c.position} ({c.preview()!r})")
        else:
            parts.append(f"the cell of {sol[i].marker.title() or ', '.join(sorted(sol[i].defs))} "
                         "(not found in your notebook: did you delete it?)")
    return "; ".join(parts)


def grade_notebook(path: Path, solutions: Path = SOLUTIONS, cell_timeout: int = CELL_TIMEOUT,
                   solution_path: Path | None = None, course_root: Path = ROOT) -> Report:
    """Grade one student notebook against ``solutions/<same name>`` (or the solution it matches).

    It runs in a private copy of ``course_root`` (the instructor's checkout) with every write into
    the checkout forbidden (:mod:`.jail`); the checkout is hashed before and after, and a change
    fails this notebook and the run (``report.checkout_changed``, an infrastructure error).
    """
    report = Report(path.name)
    try:
        student = read_student(path)
    except (ValueError, OSError) as e:
        report.error = str(e)
        return report
    solution_path = solution_path or solutions / path.name
    if not solution_path.exists():
        solution_path = identify(student, solutions)
        if solution_path is None:
            report.error = (f"could not tell which exercise notebook {path.name} is (no check cell of any "
                            f"solution in {solutions} found in it)")
            return report
    solution = nbformat.read(solution_path, as_version=4)
    merged, report.checks, report.integrity = merge(solution, student, path.name)
    to_run = [c for c in report.checks if not c.reason]
    if not to_run:  # none of this solution's checks in it: is it another chapter under this file name?
        other = identify(student, solutions)
        if other is not None and other != solution_path:
            solution_path, solution = other, nbformat.read(other, as_version=4)
            merged, report.checks, report.integrity = merge(solution, student, path.name)
            to_run = [c for c in report.checks if not c.reason]
    report.exercise = solution_path.stem
    if not to_run:
        return report
    unprotected = jail.abi() < 1 or os.environ.get("COURSE_GRADE_UNPROTECTED") == "1"  # then watch .venv too
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        root, files = checkout.sandbox(Path(tmp), course_root)
        work = Path(tmp) / "work"
        work.mkdir()
        nb_path = work / "graded.ipynb"
        nb_path.write_text(nbformat.writes(merged))
        junit = work / "junit.xml"
        n_code = sum(c.get("cell_type") == "code" for c in merged.cells)
        before = checkout.snapshot(course_root, course_root / ".venv" if unprotected else None)
        run = run_nbval(nb_path, junit, cell_timeout, cell_timeout * 2 + 30 * n_code + 120, root, course_root)
        after = checkout.snapshot(course_root, course_root / ".venv" if unprotected else None)
        cases = junit_cases(junit) if run.returncode in (0, 1) else {}
        changed = checkout.changed_files(files, root)
    report.protection = run.protection if jail.abi() > 0 else "Landlock is not available on this machine"
    if changed:
        report.integrity.passed = False
        report.integrity.reason = "; ".join(filter(None, [
            "your notebook wrote into the course's files (" + ", ".join(changed[:5]) + ")", report.integrity.reason]))
    _read_cells(report, merged, student, cases, cell_timeout, run.finished)
    if run.finished and run.returncode < 0:
        report.error = (f"the grading process was killed (signal {-run.returncode}: from inside the notebook, or "
                        "the out-of-memory killer), so its results cannot be trusted")
    elif not cases and not run.finished:
        report.error = "grading timed out before any cell finished"
    elif not cases:
        report.error, report.infra = "nbval did not run: " + last_error_line(run.output), True
    report.checkout_changed = checkout.differences(before, after)
    if report.checkout_changed and report.protection != "protected":  # it may have been this notebook
        report.infra = True
        report.integrity.passed = False
        report.integrity.reason = "; ".join(filter(None, [report.integrity.reason,
                                                          "the instructor's checkout changed while it ran"]))
        report.error = checkout_warning(report, course_root)
    return report


def checkout_warning(report: Report, course_root: Path = ROOT) -> str:
    """The loud line for a checkout that changed while ``report``'s notebook ran."""
    files = ", ".join(report.checkout_changed[:8]) + (" ..." if len(report.checkout_changed) > 8 else "")
    who = ("it was write-protected, so not by this notebook: was the checkout edited meanwhile?"
           if report.protection == "protected" else "it was not write-protected: this notebook may have written there")
    return (f"THE INSTRUCTOR'S CHECKOUT CHANGED while {report.notebook} was graded ({who}): {files} "
            f"(in {course_root}: see `git status` there, and restore it before grading again)")


def _read_cells(report: Report, merged, student: list[Cell], cases: dict, cell_timeout: int, finished: bool):
    """Each check's verdict from nbval's items; the first failure or crash of another cell, named."""
    to_run = [c for c in report.checks if not c.reason]
    last_failure = died = ""
    positions = merged.metadata.get("grader_positions", {})
    code_cells = [c for c in merged.cells if c.get("cell_type") == "code"]  # nbval numbers these
    for i, cell in enumerate(code_cells):
        passed, text = cases.get(i, (None, ""))
        death = kernel_died(text) if passed is False else ""
        check = next((c for c in to_run if c.cell_id == cell.get("id") and is_check_cell(cell)), None)
        if check is None:
            where = positions.get(cell.get("id"))
            cell_name = f"your cell {where} ({_preview(student, where)})" if where else "a cell the exercise gives you"
            if i == 0 and passed is False:
                report.error = "the grader could not start the notebook: " + last_error_line(text)
                report.infra = True
            elif death and not died:
                died = death.replace("died while this cell ran", f"died earlier, while {cell_name} ran")
                last_failure = last_failure or died
            elif passed is False and text != "skipped" and not last_failure:
                last_failure = f"{cell_name} failed first: {last_error_line(text)}"
            continue
        moved = (f" (you moved this check cell to cell {check.moved_from}: it was graded where the exercise puts it)"
                 if check.moved_from else "")
        if death:
            check.reason = (f"{death}, so it gave no verdict (a crash in the code it calls: e.g. a segmentation fault, "
                            "os._exit, or the out-of-memory killer)")
            died = died or death.replace("died while this cell ran", f"died earlier, while check {check.name!r} ran")
        elif died and passed is False:
            check.reason = f"this check did not run: {died}"
        elif text == "skipped":
            check.reason = ("this check did not run: an earlier cell hung past the time limit or the kernel "
                            "died, and the rest of the notebook was skipped")
            check.reason += f" [{last_failure}]" if last_failure else ""
        elif passed is None:
            check.reason = ("the grader stopped before this check ran (a cell hung past the time limit, "
                            "or the kernel died)" if not finished else "this check did not run")
        elif passed:
            check.passed = True
        elif "Kernel dead on test start" in text:
            check.reason = "this check did not run: the kernel was stopped after an earlier cell hung" + (
                f" [{last_failure}]" if last_failure else "")
        else:
            check.reason = last_error_line(text) + moved
            if "timeout" in text.lower() and "exceeded" in text.lower():
                check.reason = f"the cell ran longer than {cell_timeout} s (does a loop never end?)"
            if last_failure and "NameError" in check.reason:  # a definition missing: say which cell broke
                check.reason += f" [{last_failure}]"
            if "IntegrityError" in check.reason:
                report.integrity.passed = False
                what = f"at run time, in check {check.name!r}: the course's code was changed"
                report.integrity.reason = "; ".join(filter(None, [report.integrity.reason, what]))


from .report import main, table, write_csv, write_junit  # noqa: E402  (the CLI and the outputs)

__all__ = ["Check", "Report", "grade_notebook", "identify", "merge", "main", "table", "write_csv", "write_junit"]
