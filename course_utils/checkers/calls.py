"""What a student's Python function calls, seen while it runs: the answer key refused by behaviour.

A name check (:func:`course_utils.check.refuse_answer_key`) reads the student's code for the course's
answers; a function that reaches one through ``importlib.import_module(...)`` and ``getattr`` hides it
from that reading. :func:`run_watched` runs the student's function under a profile hook
(``sys.setprofile``, standard Python) and records every call of a watched function's code, whatever
name or route reached it, with the arguments it got. The modelling checks of chapters 9 and 10 refuse
a call of their answer key this way, as exercise 8.1's check refuses the course's harness by what runs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from torch.overrides import TorchFunctionMode


@dataclass
class Calls:
    """The watched functions' calls: (description, the call's arguments by name), in order."""
    seen: list[tuple[str, dict]] = field(default_factory=list)

    def first(self, description: str) -> dict | None:
        return next((args for d, args in self.seen if d == description), None)


def _code(obj):
    obj = getattr(obj, "fn", obj)                 # a @triton.jit kernel: the Python function it wraps
    obj = getattr(obj, "__wrapped__", obj)        # functools.wraps
    return getattr(obj, "__code__", None)


def run_watched(fn, args: tuple, watched: dict[str, object]) -> tuple[object, Calls]:
    """``(fn(*args), calls)``: the result, and every call made while it ran of a function in ``watched``
    (``{description: function}``), with its arguments."""
    codes = {c: d for d, f in watched.items() if (c := _code(f)) is not None}
    calls = Calls()

    def hook(frame, event, _arg):
        if event == "call" and frame.f_code in codes:
            n = frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount
            names = frame.f_code.co_varnames[:n]
            calls.seen.append((codes[frame.f_code], {k: frame.f_locals.get(k) for k in names}))

    return run_with_hook(fn, args, hook), calls


def run_with_hook(fn, args: tuple, hook):
    """``fn(*args)`` with ``hook`` as the profile function while it runs (the previous one put back after)."""
    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        return fn(*args)
    finally:
        sys.setprofile(previous)


def refuse_calls(what: str, calls: Calls) -> None:
    """Raise :class:`course_utils.check.CheckFailure` if the student's function called an answer key."""
    from .. import check

    if calls.seen:
        names = ", ".join(dict.fromkeys(d for d, _ in calls.seen))
        raise check.CheckFailure(f"{what}: while your function ran it called {names}: that is the answer the "
                                 "check compares with, whatever name reached it. Write the computation yourself.")


class FailedTorchCall(TorchFunctionMode):
    """While on, remembers the last torch call that raised: (function, args, kwargs, exception). Torch's own
    words for a shape error give two shapes, not which tensors; the operands do (the weight of which GEMM,
    the .grad of which parameter), so a check can name the student's slip. Only top-level calls are seen:
    torch turns the mode off inside the call it hands over."""

    def __init__(self):
        super().__init__()
        self.failed = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception as e:
            self.failed = (func, args, kwargs, e)
            raise

    def that_raised(self, error: BaseException | None):
        """(function, args, kwargs) of the torch call that raised ``error`` itself, or None (another error,
        one raised outside torch, or one torch raised and the code caught)."""
        if error is None or self.failed is None or self.failed[3] is not error:
            return None
        return self.failed[:3]
