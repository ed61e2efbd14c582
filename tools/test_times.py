"""What a test run spent, by test file: the lines ``COURSE_TEST_TIMES=<file> pytest ...`` writes
(``tests/conftest.py``), summed per file and per test, slowest first, with the wall time that ``workers``
perfectly balanced workers would need (the sum over the workers, or the slowest test if that is longer).

    python tools/test_times.py <file> [--workers 16] [--top 25]
"""

from __future__ import annotations

import argparse
from collections import defaultdict


def _lines(path: str):
    """(seconds, phase, node id, outcome) of each line ``seconds<TAB>phase<TAB>node id[<TAB>outcome]``
    (older files have no outcome: "?"); any other line is skipped."""
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) not in (3, 4):
                continue
            try:
                seconds = float(parts[0])
            except ValueError:
                continue
            yield seconds, parts[1], parts[2], parts[3] if len(parts) == 4 else "?"


def read(path: str) -> dict[str, float]:
    """node id -> seconds (its phases summed)."""
    tests: dict[str, float] = defaultdict(float)
    for seconds, _, node, _ in _lines(path):
        tests[node] += seconds
    return dict(tests)


def failed(path: str) -> list[str]:
    """The node ids with a phase whose outcome is "failed" (an error in setup or teardown counts), in order."""
    return list(dict.fromkeys(node for _, _, node, outcome in _lines(path) if outcome == "failed"))


def by_file(tests: dict[str, float]) -> dict[str, tuple[float, int]]:
    """test file -> (seconds, tests)."""
    files: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for node, s in tests.items():
        f = files[node.split("::", 1)[0]]
        f[0] += s
        f[1] += 1
    return {k: (v[0], v[1]) for k, v in files.items()}


def balanced_wall(tests: dict[str, float], workers: int) -> float:
    """The least wall time ``workers`` workers could take: the total over them, or the longest test."""
    return max(sum(tests.values()) / workers, max(tests.values(), default=0.0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    tests = read(a.file)
    total = sum(tests.values())
    print(f"{len(tests)} tests, {total:.0f} s in all; {a.workers} balanced workers: at least "
          f"{balanced_wall(tests, a.workers):.0f} s of wall time")
    print(f"\n{'seconds':>8} {'share':>6} {'tests':>6}  file")
    for name, (s, n) in sorted(by_file(tests).items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"{s:8.0f} {s / total:6.1%} {n:6d}  {name}")
    print(f"\n{'seconds':>8}  test")
    for node, s in sorted(tests.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"{s:8.1f}  {node}")
    bad = failed(a.file)
    if bad:
        print(f"\nfailed ({len(bad)}):")
        print("\n".join(f"  {node}" for node in bad))


if __name__ == "__main__":
    main()
