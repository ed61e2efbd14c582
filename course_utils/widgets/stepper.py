"""The online-softmax stepper (chapter 6).

One row of scores, cut into tiles, is walked tile by tile. After each tile the display shows the
running max ``m``, the running sum ``s`` (of ``exp(x - m)`` over everything seen so far), the
correction factor ``exp(m_old - m_new)`` that rescaled the old sum, and the partial result
``exp(x - m) / s`` of the elements seen so far; after the last tile the partial result is the exact
softmax of the row.

The logic is in pure functions (:func:`row`, :func:`trace`, :func:`state`) that the tests drive;
:class:`OnlineSoftmaxStepper` only draws them, with a slider and a Play button linked together.
Works on ipywidgets 7.7 and 8.x.
"""

from __future__ import annotations

import math

import numpy as np


def _positive(name, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def row(n: int, seed: int = 0, spread: float = 3.0, rising: bool = True) -> np.ndarray:
    """A reproducible row of ``n`` scores (float64). ``rising`` adds a slope, so the max keeps
    growing from tile to tile and the correction factor has work to do."""
    n = _positive("n", n)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * spread
    if rising:
        x = x + np.linspace(0.0, 2.0 * spread, n)
    return x


def trace(x, block: int) -> list[dict]:
    """The online recurrence over the tiles of ``x``, one dict per tile.

    Each dict holds the tile's bounds, the tile's own max, ``m_old``/``m_new``, the correction
    ``exp(m_old - m_new)`` (0 for the first finite tile: nothing to rescale), ``s_old``/``s_new``.
    A tile of only -inf leaves (m, s) unchanged.
    """
    block = _positive("block", block)
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"x must be a non-empty 1-D row, got shape {x.shape}")
    m, s = -math.inf, 0.0
    steps = []
    for start in range(0, x.size, block):
        tile = x[start:start + block]
        tile_max = float(tile.max())
        m_new = max(m, tile_max)
        if m_new == -math.inf:
            correction, s_new = 1.0, 0.0
        else:
            correction = math.exp(m - m_new)  # exp(-inf) = 0 on the first finite tile
            s_new = s * correction + float(np.exp(tile - m_new).sum())
        steps.append({"start": start, "stop": start + tile.size, "tile_max": tile_max, "m_old": m,
                      "m_new": m_new, "correction": correction, "s_old": s, "s_new": s_new})
        m, s = m_new, s_new
    return steps


def state(x, block: int, step: int) -> dict:
    """What the display shows after ``step`` tiles (0 = nothing read yet; clipped to the tiles).

    ``partial`` is exp(x - m) / s over the elements seen so far (NaN for the unseen ones);
    ``exact`` is the softmax of the whole row; ``done`` says the partial result is complete, and
    ``max_abs_error`` compares it with ``exact`` on the elements seen.
    """
    x = np.asarray(x, dtype=np.float64)
    steps = trace(x, block)
    step = max(0, min(int(step), len(steps)))
    exact = np.exp(x - x.max())
    exact = exact / exact.sum()
    partial = np.full(x.size, np.nan)
    if step:
        cur = steps[step - 1]
        seen = cur["stop"]
        m, s = cur["m_new"], cur["s_new"]
        partial[:seen] = np.exp(x[:seen] - m) / s if s > 0 else np.nan
        last = cur
    else:
        seen, m, s, last = 0, -math.inf, 0.0, None
    err = float(np.nanmax(np.abs(partial[:seen] - exact[:seen]))) if seen and s > 0 else math.nan
    return {"n_tiles": len(steps), "step": step, "seen": seen, "m": m, "s": s, "last": last,
            "partial": partial, "exact": exact, "done": step == len(steps),
            "max_abs_error": err}


def _fmt(v: float) -> str:
    if v == -math.inf:
        return "-inf"
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    return f"{v:.4g}"


def render(x, block: int, st: dict) -> str:
    """HTML for a :func:`state`: the row as cells coloured by tile, then the statistics."""
    x = np.asarray(x, dtype=np.float64)
    cells = []
    for i, v in enumerate(x):
        tile = i // block
        if i < st["seen"] - (st["last"]["stop"] - st["last"]["start"] if st["last"] else 0):
            color = "#b7e1cd"   # read in an earlier tile
        elif i < st["seen"]:
            color = "#f6b26b"   # the tile just read
        else:
            color = "#ffffff"
        p = st["partial"][i]
        cells.append(f'<td title="x[{i}] = {v:.3f}, tile {tile}" style="background:{color};border:1px solid #999;'
                     f'font-size:10px;text-align:center;padding:1px 3px">{v:.1f}<br>'
                     f'<span style="color:#555">{"" if np.isnan(p) else f"{p:.3f}"}</span></td>')
    grid = f'<table style="border-collapse:collapse"><tr>{"".join(cells)}</tr></table>'
    last = st["last"]
    if last is None:
        what = "Nothing read yet: m = -inf, s = 0."
    else:
        what = (f"Tile {st['step']} of {st['n_tiles']} (x[{last['start']}:{last['stop']}]), tile max "
                f"{_fmt(last['tile_max'])}: m {_fmt(last['m_old'])} &rarr; {_fmt(last['m_new'])}, correction "
                f"exp(m_old &minus; m_new) = {_fmt(last['correction'])}, s = {_fmt(last['s_old'])} &times; "
                f"{_fmt(last['correction'])} + sum(exp(tile &minus; m_new)) = {_fmt(last['s_new'])}.")
    if st["done"]:
        verdict = (f"All tiles read: exp(x &minus; m) / s equals the exact softmax "
                   f"(largest difference {st['max_abs_error']:.1e}).")
    elif st["step"]:
        verdict = ("Partial result (second line of each cell) uses the statistics so far: it is not the "
                   "softmax yet, because later tiles can still raise m and s.")
    else:
        verdict = ""
    return f"<div style='font-family:monospace'>{grid}<p>{what}</p><p>{verdict}</p></div>"


class OnlineSoftmaxStepper:
    """Slider + Play over the tiles of one row; ``render()`` returns the HTML shown."""

    def __init__(self, n: int = 24, block: int = 4, seed: int = 0, x=None):
        import ipywidgets as w

        self.x = row(n, seed) if x is None else np.asarray(x, dtype=np.float64)
        self.block = _positive("block", block)
        n_tiles = len(trace(self.x, self.block))
        self.step = w.IntSlider(value=0, min=0, max=n_tiles, step=1, description="tiles read")
        self.play = w.Play(value=0, min=0, max=n_tiles, step=1, interval=900, description="play")
        w.jslink((self.play, "value"), (self.step, "value"))
        options = sorted({b for b in (2, 3, 4, 6, 8, 12) if b < self.x.size} | {self.block})
        self.block_size = w.Dropdown(options=options, value=self.block, description="BLOCK")
        self.view = w.HTML()
        self.controls = [self.step, self.play, self.block_size]
        self.step.observe(self._update, names="value")
        self.block_size.observe(self._new_block, names="value")
        self.widget = w.VBox([w.HBox([self.play, self.step, self.block_size]), self.view])
        self._update()

    def state(self) -> dict:
        return state(self.x, self.block, self.step.value)

    def render(self) -> str:
        return render(self.x, self.block, self.state())

    def _new_block(self, change=None):
        self.block = int(self.block_size.value)
        n_tiles = len(trace(self.x, self.block))
        self.step.value = 0
        self.step.max = n_tiles
        self.play.max = n_tiles
        self._update()

    def _update(self, change=None):
        self.view.value = self.render()

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
