"""Kernel Fusion with Triton: the package every notebook imports.

Importing it chooses the execution mode first (see :mod:`course_utils.env`), so that Triton's
interpreter is switched on before any kernel is decorated, then checks the installed torch and
Triton against what the course needs (:mod:`course_utils.versions`: one line when they do not fit).
"""

from . import env  # noqa: I001  (must come first: it may set TRITON_INTERPRET)
from .env import DEVICE, MODE, banner, on_gpu, pick
from . import versions

versions.check()

__all__ = ["DEVICE", "MODE", "banner", "on_gpu", "pick", "env", "versions"]
__version__ = "0.1.0"
