"""Module-level state that the course fills as it runs, marked as such.

A tile choice's times, an op's launch plans, what a device's torch refused: dicts kept at module level so
that every call after the first finds them. They are state, not constants, and the grader's integrity
check (:mod:`course_utils.grade.guard`) holds them to their identity, not to their contents: a check that
times tiles on a GPU fills them legitimately, while a cell that puts another dict in their place is caught.
"""

from __future__ import annotations


class RuntimeCache(dict):
    """A module-level dict the course fills as it runs (see the module's docstring)."""

    __slots__ = ()
