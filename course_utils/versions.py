"""The torch and Triton the course needs, checked once on ``import course_utils``.

Floors, each for a reason in the code (not a guess):

- Triton >= 3.4: the tuned attention and GEMM build TMA tensor descriptors with
  ``tl.make_tensor_descriptor`` and ``triton.tools.tensor_descriptor.TensorDescriptor``, public
  (without the ``_experimental`` prefix) since Triton 3.4.
- torch >= 2.8: the first PyTorch whose CUDA wheels bring Triton 3.4 (torch 2.7 pins Triton 3.3,
  and pip refuses to mix them), so an older torch on a GPU machine means an older Triton.

Tested: the pinned Triton of ``tools/setup_env.sh`` and the newest release pip installs (``make
test-triton-next``). Triton ships Linux wheels only: on macOS or Windows run the course on Colab or
in WSL 2 (Ubuntu); see the README.
"""

from __future__ import annotations

import re

TORCH_MIN = (2, 8)
TRITON_MIN = (3, 4)
NO_TRITON = ("Triton is not installed. It ships Linux wheels only: on macOS or Windows, open the course "
             "in Colab or in WSL 2 (Ubuntu) (see the README); on Linux: pip install 'triton>={t}'")


def parse(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '2.13.0+cpu' or '3.4.0rc1'; None if unreadable."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _text(v: tuple[int, int]) -> str:
    return ".".join(map(str, v))


def problem(torch_version: str, triton_version: str | None) -> str | None:
    """One line naming the installed and the needed versions when they do not fit, else None.

    ``triton_version`` None means Triton is not importable.
    """
    need = f"the course needs torch >= {_text(TORCH_MIN)} and triton >= {_text(TRITON_MIN)}"
    if triton_version is None:
        return f"course_utils: torch {torch_version} found, but " + NO_TRITON.format(t=_text(TRITON_MIN))
    old = []
    tv, trv = parse(torch_version), parse(triton_version)
    if tv is not None and tv < TORCH_MIN:
        old.append(f"torch {torch_version}")
    if trv is not None and trv < TRITON_MIN:
        old.append(f"triton {triton_version}")
    if not old:
        return None
    return (f"course_utils: {' and '.join(old)} installed, but {need} (Triton {_text(TRITON_MIN)} for tensor "
            f"descriptors; torch {_text(TORCH_MIN)} is the first to ship it): "
            f"pip install -U 'torch>={_text(TORCH_MIN)}' 'triton>={_text(TRITON_MIN)}' "
            "(on a GPU machine upgrading torch brings its Triton)")


def installed() -> tuple[str, str | None]:
    """(torch version, Triton version or None when Triton cannot be imported)."""
    import torch
    try:
        import triton
    except ImportError:
        return torch.__version__, None
    return torch.__version__, getattr(triton, "__version__", "0.0")


def check(say=print) -> str | None:
    """Say the one-line problem with the installed versions, if any (``import course_utils`` does)."""
    line = problem(*installed())
    if line:
        say(line)
    return line


__all__ = ["TORCH_MIN", "TRITON_MIN", "parse", "problem", "installed", "check"]
