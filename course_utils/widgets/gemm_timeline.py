"""Trailing vs fused epilogue, as two timelines side by side (chapter 9).

Top: the GEMM writes its product to HBM, then the epilogue's kernels each read it back and write it
again (with PyTorch's ``addmm``, the default, the bias rides in the GEMM and GELU is the one trailing
kernel). Bottom: one kernel applies the epilogue to the accumulator before its single
store. A cursor moves along both at the same time scale; each side adds up the HBM bytes moved so
far, kernel by kernel.

Times and bytes come from ``course_utils.traffic`` (``gemm_epilogue`` counts the bytes,
``estimate_time`` is the roofline time model, on an H100 SXM's datasheet ceilings or on the ceilings
measured on an H100 in ``results/h100-80gb-hbm3/ceilings.csv``); they are a model, not a measurement.
The trailing side is PyTorch's ``addmm`` + GELU by default (the bias inside cuBLASLt's GEMM, 2 kernels),
or one kernel per op (``eager``), or one fused elementwise kernel (``fused``). The logic is in pure
functions (:func:`timeline`, :func:`state`, :func:`render`) that the
tests drive; :class:`GemmTimeline` only draws them: a Play button linked to a slider, a shape and the
trailing mode. Works on ipywidgets 7.7 and 8.x.
"""

from __future__ import annotations

from .. import traffic

STEPS = 60
SHAPES = {  # label -> (M, N, K)
    "decode: M=16, K=4096, N=16384": (16, 16384, 4096),
    "decode: M=1, K=4096, N=16384": (1, 16384, 4096),
    "MLP: M=4096, K=4096, N=16384": (4096, 16384, 4096),
    "square: 8192 x 8192 x 8192": (8192, 8192, 8192),
}
COLORS = {"gemm": "#6d9eeb", "gemm + bias": "#6d9eeb", "add bias": "#f6b26b", "gelu": "#93c47d"}
MODES = {"addmm": "the bias in cuBLASLt's GEMM, then a GELU kernel", "eager": "one kernel per op",
         "fused": "one fused elementwise kernel"}
CEILINGS = {"datasheet": "h100-sxm", "measured": "measured"}   # control label -> timeline's gpu
MEASURED = "h100-80gb-hbm3"   # results/<slug>/ceilings.csv


def machine(gpu):
    """The time model's ceilings: a hardware-table key, or ``"measured"`` (the recorded H100 copy and
    matmul rates, with no launch cost: device time only)."""
    if gpu != "measured":
        return gpu
    from .. import bench
    measured = bench.Ceilings.from_frame(bench.recorded("ceilings", gpu=MEASURED))
    return traffic.machine_from_ceilings(measured, launch_us=0.0)


def _segments(tr: traffic.Traffic, gpu, dtype: str) -> list[dict]:
    """One dict per kernel: name, start/end (us) and HBM bytes, from the time model run on the
    first 1, 2, ... kernels (so a kernel's L2 reuse of its predecessor's output is counted). Device
    time only: the host's launch cost is left out, as when the kernels are replayed in a CUDA graph."""
    out, t0, b0 = [], 0.0, 0.0
    for i, kern in enumerate(tr.kernels):
        est = traffic.estimate_time(traffic.Traffic(tr.label, tr.kernels[: i + 1]), gpu, dtype,
                                    launch_us=0.0)
        out.append({"name": kern.name, "start_us": t0, "end_us": est.us, "bytes_start": b0,
                    "bytes_end": est.hbm_bytes})
        t0, b0 = est.us, est.hbm_bytes
    return out


def timeline(m: int, n: int, k: int, dtype: str = "bfloat16", gpu: str = "h100-sxm",
             trailing: str = "addmm") -> dict:
    """Both timelines of ``gelu(x @ w + b)`` for an (m, k) x (k, n) product: ``trailing`` (one of
    :data:`MODES`) and ``fused`` (the epilogue inside the GEMM). ``gpu``: a hardware-table key or
    ``"measured"``."""
    comp = traffic.gemm_epilogue(m, n, k, dtype=dtype, trailing=trailing)
    mach = machine(gpu)
    name = gpu if isinstance(mach, str) else \
        f"{mach.gpu}, copy {mach.copy_gbps:.0f} GB/s, matmul {mach.matmul_tflops:.0f} TFLOP/s"
    return {"shape": (m, n, k), "dtype": dtype, "gpu": name, "trailing_mode": trailing,
            "trailing": _segments(comp.unfused, mach, dtype), "fused": _segments(comp.fused, mach, dtype)}


def _side(segments: list[dict], t_us: float) -> dict:
    done = [s for s in segments if s["end_us"] <= t_us]
    running = next((s for s in segments if s["start_us"] <= t_us < s["end_us"]), None)
    moved = done[-1]["bytes_end"] if done else 0.0
    if running is not None:
        frac = (t_us - running["start_us"]) / (running["end_us"] - running["start_us"])
        moved = running["bytes_start"] + frac * (running["bytes_end"] - running["bytes_start"])
    return {"kernels_done": len(done), "running": None if running is None else running["name"],
            "bytes": moved, "total_bytes": segments[-1]["bytes_end"], "end_us": segments[-1]["end_us"],
            "finished": len(done) == len(segments)}


def state(tl: dict, step: int, steps: int = STEPS) -> dict:
    """Both sides after ``step`` of ``steps`` (0: nothing has run; ``steps``: the slower side ends)."""
    step = max(0, min(int(step), steps))
    t_end = max(tl["trailing"][-1]["end_us"], tl["fused"][-1]["end_us"])
    t_us = t_end * step / steps
    tr, fu = _side(tl["trailing"], t_us), _side(tl["fused"], t_us)
    return {"step": step, "t_us": t_us, "t_end_us": t_end, "trailing": tr, "fused": fu,
            "speedup": tr["end_us"] / fu["end_us"], "bytes_saved": tr["total_bytes"] - fu["total_bytes"]}


def _bar(segments: list[dict], t_end: float, t_us: float) -> str:
    cells = []
    for s in segments:
        width = 100.0 * (s["end_us"] - s["start_us"]) / t_end
        color = COLORS.get(s["name"], "#b4a7d6") if s["start_us"] <= t_us else "#eeeeee"
        cells.append(f"<div title='{s['name']}: {s['end_us'] - s['start_us']:.1f} us' style='position:absolute;"
                     f"left:{100.0 * s['start_us'] / t_end:.3f}%;width:{width:.3f}%;height:100%;background:{color};"
                     f"border-right:1px solid #fff;overflow:hidden;font-size:10px;white-space:nowrap'>"
                     f"{s['name']}</div>")
    cursor = (f"<div style='position:absolute;left:{100.0 * t_us / t_end:.3f}%;top:0;height:100%;"
              "border-left:2px solid #c00'></div>")
    frame = "position:relative;height:22px;background:#fafafa;border:1px solid #999"
    return f"<div style='{frame}'>{''.join(cells)}{cursor}</div>"


def _line(label: str, side: dict, n_kernels: int) -> str:
    now = f"running {side['running']}" if side["running"] else ("finished" if side["finished"] else "not started")
    return (f"{label}: {n_kernels} kernel(s), {side['kernels_done']} done, {now}; HBM "
            f"{traffic.format_bytes(side['bytes'])} of {traffic.format_bytes(side['total_bytes'])}, "
            f"ends at {side['end_us']:.1f} us")


def render(tl: dict, st: dict) -> str:
    """HTML for a :func:`state`: two bars on one time scale, the bytes so far, the verdict."""
    m, n, k = tl["shape"]
    t_end, t_us = st["t_end_us"], st["t_us"]
    mode = MODES[tl["trailing_mode"]]
    rows = [f"<p>gelu(x @ w + b), M={m}, N={n}, K={k}, {tl['dtype']}; time model of {tl['gpu']} "
            f"(traffic.estimate_time, device time). t = {t_us:.1f} us</p>",
            f"<p>{_line(f'Trailing epilogue ({mode})', st['trailing'], len(tl['trailing']))}</p>",
            _bar(tl["trailing"], t_end, t_us),
            f"<p>{_line('Fused epilogue', st['fused'], len(tl['fused']))}</p>",
            _bar(tl["fused"], t_end, t_us),
            f"<p>Fusion saves {traffic.format_bytes(st['bytes_saved'])} of HBM traffic: the model's speedup is "
            f"{st['speedup']:.2f}x.</p>"]
    return "<div style='font-family:monospace;font-size:12px'>" + "".join(rows) + "</div>"


class GemmTimeline:
    """Play + slider over time, a shape and the trailing mode; ``render()`` returns the HTML shown."""

    def __init__(self, shape: str = next(iter(SHAPES)), dtype: str = "bfloat16", gpu: str = "h100-sxm"):
        import ipywidgets as w

        if shape not in SHAPES:
            raise ValueError(f"shape must be one of {list(SHAPES)}, got {shape!r}")
        self.dtype, self.gpu = dtype, gpu
        self.step = w.IntSlider(value=0, min=0, max=STEPS, step=1, description="time")
        self.play = w.Play(value=0, min=0, max=STEPS, step=1, interval=150, description="play")
        w.jslink((self.play, "value"), (self.step, "value"))
        self.shape = w.Dropdown(options=list(SHAPES), value=shape, description="shape")
        self.mode = w.ToggleButtons(options=list(MODES), value="addmm", description="trailing")
        self.ceilings = w.ToggleButtons(options=list(CEILINGS), value="datasheet", description="ceilings")
        self.view = w.HTML()
        self.controls = [self.step, self.play, self.shape, self.mode, self.ceilings]
        self.step.observe(self._update, names="value")
        for c in (self.shape, self.mode, self.ceilings):
            c.observe(self._new_timeline, names="value")
        self.widget = w.VBox([w.HBox([self.play, self.step]), w.HBox([self.shape, self.mode]), self.ceilings,
                              self.view])
        self._new_timeline()

    def timeline(self) -> dict:
        return self._tl

    def state(self) -> dict:
        return state(self._tl, self.step.value)

    def render(self) -> str:
        return render(self._tl, self.state())

    def _new_timeline(self, change=None):
        m, n, k = SHAPES[self.shape.value]
        gpu = self.gpu if self.ceilings.value == "datasheet" else CEILINGS[self.ceilings.value]
        self._tl = timeline(m, n, k, self.dtype, gpu, self.mode.value)
        self._update()

    def _update(self, change=None):
        self.view.value = self.render()

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
