"""Kernel Fusion with Triton: the package every notebook imports.

Importing it chooses the execution mode first (see :mod:`course_utils.env`), so that Triton's
interpreter is switched on before any kernel is decorated.
"""

from . import env  # noqa: I001  (must come first: it may set TRITON_INTERPRET)
from .env import DEVICE, MODE, banner, on_gpu, pick

__all__ = ["DEVICE", "MODE", "banner", "on_gpu", "pick", "env"]
__version__ = "0.1.0"
