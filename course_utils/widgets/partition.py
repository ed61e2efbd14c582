"""How a 1-D launch cuts a tensor into program instances (chapter 3).

Drag ``BLOCK_SIZE`` and the tensor length: the tensor is drawn as a strip of cells, one colour per
``pid``; the lanes of the last tile that lie past the end are drawn hatched (``mask`` is False
there, so they neither load nor store). Below the strip: the grid, ``triton.cdiv(n, BLOCK_SIZE)``,
how many lanes are live and masked, and how many waves the programs make on a GPU with a given
number of SMs if each SM ran one program at a time.

The numbers come from pure functions (:func:`partition`, :func:`summary`) that the tests check;
:class:`PartitionWidget` only draws them. Works on ipywidgets 7.7 and 8.x.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from .. import hardware

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac"]
MASKED_STYLE = "background:repeating-linear-gradient(45deg,#ddd,#ddd 3px,#fff 3px,#fff 6px)"
BLOCK_SIZES = [2**k for k in range(2, 13)]          # 4 ... 4096
MAX_CELLS = 256                                     # cells drawn; beyond it one cell stands for many elements
GPU_OPTIONS = [(f"{s.name} ({s.sms} SMs)", key) for key, s in hardware.SPECS.items()]


def _count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class Tile:
    """One program instance: elements [start, stop) are live, ``masked`` lanes run past the end."""

    pid: int
    start: int
    stop: int
    masked: int

    @property
    def live(self) -> int:
        return self.stop - self.start


def n_programs(n_elements: int, block_size: int) -> int:
    """The launch grid of a 1-D elementwise kernel: ceil(n / BLOCK_SIZE) (``triton.cdiv``)."""
    n = _count("n_elements", n_elements, 0)
    b = _count("BLOCK_SIZE", block_size, 1)
    return -(-n // b)


def partition(n_elements: int, block_size: int) -> list[Tile]:
    """The tiles program instances 0, 1, ... own: pid owns [pid * BLOCK_SIZE, (pid + 1) * BLOCK_SIZE)."""
    n = _count("n_elements", n_elements, 0)
    tiles = []
    for pid in range(n_programs(n, block_size)):
        start = pid * block_size
        stop = min(n, start + block_size)
        tiles.append(Tile(pid, start, stop, block_size - (stop - start)))
    return tiles


def summary(n_elements: int, block_size: int, sms: int = 132) -> dict:
    """The numbers the widget prints under the strip."""
    _count("sms", sms, 1)
    grid = n_programs(n_elements, block_size)
    last = partition(n_elements, block_size)[-1] if grid else None
    return {"n_elements": n_elements, "BLOCK_SIZE": block_size, "grid": grid,
            "lanes": grid * block_size, "masked_lanes": last.masked if last else 0,
            "last_live": last.live if last else 0, "full_tiles": n_elements // block_size,
            "sms": sms, "waves": -(-grid // sms)}


def render(n_elements: int, block_size: int, sms: int = 132, max_cells: int = MAX_CELLS) -> str:
    """HTML: the strip of cells (colour = pid, hatched = masked lanes) and the summary line."""
    s = summary(n_elements, block_size, sms)
    lanes = s["lanes"]
    per_cell = max(1, -(-lanes // max_cells))        # elements (lanes) one cell stands for
    cells = []
    for c in range(-(-lanes // per_cell)):
        lo = c * per_cell
        pid = lo // block_size
        color = PALETTE[pid % len(PALETTE)]
        if lo >= n_elements:
            style = MASKED_STYLE + f";outline:1px solid {color}"
            title = f"pid {pid}: lanes past the end (mask is False)"
        else:
            style = f"background:{color}"
            title = f"pid {pid}: elements {lo}..{min(n_elements, lo + per_cell) - 1}"
        edge = "border-left:2px solid #000;" if lo % block_size == 0 else ""
        cells.append(f'<span title="{html.escape(title)}" style="display:inline-block;width:9px;height:18px;'
                     f'{edge}{style}"></span>')
    scale = (f"one cell = {per_cell} elements" if per_cell > 1 else "one cell = one element")
    last = ("" if not s["masked_lanes"] else
            f"; the last program (pid {s['grid'] - 1}) has {s['last_live']} live lanes and "
            f"{s['masked_lanes']} masked lanes (hatched)")
    text = (f"n = {n_elements:,}, BLOCK_SIZE = {block_size}: grid = cdiv({n_elements:,}, {block_size}) = "
            f"{s['grid']:,} program instances, {s['full_tiles']:,} full tiles{last}. On {sms} SMs, one program "
            f"per SM at a time, that is {s['waves']:,} wave(s). ({scale}; a black edge starts a new pid.)")
    return (f'<div style="line-height:0;max-width:{10 * 64}px">{"".join(cells)}</div>'
            f'<div style="font-family:monospace;font-size:12px;margin-top:6px">{html.escape(text)}</div>')


class PartitionWidget:
    """Sliders for the tensor length and BLOCK_SIZE, a dropdown for the GPU (its SM count)."""

    def __init__(self, n_elements: int = 1000, block_size: int = 128, gpu: str = "h100-sxm", max_n: int = 5000):
        import ipywidgets as w

        block_size = block_size if block_size in BLOCK_SIZES else 128
        self.controls = {
            "n_elements": w.IntSlider(value=min(max(1, n_elements), max_n), min=1, max=max_n,
                                      description="n"),
            "BLOCK_SIZE": w.Dropdown(options=BLOCK_SIZES, value=block_size, description="BLOCK_SIZE"),
            "gpu": w.Dropdown(options=GPU_OPTIONS, value=gpu if gpu in hardware.SPECS else "h100-sxm",
                              description="GPU"),
        }
        self.output = w.HTML()
        for c in self.controls.values():
            c.observe(self._refresh, names="value")
        self.widget = w.VBox([w.HBox(list(self.controls.values())), self.output])
        self._refresh()

    def state(self) -> dict:
        c = self.controls
        return summary(c["n_elements"].value, c["BLOCK_SIZE"].value, hardware.SPECS[c["gpu"].value].sms)

    def render(self) -> str:
        c = self.controls
        return render(c["n_elements"].value, c["BLOCK_SIZE"].value, hardware.SPECS[c["gpu"].value].sms)

    def _refresh(self, *_):
        self.output.value = self.render()

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
