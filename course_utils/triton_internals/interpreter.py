"""Hooks into Triton's interpreter (part of :mod:`course_utils.triton_internals`, the one place that touches
Triton's internals): the checkers see a kernel's loads and run a grid's last programs, and loops over a range run
on NumPy >= 2.4. Each hook first checks its assumption (``triton_internals._check``) and does nothing where it no
longer holds."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator


def _check(name: str) -> str:
    from . import _check as check  # the package imports this module last: looked up at call time
    return check(name)


def _builder(internal: str):
    """Triton's InterpreterBuilder, or None where ``internal`` of it cannot be used (no Triton, or the internal
    changed: :func:`problems` says how)."""
    try:
        from triton.runtime.interpreter import InterpreterBuilder
    except ImportError:  # pragma: no cover - no triton
        return None
    return None if _check(internal) else InterpreterBuilder


@contextlib.contextmanager
def interpreter_load_hook(on_load: Callable[[object, object], None]) -> Iterator[bool]:
    """Under the interpreter, call ``on_load(ptrs, mask)`` before every ``tl.load`` of the block
    (``ptrs.data``/``mask.data``: NumPy arrays of addresses and lanes). Yields True when hooked,
    False where it cannot be (no interpreter, or the internal changed: :func:`problems` says how)."""
    InterpreterBuilder = _builder("InterpreterBuilder.create_masked_load")
    if InterpreterBuilder is None:
        yield False
        return
    original = InterpreterBuilder.create_masked_load

    def create_masked_load(self, ptrs, mask, *args, **kwargs):
        on_load(ptrs, mask)
        return original(self, ptrs, mask, *args, **kwargs)

    create_masked_load._course_original = original
    InterpreterBuilder.create_masked_load = create_masked_load
    try:
        yield True
    finally:
        InterpreterBuilder.create_masked_load = original


@contextlib.contextmanager
def interpreter_programs_from(first: int, n_programs: int) -> Iterator[bool]:
    """Under the interpreter, a 1-D launch ``kernel[(k,)]`` of the block runs programs ``first`` to
    ``first + k - 1`` of a grid of ``n_programs`` (``tl.program_id(0)`` and ``tl.num_programs(0)`` say
    so): the last programs of a grid too long to interpret, with its offsets past 2**31. Yields True
    when in place, False where it cannot be (no interpreter, or the internal changed)."""
    InterpreterBuilder = _builder("InterpreterBuilder.set_grid_idx")
    if InterpreterBuilder is None:
        yield False
        return
    set_idx, set_dim = InterpreterBuilder.set_grid_idx, InterpreterBuilder.set_grid_dim

    def set_grid_idx(self, x, y, z):
        set_idx(self, x + first, y, z)

    def set_grid_dim(self, nx, ny, nz):
        set_dim(self, n_programs, ny, nz)

    set_grid_idx._course_original, set_grid_dim._course_original = set_idx, set_dim
    InterpreterBuilder.set_grid_idx, InterpreterBuilder.set_grid_dim = set_grid_idx, set_grid_dim
    try:
        yield True
    finally:
        InterpreterBuilder.set_grid_idx, InterpreterBuilder.set_grid_dim = set_idx, set_dim


def patch_interpreter_index() -> bool:
    """Let loops like ``for i in range(0, n, BLOCK)`` run under the interpreter with NumPy >= 2.4.

    Triton 3.6's interpreter turns a scalar into an index with ``int(array)``, which NumPy 2.4
    refuses for 1-element arrays of rank 1 ("only 0-dimensional arrays can be converted to Python
    scalars"). ``.item()`` accepts them; the patch changes nothing else. Returns True when the
    patch is (now or already) in place; False where it cannot apply (no Triton, or the internal
    changed: then :func:`problems` says how).
    """
    try:
        interpreter = importlib.import_module("triton.runtime.interpreter")
    except ImportError:  # pragma: no cover - no triton (macOS)
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, "_course_patched", False):
        return True
    if _check("interpreter._patch_lang_tensor"):
        return False

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._course_patched = True
    patched._course_original = original
    interpreter._patch_lang_tensor = patched
    return True
