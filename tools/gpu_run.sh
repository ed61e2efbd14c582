#!/usr/bin/env bash
# Run make targets (or benchmark topics) on a GPU host whose python3 already has torch and triton but no Jupyter
# stack (the course's lent H100/H200): install the carried wheels (../shared/gpu/wheels.sh .whl, plus any peer such
# as liger-kernel) into /tmp/site, then run each step with PY=python3, logging to $OUT (or /tmp) as it goes.
#   bash tools/gpu_run.sh bench test-gpu                 # make targets
#   STEP_LIMIT=300 bash tools/gpu_run.sh topic:layernorm topic:training   # benchmarks.run --only <topic>
# Each step gets at most STEP_LIMIT seconds (default: none), so one slow step cannot take the others' time.
# Every file the steps write under results/, and every log, comes back in $OUT/results.tgz: a lent machine returns
# at most 8 files from $OUT, and a run records more (the CSVs, plots, targets). summary.txt has each step's exit and
# time.
set -uo pipefail
out=${OUT:-/tmp}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# an earlier run's archive in the same $OUT (two runs in one call) is kept: packed into this run's as a loose file
[ -f "$out/results.tgz" ] && mv "$out/results.tgz" "$out/results_earlier_$(date +%s).tgz"
marker=$(mktemp)
sleep 1   # files written in the same second as the marker count as new
status=0
for step in "$@"; do
  start=$(date +%s)
  # what else the host is doing as the step starts (a busy host slows every step issued from Python)
  { echo "== $step: load $(cut -d' ' -f1-3 /proc/loadavg), busiest:"; ps -eo pcpu=,comm= --sort=-pcpu | head -n 3; } \
    >> "$out/summary.txt"
  limit=()
  [ -n "${STEP_LIMIT:-}" ] && limit=(timeout "$STEP_LIMIT")
  if [[ $step == topic:* ]]; then
    name=${step#topic:}
    "${limit[@]}" make --no-print-directory bench PY=python3 BENCH_ARGS="--only $name --no-progress" \
      > "$out/bench_$name.log" 2>&1
    rc=$?
  else
    "${limit[@]}" make --no-print-directory "$step" PY=python3 2>&1 | tee "$out/$step.log"
    rc=${PIPESTATUS[0]}
  fi
  echo "== $step: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
  [ "$rc" -eq 0 ] || status=$rc
done
# A lent machine returns at most 8 files from $OUT (in name order): everything else it holds, the step logs and
# whatever the caller left there, goes into results.tgz beside the results files, and only summary.txt stays loose.
new=$(find results -type f -newer "$marker" | sort)
loose=$(cd "$out" && find . -maxdepth 1 -type f ! -name results.tgz ! -name summary.txt -printf '%f\n' | sort)
if [ -n "$new$loose" ]; then
  tar czf "$out/results.tgz.part" $new ${loose:+-C "$out" $loose} && mv "$out/results.tgz.part" "$out/results.tgz" \
    && (cd "$out" && rm -f $loose) && echo "results.tgz: $(echo "$new" | grep -c .) results files, logs: $loose"
fi
exit $status
