"""The tanh-GELU of chapter 4 in CUDA C++ (``gelu.cu``), built where a GPU and nvcc exist.

Chapter 4 compares the three ways to fuse GELU: eager ops, Triton, and a hand-written CUDA kernel.
:func:`load_cuda_gelu` compiles ``gelu.cu`` once with ``torch.utils.cpp_extension.load_inline``
(about 30 s on an H200 host; the build is cached by torch between sessions) and :func:`gelu_cuda` calls it.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch

from .. import env

SOURCE_PATH = Path(__file__).with_name("gelu.cu")
CUDA_GELU_SOURCE = SOURCE_PATH.read_text()


def cuda_gelu_unavailable() -> str | None:
    """Why the CUDA C++ GELU cannot be built here, or None when it can (a GPU and nvcc)."""
    if not env.on_gpu():
        return "no CUDA GPU here (interpreter mode): the CUDA C++ version needs a GPU and nvcc"
    from torch.utils.cpp_extension import CUDA_HOME
    if shutil.which("nvcc") is None and not (CUDA_HOME and shutil.which("nvcc", path=f"{CUDA_HOME}/bin")):
        return "nvcc (the CUDA compiler) is not installed: torch.utils.cpp_extension cannot build the kernel"
    return None


@functools.lru_cache(maxsize=1)
def load_cuda_gelu():
    """Build (once; about 30 s) and return the extension module with ``gelu_cuda(x)``."""
    reason = cuda_gelu_unavailable()
    if reason:
        raise RuntimeError(reason)
    from torch.utils.cpp_extension import load_inline
    return load_inline(name="course_gelu_cuda", cpp_sources="torch::Tensor gelu_cuda(torch::Tensor x);",
                       cuda_sources=CUDA_GELU_SOURCE, functions=["gelu_cuda"],
                       extra_cuda_cflags=["-O3"], verbose=False)


def gelu_cuda(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU through the CUDA C++ kernel of ``gelu.cu`` (GPU with nvcc only)."""
    return load_cuda_gelu().gelu_cuda(x)
