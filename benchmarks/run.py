"""``make bench``: every course kernel against its references on the GPU in hand.

    python -m benchmarks.run                    # every topic, full sizes (under 10 minutes on an H100)
    python -m benchmarks.run --quick            # fewer sizes
    python -m benchmarks.run --only softmax,attention
    python -m benchmarks.run --list
    python -m benchmarks.run --recorded [h200]  # no GPU: re-judge the targets from results/<gpu>/*.csv

Steps: measure the ceilings once (device-to-device copy and a dense matmul, written to
``results/<gpu>/ceilings.csv``); for each topic module ``benchmarks/<topic>.py`` that has a
``sweep``, run it, add % of the measured ceilings, save ``results/<gpu>/<topic>.csv`` with
provenance and ``<topic>.png`` plots, and judge its speed targets; last, write the summary
``results/<gpu>/targets.csv`` and ``targets.md`` (every target: required ratio, measured ratio,
pass, tie at the ceiling, or short; see :data:`STATUS_RULE`). A topic that raises is reported in
the summary and the others go on; the exit code is 1 when any topic failed to run (a target that is
short does not change it).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import course_utils as cu
from course_utils import bench

TIME_BUDGET_S = 600      # what `make bench` promises on an H100
QUICK_FOLDER = "quick"   # results/<gpu>/quick/: --quick runs, never read as the recorded results
SKIP = {"run", "__init__"}
SUMMARY_COLUMNS = ["topic", "issue", "target", "required", "measured", "status", "noise", "at_ceiling"]
#: How a status is decided (``bench.Target``), printed under the table of targets.md.
STATUS_RULE = (
    "Status: **pass** when measured >= required. A target short of it is a **tie at ceiling** when the "
    "ratio is 1.0 within the run's noise and both sides run at the hardware's limit: `noise` is the "
    "ratio's range from the two sides' 20th-80th percentile times (their fastest over our slowest, "
    "their slowest over our fastest, from each one's median interleaved round) and must contain 1.0; "
    "`at_ceiling` is the fraction of the measured copy bandwidth (or matmul rate) ours / theirs "
    f"reach, both at least {bench.TIE_CEILING_FRACTION:.0%}. Everything else short of its ratio is "
    "**short**: a loss, or a race within noise below the ceiling, where there is still room to win.")
METRIC_COLUMNS = {"ms", "p20_ms", "p80_ms", "ms_p20", "ms_p80", "p20", "p80", "reps", "gbps", "tflops", "us",
                  "bytes", "flops", "pct_of_copy", "pct_of_matmul", "cuda_graph", "error", "note"}


@dataclass
class TopicResult:
    name: str
    title: str = ""
    status: str = "ok"            # ok | error | skipped
    seconds: float = 0.0
    rows: int = 0
    csv: Path | None = None
    plots: list[Path] = field(default_factory=list)
    targets: list[bench.Target] = field(default_factory=list)
    message: str = ""


def discover(package: str = "benchmarks") -> list[tuple[str, object]]:
    """``(topic, module or the exception its import raised)`` for every topic module, by name."""
    pkg = importlib.import_module(package)
    found = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name in SKIP or info.name.startswith("_"):
            continue
        try:
            found.append((info.name, importlib.import_module(f"{package}.{info.name}")))
        except Exception as e:  # a module that does not even import is reported, the others run
            found.append((info.name, e))
    return found


def select(found, only: list[str] | None):
    """Keep the topics named in ``only`` (all when None); unknown names are an error."""
    if not only:
        return found
    names = [n for n, _ in found]
    unknown = [o for o in only if o not in names]
    if unknown:
        raise SystemExit(f"unknown topic(s) {unknown}; known: {names}")
    return [(n, m) for n, m in found if n in only]


def _x_column(df):
    """The swept size: the first numeric, non-metric column with more than one value."""
    for c in df.columns:
        if c in METRIC_COLUMNS or c in ("gpu", "torch", "triton", "date"):
            continue
        if df[c].dtype.kind in "iuf" and df[c].nunique() > 1:
            return c
    return None


def default_plots(df, name: str, title: str, out_dir: Path) -> list[Path]:
    """One PNG per topic: GB/s or TFLOP/s against the swept size, a line per implementation,
    one panel per value of the other case columns (dtype, case...), at most 12 panels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    y = "tflops" if "tflops" in df.columns and df["tflops"].notna().any() else \
        "gbps" if "gbps" in df.columns and df["gbps"].notna().any() else "ms"
    x = _x_column(df)
    if x is None or "impl" not in df.columns or y not in df.columns:
        return []
    facets = [c for c in df.columns if c not in METRIC_COLUMNS and c not in (x, "impl", "gpu", "torch",
              "triton", "date") and df[c].dtype.kind in "Ob" and 1 < df[c].nunique() <= 6]
    groups = list(df.groupby(facets, sort=False)) if facets else [((), df)]
    groups = groups[:12]
    cols = min(3, len(groups))
    rows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    for ax, (key, g) in zip(axes.flat, groups, strict=False):
        key = key if isinstance(key, tuple) else (key,)
        label = ", ".join(f"{c}={v}" for c, v in zip(facets, key, strict=False))
        bench.plot_sweep(g, x=x, y=y, ax=ax, title=label or None, logx=g[x].max() / max(g[x].min(), 1e-12) > 16)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.suptitle(f"{title} ({df['gpu'].iloc[0] if 'gpu' in df.columns else ''})")
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def run_topic(name: str, module, *, quick: bool, ceilings: bench.Ceilings, out_root: Path, slug: str) -> TopicResult:
    """Run one topic; never raises (what went wrong goes into the result)."""
    res = TopicResult(name, getattr(module, "TITLE", name))
    t0 = time.perf_counter()
    try:
        df = module.sweep(quick=quick)
        import pandas as pd
        if not isinstance(df, pd.DataFrame):
            raise TypeError(f"sweep() must return a pandas DataFrame, got {type(df).__name__}")
        if df.empty:
            raise ValueError("sweep() returned an empty DataFrame")
        df = bench.with_ceilings(df, ceilings)
        res.rows = len(df)
        res.csv = bench.save(df, name, gpu=slug, root=out_root)
        saved = pd.read_csv(res.csv)  # what was written, read back as the notebooks will read it
    except Exception as e:
        res.status, res.message = "error", f"{type(e).__name__}: {e}"
        traceback.print_exc()
        res.seconds = time.perf_counter() - t0
        return res
    try:
        figs = module.plot(saved) if hasattr(module, "plot") else None
        if figs is None:
            res.plots = default_plots(saved, name, res.title, res.csv.parent)
        else:
            import matplotlib.pyplot as plt
            for i, fig in enumerate(figs if isinstance(figs, (list, tuple)) else [figs]):
                path = res.csv.parent / (f"{name}.png" if i == 0 else f"{name}_{i}.png")
                fig.savefig(path, dpi=110)
                plt.close(fig)
                res.plots.append(path)
    except Exception as e:  # a plot that fails does not lose the measurements
        res.message = f"plot failed: {type(e).__name__}: {e}"
    try:
        targets = list(module.targets(saved)) if hasattr(module, "targets") else []
        bad = [t for t in targets if not isinstance(t, bench.Target)]
        if bad:
            raise TypeError(f"targets() must return bench.Target objects, got {type(bad[0]).__name__}")
        res.targets = targets
    except Exception as e:
        res.status, res.message = "error", f"targets(): {type(e).__name__}: {e}"
        traceback.print_exc()
    res.seconds = time.perf_counter() - t0
    return res


def summary_frame(results: list[TopicResult], slug: str):
    """One row per target (and one per topic that failed), for targets.csv / targets.md."""
    import pandas as pd

    rows = []
    for r in results:
        for t in r.targets:
            row = {"topic": r.name, **t.row()}
            if t.measured != t.measured:  # NaN: the cases it compares were not measured
                row["status"] = "not measured"
            rows.append(row)
        if r.status == "error":
            rows.append({"topic": r.name, "issue": None, "target": f"(topic failed: {r.message[:150]})",
                         "required": None, "measured": None, "status": "error"})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def to_markdown(df, title: str) -> str:
    """A GitHub table (no tabulate needed)."""
    cols = list(df.columns)
    def cell(v):
        if v is None or (isinstance(v, float) and v != v):
            return ""
        return str(v).replace("|", "/")
    lines = [f"# {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def run(topics, *, quick: bool = False, ceilings: bench.Ceilings, out_root: Path = bench.RESULTS,
        slug: str | None = None, progress: bool = True) -> list[TopicResult]:
    """Run every ``(name, module)`` in ``topics``; write ceilings, CSVs, plots and the summary."""
    import pandas as pd

    slug = slug or bench.gpu_slug()
    if quick:  # a quick run never overwrites what a full run recorded: it writes beside it
        slug = f"{slug}/{QUICK_FOLDER}"
    out_dir = out_root / slug
    out_dir.mkdir(parents=True, exist_ok=True)
    bench.save(pd.DataFrame([ceilings.row()]), "ceilings", gpu=slug, root=out_root)
    before = pd.read_csv(out_dir / "targets.csv") if (out_dir / "targets.csv").exists() else None
    results = []
    bar = topics
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(topics, desc="make bench", unit="topic")
    for name, module in bar:
        if progress:
            bar.set_postfix_str(name)
        if isinstance(module, Exception):
            results.append(TopicResult(name, status="error", message=f"import failed: {type(module).__name__}: "
                                       f"{module}"))
            continue
        if not hasattr(module, "sweep"):
            results.append(TopicResult(name, getattr(module, "TITLE", name), status="skipped",
                                       message="no sweep(): not a sweep module"))
            continue
        results.append(run_topic(name, module, quick=quick, ceilings=ceilings, out_root=out_root, slug=slug))
        write_summary(results, ceilings, out_dir, quick, before)  # after every topic: a cut-short run keeps it
    write_summary(results, ceilings, out_dir, quick, before)
    return results


def write_summary(results: list[TopicResult], ceilings: bench.Ceilings, out_dir: Path, quick: bool,
                  before=None, recorded: bool = False) -> None:
    """``targets.csv`` and ``targets.md``; ``before`` (the summary as it was when the run started)
    keeps the rows of topics this run did not redo (``--only``)."""
    import pandas as pd

    stem = "targets_recorded" if recorded else "targets"  # a re-judgement never overwrites a run's summary
    path = out_dir / f"{stem}.csv"
    summary = summary_frame(results, out_dir.name)
    rerun = [r.name for r in results if r.status != "skipped"]
    if before is not None and "topic" in before.columns:
        old = before[~before["topic"].isin(rerun)]
        if len(old):
            summary = pd.concat([old[[c for c in summary.columns if c in old.columns]], summary],
                                ignore_index=True)
    summary.to_csv(path, index=False)
    runs = pd.DataFrame([{"topic": r.name, "status": r.status, "rows": r.rows, "seconds": round(r.seconds, 1),
                          "note": r.message[:120]} for r in results])
    v = bench.provenance()
    if recorded:
        title = (f"Speed targets on {ceilings.gpu}, judged on {v['date']} from the recorded results "
                 "(each topic's CSV names its own run)")
    else:
        title = (f"Speed targets on {ceilings.gpu} (torch {v['torch']}, triton {v['triton']}, {v['date']}, "
                 f"commit {commit()}{', --quick' if quick else ''})")
    text = to_markdown(summary, title)
    counts = summary["status"].value_counts()
    text += "\n" + ", ".join(f"{counts[s]} {s}" for s in ("pass", bench.TIE, "short", "not measured", "error")
                              if s in counts) + ". " + STATUS_RULE + "\n"
    text += (f"\nCeilings: copy {ceilings.copy_gbps:.0f} GB/s, {ceilings.matmul_dtype} matmul "
             f"{ceilings.matmul_tflops:.0f} TFLOP/s ({ceilings.note}).\n\n")
    text += to_markdown(runs, f"Topics run ({sum(r.seconds for r in results):.0f} s)").replace("# Topics", "## Topics")
    (out_dir / f"{stem}.md").write_text(text + multigpu_section(out_dir))


MULTIGPU_TITLE = "Across GPUs (issue 28)"
MULTIGPU_HEADING = "## " + MULTIGPU_TITLE


def multigpu_section(out_dir: Path) -> str:
    """targets.md's last section: chapter 13's targets, from ``multigpu_targets.csv`` (``torchrun`` runs,
    not ``make bench``'s, judged by ``python -m benchmarks.multigpu --judge``); empty when none is recorded."""
    import pandas as pd

    path = out_dir / "multigpu_targets.csv"
    if not path.exists():
        return ""
    rows = pd.read_csv(path)
    counts = rows["status"].value_counts()
    told = ", ".join(f"{counts[s]} {s}" for s in ("pass", bench.TIE, "short", bench.SUSPECT) if s in counts)
    table = "#" + to_markdown(rows.drop(columns=["issue"], errors="ignore"), MULTIGPU_TITLE)   # a second-level one
    suspect = (f" **{bench.SUSPECT}**: a ratio above the most its measurement can honestly give (per-GPU "
               "throughput more than 5% above one GPU's at the same work per GPU: the one-GPU baseline ran slow), "
               "never a pass; the run must be repeated." if bench.SUSPECT in counts else "")
    return (f"\n{table}\n{told}.{suspect} Measured by `torchrun` runs on one host of 2 and 4 GPUs "
            "(`results/README.md` names each run), judged from the `multigpu_*_w<W>.csv` files by `python -m "
            "benchmarks.multigpu --judge`, which rewrites this section alone.\n")


def replace_multigpu_section(out_dir: Path) -> None:
    """Rewrite the multi-GPU section of ``out_dir/targets.md`` and keep the rest (the judge of chapter 13)."""
    md = out_dir / "targets.md"
    if md.exists():
        head = md.read_text().split("\n" + MULTIGPU_HEADING)[0].rstrip("\n") + "\n"
        md.write_text(head + multigpu_section(out_dir))


def commit() -> str:
    """The commit the benchmarked code comes from: ``COURSE_COMMIT`` when set (a copy of the tree
    without ``.git``, as on a lent GPU machine), else ``git describe``; ``-dirty`` when files differ."""
    import os
    import subprocess

    if os.environ.get("COURSE_COMMIT"):
        return os.environ["COURSE_COMMIT"]
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def judge_recorded(topics, *, slug: str, out_root: Path = bench.RESULTS, plots: bool = False) -> list[TopicResult]:
    """Without a GPU: judge each topic's targets (and redraw its plots) from ``results/<slug>/<topic>.csv``.

    Every CSV keeps its own provenance columns; the summary says it was judged from recorded runs.
    """
    import pandas as pd

    out_dir = out_root / slug
    ceil_path = next((out_dir / f for f in ("ceilings.csv", "benchmarking_ceilings.csv") if (out_dir / f).exists()),
                     None)
    if ceil_path is None:
        raise SystemExit(f"no ceilings.csv recorded under {out_dir}")
    ceilings = bench.Ceilings.from_frame(pd.read_csv(ceil_path))
    before = pd.read_csv(out_dir / "targets.csv") if (out_dir / "targets.csv").exists() else None
    results = []
    for name, module in topics:
        res = TopicResult(name, getattr(module, "TITLE", name))
        path = out_dir / f"{name}.csv"
        if isinstance(module, Exception) or not hasattr(module, "sweep"):
            res.status, res.message = "skipped", "not a sweep module" if not isinstance(module, Exception) \
                else f"import failed: {module}"
        elif not path.exists():
            res.status, res.message = "skipped", f"no recorded results ({path.name})"
        else:
            t0 = time.perf_counter()
            df = pd.read_csv(path)
            res.rows, res.csv = len(df), path
            try:
                res.targets = list(module.targets(df)) if hasattr(module, "targets") else []
                if plots:
                    figs = module.plot(df) if hasattr(module, "plot") else None
                    if figs is None:
                        res.plots = default_plots(df, name, res.title, out_dir)
                    else:
                        import matplotlib.pyplot as plt
                        for i, fig in enumerate(figs if isinstance(figs, (list, tuple)) else [figs]):
                            p = out_dir / (f"{name}.png" if i == 0 else f"{name}_{i}.png")
                            fig.savefig(p, dpi=110)
                            plt.close(fig)
                            res.plots.append(p)
            except Exception as e:
                res.status, res.message = "error", f"{type(e).__name__}: {e}"
                traceback.print_exc()
            res.seconds = time.perf_counter() - t0
        results.append(res)
    judged = [r for r in results if r.status != "skipped"]
    write_summary(judged, ceilings, out_dir, False, before, recorded=True)
    return results


def report(results: list[TopicResult], ceilings: bench.Ceilings, total_s: float) -> str:
    lines = [f"ceilings on {ceilings.gpu}: copy {ceilings.copy_gbps:.0f} GB/s, "
             f"{ceilings.matmul_dtype} matmul {ceilings.matmul_tflops:.0f} TFLOP/s ({ceilings.note})", "",
             f"{'topic':18s} {'status':8s} {'rows':>5s} {'s':>6s}  targets"]
    for r in results:
        passed, tied = sum(t.passed for t in r.targets), sum(t.tied for t in r.targets)
        tgt = f"{passed}/{len(r.targets)} pass, {tied} tie at ceiling" if r.targets else "-"
        lines.append(f"{r.name:18s} {r.status:8s} {r.rows:5d} {r.seconds:6.1f}  {tgt}"
                     + (f"  ({r.message[:90]})" if r.message else ""))
    for r in results:
        for t in r.targets:
            lines.append(f"  [{t.status if t.passed or t.tied else 'SHORT'}] {r.name}: {t.claim}: "
                         f"{t.measured:.3f} (needs {t.required})")
    lines.append(f"total {total_s:.0f} s" + ("" if total_s <= TIME_BUDGET_S else
                                           f" -- over the {TIME_BUDGET_S} s budget: use --quick or fewer sizes"))
    return "\n".join(lines)


def pd_read(folder: Path) -> bench.Ceilings:
    import pandas as pd
    for f in ("ceilings.csv", "benchmarking_ceilings.csv"):
        if (folder / f).exists():
            return bench.Ceilings.from_frame(pd.read_csv(folder / f))
    raise SystemExit(f"no ceilings under {folder}")


def main(argv=None, *, package: str = "benchmarks", ceilings: bench.Ceilings | None = None,
         out_root: Path | None = None, slug: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated topics (default: all)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--list", action="store_true", help="list the topics and exit")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--recorded", nargs="?", const="", metavar="GPU_FOLDER",
                    help="no GPU needed: judge the targets from results/<gpu>/<topic>.csv (first GPU folder "
                         "with ceilings.csv when none is named)")
    ap.add_argument("--plots", action="store_true", help="with --recorded: redraw the plots too")
    args = ap.parse_args(argv)
    found = discover(package)
    if args.list:
        for name, mod in found:
            kind = "sweep" if hasattr(mod, "sweep") else ("import failed" if isinstance(mod, Exception)
                                                          else "script (skipped)")
            print(f"{name:18s} {kind:18s} {getattr(mod, 'TITLE', '')}")
        return 0
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    topics = select(found, only)
    if args.recorded is not None:
        root = out_root or bench.RESULTS
        slug = args.recorded or slug or next(
            (g for g in bench.recorded_gpus() if (root / g / "ceilings.csv").exists()), None)
        if not slug:
            print(f"no recorded results with ceilings under {root}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        results = judge_recorded(topics, slug=slug, out_root=root, plots=args.plots)
        ceil_df = pd_read(root / slug)
        print(report(results, ceil_df, time.perf_counter() - t0))
        return 1 if any(r.status == "error" for r in results) else 0
    if ceilings is None:
        if not cu.on_gpu():
            print("make bench measures a real GPU and none is visible (mode: interpreter). The notebooks "
                  f"read recorded results instead: {bench.recorded_gpus()}", file=sys.stderr)
            return 2
        print(cu.banner(), flush=True)
        ceilings = bench.measure_ceilings()
    t0 = time.perf_counter()
    results = run(topics, quick=args.quick, ceilings=ceilings, out_root=out_root or bench.RESULTS, slug=slug,
                  progress=not args.no_progress)
    print(report(results, ceilings, time.perf_counter() - t0))
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
