"""course_utils.graphs: capture a callable, replay it (a real CUDA graph on a GPU, the simulation on the CPU)."""

from __future__ import annotations

import pytest
import torch

import course_utils as cu
from course_utils import check, graphs
from course_utils.kernels import elementwise as ew
from course_utils.kernels import launch
from course_utils.profile import count_launches
from course_utils.tuned import elementwise as TE


def _chain(x, b):
    """A Triton kernel, an eager op, a tuned Triton kernel: what the benchmarks graph."""
    return TE.gelu(ew.add_teaching(x, x) * 0.5 + b)


def test_replay_reruns_every_kernel_on_the_captured_buffers():
    x, b = check.randn((5, 37)), check.randn((37,))
    g = graphs.capture(lambda: _chain(x, b))
    out = g.output
    assert isinstance(out, torch.Tensor) and g.replay() is out
    check.compare("replay", out, ew.gelu_ref(x.double() + b.double()))
    new = check.randn((5, 37), scale=3.0)
    x.copy_(new)                   # new values in the captured input are seen ...
    assert g() is out              # ... and every replay writes the same output tensor
    check.compare("replay after copy_", out, ew.gelu_ref(new.double() + b.double()))


def test_one_replay_is_one_call_from_the_host():
    x = check.randn((1000,))
    g = graphs.capture(lambda: launch.chain_ref(launch.add_one(x), 6))
    assert count_launches(launch.chain_ref, x, 6).total == 6
    if not cu.on_gpu():  # the simulation hides its tape from launch counters, as a real replay does
        assert count_launches(g.replay).total == 0
    check.compare("graph of 7 kernels", g.replay(), launch.chain_ref(x + 1, 6).double())


def test_warm_up_runs_before_the_capture_and_capture_runs_once_more():
    calls = []
    x = check.randn((16,))

    def fn():
        calls.append(1)
        return launch.add_one(x)
    graphs.capture(fn, warmup=2)
    assert len(calls) == 3


def test_bad_arguments_and_failures_give_clear_errors():
    with pytest.raises(TypeError, match="callable"):
        graphs.capture(42)
    with pytest.raises(ValueError, match="warmup"):
        graphs.capture(lambda: None, warmup=0)
    state = {"n": 0}

    def fails_under_capture():
        state["n"] += 1
        if state["n"] > 1:
            raise RuntimeError("boom")
    with pytest.raises(graphs.GraphCaptureError, match="fails_under_capture.*boom"):
        graphs.capture(fails_under_capture, warmup=1)


@pytest.mark.skipif(cu.on_gpu(), reason="the CPU stand-in")
def test_simulated_graph_keeps_the_rules_of_a_real_one():
    g = graphs.CUDAGraph()
    assert isinstance(g, graphs.SimulatedGraph)
    with pytest.raises(RuntimeError, match="before capture"):
        g.replay()
    x = check.randn((8,))
    with graphs.graph(g):
        y = x * 2 + 1
    assert y.isnan().all(), "a capture runs nothing: outputs made inside it hold garbage until a replay"
    g.replay()
    check.compare("replay", y, 2 * x.double() + 1)
    with pytest.raises(RuntimeError, match="already captured"), graphs.graph(g):
        pass
    with pytest.raises(TypeError, match="CUDAGraph"):
        graphs.graph(object())


def test_kernels_launch_still_exports_the_graph_names():
    assert launch.CUDAGraph is graphs.CUDAGraph and launch.graph is graphs.graph
    assert launch.SimulatedGraph is graphs.SimulatedGraph


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="needs a CUDA GPU")
def test_a_real_graph_hides_the_launch_cost():
    x = torch.randn(4096, device="cuda")
    g = graphs.capture(lambda: launch.chain_ref(x, 50))
    assert isinstance(g.graph, torch.cuda.CUDAGraph)
    check.compare("graph of 50 ops", g.replay(), launch.chain_ref(x, 50).double())
    x.copy_(torch.randn_like(x))
    check.compare("after copy_", g.replay(), launch.chain_ref(x, 50).double())
