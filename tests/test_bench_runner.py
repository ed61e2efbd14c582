"""benchmarks/run.py (``make bench``) on the CPU, with fake topic modules and given ceilings."""

from __future__ import annotations

import sys
import textwrap

import pandas as pd
import pytest

from benchmarks import run as runner
from course_utils import bench, env

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
