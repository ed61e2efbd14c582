"""The answer-key rule of chapters 3-7's kernel exercises: the course's own kernels, launchers,
references and ``@triton.jit`` helpers may not be handed in as the answer, nor called from the
student's code, nor from the Triton kernels the student's code launches.

:func:`course_answers` lists them for a few course modules (``{description: object}``);
:func:`refuse` applies :func:`course_utils.check.refuse_answer_key` to the answer itself and to the
Python source of every Triton kernel it reaches (a launcher's kernel, a kernel's helpers), which
``refuse_answer_key`` alone does not open. A launch of a course kernel is caught at run time by
:func:`course_utils.check.check_kernel_launches`; this catches what runs inside the student's own
kernel (``gelu_math``, the course's tile helpers) and a course kernel handed to a check that launches
what it is given.
"""

from __future__ import annotations

import importlib
import inspect

from .. import check


def _jit_source(obj):
    """The Python function behind a Triton kernel (``@triton.jit``, compiled or interpreted), else None."""
    fn = getattr(obj, "fn", None)
    return fn if inspect.isfunction(fn) else None


def course_answers(*module_names: str, only: tuple[str, ...] = (),
                   skip: tuple[str, ...] = ("compile_cases",)) -> dict[str, object]:
    """``{"course_utils.<module>.<name>": object}`` for every function and Triton kernel defined in
    each module (``__getattr__`` forwards and re-exports of other modules left out), or for the
    names in ``only``."""
    found = {}
    for name in module_names:
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            fn = _jit_source(obj) or (obj if inspect.isfunction(obj) else None)
            if fn is None or fn.__module__ != module.__name__ or attr in skip or attr.startswith("__") \
                    or (only and attr not in only):
                continue
            found[f"{module.__name__}.{attr}"] = obj
    return found


def _student_kernels(answer, depth: int = 3) -> list:
    """The Python sources of the Triton kernels ``answer`` is or reaches through its own code."""
    found, seen, todo = [], set(), [(answer, depth)]
    while todo:
        obj, d = todo.pop()
        src = _jit_source(obj)
        if src is not None:
            obj = src
            if id(src) not in seen:
                found.append(src)
        if id(obj) in seen or d < 0 or not inspect.isfunction(obj):
            continue
        seen.add(id(obj))
        for _, ref in check._referenced(obj):
            inner = _jit_source(ref)
            if inner is not None and not inner.__module__.startswith("course_utils") and id(inner) not in seen:
                todo.append((ref, d - 1))
    return found


def refuse(what: str, answer, forbidden: dict[str, object]) -> None:
    """Raise :class:`course_utils.check.CheckFailure` if ``answer`` is, or its code or the code of a
    Triton kernel it launches or calls uses, one of the course's answers in ``forbidden``."""
    check.refuse_answer_key(what, answer, forbidden)
    for src in _student_kernels(answer):
        check.refuse_answer_key(what, src, forbidden)
