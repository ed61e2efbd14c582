"""The FlashAttention tile schedule, as a stepper (chapter 7).

A grid of query tiles (rows) by key/value tiles (columns). One query tile at a time steps across
the key/value tiles it needs: the display shows which tiles are done, which one is in SRAM with the
query tile now, which a causal mask skips outright and which pay for a mask (the diagonal, the
ragged last tile), and the running max ``m`` and sum ``l`` of a few rows of the online softmax.

The logic lives in pure functions (:func:`schedule`, :func:`online_trace`, :func:`state`) that the
tests drive; :class:`TileSchedule` only draws them. Works on ipywidgets 7.7 and 8.x.
"""

from __future__ import annotations

import html
import math

import numpy as np

from .. import traffic

SKIPPED, FULL, MASKED = "skipped", "full", "masked"
COLORS = {"done": "#b7e1cd", "current": "#f6b26b", "todo": "#ffffff", SKIPPED: "#d9d9d9"}


def _positive(name, value):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def schedule(seq_len: int, block_m: int, block_n: int, causal: bool) -> list[list[str]]:
    """``kinds[i][j]`` for query tile i and key/value tile j: 'full', 'masked' or 'skipped'.

    'masked' tiles hold a key past the end of the sequence (the ragged last tile) or, when causal,
    a key after some query of the tile (the diagonal); 'skipped' tiles lie wholly above the
    diagonal and are never loaded.
    """
    n, bm, bn = _positive("seq_len", seq_len), _positive("block_m", block_m), _positive("block_n", block_n)
    kinds = []
    for i in range(math.ceil(n / bm)):
        q_lo, q_hi = i * bm, min(n, (i + 1) * bm) - 1  # first and last real query of the tile
        row = []
        for j in range(math.ceil(n / bn)):
            k_lo, k_hi = j * bn, (j + 1) * bn - 1
            if causal and k_lo > q_hi:
                row.append(SKIPPED)
            elif k_hi >= n or (causal and k_hi > q_lo):
                row.append(MASKED)
            else:
                row.append(FULL)
        kinds.append(row)
    return kinds


def scores(seq_len: int, seed: int = 0, spread: float = 3.0) -> np.ndarray:
    """A reproducible N x N matrix of attention scores to trace (float64)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((seq_len, seq_len)) * spread


def online_trace(row: np.ndarray, block_n: int, query: int | None = None) -> list[tuple[float, float]]:
    """(running max m, running sum l) of one row of scores after each key/value tile.

    ``query`` (the row's position) applies the causal mask: keys after it do not count. A tile in
    which every key is masked leaves (m, l) unchanged. The last entry equals the row's true max and
    sum(exp(s - max)) over the keys it may see.
    """
    bn = _positive("block_n", block_n)
    row = np.asarray(row, dtype=np.float64)
    m, l_sum = -math.inf, 0.0
    out = []
    for start in range(0, row.shape[0], bn):
        s = row[start:start + bn]
        if query is not None:
            s = s[: max(0, query - start + 1)]
        if s.size:
            m_new = max(m, float(s.max()))
            l_sum = l_sum * math.exp(m - m_new) + float(np.exp(s - m_new).sum())
            m = m_new
        out.append((m, l_sum))
    return out


def state(seq_len: int, block_m: int, block_n: int, causal: bool, query_tile: int, step: int,
          rows: int = 3, seed: int = 0) -> dict:
    """What the display shows when query tile ``query_tile`` has processed ``step`` K/V tiles.

    ``step`` counts visited tiles (0 = only the query tile loaded); it is clipped to the tiles
    this query tile visits. Returns the grid kinds, the visited order, the tile in SRAM, the
    running (m, l) of the first ``rows`` rows, and the K/V rows loaded by the whole kernel
    (``traffic.flash_kv_rows``) against a full N x N pass.
    """
    kinds = schedule(seq_len, block_m, block_n, causal)
    n_q = len(kinds)
    if not (isinstance(query_tile, int) and 0 <= query_tile < n_q):
        raise ValueError(f"query_tile must be in [0, {n_q}), got {query_tile!r}")
    visit = [j for j, kind in enumerate(kinds[query_tile]) if kind != SKIPPED]
    step = max(0, min(int(step), len(visit)))
    current = visit[step - 1] if step > 0 else None
    s = scores(seq_len, seed)
    tracked = []
    for r in range(query_tile * block_m, min(seq_len, query_tile * block_m + rows)):
        trace = online_trace(s[r], block_n, r if causal else None)
        m, l_sum = trace[current] if current is not None else (-math.inf, 0.0)
        tracked.append({"row": r, "m": m, "l": l_sum, "final_m": trace[-1][0], "final_l": trace[-1][1]})
    skipped = sum(k == SKIPPED for row in kinds for k in row)
    masked = sum(k == MASKED for row in kinds for k in row)
    return {"kinds": kinds, "visit": visit, "step": step, "current": current, "done": visit[:max(step - 1, 0)],
            "in_sram": {"q_tile": query_tile, "kv_tile": current}, "rows": tracked,
            "tiles_total": n_q * len(kinds[0]), "tiles_skipped": skipped, "tiles_masked": masked,
            "kv_rows_loaded": traffic.flash_kv_rows(seq_len, block_m, causal),
            "kv_rows_full": n_q * seq_len}


def _fmt(x: float) -> str:
    return "-inf" if x == -math.inf else f"{x:.3f}"


def render(st: dict) -> str:
    """HTML for a :func:`state`: the tile grid and the table of running statistics."""
    kinds, q_tile = st["kinds"], st["in_sram"]["q_tile"]
    cells = []
    for i, row in enumerate(kinds):
        tds = []
        for j, kind in enumerate(row):
            if kind == SKIPPED:
                color, label = COLORS[SKIPPED], "skip"
            elif i == q_tile and j == st["current"]:
                color, label = COLORS["current"], "SRAM"
            elif i == q_tile and j in st["done"]:
                color, label = COLORS["done"], "done"
            else:
                color, label = COLORS["todo"], ""
            border = "2px dashed #cc0000" if kind == MASKED else "1px solid #999"
            tds.append(f'<td title="Q{i} x KV{j}: {kind}" style="background:{color};border:{border};'
                       f'width:34px;height:22px;text-align:center;font-size:10px">{label}</td>')
        q_style = "font-weight:bold;background:#f6b26b" if i == q_tile else ""
        cells.append(f'<tr><th style="font-size:10px;{q_style}">Q{i}</th>{"".join(tds)}</tr>')
    head = "".join(f'<th style="font-size:10px">KV{j}</th>' for j in range(len(kinds[0])))
    grid = f'<table style="border-collapse:collapse"><tr><th></th>{head}</tr>{"".join(cells)}</table>'
    where = (f"K/V tile {st['current']} and query tile {q_tile} are in SRAM" if st["current"] is not None
             else f"query tile {q_tile} is loaded; no K/V tile yet")
    stats = "".join(f"<tr><td>{r['row']}</td><td>{_fmt(r['m'])}</td><td>{_fmt(r['l'])}</td>"
                    f"<td>{_fmt(r['final_m'])}</td><td>{_fmt(r['final_l'])}</td></tr>" for r in st["rows"])
    table = ("<table><tr><th>row</th><th>running max m</th><th>running sum l</th><th>final m</th>"
             f"<th>final l</th></tr>{stats}</table>")
    summary = (f"step {st['step']} of {len(st['visit'])}: {where}. Tiles: {st['tiles_total']} in the grid, "
               f"{st['tiles_skipped']} skipped by the causal mask, {st['tiles_masked']} masked (dashed). "
               f"K/V rows loaded by the whole kernel: {st['kv_rows_loaded']} of {st['kv_rows_full']} "
               "without skipping.")
    return f"<div>{html.escape(summary)}</div>{grid}<div style='margin-top:6px'>{table}</div>"


class TileSchedule:
    """Slider-and-play view of :func:`state`. ``.controls`` for tests, ``.widget`` to display."""

    def __init__(self, seq_len: int = 40, block_m: int = 8, block_n: int = 8, causal: bool = True,
                 rows: int = 3, seed: int = 0):
        import ipywidgets as w

        self.seq_len, self.rows, self.seed = _positive("seq_len", seq_len), rows, seed
        self.controls = {
            "block_m": w.Dropdown(options=[4, 8, 16], value=block_m, description="BLOCK_M"),
            "block_n": w.Dropdown(options=[4, 8, 16], value=block_n, description="BLOCK_N"),
            "causal": w.ToggleButtons(options=[("causal", True), ("full", False)], value=causal,
                                      description="mask"),
            "query_tile": w.IntSlider(value=0, min=0, max=0, description="query tile"),
            "step": w.IntSlider(value=0, min=0, max=0, description="step"),
        }
        self.play = w.Play(value=0, min=0, max=0, interval=700, description="play")
        w.jslink((self.play, "value"), (self.controls["step"], "value"))
        self.output = w.HTML()
        for c in self.controls.values():
            c.observe(self._update, names="value")
        self._update()
        c = self.controls
        self.widget = w.VBox([w.HBox([c["block_m"], c["block_n"], c["causal"]]),
                              w.HBox([c["query_tile"], self.play, c["step"]]), self.output])

    def _update(self, *_):
        c = self.controls
        n_q = math.ceil(self.seq_len / c["block_m"].value)
        c["query_tile"].max = n_q - 1
        kinds = schedule(self.seq_len, c["block_m"].value, c["block_n"].value, c["causal"].value)
        n_visit = sum(k != SKIPPED for k in kinds[c["query_tile"].value])
        c["step"].max = n_visit
        self.play.max = n_visit
        self.output.value = self.render()

    def state(self) -> dict:
        c = self.controls
        return state(self.seq_len, c["block_m"].value, c["block_n"].value, c["causal"].value,
                     c["query_tile"].value, c["step"].value, self.rows, self.seed)

    def render(self) -> str:
        return render(self.state())

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
