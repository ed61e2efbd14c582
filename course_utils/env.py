"""Execution mode, chosen once on import.

- ``cuda``: a CUDA GPU is visible; kernels run for real at full sizes.
- ``interpreter``: no GPU; Triton's interpreter runs every kernel on CPU tensors.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` is decorated, so this module sets it
(when no GPU is visible and it is unset) before anything in the course imports a kernel.
``COURSE_MODE=cuda|interpreter`` forces a mode.
"""

from __future__ import annotations

import os
import platform

import torch

MODES = ("cuda", "interpreter")


def _choose_mode() -> str:
    forced = os.environ.get("COURSE_MODE", "").strip().lower()
    if forced:
        if forced not in MODES:
            raise ValueError(f"COURSE_MODE must be one of {MODES}, got {forced!r}")
        if forced == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("COURSE_MODE=cuda but torch sees no CUDA GPU")
        return forced
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreter"
    return "cuda" if torch.cuda.is_available() else "interpreter"


MODE = _choose_mode()
if MODE == "interpreter" and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    print("course_utils: no GPU visible, so Triton kernels run under its interpreter on the CPU "
          "(TRITON_INTERPRET=1); timing cells show recorded GPU results.")
elif MODE == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
    raise RuntimeError("COURSE_MODE=cuda conflicts with TRITON_INTERPRET=1: unset one of them")

DEVICE = torch.device("cuda" if MODE == "cuda" else "cpu")


if MODE == "interpreter":
    # Triton 3.6's interpreter on NumPy >= 2.4 (``for i in range(0, n, BLOCK)``); the one documented
    # place for Triton internals says whether the assumption still holds (a no-op without Triton).
    from .triton_internals import patch_interpreter_index

    patch_interpreter_index()


def on_gpu() -> bool:
    """True when kernels run on a real CUDA GPU."""
    return MODE == "cuda"


def pick(gpu, cpu):
    """The GPU value in cuda mode, the (smaller) CPU value under the interpreter."""
    return gpu if on_gpu() else cpu


def device_name() -> str:
    if on_gpu():
        return torch.cuda.get_device_name(DEVICE)
    return platform.processor() or platform.machine() or "CPU"


def versions() -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency on Linux
        triton_version = "not installed"
    return {"torch": torch.__version__, "triton": triton_version}


def banner() -> str:
    """One line: mode, device, torch and triton versions."""
    v = versions()
    what = "real GPU" if on_gpu() else "Triton interpreter on the CPU, recorded GPU timings"
    return f"mode: {MODE} ({what}) | device: {device_name()} | torch {v['torch']} | triton {v['triton']}"


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """Floating dtypes a kernel of the course must handle on this device.

    The interpreter computes bf16 arithmetic wrongly, and GPUs before sm_80 (T4) have no bf16.
    """
    if not on_gpu():
        return (torch.float32, torch.float16)
    major, _ = torch.cuda.get_device_capability(DEVICE)
    if major >= 8:
        return (torch.float32, torch.float16, torch.bfloat16)
    return (torch.float32, torch.float16)


def in_colab() -> bool:
    """True inside Google Colab."""
    import sys
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ
