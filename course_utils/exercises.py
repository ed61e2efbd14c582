"""Generating ``exercises/`` from ``solutions/``.

A solution notebook marks the code a student writes between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` (nbgrader's convention). The exercise replaces each such block with a stub
that raises ``NotImplementedError`` naming the exercise, strips every output and execution count,
keeps cell ids (the grader matches cells by id, else by content), and ends with a line telling the
student how to grade their own work (``make grade NB=...``). Check cells carry the tag
``nbval-check-output`` and are saved, in the solution only, with their expected output.

    python -m course_utils.exercises write              # solutions/*.ipynb -> exercises/
    python -m course_utils.exercises check              # exercises/ is exactly what write makes
    python -m course_utils.exercises refresh-solutions  # re-run solutions, keep check outputs
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"
CHECK_TAG = "nbval-check-output"
BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
_DEF = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)|^\s*class\s+(\w+)")
_EXERCISE = re.compile(r"^\s*#\s*(Exercise\s+[\w.\-]+.*?)\s*$", re.IGNORECASE)


def is_check_cell(cell) -> bool:
    return cell.get("cell_type") == "code" and CHECK_TAG in cell.get("metadata", {}).get("tags", [])


def exercise_name(lines: list[str], begin: int, fallback: str) -> str:
    """The exercise a solution block belongs to: the nearest '# Exercise ...' comment or def above."""
    above = lines[:begin]
    for line in reversed(above):
        m = _EXERCISE.match(line)
        if m:
            return m.group(1).rstrip(":")
    for line in reversed(above):
        m = _DEF.match(line)
        if m:
            return m.group(1) or m.group(2)
    return fallback


def stub_source(source: str, fallback: str = "this exercise") -> str:
    """Replace every BEGIN/END SOLUTION block of a cell's source by a stub that raises."""
    lines = source.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == BEGIN:
            indent = line[: len(line) - len(line.lstrip())]
            name = exercise_name(lines, i, fallback)
            j = i + 1
            while j < len(lines) and lines[j].strip() != END:
                if lines[j].strip() == BEGIN:
                    raise ValueError(f"nested {BEGIN} in {fallback}")
                j += 1
            if j == len(lines):
                raise ValueError(f"{BEGIN} without {END} in {fallback}")
            out.append(f"{indent}# YOUR CODE HERE")
            out.append(f'{indent}raise NotImplementedError("{name}: replace this line with your code")')
            i = j + 1
            continue
        if line.strip() == END:
            raise ValueError(f"{END} without {BEGIN} in {fallback}")
        out.append(line)
        i += 1
    return "\n".join(out)


def strip_outputs(cell) -> None:
    if cell.get("cell_type") == "code":
        cell["outputs"] = []
        cell["execution_count"] = None
    cell.get("metadata", {}).pop("execution", None)


def make_exercise(solution: nbformat.NotebookNode, label: str = "solution") -> nbformat.NotebookNode:
    """The exercise notebook generated from a solution notebook (a new object)."""
    nb = copy.deepcopy(solution)
    for k, cell in enumerate(nb.cells):
        if cell.get("cell_type") == "code":
            cell["source"] = stub_source(cell["source"], f"{label}, cell {k}")
        strip_outputs(cell)
    return nb


SELF_CHECK_ID = "self-check"


def self_check_cell(name: str):
    """The last cell of every exercise notebook: how a student grades their own work."""
    cell = nbformat.v4.new_markdown_cell(
        "## Check your work\n\n"
        f"Save this notebook, then run `make grade NB=exercises/{name}` in the course folder (or\n"
        f"`python -m course_utils.grade exercises/{name}`; give the path of your copy if you saved it\n"
        "elsewhere). It is the grader your instructor runs: it runs your notebook in a fresh kernel with\n"
        "the checks as they are on disk, and for every check that fails it says why and which of your\n"
        "cells to look at. Changing the check cells or the course's code does not help: the grader\n"
        "uses its own copies and reports the attempt.")
    cell["id"] = SELF_CHECK_ID
    return cell


def exercise_file(solution, name: str):
    """The exercise notebook as written to ``exercises/``: the exercise plus the self-check line."""
    nb = make_exercise(solution, name)
    nb.cells.append(self_check_cell(name))
    return nb


def dumps(nb) -> str:
    return nbformat.writes(nb) + ("" if nbformat.writes(nb).endswith("\n") else "\n")


def solution_paths() -> list[Path]:
    return sorted(SOLUTIONS.glob("*.ipynb"))


def write(check_only: bool = False) -> int:
    """Write (or compare) every exercise; return the number of files that differ."""
    differ = 0
    expected_names = set()
    for path in solution_paths():
        target = EXERCISES / path.name
        expected_names.add(path.name)
        text = dumps(exercise_file(nbformat.read(path, as_version=4), path.name))
        current = target.read_text() if target.exists() else None
        if current != text:
            differ += 1
            if check_only:
                print(f"out of date: {target.relative_to(ROOT)} (run make exercises)")
            else:
                EXERCISES.mkdir(exist_ok=True)
                target.write_text(text)
                print(f"wrote {target.relative_to(ROOT)}")
    for stray in sorted(EXERCISES.glob("*.ipynb")):
        if stray.name not in expected_names:
            differ += 1
            print(f"{stray.relative_to(ROOT)} has no solution in solutions/"
                  + ("" if check_only else ": removed"))
            if not check_only:
                stray.unlink()
    return differ


def refresh_solution(path: Path, timeout: int = 600) -> None:
    """Execute a solution notebook and keep outputs only on its check cells."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    count = 0
    for cell in nb.cells:
        if is_check_cell(cell):
            count += 1
            cell["execution_count"] = count
            for out in cell["outputs"]:
                if out.get("output_type") == "error":
                    raise RuntimeError(f"{path.name}: a check cell fails in the solution:\n"
                                       + "\n".join(out.get("traceback", [])[-3:]))
                if "execution_count" in out:
                    out["execution_count"] = count
            cell.get("metadata", {}).pop("execution", None)
        else:
            strip_outputs(cell)
    path.write_text(dumps(nb))
    print(f"refreshed {path.relative_to(ROOT)}: {count} check cell(s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["write", "check", "refresh-solutions"])
    ap.add_argument("notebooks", nargs="*", help="solution notebooks (refresh-solutions only)")
    args = ap.parse_args(argv)
    if args.command == "write":
        write()
        return 0
    if args.command == "check":
        differ = write(check_only=True)
        if differ == 0:
            print(f"exercises/ is up to date ({len(solution_paths())} notebook(s))")
        return 1 if differ else 0
    for p in [Path(p) for p in args.notebooks] or solution_paths():
        refresh_solution(p.resolve())
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
