"""Bytes across links (chapter 13): what each rank sends and receives in a collective, and the
alpha-beta time model fitted to measured points. Pure Python.

``nbytes`` is the tensor each rank holds (the all-reduce's input, the reduce-scatter's input, the
all-gather's output); ``world`` the number of ranks. Per rank:

- ring all-reduce: a reduce-scatter then an all-gather around the ring, ``2 (W-1)`` steps, each
  moving ``nbytes / W``: sends and receives ``2 (W-1)/W * nbytes``.
- one-shot all-reduce: one barrier, then every rank reads every peer's whole buffer: receives
  ``(W-1) * nbytes``, and its own buffer is read by W-1 peers (sends as much). One step.
- two-shot all-reduce: each rank reads its 1/W shard from every peer and sums it (a reduce-scatter),
  then reads the other summed shards (an all-gather): ``2 (W-1)/W * nbytes``, two steps.
- ring reduce-scatter and ring all-gather: ``(W-1)/W * nbytes``, ``W-1`` steps.

Time model: ``steps * alpha + max(sent, received) / beta`` (alpha the latency of one step, beta the
link bandwidth of one GPU in each direction). One-shot moves ``W/2`` times the ring's bytes in one
step instead of ``2 (W-1)``: it wins while latency dominates, the ring wins on large messages.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_REDUCES = ("ring", "one-shot", "two-shot")


@dataclass(frozen=True)
class LinkTraffic:
    """Bytes one rank sends and receives in one collective, and its number of dependent steps."""

    collective: str
    world: int
    nbytes: float
    sent: float
    received: float
    steps: int

    @property
    def link_bytes(self) -> float:
        """The bytes the busier direction of the rank's links carries."""
        return max(self.sent, self.received)


def _check(nbytes, world) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")


def all_reduce(nbytes: float, world: int, algorithm: str = "ring") -> LinkTraffic:
    """Per-rank traffic of an all-reduce of ``nbytes`` per rank by ``algorithm`` (see the module doc)."""
    _check(nbytes, world)
    w = world
    if algorithm == "ring":
        moved, steps = 2 * (w - 1) / w * nbytes, 2 * (w - 1)
    elif algorithm == "one-shot":
        moved, steps = (w - 1) * nbytes, 1 if w > 1 else 0
    elif algorithm == "two-shot":
        moved, steps = 2 * (w - 1) / w * nbytes, 2 if w > 1 else 0
    else:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; expected one of {ALL_REDUCES}")
    return LinkTraffic(f"all-reduce ({algorithm})", w, nbytes, moved, moved, steps)


def reduce_scatter(nbytes: float, world: int) -> LinkTraffic:
    """Ring reduce-scatter of ``nbytes`` per rank (each rank ends with its summed 1/W shard)."""
    _check(nbytes, world)
    moved = (world - 1) / world * nbytes
    return LinkTraffic("reduce-scatter (ring)", world, nbytes, moved, moved, world - 1)


def all_gather(nbytes: float, world: int) -> LinkTraffic:
    """Ring all-gather into ``nbytes`` per rank (each rank contributes 1/W of it)."""
    _check(nbytes, world)
    moved = (world - 1) / world * nbytes
    return LinkTraffic("all-gather (ring)", world, nbytes, moved, moved, world - 1)


def bus_bandwidth(nbytes: float, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce, bytes/s: ``nbytes / t * 2 (W-1)/W`` (the ring's link
    bytes per second, comparable across world sizes)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return nbytes / seconds * 2 * (world - 1) / world


@dataclass(frozen=True)
class AlphaBeta:
    """``alpha_us`` per dependent step plus ``bytes / beta`` (``beta_gbs`` in GB/s, one direction)."""

    alpha_us: float
    beta_gbs: float

    def time_us(self, traffic: LinkTraffic) -> float:
        return traffic.steps * self.alpha_us + traffic.link_bytes / (self.beta_gbs * 1e3)


def fit_alpha_beta(points, world: int, algorithm: str = "ring") -> AlphaBeta:
    """Least-squares ``time_us = steps * alpha + link_bytes / beta`` over measured ``(nbytes, time_us)``
    all-reduces of ``algorithm`` on ``world`` ranks (at least two sizes)."""
    pts = [(all_reduce(n, world, algorithm), t) for n, t in points]
    if len({tr.link_bytes for tr, _ in pts}) < 2:
        raise ValueError("fit_alpha_beta needs at least two different message sizes")
    xs, ys = [tr.link_bytes for tr, _ in pts], [t for _, t in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if slope <= 0:
        raise ValueError("the measured times do not grow with size: no bandwidth to fit")
    return AlphaBeta(alpha_us=max(intercept, 0.0) / max(pts[0][0].steps, 1), beta_gbs=1e-3 / slope)


def best_all_reduce(nbytes: float, world: int, model: AlphaBeta) -> tuple[str, dict]:
    """The fastest all-reduce algorithm under ``model``, and every algorithm's time in us."""
    times = {a: model.time_us(all_reduce(nbytes, world, a)) for a in ALL_REDUCES}
    return min(times, key=times.get), times


def epilogue_saving_us(nbytes: float, hbm_gbs: float, launch_us: float) -> float:
    """What fusing residual + norm into the all-reduce saves per call: the sum's trip through HBM (written
    by the all-reduce, read back by the norm: ``2 * nbytes``) and one launch."""
    if hbm_gbs <= 0:
        raise ValueError(f"hbm_gbs must be > 0, got {hbm_gbs}")
    return 2 * nbytes / (hbm_gbs * 1e3) + launch_us
