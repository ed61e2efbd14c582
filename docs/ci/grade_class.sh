#!/usr/bin/env bash
# Grade a class on a CPU runner, with Triton's interpreter (no GPU needed).
#   bash docs/ci/grade_class.sh SUBMISSIONS_DIR OUT_DIR
# SUBMISSIONS_DIR holds one notebook per student, under any file name (alice.ipynb), or one folder
# per student (alice/*.ipynb). OUT_DIR receives grades.csv (student, exercise, check, result,
# reason), grades.xml (JUnit) and report.txt (the table). Exit status: 0 when every notebook was
# graded, whatever the students scored; 2 only when the grader itself failed (an infrastructure
# error). Set SKIP_SETUP=1 when the course is already installed, PY to choose the interpreter.
set -euo pipefail
SUBMISSIONS=${1:-submissions}
OUT=${2:-grades}
PY=${PY:-.venv/bin/python}
if [ "${SKIP_SETUP:-0}" != 1 ]; then
  make setup   # a virtual environment with a CPU-only torch, Triton and the course
fi
mkdir -p "$OUT"
export TRITON_INTERPRET=1 COURSE_MODE=interpreter
set +e
"$PY" -m course_utils.grade --class "$SUBMISSIONS" --csv "$OUT/grades.csv" --junit "$OUT/grades.xml" \
  > "$OUT/report.txt"
status=$?
set -e
cat "$OUT/report.txt"
exit "$status"
