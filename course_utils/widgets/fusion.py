"""What-if widgets of chapter 2 (fusion accounting): thin views over :mod:`course_utils.traffic`.

- :class:`ChainTraffic`: chain length on a fixed 64 MB bf16 tensor, HBM traffic unfused vs fused.
- :class:`PerOpBars`: chain length and tensor size, one bar per unfused kernel against the single
  fused total, with the exact MB written on the bars.
- :class:`FusionAccountant`: ops before and after a matmul (add, remove, move earlier; presets
  include softmax + matmul + bias): traffic with and without fusion, and the speedup ceiling.
- :class:`SpeedupCurve`: speedup vs chain length, the traffic-only ceiling against the time model
  with launch overhead and L2 reuse.

Each class has ``.controls`` (a dict of plain ipywidgets), ``.widget`` (what a notebook displays),
a pure ``state()`` (the numbers, straight from traffic.py) and ``render()`` (the HTML shown), so
tests drive them headlessly; ``update(**values)`` clamps out-of-range values instead of raising.
Only IntSlider, Dropdown, ToggleButtons, HBox/VBox, HTML and Output are used: ipywidgets 7.7 and 8.x.
"""

from __future__ import annotations

import html

from .. import hardware
from .. import traffic as T
from .view import (  # noqa: F401  (the option lists and dtype_for are part of this module's interface)
    BAR_COLORS,
    DTYPE_OPTIONS,
    GPU_OPTIONS,
    SIZE_OPTIONS,
    _bar,
    _choice,
    _clamp,
    _mb,
    _View,
    dtype_for,
)


class ChainTraffic(_View):
    """HBM traffic of a chain of unary ops on a fixed 64 MB bf16 tensor, unfused vs fused."""

    TENSOR_BYTES = 64 * 10**6
    DTYPE = "bfloat16"

    def __init__(self, n_ops: int = 4, gpu: str = "h100-sxm", max_ops: int = 16):
        import ipywidgets as w

        self.controls = {
            "n_ops": w.IntSlider(value=_clamp(n_ops, 1, max_ops, 4), min=1, max=max_ops, description="ops"),
            "gpu": w.Dropdown(options=GPU_OPTIONS, value=_choice(gpu, GPU_OPTIONS, "h100-sxm"), description="GPU"),
        }
        self.output = w.HTML()
        self._wire(w.VBox([w.HBox(list(self.controls.values())), self.output]))

    def state(self) -> dict:
        n_ops, gpu = self.controls["n_ops"].value, self.controls["gpu"].value
        c = T.elementwise_chain(n_ops, self.TENSOR_BYTES // T.dtype_bytes(self.DTYPE), self.DTYPE)
        bw = hardware.lookup(gpu).hbm_gbps * 1e9
        return {"n_ops": n_ops, "gpu": gpu, "tensor_bytes": self.TENSOR_BYTES,
                "unfused_bytes": c.unfused.total_bytes, "fused_bytes": c.fused.total_bytes,
                "unfused_launches": c.unfused.launches, "fused_launches": c.fused.launches,
                "ratio": c.ratio, "unfused_us": c.unfused.total_bytes / bw * 1e6,
                "fused_us": c.fused.total_bytes / bw * 1e6, "hbm_gbps": bw / 1e9}

    def render(self) -> str:
        s = self.state()
        scale = s["unfused_bytes"]
        return ("<div style='font-family:monospace;font-size:13px'>"
                f"{s['n_ops']} elementwise op(s) on a 64 MB bf16 tensor, at {s['hbm_gbps']:,.0f} GB/s:"
                + _bar(f"unfused ({s['unfused_launches']} kernels)", s["unfused_bytes"], scale, BAR_COLORS["unfused"])
                + _bar("fused (1 kernel)", s["fused_bytes"], scale, BAR_COLORS["fused"])
                + f"<div>traffic ratio {s['ratio']:.1f}x; memory time {s['unfused_us']:,.1f} us vs "
                  f"{s['fused_us']:,.1f} us (bytes / bandwidth only: no launches, no L2)</div></div>")


class PerOpBars(_View):
    """One bar per unfused kernel (bytes read + written) against the one fused total."""

    def __init__(self, n_ops: int = 5, size: int = 64 * 10**6, dtype: str = "bfloat16", max_ops: int = 12):
        import ipywidgets as w

        self.controls = {
            "n_ops": w.IntSlider(value=_clamp(n_ops, 1, max_ops, 5), min=1, max=max_ops, description="ops"),
            "size": w.Dropdown(options=SIZE_OPTIONS, value=_choice(size, SIZE_OPTIONS, 64 * 10**6),
                               description="tensor"),
            "dtype": w.Dropdown(options=DTYPE_OPTIONS, value=_choice(dtype, DTYPE_OPTIONS, "bfloat16"),
                                description="dtype"),
        }
        self.output = w.HTML()
        self._wire(w.VBox([w.HBox(list(self.controls.values())), self.output]))

    def state(self) -> dict:
        n_ops, size, dtype = (self.controls[k].value for k in ("n_ops", "size", "dtype"))
        c = T.elementwise_chain(n_ops, size // T.dtype_bytes(dtype), dtype)
        return {"n_ops": n_ops, "tensor_bytes": size, "dtype": dtype,
                "op_bytes": [k.total_bytes for k in c.unfused.kernels],
                "unfused_bytes": c.unfused.total_bytes, "fused_bytes": c.fused.total_bytes, "ratio": c.ratio}

    def render(self) -> str:
        s = self.state()
        scale = max(s["op_bytes"] + [s["fused_bytes"]])
        bars = "".join(_bar(f"op {i + 1}: read+write", b, scale, BAR_COLORS["unfused"])
                       for i, b in enumerate(s["op_bytes"]))
        return ("<div style='font-family:monospace;font-size:13px'>" + bars
                + _bar("fused: all ops", s["fused_bytes"], scale, BAR_COLORS["fused"])
                + f"<div>unfused total {_mb(s['unfused_bytes'])} in {s['n_ops']} kernels; fused "
                  f"{_mb(s['fused_bytes'])} in 1 kernel ({s['ratio']:.1f}x less)</div></div>")


# The accountant's menu: label -> (side of the matmul, op). 'before' ops act on A, 'after' ops on C.
ACCOUNTANT_OPS: dict[str, tuple[str, T.Op]] = {
    "before: softmax (rows of A)": ("before", T.Op("softmax", (), 5)),
    "before: scale": ("before", T.Op("scale", ("scalar",))),
    "before: add bias": ("before", T.Op("add bias", ("col",))),
    "after: add bias": ("after", T.Op("add bias", ("col",))),
    "after: GELU": ("after", T.Op("gelu", (), 9)),
    "after: ReLU": ("after", T.Op("relu")),
    "after: dropout (mask generated)": ("after", T.Op("dropout", (), 2)),
    "after: residual add": ("after", T.Op("residual add", ("full",))),
    "after: scale": ("after", T.Op("scale", ("scalar",))),
}
PRESETS: dict[str, list[str]] = {
    "softmax + matmul + bias": ["before: softmax (rows of A)", "after: add bias"],
    "matmul + bias + GELU + dropout": ["after: add bias", "after: GELU", "after: dropout (mask generated)"],
    "matmul + bias + residual": ["after: add bias", "after: residual add"],
    "matmul only": [],
}
_ADD, _REMOVE, _MOVE, _PRESET = "add op...", "remove op...", "move op earlier...", "preset..."


class FusionAccountant(_View):
    """Ops before and after ``A @ B``: traffic and time with and without fusion."""

    def __init__(self, preset: str = "softmax + matmul + bias", m_log2: int = 12, n_log2: int = 12,
                 k_log2: int = 12, dtype: str = "bfloat16", gpu: str = "h100-sxm"):
        import ipywidgets as w

        self.ops: list[str] = list(PRESETS.get(preset, []))
        self.controls = {
            "m_log2": w.IntSlider(value=_clamp(m_log2, 0, 16, 12), min=0, max=16, description="log2 m"),
            "n_log2": w.IntSlider(value=_clamp(n_log2, 4, 16, 12), min=4, max=16, description="log2 n"),
            "k_log2": w.IntSlider(value=_clamp(k_log2, 4, 16, 12), min=4, max=16, description="log2 k"),
            "dtype": w.Dropdown(options=DTYPE_OPTIONS, value=_choice(dtype, DTYPE_OPTIONS, "bfloat16"),
                                description="dtype"),
            "gpu": w.Dropdown(options=GPU_OPTIONS, value=_choice(gpu, GPU_OPTIONS, "h100-sxm"), description="GPU"),
        }
        self.menus = {
            "preset": w.Dropdown(options=[_PRESET, *PRESETS], value=_PRESET, description="preset"),
            "add": w.Dropdown(options=[_ADD, *ACCOUNTANT_OPS], value=_ADD, description="add"),
            "remove": w.Dropdown(options=[_REMOVE], value=_REMOVE, description="remove"),
            "move": w.Dropdown(options=[_MOVE], value=_MOVE, description="move"),
        }
        for name, menu in self.menus.items():
            menu.observe(lambda change, name=name: self._menu(name, change["new"]), names="value")
        self.output = w.HTML()
        c = self.controls
        self._wire(w.VBox([w.HBox([c["m_log2"], c["n_log2"], c["k_log2"]]), w.HBox([c["dtype"], c["gpu"]]),
                           w.HBox(list(self.menus.values())), self.output]))

    # -- editing the op list (pure list operations; invalid requests are ignored) --
    def add(self, label: str):
        if label in ACCOUNTANT_OPS:
            self.ops.append(label)
        return self._changed()

    def remove(self, index: int):
        if isinstance(index, int) and 0 <= index < len(self.ops):
            self.ops.pop(index)
        return self._changed()

    def move_earlier(self, index: int):
        if isinstance(index, int) and 0 < index < len(self.ops):
            self.ops[index - 1], self.ops[index] = self.ops[index], self.ops[index - 1]
        return self._changed()

    def preset(self, name: str):
        if name in PRESETS:
            self.ops = list(PRESETS[name])
        return self._changed()

    def _menu(self, name: str, value):
        if value in (_ADD, _REMOVE, _MOVE, _PRESET):
            return
        if name == "add":
            self.add(value)
        elif name == "preset":
            self.preset(value)
        elif name in ("remove", "move"):
            index = int(str(value).split(":", 1)[0]) - 1
            self.remove(index) if name == "remove" else self.move_earlier(index)
        self.menus[name].value = self.menus[name].options[0]  # back to the prompt

    def _changed(self):
        labels = [f"{i + 1}: {op}" for i, op in enumerate(self.ops)]
        if hasattr(self, "menus"):
            self.menus["remove"].options = [_REMOVE, *labels]
            self.menus["move"].options = [_MOVE, *labels[1:]]
        if hasattr(self, "widget"):
            self._refresh()
        return self

    def comparison(self) -> T.Comparison:
        c = self.controls
        m, n, k = (2 ** c[key].value for key in ("m_log2", "n_log2", "k_log2"))
        before = [ACCOUNTANT_OPS[o][1] for o in self.ops if ACCOUNTANT_OPS[o][0] == "before"]
        after = [ACCOUNTANT_OPS[o][1] for o in self.ops if ACCOUNTANT_OPS[o][0] == "after"]
        return T.matmul_chain(before, after, m, n, k, c["dtype"].value)

    def state(self) -> dict:
        c = self.controls
        comp = self.comparison()
        gpu = c["gpu"].value
        s = T.speedup(comp, gpu, dtype_for(gpu, c["dtype"].value))
        return {"ops": list(self.ops), "m": 2 ** c["m_log2"].value, "n": 2 ** c["n_log2"].value,
                "k": 2 ** c["k_log2"].value, "gpu": gpu,
                "unfused_bytes": comp.unfused.total_bytes, "fused_bytes": comp.fused.total_bytes,
                "unfused_launches": comp.unfused.launches, "kernels": [kk.name for kk in comp.unfused.kernels],
                "traffic_ratio": s["traffic_ratio"], "unfused_us": s["unfused_us"], "fused_us": s["fused_us"],
                "estimated_speedup": s["estimated_speedup"]}

    def render(self) -> str:
        s = self.state()
        ops = " -> ".join(html.escape(o.split(": ", 1)[1]) for o in s["ops"] if o.startswith("before")) or "-"
        post = " -> ".join(html.escape(o.split(": ", 1)[1]) for o in s["ops"] if o.startswith("after")) or "-"
        scale = s["unfused_bytes"]
        return ("<div style='font-family:monospace;font-size:13px'>"
                f"<div>A ({s['m']} x {s['k']}) : {ops} | matmul with B ({s['k']} x {s['n']}) | {post}</div>"
                + _bar(f"unfused ({s['unfused_launches']} kernels)", s["unfused_bytes"], scale, BAR_COLORS["unfused"])
                + _bar("fused (1 kernel)", s["fused_bytes"], scale, BAR_COLORS["fused"])
                + f"<div>traffic ratio (speedup ceiling if memory-bound): {s['traffic_ratio']:.2f}x</div>"
                  f"<div>time model on {html.escape(hardware.lookup(s['gpu']).name)}: {s['unfused_us']:,.1f} us "
                  f"unfused vs {s['fused_us']:,.1f} us fused: {s['estimated_speedup']:.2f}x</div></div>")


class SpeedupCurve(_View):
    """Speedup of fusing a chain of k unary ops, k = 1..max: traffic ceiling vs time model."""

    def __init__(self, size: int = 16 * 10**6, gpu: str = "h100-sxm", overlap: bool = False, max_ops: int = 16):
        import ipywidgets as w

        self.max_ops = max_ops
        self.controls = {
            "size": w.Dropdown(options=[("64 KB", 64 * 10**3), *SIZE_OPTIONS],
                               value=_choice(size, [("", 64 * 10**3), *SIZE_OPTIONS], 16 * 10**6),
                               description="tensor"),
            "gpu": w.Dropdown(options=GPU_OPTIONS, value=_choice(gpu, GPU_OPTIONS, "h100-sxm"), description="GPU"),
            "overlap": w.ToggleButtons(options=[("launches add up", False), ("launches overlap", True)],
                                       value=bool(overlap), description="model"),
        }
        self.output = w.HTML()
        self.plot = w.Output()
        self._wire(w.VBox([w.HBox(list(self.controls.values())), self.output, self.plot]))

    def state(self) -> dict:
        size, gpu, overlap = (self.controls[k].value for k in ("size", "gpu", "overlap"))
        dtype = dtype_for(gpu, "bfloat16")
        ks = list(range(1, self.max_ops + 1))
        rows = [T.speedup(T.elementwise_chain(k, size // T.dtype_bytes(dtype), dtype), gpu, dtype,
                          overlap_launches=overlap) for k in ks]
        return {"n_ops": ks, "ceiling": [r["traffic_ratio"] for r in rows],
                "estimate": [r["estimated_speedup"] for r in rows], "gpu": gpu, "tensor_bytes": size,
                "dtype": dtype, "overlap": overlap}

    def render(self) -> str:
        s = self.state()
        k = s["n_ops"][-1]
        return (f"<div style='font-family:monospace;font-size:13px'>{k} ops on {_mb(s['tensor_bytes'])} "
                f"({s['dtype']}), {html.escape(hardware.lookup(s['gpu']).name)}: traffic ceiling "
                f"{s['ceiling'][-1]:.1f}x, time model {s['estimate'][-1]:.2f}x</div>")

    def figure(self):
        import matplotlib.pyplot as plt

        s = self.state()
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(s["n_ops"], s["ceiling"], "o-", label="traffic ratio (ceiling)")
        ax.plot(s["n_ops"], s["estimate"], "s-", label="time model (launches, L2 reuse)")
        ax.set_xlabel("ops in the chain")
        ax.set_ylabel("speedup of the fused kernel")
        ax.set_title(f"{_mb(s['tensor_bytes'])} {s['dtype']}, {hardware.lookup(s['gpu']).name} (model)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        return fig

    def _refresh(self, *_):
        super()._refresh()
        import matplotlib.pyplot as plt

        self.plot.clear_output(wait=True)
        fig = self.figure()
        if _in_kernel():
            from IPython.display import display
            with self.plot:
                display(fig)
        plt.close(fig)


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
        return get_ipython() is not None and hasattr(get_ipython(), "kernel")
    except ImportError:
        return False
