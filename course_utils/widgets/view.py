"""What the fusion widgets share (chapter 2): the option lists, clamping, bars, and the :class:`_View`
plumbing (observe every control, re-render, ``update(**values)``)."""

from __future__ import annotations

import html

from .. import hardware
from .. import traffic as T

GPU_OPTIONS = [(spec.name, key) for key, spec in hardware.SPECS.items()]
DTYPE_OPTIONS = [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")]
SIZE_OPTIONS = [("1 MB", 10**6), ("16 MB", 16 * 10**6), ("64 MB", 64 * 10**6), ("256 MB", 256 * 10**6),
                ("1 GB", 10**9)]
BAR_COLORS = {"unfused": "#e06666", "fused": "#6aa84f", "gemm": "#6d9eeb"}


def _clamp(value, lo: int, hi: int, default: int) -> int:
    try:
        return min(hi, max(lo, int(value)))
    except (TypeError, ValueError):
        return default


def _choice(value, options, default):
    values = [v for _, v in options] if options and isinstance(options[0], tuple) else list(options)
    return value if value in values else default


def dtype_for(gpu: str, dtype: str) -> str:
    """``dtype`` if the GPU's table has a peak for it, else float16 (a T4 has no bf16)."""
    spec = hardware.lookup(gpu)
    return dtype if T.dtype_name(dtype) in spec.tflops else "float16"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def _bar(label: str, nbytes: float, scale: float, color: str) -> str:
    width = max(0.5, 100.0 * nbytes / scale) if scale > 0 else 0.5
    return (f"<div style='display:flex;align-items:center;margin:2px 0;font-family:monospace;font-size:12px'>"
            f"<div style='width:150px'>{html.escape(label)}</div>"
            f"<div style='flex:1'><div style='width:{width:.2f}%;background:{color};color:#000;"
            f"white-space:nowrap;padding:1px 4px'>{_mb(nbytes)}</div></div></div>")


class _View:
    """Shared plumbing: observe every control, re-render into ``self.output``."""

    def _wire(self, layout):
        for c in self.controls.values():
            c.observe(self._refresh, names="value")
        self.widget = layout
        self._refresh()

    def _refresh(self, *_):
        self.output.value = self.render()

    def update(self, **values):
        """Set controls by name; numbers are clamped to the slider's range, unknown choices ignored."""
        for name, value in values.items():
            if name not in self.controls:
                raise ValueError(f"no control named {name!r}; controls are {sorted(self.controls)}")
            c = self.controls[name]
            if hasattr(c, "min") and hasattr(c, "max"):
                c.value = _clamp(value, c.min, c.max, c.value)
            else:
                c.value = _choice(value, list(c.options), c.value)
        return self

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
