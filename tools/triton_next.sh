#!/usr/bin/env bash
# The course under the NEWEST Triton that pip installs, so that an upgrade that breaks it is caught
# before a student finds it (make test-triton-next; make test runs it).
#
# A second virtual environment, $NEXT (build/venv-triton-next), that sees every package of $VENV
# through a .pth file and has only its own triton, upgraded to the newest release on each run
# (pip compares with the index and downloads only when there is a newer one). Then, under Triton's
# interpreter, the CPU unit tests ($TESTS_MARK) and the compile matrix (python -m course_utils.aot).
# Cost on the 2-core development machine (2026-11-24, Triton 3.9.0, load about 1.5): first install
# 29 s (1-3 s once the newest is there), compile matrix about 190 s per target; the unit tests below took
# about 1380 CPU-seconds under the pinned Triton on 2026-11-28 (about 815 in the 1991 tests without "machinery").
#   BASE_PY=.venv/bin/python  NEXT=build/venv-triton-next  TRITON_NEXT=triton  (a requirement, e.g. triton==3.9.0)
set -euo pipefail
VENV=${VENV:-.venv}
NEXT=${NEXT:-build/venv-triton-next}
TRITON_NEXT=${TRITON_NEXT:-triton}
WORKERS=${WORKERS:-2}
# not "machinery": the training steps, data-parallel runs and tools around the kernels, whose kernels the kernels'
# own tests already run (2026-11-28: about 500 of the 1380 CPU-seconds of the tests below), and the tests that
# run no Triton at all: the widgets (pure Python, and ipywidgets 7), make test-gpu's schedule, the benchmark
# runner with fake topics, the integrity scan (40 CPU-seconds of the remaining 854 in the 2026-11-28 CPU run).
# Every kernel test and every checker test stays.
TESTS_MARK=${TESTS_MARK:-not slow and not browser and not gpu and not machinery}
TESTS=${TESTS:-tests}          # a narrower selection for a quick check of this script
# Every test function, on every third of its parameter sets and its last (tests/conftest.py, sample_params):
# a canary for an upgrade, not a second full run (2026-11-28: 1238 of the 2045 tests, about 965 of their 1481
# CPU-seconds under the pinned Triton). 1: every parameter set.
PARAM_SAMPLE=${PARAM_SAMPLE:-3}
AOT_ARGS=${AOT_ARGS:---smoke}  # per kernel its smallest and largest tile choice; --quick: every tile choice; "": all
RUN_TESTS=${RUN_TESTS:-1}      # 0: the compile matrix alone (make compile-matrix)
# Targets compiled under the newest Triton: sm_75 (T4, Colab; the oldest the course supports) and sm_90
# (H100: TMA descriptors, wgmma). sm_80 lies between them and is compiled under the pinned Triton by
# make test; NEXT_ARCHS="75 80 90" adds it here (about 3.5 more minutes of CPU).
NEXT_ARCHS=${NEXT_ARCHS:-75 90}

if [ "$(uname -s)" != Linux ]; then
  echo "triton-next: skipped: Triton ships Linux wheels only"
  exit 0
fi
BASE_PY=${BASE_PY:-$VENV/bin/python}
if [ ! -x "$NEXT/bin/python" ]; then
  "$BASE_PY" -m venv "$NEXT"
fi
PY="$NEXT/bin/python"
NEXT_SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# Every package directory the base interpreter sees (its venv, and the system's when the venv was made
# with --system-site-packages), after $NEXT's own packages: only triton differs.
"$BASE_PY" -c "
import sys
dirs = [p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))]
print('import site; ' + '; '.join(f'site.addsitedir({d!r})' for d in dirs))
" > "$NEXT_SITE/zz_base_venv.pth"

t0=$(date +%s)
"$PY" -m pip install -q --disable-pip-version-check --upgrade --no-deps "$TRITON_NEXT"
t1=$(date +%s)
read -r TORCH_V TRITON_V TRITON_AT < <("$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, triton.__file__)")
case "$TRITON_AT" in
  "$(cd "$NEXT_SITE" && pwd)"/*) ;;
  *) echo "triton-next: triton comes from $TRITON_AT, not from $NEXT" >&2; exit 1 ;;
esac
echo "triton-next: torch $TORCH_V | triton $TRITON_V (pinned: $("$BASE_PY" -c 'import triton; print(triton.__version__)')); installed in $((t1 - t0)) s"
export TRITON_INTERPRET=1 COURSE_MODE=interpreter
tests_rc=0
if [ "$RUN_TESTS" = 1 ]; then
  COURSE_PARAM_SAMPLE=$PARAM_SAMPLE "$PY" -m pytest -q -n "$WORKERS" --dist worksteal $TESTS -m "$TESTS_MARK" \
    -p no:cacheprovider || tests_rc=1
fi
# (the compile matrix runs even when a unit test failed: one run reports everything that broke)
t2=$(date +%s)
# The compile matrix for $NEXT_ARCHS, one process per target, two at a time when there are two workers.
LOGS="$NEXT/aot-logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
rc=0
pids=()
for arch in $NEXT_ARCHS; do
  "$PY" -m course_utils.aot --quiet $AOT_ARGS --arch "$arch" >"$LOGS/sm$arch.log" 2>&1 &
  pids+=($!)
  if [ "${#pids[@]}" -ge "$WORKERS" ]; then
    wait "${pids[0]}" || rc=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || rc=1; done
grep -h -E "^(FAIL|compile matrix:)|Error" "$LOGS"/*.log || true
t3=$(date +%s)
if [ "$rc" -ne 0 ] || [ "$tests_rc" -ne 0 ]; then
  [ "$tests_rc" -ne 0 ] && echo "triton-next: unit tests FAILED under triton $TRITON_V (above)" >&2
  [ "$rc" -ne 0 ] && echo "triton-next: the compile matrix FAILED under triton $TRITON_V (full logs: $LOGS)" >&2
  echo "triton-next: install $((t1 - t0)) s, unit tests $((t2 - t1)) s, compile matrix $((t3 - t2)) s" >&2
  exit 1
fi
echo "triton-next: triton $TRITON_V passed: install $((t1 - t0)) s, unit tests $((t2 - t1)) s, compile matrix $((t3 - t2)) s"
