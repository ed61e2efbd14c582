"""Choosing a tile configuration by timing the candidates on the GPU in hand: the tuned shelves' one way.

Every candidate is first launched once untimed (its compile, and the idle GPU clocks that compiling
leaves behind, come before any timing); then each runs once per round, for ``CHOICE_ROUNDS`` rounds
(interleaved, so that a drift of the clocks during the choice reaches every candidate alike), and keeps
its fastest time; the fastest candidate is remembered per key (device, shape class, dtype...), so the
timing happens once per key. ``TIMES[key]`` keeps the times of that choice ({candidate: ms, or None
for one this GPU cannot fit}) so that a check can print why a candidate won.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from .. import env
from ..state import RuntimeCache

CHOICE_ROUNDS = 3  # close configurations are a few percent apart: the best of three timings each
TIMES: dict = RuntimeCache()   # key -> {candidate: best ms or None}, for every choice timed in this process


def out_of_resources(e: BaseException) -> bool:
    """A configuration this GPU cannot fit (registers, shared memory): skipped, not an error."""
    return "resource" in f"{type(e).__name__} {e}".lower()


def do_bench_median(fn: Callable[[], object], warmup: int = 5, rep: int = 20) -> float:
    """``triton.testing.do_bench``'s median in ms (it returns the mean unless asked; warmup and rep are
    milliseconds; it flushes L2 before each call)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def fastest(cands: Sequence, key: Hashable, launch: Callable, cache: dict,
            timer: Callable[[Callable[[], object]], float] = do_bench_median, rounds: int = CHOICE_ROUNDS):
    """The candidate ``c`` whose ``launch(c)`` is fastest, timed once per ``key`` (kept in ``cache``).

    Off a GPU, or with one candidate, the first candidate (nothing to time).
    """
    if len(cands) == 1 or not env.on_gpu():
        return cands[0]
    if key not in cache:
        times: dict = {}
        for c in cands:  # compile-only warm-up: no timing includes a compile or the clocks' ramp after it
            try:
                launch(c)
            except Exception as e:
                if not out_of_resources(e):
                    raise
                times[c] = None
        for _ in range(rounds):
            for c in cands:
                if c in times and times[c] is None:
                    continue
                try:
                    t = timer(lambda c=c: launch(c))
                except Exception as e:
                    if not out_of_resources(e):
                        raise
                    times[c] = None
                    continue
                times[c] = min(t, times.get(c) or t)
        TIMES[key] = dict(times)
        ok = {c: t for c, t in times.items() if t is not None}
        if not ok:
            raise RuntimeError(f"no candidate of {list(cands)} compiled on this GPU")
        cache[key] = min(ok, key=ok.get)
    return cache[key]
