"""What the grader reports: the table a student reads, JUnit XML and a per-student CSV for CI.

A class is a folder of submissions, one notebook per student under any file name
(``submissions/alice.ipynb``), or one folder per student (``submissions/alice/*.ipynb``). Each
notebook is matched to the solution it answers by its content. The exit code of ``--class`` is 0
when every notebook was graded, whatever the students scored, and 2 only when the grader itself
failed (an infrastructure error): CI fails on a broken runner, never on a failing student.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import threading
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from ..exercises import SOLUTIONS

CSV_FIELDS = ["student", "exercise", "check", "result", "reason"]


def notebooks_in(targets: list[str]) -> list[Path]:
    paths: list[Path] = []
    for t in targets:
        p = Path(t)
        paths.extend(sorted(p.glob("*.ipynb")) if p.is_dir() else [p])
    return paths


def class_notebooks(folder: Path) -> list[tuple[str, Path]]:
    """(student, notebook) for every notebook of a class folder (``.ipynb_checkpoints`` skipped)."""
    out = []
    for p in sorted(folder.rglob("*.ipynb")):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue
        out.append((rel.parts[0] if len(rel.parts) > 1 else p.stem, p))
    return out


def table(reports) -> str:
    width = max([len(r.notebook) for r in reports] + [8])
    lines = [f"{'exercise':<{width}}  checks  result", "-" * (width + 16)]
    for r in reports:
        total = len(r.checks)
        status = "PASS" if r.ok else "FAIL"
        who = f"{r.student}: " if r.student else ""
        lines.append(f"{who}{r.notebook:<{width}}  {r.passed:>2}/{total:<3}  {status}")
        if r.error:
            lines.append(f"    ! {r.error}")
        if r.checkout_changed and not r.error:
            from . import checkout_warning
            lines.append(f"    !! {checkout_warning(r)}")
        if r.integrity is not None and not r.integrity.passed:
            lines.append(f"    x integrity: {r.integrity.reason}")
        for c in r.checks:
            if not c.passed:
                lines.append(f"    x {c.name}: {c.reason}")
                if c.look_at:
                    lines.append(f"      look at {c.look_at}")
    n_ok = sum(r.ok for r in reports)
    lines.append("-" * (width + 16))
    lines.append(f"{n_ok} of {len(reports)} exercise notebook(s) pass every check")
    lines += protection_lines(reports)
    return "\n".join(lines)


def protection_lines(reports) -> list[str]:
    """Whether the instructor's checkout was write-protected, and the notebooks it changed under."""
    why_not = sorted({r.protection for r in reports if r.protection and r.protection != "protected"})
    changed = [r.notebook for r in reports if r.checkout_changed]
    if changed:
        end = "exit status 2" if any(r.infra for r in reports if r.checkout_changed) else "see above"
        return [f"!! THE INSTRUCTOR'S CHECKOUT CHANGED while grading {', '.join(changed)}: {end}"]
    if why_not:
        return ["WARNING: the checkout could not be write-protected here (" + "; ".join(why_not) + "): a notebook's "
                "writes into it are detected (hashes before and after each notebook), not prevented"]
    if any(r.protection for r in reports):
        return ["The checkout was write-protected (Linux Landlock) while the notebooks ran, and was unchanged after."]
    return []


def write_junit(reports, path: Path) -> None:
    suites = ET.Element("testsuites")
    for r in reports:
        rows = r.rows()
        name = f"{r.student}/{r.notebook}" if r.student else r.notebook
        suite = ET.SubElement(suites, "testsuite", name=name, tests=str(len(rows)),
                              failures=str(sum(not c.passed for c in rows)))
        for c in rows:
            case = ET.SubElement(suite, "testcase", classname=name, name=c.name)
            if not c.passed:
                ET.SubElement(case, "failure", message=c.reason)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def write_csv(reports, path: Path) -> None:
    """One row per student, exercise and check: pass or fail, and the reason."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in reports:
            for c in r.rows():
                w.writerow([r.student or Path(r.notebook).stem, r.exercise or Path(r.notebook).stem, c.name,
                            "pass" if c.passed else "fail", " ".join(c.reason.split())])


def main(argv=None) -> int:
    from . import CELL_TIMEOUT, grade_notebook

    ap = argparse.ArgumentParser(description="Grade exercise notebooks against the solutions' checks.")
    ap.add_argument("targets", nargs="*", default=["exercises"], help="notebooks or folders")
    ap.add_argument("--class", dest="klass", type=Path, help="a folder of submissions, one notebook per student")
    ap.add_argument("--junit", type=Path, help="also write JUnit XML here")
    ap.add_argument("--csv", type=Path, help="also write a CSV (student, exercise, check, result, reason)")
    ap.add_argument("--solutions", type=Path, default=SOLUTIONS)
    ap.add_argument("--cell-timeout", type=int, default=CELL_TIMEOUT)
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                    help="notebooks graded at once (default: the CPU cores, at most 4)")
    args = ap.parse_args(argv)
    if args.klass:
        if not args.klass.is_dir():
            print(f"--class {args.klass}: not a folder")
            return 2
        jobs = class_notebooks(args.klass)
    else:
        jobs = [("", p) for p in notebooks_in(args.targets)]
    if not jobs:
        print(f"no notebooks found in {args.klass or args.targets}")
        return 2
    changed = threading.Event()  # the checkout changed: later notebooks would be graded against it

    def one(job):
        student, p = job
        if changed.is_set():
            from . import Report
            r = Report(p.name, error="not graded: the instructor's checkout changed earlier in this run", infra=True)
            r.student = student
            return r
        try:
            r = grade_notebook(p, args.solutions, args.cell_timeout)
        except Exception as e:  # the grader's own failure: report it, go on, exit 2 at the end
            from . import Report
            r = Report(p.name, error=f"the grader failed on this notebook: {type(e).__name__}: {e}", infra=True)
        r.student = student
        if r.checkout_changed and r.infra:  # not write-protected: this notebook may have changed the solutions
            changed.set()
        return r

    # each notebook runs in its own kernel process: grading several at once uses the runner's cores
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(one, job) for job in jobs]
        try:
            from tqdm.auto import tqdm
            for _ in tqdm(as_completed(futures), total=len(futures), desc="grading", unit="notebook",
                          file=sys.stderr):
                pass
        except ImportError:  # pragma: no cover
            pass
        reports = [f.result() for f in futures]
    print(table(reports))
    if args.junit:
        write_junit(reports, args.junit)
        print(f"JUnit XML written to {args.junit}")
    if args.csv:
        write_csv(reports, args.csv)
        print(f"CSV written to {args.csv}")
    if not args.klass:
        print("(this is the self-check: the same grader your instructor runs)" if all(r.ok for r in reports)
              else "Fix what is marked x above (the cell to look at is named), save, and run make grade again.")
    if any(r.infra for r in reports):
        return 2
    return 0 if args.klass or all(r.ok for r in reports) else 1
