#!/usr/bin/env bash
# Run make targets on a GPU host whose python3 already has torch and triton but no Jupyter stack
# (the course's lent H100/H200): install the carried wheels (../shared/gpu/wheels.sh .whl) into
# /tmp/site, then run each target with PY=python3, logging to $OUT (or /tmp) as we go.
#   bash tools/gpu_run.sh bench test-gpu
set -uo pipefail
out=${OUT:-/tmp}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
for target in "$@"; do
  start=$(date +%s)
  make --no-print-directory "$target" PY=python3 2>&1 | tee "$out/$target.log"
  rc=${PIPESTATUS[0]}
  echo "== make $target: exit $rc in $(( $(date +%s) - start )) s"
  [ "$rc" -eq 0 ] || status=$rc
done
exit $status
