#!/usr/bin/env bash
# Make the virtual environment (if missing) and install the course into it.
#  - A torch that is already importable (GPU box, Colab) is reused, never replaced:
#    the venv then sees the system packages.
#  - With no torch and no NVIDIA GPU, a CPU-only torch is installed (a local wheel when the
#    machine has one, else PyTorch's CPU index), never the multi-GB CUDA build.
set -euo pipefail
VENV=${VENV:-.venv}
BASE=${PYTHON:-python3}
CPU_TORCH=${CPU_TORCH:-torch==2.13.0}
CPU_TRITON=${CPU_TRITON:-triton==3.6.0}

if [ ! -x "$VENV/bin/python" ]; then
  if "$BASE" -c "import torch" 2>/dev/null; then
    echo "setup: reusing the torch already installed for $BASE"
    "$BASE" -m venv --system-site-packages "$VENV"
  else
    "$BASE" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
pipi() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found, installing a CUDA build of torch"
    pipi "torch>=2.8"   # floors: course_utils/versions.py
  elif "$PY" -m pip download -q --no-index --no-deps -d "$(mktemp -d)" "$CPU_TORCH" >/dev/null 2>&1; then
    echo "setup: installing $CPU_TORCH, a CPU build this machine keeps on local disk"
    pipi "$CPU_TORCH"
  else
    echo "setup: no GPU, installing a CPU-only torch from PyTorch's CPU index"
    pipi torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
if [ "$(uname -s)" = Linux ] && ! "$PY" -c "import triton" 2>/dev/null; then
  pipi "$CPU_TRITON"
fi
pipi -e ".[dev]"
touch "$VENV/.installed"
"$PY" -c "import torch, triton; print('setup: torch', torch.__version__, '| triton', triton.__version__)"
