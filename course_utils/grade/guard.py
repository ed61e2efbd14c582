"""The run-time layer of the integrity check: the course's code as imported, verified by every check.

:func:`arm` runs in a cell the grader puts before the student's first cell. It records every
function (with its code object), class and constant of the loaded ``course_utils`` modules,
``builtins``, torch's public functions and ``torch.Tensor``'s methods, ``sys.modules`` entries and
IPython's input transformers and exception handlers. Each check cell then calls the returned
:class:`Guard`: :meth:`Guard.bind` re-binds the names the check uses to the recorded objects, and
:meth:`Guard.verify`, before and after the check, raises :class:`IntegrityError` naming whatever
changed. (The static layer is :mod:`course_utils.integrity`; the course's files on disk are kept
out of reach by :mod:`.checkout` and :mod:`.jail`.)
"""

from __future__ import annotations

import builtins
import importlib
import pkgutil
import sys

from ..state import RuntimeCache

COURSE = "course_utils"


class IntegrityError(AssertionError):
    """A check cell found the course's code changed since grading started."""


def _record(obj):
    """What must not change in a module attribute: its identity, and a function's code."""
    target = obj
    if not hasattr(obj, "__code__") and hasattr(getattr(obj, "fn", None), "__code__"):
        target = obj.fn  # a @triton.jit kernel: its Python function
    return (obj, getattr(target, "__code__", None), getattr(target, "__defaults__", None),
            getattr(target, "__kwdefaults__", None))


def _rewrapped(module: str, now, was) -> bool:
    """torch wraps some of its own functions when a submodule loads (torch._dynamo: manual_seed)."""
    while not module.startswith(COURSE) and hasattr(now, "__wrapped__"):
        now = now.__wrapped__
        if now is was:
            return True
    return False


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _watched(name: str, value) -> bool:
    if callable(value) or isinstance(value, (type(sys), RuntimeCache)):
        return True
    if isinstance(value, dict) and name.startswith("_"):
        # a private dict is a cache the launchers fill on a GPU (_BEST, _DEVICE_INFO): not a constant
        return False
    return name.isupper() and "CACHE" not in name and isinstance(value, (int, float, str, tuple, dict, frozenset))


_IPYTHON_OWN = {"input", "exit", "quit", "get_ipython", "display", "_", "__", "___", "__IPYTHON__", "help", "copyright",
                "credits", "license", "runfile", "__debug__"}


def _tensor_methods() -> dict:
    t = sys.modules["torch"].Tensor
    out = {}
    for k in dir(t):
        if not k.startswith("__") or k in ("__getitem__", "__setitem__", "__eq__", "__sub__", "__add__"):
            v = getattr(t, k, None)
            if callable(v):
                out[k] = _record(v)
    return out


class Guard:
    """The state recorded by :func:`arm`; calling :meth:`verify` raises if any of it changed."""

    def __init__(self, import_source: str = ""):
        self.skipped: list[str] = []  # a checker module that does not import: its own check says why
        for m in pkgutil.iter_modules(importlib.import_module(f"{COURSE}.checkers").__path__):
            try:
                importlib.import_module(f"{COURSE}.checkers.{m.name}")
            except Exception as e:  # noqa: BLE001
                self.skipped.append(f"{m.name}: {type(e).__name__}")
        self.names: dict = {}
        exec(compile(import_source, "<course imports>", "exec"), self.names)  # the solution's own imports
        self.modules = {n: m for n, m in sys.modules.items() if n == COURSE or n.startswith(COURSE + ".")}
        for lib in ("torch", "torch.nn.functional", "triton", "builtins"):
            if lib in sys.modules:
                self.modules[lib] = sys.modules[lib]
        self.attrs = {n: self._attrs(n, m) for n, m in self.modules.items() if not n.startswith("triton")}
        self.attrs["torch.Tensor"] = _tensor_methods() if "torch" in sys.modules else {}
        self.hooks = self._hooks()

    @staticmethod
    def _attrs(name, module):
        out = {}
        for k, v in list(vars(module).items()):
            if name == "builtins" and k in _IPYTHON_OWN:
                continue
            if name.startswith(COURSE) or name == "builtins" or callable(v):
                if _watched(k, v):
                    # a constant by its value; a RuntimeCache (course_utils.state) by its identity alone
                    constant = isinstance(v, (dict, tuple)) and not isinstance(v, RuntimeCache)
                    out[k] = (repr(v),) if constant else _record(v)
                if isinstance(v, type) and name.startswith(COURSE) and v.__module__ == name:
                    for ck, cv in vars(v).items():
                        if callable(cv):
                            out[f"{k}.{ck}"] = _record(cv)
        return out

    @staticmethod
    def _hooks():
        ip = getattr(builtins, "get_ipython", lambda: None)()
        if ip is None:
            return None
        return ([*ip.input_transformers_cleanup], [*ip.input_transformers_post], [*ip.ast_transformers],
                [*ip.custom_exceptions])

    def bind(self, names) -> None:
        """Re-bind, in the calling cell's namespace, the names a check cell uses to the recorded objects."""
        sys._getframe(1).f_globals.update({n: self.names[n] for n in names if n in self.names})

    def changes(self) -> list[str]:
        out = []
        for name, module in self.modules.items():
            if sys.modules.get(name) is not module:
                out.append(f"sys.modules[{name!r}] was replaced")
        for name, rec in self.attrs.items():
            if name == "torch.Tensor":  # its methods, inherited ones (TensorBase's) included
                space = {k: getattr(sys.modules["torch"].Tensor, k, _MISSING) for k in rec}
            else:
                space = vars(self.modules[name])
            for k, was in rec.items():
                head, _, tail = k.partition(".")
                now = space.get(head, _MISSING) if not tail else vars(space.get(head, object)).get(tail, _MISSING)
                if now is _MISSING:
                    out.append(f"{name}.{k} was deleted")
                elif (len(was) == 1 and repr(now) != was[0]) or (len(was) > 1 and not _same(_record(now), was)
                                                                  and not _rewrapped(name, now, was[0])):
                    out.append(f"{name}.{k} was replaced or its code swapped")
        now = self._hooks()
        if now is not None and not all(_same(tuple(a), tuple(b)) for a, b in zip(now, self.hooks)):
            out.append("IPython's input transformers or exception handlers were changed")
        return out

    def verify(self, where: str = "this check") -> None:
        bad = self.changes()
        if bad:
            raise IntegrityError(f"integrity: {where} cannot be trusted, the course's code was changed after "
                                 f"grading started: {'; '.join(bad[:5])}" + (" ..." if len(bad) > 5 else ""))


_MISSING = object()


def arm(import_source: str = "") -> Guard:
    """Record the course's code as imported (the grader calls this before any student cell runs)."""
    return Guard(import_source)
