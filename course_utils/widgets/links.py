"""What-if widget of chapter 13 (fusion across GPUs): a thin view over :mod:`course_utils.traffic.links`.

:class:`AllReduceChooser`: message size, world size, link bandwidth and per-step latency; the alpha-beta
time of ring, one-shot and two-shot all-reduce, which one wins, and what fusing the residual add and
the norm into the all-reduce saves (the sum's round trip through HBM and one launch, at the chosen
GPU's HBM bandwidth and the course's recorded launch overhead).

Like the other widgets: ``.controls`` (plain ipywidgets), ``.widget``, a pure ``state()`` and
``render()``, ``update(**values)`` clamps. Only IntSlider, Dropdown, HBox/VBox and HTML: ipywidgets
7.7 and 8.x.
"""

from __future__ import annotations

import html

from .. import hardware
from .. import traffic as T
from ..traffic import links
from .view import GPU_OPTIONS, _choice, _clamp, _View

COLORS = {"ring": "#6d9eeb", "one-shot": "#6aa84f", "two-shot": "#f6b26b"}


def _size_label(log2_kib: int) -> str:
    kib = 2**log2_kib
    return f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"


def _time_bar(label: str, us: float, scale: float, color: str) -> str:
    width = max(0.5, 100.0 * us / scale) if scale > 0 else 0.5
    return (f"<div style='display:flex;align-items:center;margin:2px 0;font-family:monospace;font-size:12px'>"
            f"<div style='width:150px'>{html.escape(label)}</div>"
            f"<div style='flex:1'><div style='width:{width:.2f}%;background:{color};color:#000;"
            f"white-space:nowrap;padding:1px 4px'>{us:,.1f} us</div></div></div>")


class AllReduceChooser(_View):
    """Which all-reduce wins at a message size, and what fusing the epilogue saves."""

    def __init__(self, log2_kib: int = 14, world: int = 4, bandwidth_gbs: int = 300, latency_us: int = 5,
                 gpu: str = "h100-sxm"):
        import ipywidgets as w

        self.controls = {
            "log2_kib": w.IntSlider(value=_clamp(log2_kib, 0, 20, 14), min=0, max=20,
                                    description="size 2^k KiB"),
            "world": w.IntSlider(value=_clamp(world, 2, 8, 4), min=2, max=8, description="GPUs"),
            "bandwidth_gbs": w.IntSlider(value=_clamp(bandwidth_gbs, 10, 900, 300), min=10, max=900, step=10,
                                         description="link GB/s"),
            "latency_us": w.IntSlider(value=_clamp(latency_us, 1, 50, 5), min=1, max=50, description="step us"),
            "gpu": w.Dropdown(options=GPU_OPTIONS, value=_choice(gpu, GPU_OPTIONS, "h100-sxm"), description="HBM of"),
        }
        self.output = w.HTML()
        self._wire(w.VBox([w.HBox([self.controls[k] for k in ("log2_kib", "world")]),
                           w.HBox([self.controls[k] for k in ("bandwidth_gbs", "latency_us", "gpu")]), self.output]))

    def state(self) -> dict:
        c = {k: v.value for k, v in self.controls.items()}
        nbytes = 2**c["log2_kib"] * 1024
        model = links.AlphaBeta(alpha_us=float(c["latency_us"]), beta_gbs=float(c["bandwidth_gbs"]))
        best, times = links.best_all_reduce(nbytes, c["world"], model)
        hbm = hardware.lookup(c["gpu"]).hbm_gbps
        saving = links.epilogue_saving_us(nbytes, hbm, T.LAUNCH_OVERHEAD_US)
        return {**c, "nbytes": nbytes, "times_us": times, "best": best, "hbm_gbs": hbm, "epilogue_saving_us": saving,
                "bytes": {a: links.all_reduce(nbytes, c["world"], a).link_bytes for a in links.ALL_REDUCES}}

    def render(self) -> str:
        s = self.state()
        scale = max(s["times_us"].values())
        bars = "".join(_time_bar(f"{a} ({s['bytes'][a] / 2**20:,.2f} MiB)", t, scale, COLORS[a])
                       for a, t in s["times_us"].items())
        return ("<div style='font-family:monospace;font-size:13px'>"
                f"all-reduce of {_size_label(s['log2_kib'])} per rank on {s['world']} GPUs, "
                f"{s['latency_us']} us per step + bytes / {s['bandwidth_gbs']} GB/s:" + bars
                + f"<div><b>{s['best']}</b> wins. Fusing residual + norm into it saves "
                  f"{s['epilogue_saving_us']:,.1f} us per call (2 x {_size_label(s['log2_kib'])} through HBM at "
                  f"{s['hbm_gbs']:,.0f} GB/s + one launch of {T.LAUNCH_OVERHEAD_US:,.1f} us)</div></div>")
