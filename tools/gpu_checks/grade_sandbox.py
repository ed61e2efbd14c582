"""On a GPU: grading under the write protection (Landlock) works, and costs no time.

Grades two solution notebooks (each must pass every check) with the protection, then without it
(COURSE_GRADE_UNPROTECTED=1), and prints a table: notebook, protection, checks passed, seconds.
About 2-3 minutes on an H100.

    .venv/bin/python tools/gpu_checks/grade_sandbox.py
"""

from __future__ import annotations

import os
import sys
import time

from course_utils import grade
from course_utils.exercises import SOLUTIONS

CHAPTERS = ("03_triton_model.ipynb", "05_softmax.ipynb")


def main() -> int:
    rows, ok = [], True
    for unprotected in (False, True):
        os.environ["COURSE_GRADE_UNPROTECTED"] = "1" if unprotected else "0"
        for name in CHAPTERS:
            start = time.perf_counter()
            r = grade.grade_notebook(SOLUTIONS / name)
            seconds = time.perf_counter() - start
            ok &= r.ok and (unprotected or r.protection == "protected") and not r.checkout_changed
            if not r.ok:
                print(grade.table([r]))
            rows.append((name, r.protection or "-", f"{r.passed}/{len(r.checks)}", f"{seconds:.1f}"))
    os.environ.pop("COURSE_GRADE_UNPROTECTED")
    width = max(len(r[1]) for r in rows)
    print(f"{'notebook':<22} {'protection':<{width}} {'checks':>6} {'seconds':>8}")
    for name, prot, checks, seconds in rows:
        print(f"{name:<22} {prot:<{width}} {checks:>6} {seconds:>8}")
    print("OK" if ok else "FAILED: a solution did not pass, or the protection was not in force")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
