"""benchmarks/run.py (``make bench``) on the CPU, with fake topic modules and given ceilings."""

from __future__ import annotations

import sys
import textwrap

import pandas as pd
import pytest

from benchmarks import run as runner
from course_utils import bench, env

pytestmark = pytest.mark.machinery   # left out of the newest-Triton run (pyproject.toml says why)

CEIL = bench.Ceilings("Fake GPU 9000", copy_gbps=1000.0, matmul_tflops=100.0, note="given by the test")

GOOD = '''
import pandas as pd
from course_utils import bench, env
TITLE = "good topic"
def sweep(quick=False):
    sizes = [1, 4] if quick else [1, 4, 16]
    rows = []
    for n in sizes:
        for impl, ms in (("ours", 1.0 * n), ("theirs", 2.0 * n)):
            rows.append(dict(n_mib=n, dtype="fp32", impl=impl, ms=ms, gbps=bench.gbps(n * 2**20, ms)))
    return pd.DataFrame(rows)
def targets(df):
    big = df[df.n_mib == df.n_mib.max()].set_index("impl").ms
    return [bench.Target(99, "ours vs theirs, largest size", big["theirs"] / big["ours"], 1.5),
            bench.Target(99, "ours vs theirs, 4x (will be short)", big["theirs"] / big["ours"], 4.0)]
'''
BROKEN = '''
TITLE = "raises"
def sweep(quick=False):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
def targets(df):
    return []
'''
EMPTY = '''
import pandas as pd
TITLE = "empty"
def sweep(quick=False):
    return pd.DataFrame()
def targets(df):
    return []
'''
BAD_TARGETS = '''
import pandas as pd
TITLE = "bad targets"
def sweep(quick=False):
    return pd.DataFrame([dict(n=1, impl="a", ms=1.0), dict(n=2, impl="a", ms=2.0)])
def targets(df):
    return [("not", "a", "Target")]
'''
SCRIPT = '''
"""A script like ncu_traffic: no sweep, must be skipped."""
TITLE = "script"
def main():
    raise SystemExit("must not run")
'''
NO_IMPORT = '''
import a_module_that_does_not_exist_anywhere
'''


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    name = f"fakebench_{abs(hash(tmp_path)) % 10**8}"
    root = tmp_path / "src" / name
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "run.py").write_text("raise SystemExit('the runner itself is not a topic')\n")
    for mod, src in {"good": GOOD, "broken": BROKEN, "empty": EMPTY, "badtargets": BAD_TARGETS,
                     "script": SCRIPT, "noimport": NO_IMPORT}.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(src))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    yield name
    for m in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[m]


def _main(pkg, tmp_path, *args):
    return runner.main(["--no-progress", *args], package=pkg, ceilings=CEIL, out_root=tmp_path / "results",
                       slug="fake-gpu")


def test_discover_skips_runner_and_reports_import_errors(pkg):
    found = dict(runner.discover(pkg))
    assert "run" not in found
    assert set(found) == {"good", "broken", "empty", "badtargets", "script", "noimport"}
    assert isinstance(found["noimport"], ImportError)
    assert not hasattr(found["script"], "sweep")


def test_full_run_continues_after_failures_and_writes_everything(pkg, tmp_path, capsys):
    rc = _main(pkg, tmp_path)
    out = capsys.readouterr().out
    assert rc == 1  # some topics failed
    d = tmp_path / "results" / "fake-gpu"
    good = pd.read_csv(d / "good.csv")
    assert len(good) == 6 and {"gpu", "torch", "triton", "date", "pct_of_copy"} <= set(good.columns)
    assert good["pct_of_copy"].iloc[0] == pytest.approx(100 * good["gbps"].iloc[0] / CEIL.copy_gbps)
    assert (d / "good.png").stat().st_size > 1000
    ceil = pd.read_csv(d / "ceilings.csv")
    assert ceil["copy_gbps"][0] == 1000.0 and ceil["matmul_tflops"][0] == 100.0
    summary = pd.read_csv(d / "targets.csv")
    by = {(r.topic, r.status) for r in summary.itertuples()}
    assert ("good", "pass") in by and ("good", "short") in by
    for topic in ("broken", "empty", "badtargets", "noimport"):
        assert (topic, "error") in by, topic
    assert "script" not in set(summary.topic)
    md = (d / "targets.md").read_text()
    assert "| topic |" in md and "ours vs theirs, largest size" in md
    assert "## Topics run" in md and "Ceilings: copy 1000 GB/s" in md
    assert "illegal memory access" in out and "skipped" in out


def test_quick_and_only(pkg, tmp_path):
    assert _main(pkg, tmp_path, "--only", "good", "--quick") == 0
    d = tmp_path / "results" / "fake-gpu"
    assert len(pd.read_csv(d / "quick" / "good.csv")) == 4
    assert not (d / "good.csv").exists() and not (d / "broken.csv").exists()
    assert "--quick" in (d / "quick" / "targets.md").read_text()


def test_quick_never_overwrites_a_full_run(pkg, tmp_path):
    _main(pkg, tmp_path, "--only", "good")
    d = tmp_path / "results" / "fake-gpu"
    full = {f.name: f.read_bytes() for f in d.glob("*.*")}
    _main(pkg, tmp_path, "--only", "good", "--quick")
    assert {f.name: f.read_bytes() for f in d.glob("*.*")} == full
    assert len(pd.read_csv(d / "good.csv")) == 6 and len(pd.read_csv(d / "quick" / "good.csv")) == 4


def test_summary_names_the_commit(pkg, tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_COMMIT", "abc123def456")
    _main(pkg, tmp_path, "--only", "good")
    assert "commit abc123def456" in (tmp_path / "results" / "fake-gpu" / "targets.md").read_text()


def test_only_keeps_other_topics_in_the_summary(pkg, tmp_path):
    _main(pkg, tmp_path)
    _main(pkg, tmp_path, "--only", "good")
    summary = pd.read_csv(tmp_path / "results" / "fake-gpu" / "targets.csv")
    assert (summary.topic == "good").sum() == 2  # replaced, not duplicated
    assert "broken" in set(summary.topic)       # kept from the first run


def test_unknown_topic_is_an_error(pkg, tmp_path):
    with pytest.raises(SystemExit, match="unknown topic"):
        _main(pkg, tmp_path, "--only", "nope")


def test_list(pkg, tmp_path, capsys):
    assert _main(pkg, tmp_path, "--list") == 0
    out = capsys.readouterr().out
    assert "script (skipped)" in out and "import failed" in out


@pytest.mark.skipif(env.on_gpu(), reason="the refusal happens only without a GPU")
def test_without_gpu_main_refuses(pkg, tmp_path, capsys):
    assert runner.main(["--no-progress"], package=pkg, out_root=tmp_path / "r", slug="x") == 2
    assert "recorded" in capsys.readouterr().err


def test_real_topics_are_discovered():
    found = dict(runner.discover("benchmarks"))
    assert "benchmarking" in found and "run" not in found
    assert hasattr(found["benchmarking"], "sweep") and hasattr(found["benchmarking"], "targets")


def test_markdown_table():
    df = pd.DataFrame([{"a": 1, "b": float("nan"), "c": "x|y"}])
    md = runner.to_markdown(df, "T")
    assert md.splitlines()[2] == "| a | b | c |" and "| 1 |  | x/y |" in md


def test_recorded_mode_judges_targets_without_a_gpu(pkg, tmp_path, capsys):
    _main(pkg, tmp_path, "--only", "good")  # leaves good.csv and ceilings.csv as a GPU run would
    d = tmp_path / "results" / "fake-gpu"
    run_summary = (d / "targets.md").read_text()
    rc = runner.main(["--no-progress", "--recorded", "fake-gpu"], package=pkg, out_root=tmp_path / "results")
    out = capsys.readouterr().out
    assert rc == 0 and "no recorded results" in out  # the other topics have no CSV: skipped, not errors
    summary = pd.read_csv(d / "targets_recorded.csv")
    assert set(summary.topic) == {"good"} and set(summary.status) == {"pass", "short"}
    assert "judged on" in (d / "targets_recorded.md").read_text()
    assert (d / "targets.md").read_text() == run_summary  # the run's own summary is left alone
    (d / "ceilings.csv").unlink()
    with pytest.raises(SystemExit, match="ceilings"):
        runner.main(["--recorded", "fake-gpu"], package=pkg, out_root=tmp_path / "results")


# ------------------------------------------------------------------ pass, tie at the ceiling, short

def _timed(ms, spread=0.01, pct=95.0, ceiling="pct_of_copy"):
    """One results row: median ``ms``, p20/p80 ``spread`` either side, ``pct`` of a ceiling."""
    return {"ms": ms, "ms_p20": ms * (1 - spread), "ms_p80": ms * (1 + spread), ceiling: pct}


def test_a_ratio_within_noise_of_one_with_both_at_the_ceiling_is_a_tie():
    t = bench.Target.between(99, "ours vs theirs", _timed(1.0), _timed(0.995), 1.0)
    assert t.measured == pytest.approx(0.995) and not t.passed
    assert t.noise == pytest.approx((0.995 * 0.99 / 1.01, 0.995 * 1.01 / 0.99))
    assert t.tied and t.status == bench.TIE == t.row()["status"]
    assert t.row()["at_ceiling"] == "95% / 95%" and t.row()["noise"] == "0.975-1.015"
    matmul = bench.Target.between(99, "gemm", _timed(1.0, ceiling="pct_of_matmul", pct=91),
                                  _timed(0.99, ceiling="pct_of_matmul", pct=92), 1.0)
    assert matmul.status == bench.TIE  # the matmul ceiling counts as the copy ceiling does


def test_a_real_loss_at_the_ceiling_is_short():
    # both at the copy ceiling, but 3% apart with 1% spreads: the p20-p80 ranges do not overlap
    t = bench.Target.between(99, "ours vs theirs", _timed(1.0, pct=93), _timed(0.97, pct=96), 1.0)
    assert t.noise[1] < 1.0 and not t.tied and t.status == "short"
    big = bench.Target.between(99, "ours vs theirs", _timed(1.0, pct=60), _timed(0.7, pct=90), 1.0)
    assert big.status == "short"


def test_a_ratio_within_noise_but_off_the_ceiling_is_still_short():
    for ours_pct, theirs_pct in ((89.0, 95.0), (95.0, 89.0), (40.0, 40.0)):
        t = bench.Target.between(99, "ours vs theirs", _timed(1.0, pct=ours_pct), _timed(0.995, pct=theirs_pct), 1.0)
        assert t.noise[0] <= 1.0 <= t.noise[1] and t.status == "short", (ours_pct, theirs_pct)


def test_a_pass_stays_a_pass_and_missing_evidence_is_never_a_tie():
    assert bench.Target.between(99, "x", _timed(1.0), _timed(1.5), 1.3).status == "pass"
    assert bench.Target.between(99, "x", _timed(1.0), _timed(1.0), 1.0).status == "pass"
    wall = {"ms": 1.0, "pct_of_copy": 95.0}  # a wall-clock row: no percentiles
    assert bench.Target.between(99, "x", wall, {"ms": 0.999, "pct_of_copy": 95.0}, 1.0).status == "short"
    no_ceiling = {"ms": 1.0, "ms_p20": 0.99, "ms_p80": 1.01}
    assert bench.Target.between(99, "x", no_ceiling, {**no_ceiling, "ms": 0.999}, 1.0).status == "short"
    assert bench.Target(99, "x", 0.999, 1.0).status == "short"  # a bare ratio carries no noise
    assert bench.Target(99, "x", 0.999, 1.0).row()["noise"] == ""


TIES = '''
import pandas as pd
from course_utils import bench
TITLE = "ties"
def sweep(quick=False):
    rows = [dict(n_mib=n, impl=impl, ms=ms, ms_p20=ms * 0.99, ms_p80=ms * 1.01, gbps=gbps)
            for n in (1, 2) for impl, ms, gbps in (("ours", 1.0, 950.0), ("peer", 0.995, 955.0), ("slow", 1.0, 500.0))]
    return pd.DataFrame(rows)
def targets(df):
    by = df[df.n_mib == 2].set_index("impl")
    return [bench.Target.between(99, "ours vs peer at the ceiling", by.loc["ours"], by.loc["peer"], 1.0),
            bench.Target.between(99, "slow vs peer off the ceiling", by.loc["slow"], by.loc["peer"], 1.0)]
'''


def test_the_summary_tells_ties_from_losses_and_says_how(pkg, tmp_path, capsys):
    import importlib

    (tmp_path / "src" / pkg / "ties.py").write_text(textwrap.dedent(TIES))
    importlib.invalidate_caches()
    assert _main(pkg, tmp_path, "--only", "ties,good") == 0
    out = capsys.readouterr().out
    d = tmp_path / "results" / "fake-gpu"
    summary = pd.read_csv(d / "targets.csv").set_index("target")
    assert summary.loc["ours vs peer at the ceiling", "status"] == bench.TIE
    assert summary.loc["ours vs peer at the ceiling", "at_ceiling"] == "95% / 96%"
    assert summary.loc["slow vs peer off the ceiling", "status"] == "short"   # 50% of copy: room to win
    assert summary.loc["ours vs theirs, largest size", "status"] == "pass"
    md = (d / "targets.md").read_text()
    assert "1 pass, 1 tie at ceiling, 2 short." in md and runner.STATUS_RULE in md
    assert "[tie at ceiling] ties: ours vs peer at the ceiling" in out and "1/2 pass, 1 tie at ceiling" not in out
    assert "0/2 pass, 1 tie at ceiling" in out and "[SHORT] ties: slow vs peer" in out


def _recorded_h100():
    if not (bench.RESULTS / "h100-80gb-hbm3" / "ceilings.csv").exists():
        pytest.skip("no recorded H100 results")
    return {name: {t.claim: t for t in bench.topic(name).targets(bench.recorded(name, gpu="h100-80gb-hbm3"))}
            for name in ("elementwise", "layernorm", "softmax")}


def test_recorded_h100_targets_are_judged_by_the_tie_rule():
    judged = _recorded_h100()
    ew, ln = judged["elementwise"], judged["layernorm"]
    # both at the copy ceiling (98%), p20-p80 ranges overlapping: a tie, not a loss
    assert ew["gelu bf16 256 MiB speed vs F.gelu"].status == bench.TIE
    assert ln["LayerNorm fwd bfloat16 N=4096 vs Liger-Kernel"].status == bench.TIE
    # within noise of 1.0 but ours at 89% of copy: short
    off = ew["bias+gelu+scale fp32 64 MiB vs torch.compile (events)"]
    assert off.noise[0] <= 1.0 <= off.noise[1] and off.status == "short"
    # the wide-row backward: won since the split plan (1.19x Liger at N=16384, bf16); fp32 at N=8192 is a race
    # within noise below the ceiling (74% / 80% of copy): short, never a tie
    assert ln["LayerNorm fwd+bwd bfloat16 N=16384 vs Liger-Kernel"].status == "pass"
    race = ln["LayerNorm fwd+bwd float32 N=8192 vs Liger-Kernel"]
    assert race.status == "short" and race.noise[0] <= 1.0 <= race.noise[1]
    # every race against a peer timed by events carries its evidence; a CUDA graph's (data in L2, past
    # the copy ceiling) and the wall clock's (no percentiles) never make a tie
    launch_bound = ("(graph)", "(wall)")
    assert all(t.noise is not None for name in judged for t in judged[name].values()
               if "vs copy" not in t.claim and not any(w in t.claim for w in launch_bound))
    assert all(t.noise is None and not t.tied for t in ew.values() if any(w in t.claim for w in launch_bound))


def test_the_launch_bound_wall_clock_targets_against_eager_are_retired():
    ew = _recorded_h100()["elementwise"]
    assert not [c for c in ew if "(wall)" in c and "vs eager" in c]
    for dtype in ("bf16", "fp32"):
        for size in (1, 4, 16):
            assert f"bias+gelu+scale {dtype} {size} MiB vs torch.compile (wall)" in ew
            assert ew[f"bias+gelu+scale {dtype} {size} MiB vs eager (graph)"].required == 2.5


def test_targets_md_carries_the_multi_gpu_targets_and_their_judge_rewrites_that_section_alone(tmp_path):
    import pandas as pd
    (tmp_path / "targets.md").write_text("# Speed targets\n\n| a |\n|---|\n| 1 |\n")
    rows = pd.DataFrame({"issue": [28, 28], "target": ["fused vs nccl, 2 GPUs", "DDP vs 1 GPU, 4 GPUs"],
                         "required": [1.5, 0.9], "measured": [1.6, 0.22], "status": ["pass", "short"]})
    rows.to_csv(tmp_path / "multigpu_targets.csv", index=False)
    runner.replace_multigpu_section(tmp_path)
    runner.replace_multigpu_section(tmp_path)   # twice: one section, not two
    text = (tmp_path / "targets.md").read_text()
    assert text.startswith("# Speed targets\n\n| a |") and text.count(runner.MULTIGPU_HEADING) == 1
    assert "| DDP vs 1 GPU, 4 GPUs | 0.9 | 0.22 | short |" in text and "1 pass, 1 short." in text
    assert "suspect" not in text   # the word is explained only where a row has that status
    rows.loc[1, ["measured", "status"]] = [1.41, "suspect"]
    rows.to_csv(tmp_path / "multigpu_targets.csv", index=False)
    runner.replace_multigpu_section(tmp_path)
    text = (tmp_path / "targets.md").read_text()
    assert "1 pass, 1 suspect. **suspect**: a ratio above the most its measurement can honestly give" in text
    (tmp_path / "multigpu_targets.csv").unlink()
    runner.replace_multigpu_section(tmp_path)   # nothing recorded: no section
    assert runner.MULTIGPU_HEADING not in (tmp_path / "targets.md").read_text()


def test_gemm_targets_judge_the_worst_shape_with_its_own_noise_and_ceilings():
    import pandas as pd

    from benchmarks import gemm as G

    def row(m, impl, ms, pct, spread=0.01):
        return {"kind": "mlp", "m": m, "k": 64, "n": 64, "dtype": "bfloat16", "impl": impl,
                **_timed(ms, spread=spread, ceiling="pct_of_matmul", pct=pct)}
    # shape 1: ours 2% ahead; shape 2: 0.2% behind within noise, both at the matmul ceiling; shape 3: 5% behind
    # off the ceiling, so the worst shape alone decides and it is short
    near = [row(1, "fused", 1.0, 92), row(1, "addmm+gelu", 1.02, 92), row(2, "fused", 1.0, 93),
            row(2, "addmm+gelu", 0.998, 93)]
    t = {x.claim: x for x in G.targets(pd.DataFrame(near))}["fused / addmm+gelu, MLP shapes (worst of bf16, fp16)"]
    assert t.measured == pytest.approx(0.998) and t.status == bench.TIE and t.row()["at_ceiling"] == "93% / 93%"
    far = near + [row(3, "fused", 1.0, 70), row(3, "addmm+gelu", 0.95, 74)]
    t = {x.claim: x for x in G.targets(pd.DataFrame(far))}["fused / addmm+gelu, MLP shapes (worst of bf16, fp16)"]
    assert t.measured == pytest.approx(0.95) and t.status == "short" and t.row()["at_ceiling"] == "70% / 74%"
    missing = {x.claim: x for x in G.targets(pd.DataFrame(near))}["triton matmul / torch.mm (cuBLAS), MLP shapes"]
    assert missing.measured != missing.measured and missing.status == "short"   # no rows: NaN, never a tie
