"""Benchmarks of the course: one module per topic, run by ``make bench`` (``python -m benchmarks.run``).

A topic module defines ``TITLE``, ``sweep(quick=False) -> pandas.DataFrame`` and
``targets(df) -> list[course_utils.bench.Target]`` (see docs/AUTHORING.md); it may define
``plot(df) -> list[matplotlib.figure.Figure]`` to replace the runner's default plot. Modules
without ``sweep`` (``ncu_traffic``, which drives Nsight Compute) are scripts the runner skips.
"""
