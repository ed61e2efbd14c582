"""The GPU check scripts' verdict log: each check runs, whatever the ones before it did, and the table at
the end says which passed (a script stops at nothing but prints every failure's traceback)."""

from __future__ import annotations

import time
import traceback

RESULTS: list[tuple[str, str, str]] = []


def record(name: str, fn, detail_chars: int = 200) -> None:
    """Run ``fn()`` (its return value, if any, is the verdict's detail) and log PASS or FAIL with its time."""
    start = time.perf_counter()
    try:
        detail = fn() or ""
        status = "PASS"
    except Exception as e:  # noqa: BLE001  (every check runs; the table says which failed)
        traceback.print_exc()
        status, detail = "FAIL", f"{type(e).__name__}: {str(e)[:detail_chars]}"
    RESULTS.append((name, status, f"{detail} ({time.perf_counter() - start:.1f} s)"))
