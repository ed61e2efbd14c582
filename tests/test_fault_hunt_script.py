"""tools/gpu_checks/fault_hunt.py: its runs (one process per version, the benchmark's order together) and its
verdicts from a run's output, without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "gpu_checks"))

import fault_hunt as F  # noqa: E402

from benchmarks import training as T  # noqa: E402


def _args(**kw):
    return SimpleNamespace(**{"impls": "", "config": "gpt2-b16", "blocking": False, "attention_visible": False,
                              "together": False, **kw})


def test_one_process_per_course_version_then_all_in_the_benchmarks_order():
    plan = F.runs(_args(together=True, blocking=True, attention_visible=True))
    course = [n for n, (ops, _) in T.IMPLS.items() if ops.startswith("course")]   # course-blocks too
    assert [label for label, _, _ in plan] == course + ["(all, in order)"]
    for (_label, cmd, env), name in zip(plan, course):
        assert cmd[-2:] == ["--impls", name] and "--config" in cmd and "gpt2-b16" in cmd
        assert env["CUDA_LAUNCH_BLOCKING"] == "1" and env["COURSE_ATTENTION_VISIBLE"] == "1"
    assert plan[-1][1][-1] == ";".join(T.IMPLS)                      # the torch versions too, in order
    plain = F.runs(_args(impls="course + CUDA graph"))
    assert len(plain) == 1 and plain[0][2].get("CUDA_LAUNCH_BLOCKING") == F.os.environ.get("CUDA_LAUNCH_BLOCKING")
    with pytest.raises(SystemExit, match="unknown versions"):
        F.runs(_args(impls="course;nope"))


@pytest.mark.parametrize("rc, out, want", [
    (0, "built course in 3.0 s\n\ngpt2-b16 on H100\ncourse   40.1 ms/step", "ok"),
    (0, "FAILED course + CUDA graph after 2.0 s: RuntimeError: shapes", "build failed"),
    (0, "FAILED course after 9.9 s: AcceleratorError: CUDA error: an illegal memory access was encountered",
     "fault in the build"),
    (134, "built course in 3.0 s\ntorch.AcceleratorError: CUDA error: an illegal memory access was encountered",
     "fault"),
    (None, "built course in 3.0 s", "timeout"),
    (1, "Traceback ... ValueError", "exit 1"),
])
def test_verdicts(rc, out, want):
    assert F.verdict(rc, out)[0] == want
