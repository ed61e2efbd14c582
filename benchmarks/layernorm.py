"""LayerNorm, RMSNorm and softmax backward (chapter 10): ours against PyTorch, torch.compile and Liger.

Every case of the sweep is M x N with M chosen so that x is 1 GiB (``SWEEP_BYTES``), N in NS, in fp32 and
bf16 (the tuning, atomics and parts runs: 256 MiB). GB/s count the
minimum traffic: forward reads x and writes y (2MN elements); forward + backward adds reading x and
dy and writing dx (5MN in all); softmax backward reads y and dy and writes dx (3MN). The copy row is
a device-to-device copy of x (the ceiling). Liger-Kernel's rows are skipped, with a note, when the
``liger-kernel`` package is not installed. A torch.compile row whose function dynamo ran eagerly (a
fallback: recompile limit, graph break) is kept with ``fallback=True``; :func:`ratios` shows it as such
and :func:`targets` never judges a target on it. "ours (per-SM plan)" is the fwd+bwd with the tuned
backward's Liger-Kernel layout (``backward_design("per-sm")``), beside the default.

    python -m benchmarks.layernorm sweep  [--out DIR]   # what make bench runs: CSV + table + targets
    python -m benchmarks.layernorm tune   [--out DIR]   # tiles/warps/grids of our kernels, CSV + table
    python -m benchmarks.layernorm check                 # correctness on the GPU against float64
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

import course_utils as cu
from course_utils import bench
from course_utils.tuned import layernorm as T
from course_utils.tuned import layernorm_autograd as TA
from course_utils.tuned import softmax_backward as TSB

TITLE = "LayerNorm and RMSNorm, forward and backward; softmax backward"
INPUT_BYTES = 256 * 2**20   # the tuning runs' x
# The sweep's x. At 256 MiB a forward + backward took 0.35 to 1.1 ms, and a call from Python through autograd
# costs the host about 0.25 ms (the course's LayerNorm at a tiny shape, training_overhead.csv; Liger-Kernel's
# and torch.compile's are Python autograd Functions too), on the H200 of 2026-11-29 (16 cores): in slow spells
# the loop ran at the host's pace, and one row's 20th and 80th percentile times were up to 75% apart (ours: 69%;
# results/h200/layernorm_256mib_s18.csv). At 1 GiB the GPU's time is 4x longer and the host's the same.
SWEEP_BYTES = 2**30
NS = (1024, 2048, 4096, 8192, 16384)
DTYPES = (torch.float32, torch.bfloat16)
ROUNDS = 3          # interleaved rounds: every implementation once per round, the median round kept
EPS = 1e-5
MN_FACTOR = {"ln_fwd": 2, "rms_fwd": 2, "ln_fwd_bwd": 5, "rms_fwd_bwd": 5, "softmax_bwd": 3, "copy": 2}
NOTES: list[str] = []
EAGER_RUNS: Counter = Counter()  # calls of a torch.compile'd function that dynamo ran eagerly, per (kind, op)
FALLBACK_PREFIX = "not a torch.compile measurement"  # how the first recorded sweep marked its fallbacks


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rows_for(n_cols: int, dtype: torch.dtype, nbytes: int = INPUT_BYTES) -> int:
    return max(1, nbytes // (n_cols * dtype.itemsize))


def liger():
    """(LigerLayerNormFunction, LigerRMSNormFunction), or None with a note when not installed."""
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as e:  # noqa: BLE001 - a missing or broken peer is reported, not fatal
        note = f"Liger-Kernel rows skipped: liger_kernel does not import ({type(e).__name__}: {str(e)[:120]})"
        if note not in NOTES:
            NOTES.append(note)
            _log(note)
        return None
    return LigerLayerNormFunction, LigerRMSNormFunction


def _flag_eager(fn, key):
    """``fn`` that counts, in EAGER_RUNS[key], the calls dynamo did not compile: traced, the branch is
    dropped (torch.compiler.is_compiling() is True there); run eagerly, it counts."""
    def run(*args):
        out = fn(*args)
        if not torch.compiler.is_compiling():
            EAGER_RUNS[key] += 1
        return out
    return run


def _fwd_bwd(fn, inputs, dy):
    def run():
        y = fn(*inputs)
        return torch.autograd.grad(y, inputs, dy)  # returned, never accumulated into .grad
    return run


def implementations(op: str, x, w, b, dy, compiled: dict):
    """{impl: callable} for one op; ``compiled`` caches torch.compile'd functions per op."""
    from course_utils.kernels import layernorm as L
    lg = liger()
    if op == "softmax_bwd":
        y = torch.softmax(x.float(), -1).to(x.dtype)
        return {"ours": lambda: TSB.softmax_backward(y, dy),
                "torch": lambda: torch.ops.aten._softmax_backward_data(dy, y, -1, x.dtype)}
    rms = op.startswith("rms")
    # The torch functions read N from x: torch.compile'd once per op, they see every shape.
    if rms:
        ours, torch_fn = (lambda x, w: TA.rms_norm_autograd(x, w, EPS)), \
            (lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS))
        lig = None if lg is None else (lambda x, w: lg[1].apply(x, w, EPS, 0.0, "llama", False))
        args = (x, w)
    else:
        ours, torch_fn = (lambda x, w, b: TA.layer_norm_autograd(x, w, b, EPS)), \
            (lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS))
        lig = None if lg is None else (lambda x, w, b: lg[0].apply(x, w, b, EPS))
        args = (x, w, b)
    key = ("rms" if rms else "ln", op)
    if key not in compiled:  # one graph per shape and op, as a model of fixed shape gets
        compiled[key] = torch.compile(_flag_eager(torch_fn, key), dynamic=False)
    fns = {"ours": ours, "torch": torch_fn, "torch.compile": compiled[key]}
    if lig is not None:
        fns["liger"] = lig
    if op.endswith("fwd"):
        if not rms:  # the nine eager ops that traffic.layernorm counts (chapter 10, section 1)
            fns["eager (9 ops)"] = lambda x, w, b: L.layer_norm_ref(x, w, b, EPS)
        if rms:
            fns["ours"] = lambda x, w: T.rms_norm(x, w, EPS)
        else:
            fns["ours"] = lambda x, w, b: T.layer_norm(x, w, b, EPS)
        return {k: (lambda f=f: f(*[a.detach() for a in args])) for k, f in fns.items()}
    runs = {k: _fwd_bwd(f, args, dy) for k, f in fns.items()}
    runs["ours (per-SM plan)"] = _with_design(runs["ours"], "per-sm")
    return runs


def _with_design(run, design):
    def timed():
        with T.backward_design(design):
            return run()
    return timed


def _inputs(n, dtype, grad: bool, nbytes: int = INPUT_BYTES):
    m = rows_for(n, dtype, nbytes)
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
    b = (0.1 * torch.randn(n, device="cuda")).to(dtype)
    dy = torch.randn_like(x)
    if grad:
        for t in (x, w, b):
            t.requires_grad_(True)
    return m, x, w, b, dy


def sweep(quick: bool = False, partial: Path | None = None):
    """One row per (op, N, dtype, impl): the median of ROUNDS interleaved rounds (bench.time_rounds);
    an implementation that fails gets a row with its error instead of a time."""
    import pandas as pd

    reps = 10 if quick else 20
    ns = (1024, 4096, 16384) if quick else NS
    ops = ("ln_fwd", "ln_fwd_bwd", "rms_fwd", "rms_fwd_bwd", "softmax_bwd")
    compiled: dict = {}
    rows = []
    for dtype in DTYPES:
        for n in ns:
            # torch.compile's graphs are dropped between cases: dynamo stops compiling a function after
            # torch._dynamo.config.recompile_limit (8) shapes and silently runs it eagerly from then on.
            torch.compiler.reset()
            compiled.clear()
            EAGER_RUNS.clear()
            m, x, w, b, dy = _inputs(n, dtype, grad=True, nbytes=SWEEP_BYTES)
            out = torch.empty_like(x)
            impls = {("copy", "copy"): lambda: out.copy_(x.detach())}  # noqa: B023 (called at once)
            for op in ops:
                for impl, fn in implementations(op, x, w, b, dy, compiled).items():
                    impls[(op, impl)] = fn
            errors: dict = {}
            timings = bench.time_rounds(impls, ROUNDS, errors=errors, warmup=3, rep=reps)
            for k, e in errors.items():
                _log(f"  {k} N={n} {_name(dtype)} failed: {e[:200]}")
                rows.append({"op": k[0], "n_cols": n, "n_rows": m, "dtype": _name(dtype), "impl": k[1],
                             "error": e[:300]})
            for (op, impl), t in timings.items():
                nbytes = MN_FACTOR[op] * m * n * dtype.itemsize
                fallback = impl == "torch.compile" and EAGER_RUNS[("rms" if op.startswith("rms") else "ln", op)] > 0
                if fallback:
                    _log(f"  {op} torch.compile N={n} {_name(dtype)}: dynamo ran it eagerly (a fallback, kept as such)")
                rows.append({"op": op, "n_cols": n, "n_rows": m, "dtype": _name(dtype), "impl": impl,
                             **t.columns(), "gbps": bench.gbps(nbytes, t), "fallback": fallback})
            if partial is not None:
                pd.DataFrame(rows).to_csv(partial, index=False)
            _log(f"  N={n:>5} {_name(dtype):>8}: " + ", ".join(
                f"{r['op']}/{r['impl']} {r['gbps']:.0f}" for r in rows if r["n_cols"] == n and
                r["dtype"] == _name(dtype) and r["impl"] in ("ours", "copy")))
            torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    if NOTES:
        df["note"] = "; ".join(NOTES)
    return df


def fallbacks(df):
    """Which rows are torch.compile's eager fallbacks: the ``fallback`` column, or the first sweep's note."""
    import pandas as pd

    fb = df["fallback"].astype("boolean").fillna(False).astype(bool) if "fallback" in df.columns else \
        pd.Series(False, index=df.index)
    if "error" in df.columns:
        fb |= df["error"].fillna("").astype(str).str.startswith(FALLBACK_PREFIX)
    return fb


def ratios(df):
    """Per (op, dtype, N): ours / each peer (speed, time ratio), ours / copy and Liger / copy (bandwidth), and
    ``compile``: "compiled", "eager fallback" (its vs_torch.compile is left out, never judged), "failed" or
    "absent"."""
    import pandas as pd

    out = []
    fb = fallbacks(df)
    failed = df["error"].notna() & ~fb if "error" in df.columns else pd.Series(False, index=df.index)
    status = {(r.op, r.dtype, r.n_cols): "failed" for r in df[failed & (df.impl == "torch.compile")].itertuples()}
    status.update({(r.op, r.dtype, r.n_cols): "eager fallback" for r in df[fb].itertuples()})
    df = df[~failed & ~fb]
    copy = df[df.op == "copy"].set_index(["dtype", "n_cols"])["gbps"]
    for (op, d, n), g in df[df.op != "copy"].groupby(["op", "dtype", "n_cols"]):
        ms = g.set_index("impl")["ms"]
        if "ours" not in ms:
            continue
        gbps = g.set_index("impl")["gbps"]
        line = copy.get((d, n), float("nan"))
        r = {"op": op, "dtype": d, "n_cols": n, "ours_gbps": float(gbps["ours"]), "vs_copy": float(gbps["ours"] / line),
             "liger_vs_copy": float(gbps["liger"] / line) if "liger" in gbps else float("nan")}
        for peer in ("torch", "torch.compile", "liger"):
            r[f"vs_{peer}"] = float(ms[peer] / ms["ours"]) if peer in ms else float("nan")
        r["compile"] = status.get((op, d, n), "compiled" if "torch.compile" in ms else "absent")
        if "ours (per-SM plan)" in ms:
            r["per_sm_vs_ours"] = float(ms["ours"] / ms["ours (per-SM plan)"])
        out.append(r)
    return pd.DataFrame(out)


def targets(df) -> list:
    """The speed targets of issue 15 as measured ratios (ours / theirs, from one run); each race against
    a peer carries both rows' spread and % of copy, so a tie at the ceiling is told from a loss."""
    found = []
    peers = {"ln": "F.layer_norm", "rms": "F.rms_norm"}
    timed = df.set_index(["op", "dtype", "n_cols", "impl"])
    for _, r in ratios(df).iterrows():
        op, d, n = r["op"], r["dtype"], int(r["n_cols"])
        what = {"ln_fwd": "LayerNorm fwd", "ln_fwd_bwd": "LayerNorm fwd+bwd", "rms_fwd": "RMSNorm fwd",
                "rms_fwd_bwd": "RMSNorm fwd+bwd", "softmax_bwd": "softmax backward"}[op]
        if op == "softmax_bwd":
            found.append(bench.Target(15, f"{what} {d} N={n} vs copy bandwidth", r["vs_copy"], 0.9))
            continue
        if op == "ln_fwd":
            found.append(bench.Target(15, f"{what} {d} N={n} vs copy bandwidth", r["vs_copy"], 0.9))
        for peer in ("torch", "torch.compile", "liger"):
            name = {"torch": peers[op.split("_")[0]], "torch.compile": "torch.compile",
                    "liger": "Liger-Kernel"}[peer]
            if peer == "torch.compile" and r["compile"] != "compiled":
                continue  # an eager fallback (or a failure) is no torch.compile measurement: never a verdict
            if r[f"vs_{peer}"] == r[f"vs_{peer}"]:  # not NaN (Liger may be missing)
                found.append(bench.Target.between(15, f"{what} {d} N={n} vs {name}", timed.loc[(op, d, n, "ours")],
                                                  timed.loc[(op, d, n, peer)], 1.0))
    return found


def plot(df):
    """Bandwidth against N per op, one panel per (op, dtype)."""
    import matplotlib.pyplot as plt

    ops = [o for o in MN_FACTOR if o != "copy" and o in set(df.op)]
    df = df.assign(impl=df.impl.where(~fallbacks(df), "torch.compile (eager fallback)"))
    df = df[df.ms.notna()]
    fig, axes = plt.subplots(len(DTYPES), len(ops), figsize=(4 * len(ops), 7), squeeze=False, sharex=True)
    for i, d in enumerate(_name(t) for t in DTYPES):
        copy = df[(df.op == "copy") & (df.dtype == d)].sort_values("n_cols")
        for j, op in enumerate(ops):
            ax = axes[i][j]
            for impl, g in df[(df.op == op) & (df.dtype == d)].groupby("impl"):
                g = g.sort_values("n_cols")
                ax.plot(g.n_cols, g.gbps, marker="o", label=impl)
            ax.plot(copy.n_cols, copy.gbps, "k--", label="copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op} {d}", fontsize=9)
            ax.set_xlabel("N")
            ax.set_ylabel("GB/s")
            ax.legend(fontsize=7)
    fig.suptitle(bench.provenance_line(df) if "gpu" in df.columns else TITLE, fontsize=9)
    fig.tight_layout()
    return [fig]


# --------------------------------------------------------------------------- tuning


FWD_CANDIDATES = {1024: ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)),
                  2048: ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)),
                  4096: ((4096, 4), (4096, 8), (8192, 8), (8192, 16)),
                  8192: ((8192, 8), (8192, 16), (8192, 32), (16384, 16)),
                  16384: ((16384, 8), (16384, 16), (16384, 32))}
BWD_CANDIDATES = {1024: ((1024, 4), (2048, 4), (2048, 8), (4096, 8)),
                  2048: ((2048, 4), (2048, 8), (4096, 8), (4096, 16)),
                  4096: ((4096, 8), (4096, 16), (8192, 16)),
                  8192: ((8192, 8), (8192, 16), (8192, 32)),
                  16384: ((16384, 16), (16384, 32))}


def tune(out_dir: Path):
    """Time candidate tiles/warps (and backward grids) of our kernels next to copy, torch and Liger."""
    import pandas as pd

    from course_utils import hardware
    from course_utils.tuned import softmax_backward as TS
    lg = liger()
    info = hardware.device_info()
    saved_fwd = dict(T.FWD_TILES)
    rows = []
    path = out_dir / "layernorm_tune.csv"

    def add(op, n, m, dtype, impl, fn, factor, **extra):
        try:
            t = bench.time_ms(fn, warmup=3, rep=15)
        except Exception as e:  # noqa: BLE001
            _log(f"  {op} {impl} N={n} failed: {type(e).__name__}: {str(e)[:160]}")
            return
        rows.append({"op": op, "n_cols": n, "dtype": _name(dtype), "impl": impl, "ms": t.median,
                     "gbps": bench.gbps(factor * m * n * dtype.itemsize, t), **extra})
        pd.DataFrame(rows).assign(**bench.provenance()).to_csv(path, index=False)

    for dtype in DTYPES:
        for n in NS:
            m, x, w, b, dy = _inputs(n, dtype, grad=False)
            out = torch.empty_like(x)
            add("copy", n, m, dtype, "copy", lambda: out.copy_(x), 2)  # noqa: B023
            add("ln_fwd", n, m, dtype, "torch", lambda: F.layer_norm(x, (n,), w, b, EPS), 2)  # noqa: B023
            if lg:
                add("ln_fwd", n, m, dtype, "liger", lambda: lg[0].apply(x, w, b, EPS), 2)  # noqa: B023
            y, mean, rstd = torch.ops.aten.native_layer_norm(x, (n,), w, b, EPS)
            add("ln_bwd", n, m, dtype, "torch", lambda: torch.ops.aten.native_layer_norm_backward(  # noqa: B023
                dy, x, (n,), mean, rstd, w, b, (True, True, True)), 3)  # noqa: B023
            if lg:
                from liger_kernel.ops.layer_norm import layer_norm_backward as lbwd
                add("ln_bwd", n, m, dtype, "liger", lambda: lbwd(dy, x, w, b, mean.view(-1), rstd.view(-1)), 3)  # noqa: B023
            mean, rstd = mean.view(-1).float(), rstd.view(-1).float()
            block = max(n, 1024)
            for tile, warps in FWD_CANDIDATES[block]:
                T.FWD_TILES[(block, dtype.itemsize)] = (tile, warps)
                add("ln_fwd", n, m, dtype, f"ours tile={tile} w={warps}", lambda: T.layer_norm(x, w, b, EPS), 2,  # noqa: B023
                    tile=tile, num_warps=warps)
            T.FWD_TILES.clear()
            T.FWD_TILES.update(saved_fwd)
            for tile, warps in BWD_CANDIDATES[block]:
                rows_ = T._rows(m, block, tile)
                for per_sm in (1, 2, 4):
                    for atomic in (False, True) if per_sm == 2 else (False,):
                        plan = T.Plan("tiles", block, rows_, warps, *T._grid(m, rows_, info.sms * per_sm))
                        add("ln_bwd", n, m, dtype, f"ours{' atomic' if atomic else ''} tile={tile} w={warps} "
                            f"per_sm={per_sm}", lambda: T.layer_norm_backward(  # noqa: B023
                                dy, x, w, mean, rstd, atomic=atomic, plan=plan), 3,  # noqa: B023
                            tile=tile, num_warps=warps, per_sm=per_sm)
            for plan in (c for c in T.backward_candidates(m, n, dtype.itemsize, info) if c.version == "chunked"):
                add("ln_bwd", n, m, dtype, f"ours chunked chunk={plan.BLOCK_N} w={plan.num_warps} grid={plan.grid}",
                    lambda: T.layer_norm_backward(dy, x, w, mean, rstd, plan=plan), 3)  # noqa: B023
            ys = torch.softmax(x.float(), -1).to(dtype)
            add("softmax_bwd", n, m, dtype, "torch", lambda: torch.ops.aten._softmax_backward_data(  # noqa: B023
                dy, ys, -1, dtype), 3)  # noqa: B023
            for tile, warps in sorted({(max(n, 4096), 8), (max(n, 4096), 16), (max(n, 8192), 16)}):
                TS.TILE_ELEMENTS, TS.ELEMENTS_PER_THREAD = tile, tile // (32 * warps)
                add("softmax_bwd", n, m, dtype, f"ours tile={tile} w={warps}", lambda: TSB.softmax_backward(ys, dy), 3,  # noqa: B023
                    tile=tile, num_warps=warps)
            torch.cuda.empty_cache()
    df = pd.DataFrame(rows).assign(**bench.provenance())
    df.to_csv(path, index=False)
    return df


def tune_table(df):
    """Best of ours per (op, dtype, N) against copy, torch and Liger."""
    import pandas as pd

    out = []
    copy = df[df.op == "copy"].set_index(["dtype", "n_cols"])["gbps"]
    for (op, d, n), g in df[df.op != "copy"].groupby(["op", "dtype", "n_cols"]):
        ours = g[g.impl.str.startswith("ours") & ~g.impl.str.contains("atomic")]
        best = ours.loc[ours.gbps.idxmax()]
        r = {"op": op, "dtype": d, "N": n, "best": best.impl, "gbps": round(best.gbps),
             "vs_copy": round(best.gbps / copy[(d, n)], 3)}
        for peer in ("torch", "liger"):
            p = g[g.impl == peer]
            r[f"vs_{peer}"] = round(best.gbps / p.gbps.iloc[0], 3) if len(p) else float("nan")
        atom = g[g.impl.str.contains("atomic")]
        if len(atom):
            r["atomic_best_vs_partials"] = round(atom.gbps.max() / best.gbps, 3)
        out.append(r)
    return pd.DataFrame(out)


def atomics(out_dir: Path, runs: int = 10):
    """Backward with per-program partial sums vs atomics: time, and how many different dw bit patterns
    ``runs`` repeated calls on the same inputs give (1 = deterministic). Written to layernorm_atomics.csv."""
    import pandas as pd

    from course_utils.kernels import layernorm as L
    rows = []
    for dtype in DTYPES:
        for n in NS:
            m, x, w, b, dy = _inputs(n, dtype, grad=False)
            _, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
            for atomic in (False, True):
                fn = lambda: T.layer_norm_backward(dy, x, w, mean, rstd, atomic=atomic)  # noqa: B023, E731
                t = bench.time_ms(fn, warmup=3, rep=20)
                patterns = {fn()[1].float().cpu().numpy().tobytes() for _ in range(runs)}
                rows.append({"n_cols": n, "n_rows": m, "dtype": _name(dtype),
                             "impl": "atomics" if atomic else "partials + reduction", "ms": t.median,
                             "gbps": bench.gbps(3 * m * n * dtype.itemsize, t), "runs": runs,
                             "distinct_dw": len(patterns)})
                _log(f"  atomics N={n} {_name(dtype)} {rows[-1]['impl']}: {t.median:.3f} ms, "
                     f"{len(patterns)} distinct dw in {runs} runs")
    df = pd.DataFrame(rows).assign(**bench.provenance())
    df.to_csv(out_dir / "layernorm_atomics.csv", index=False)
    return df


def parts(out_dir: Path):
    """Where forward + backward spends its time (ours, LayerNorm): forward without and with the saved
    statistics, the backward alone, and the autograd pair timed with events and in a CUDA graph (no
    host in the way). Written to layernorm_parts.csv."""
    import pandas as pd

    rows = []
    for dtype in DTYPES:
        for n in (1024, 4096, 16384):
            m, x, w, b, dy = _inputs(n, dtype, grad=True)
            xd, wd, bd = x.detach(), w.detach(), b.detach()
            _, mean, rstd = T._forward(xd, wd, bd, EPS, False, True, "parts")
            auto = _fwd_bwd(lambda x, w, b: TA.layer_norm_autograd(x, w, b, EPS), (x, w, b), dy)
            impls = {"forward": lambda: T.layer_norm(xd, wd, bd, EPS),  # noqa: B023
                     "forward + stats": lambda: T._forward(xd, wd, bd, EPS, False, True, "parts"),  # noqa: B023
                     "backward": lambda: T.layer_norm_backward(dy, xd, wd, mean, rstd),  # noqa: B023
                     "autograd fwd+bwd": auto,
                     "autograd fwd+bwd (graph)": (auto, lambda f, **k: bench.time_ms(f, cuda_graph=True, **k))}
            errors: dict = {}
            for k, t in bench.time_rounds(impls, ROUNDS, errors=errors, warmup=3, rep=20).items():
                rows.append({"n_cols": n, "n_rows": m, "dtype": _name(dtype), "part": k, **t.columns()})
            for k, e in errors.items():
                rows.append({"n_cols": n, "n_rows": m, "dtype": _name(dtype), "part": k, "error": e[:300]})
    df = pd.DataFrame(rows).assign(**bench.provenance())
    df.to_csv(out_dir / "layernorm_parts.csv", index=False)
    return df


def check() -> None:
    """Every op against float64 autograd on odd shapes, strided rows and offset rows (one line each)."""
    from course_utils.kernels import layernorm as L
    tol = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
    for dtype in (torch.float32, torch.bfloat16):
        for m, n in ((7, 13), (1000, 1000), (33, 4097), (300, 16384), (5, 40000)):
            x = (torch.randn(m, n + 3, device="cuda") * 2 + 30).to(dtype)[:, :n]  # strided rows
            w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
            b = torch.randn(n, device="cuda").to(dtype)
            dy = torch.randn(m, n, device="cuda").to(dtype)
            xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
            for name, ours, ref, args, refargs in (
                    ("layer_norm", TA.layer_norm_autograd, lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS),
                     (x, w, b), (xd, wd, bd)),
                    ("rms_norm", TA.rms_norm_autograd, lambda x, w: F.rms_norm(x, (n,), w, 1e-6), (x, w), (xd, wd)),
                    ("softmax", TSB.softmax_autograd, lambda x: torch.softmax(x, -1), (x,), (xd,))):
                a = [t.detach().clone().requires_grad_() for t in args]
                y = ours(*a)
                got = [y, *torch.autograd.grad(y, a, dy)]
                yr = ref(*refargs)
                want = [yr, *torch.autograd.grad(yr, refargs, dy.double())]
                errs = [float((g.double() - r).abs().max() / r.abs().max().clamp_min(1)) for g, r in zip(got, want)]
                ok = all(e <= tol[dtype] for e in errs) and not any(g.isnan().any() for g in got)
                print(f"{'ok ' if ok else 'BAD'} {_name(dtype):>8} {m}x{n} {name}: rel errs "
                      + " ".join(f"{e:.1e}" for e in errs), flush=True)
            _, mean, rstd = L.layer_norm_teaching(x, w, b, return_stats=True)
            dws = {T.layer_norm_backward(dy, x, w, mean, rstd, atomic=True)[1].float().sum().item() for _ in range(5)}
            print(f"    atomics: {len(dws)} distinct dw sums in 5 runs", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("what", choices=["sweep", "tune", "check", "atomics", "parts"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if not cu.on_gpu():
        print("benchmarks.layernorm needs a CUDA GPU", file=sys.stderr)
        return 2
    import pandas as pd
    pd.set_option("display.width", 220)
    out = a.out or (bench.RESULTS / bench.gpu_slug())
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "check":
        check()
        return 0
    if a.what == "parts":
        print(parts(out).pivot_table(index=["dtype", "n_cols"], columns="part", values="ms").round(3).to_string())
        return 0
    if a.what == "atomics":
        print(atomics(out).to_string(index=False))
        return 0
    if a.what == "tune":
        print(tune_table(tune(out)).to_string(index=False))
        return 0
    df = sweep(a.quick, partial=out / "layernorm_partial.csv").assign(**bench.provenance())
    df.to_csv(out / "layernorm.csv", index=False)
    print(ratios(df).round(3).to_string(index=False))
    print(pd.DataFrame([t.row() for t in targets(df)]).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
