"""count_launches: what a check cell prints about fusion must be right, and the same on CPU and GPU."""

from __future__ import annotations

import pytest
import torch

import course_utils as cu
from course_utils import check, profile
from course_utils.kernels import launch


def softmax_5_ops(x):
    m = x.max(dim=1, keepdim=True).values
    e = torch.exp(x - m)
    s = e.sum(dim=1, keepdim=True)
    return e / s


def test_eager_softmax_counts_five_launches():
    x = check.randn((7, 33))
    counts = profile.count_launches(softmax_5_ops, x)
    assert counts.total == 5, counts
    assert set(counts.torch) == {"max", "sub", "exp", "sum", "div"}
    assert not counts.triton


def test_a_triton_kernel_counts_one_and_hides_the_interpreters_own_torch_ops():
    x = check.randn((1000,))
    launch.add_one(x)  # compile first
    counts = profile.count_launches(launch.add_one, x)
    assert counts.total == 1, counts
    assert counts.triton == {"add_one_kernel": 1}
    assert not counts.torch  # empty_like is an allocation, not a kernel
    assert "1x add_one_kernel" in str(counts)


def test_views_and_allocations_count_zero():
    x = check.randn((6, 10))

    def views(t):
        a = t.view(60).reshape(3, 20).t()
        b = t.unsqueeze(0).squeeze(0).transpose(0, 1).permute(1, 0)[1:4]
        torch.empty(5, device=t.device)
        torch.empty_like(t)
        return a, b, t.narrow(1, 2, 3), t.expand(2, 6, 10)

    counts = profile.count_launches(views, x)
    assert counts.total == 0, counts
    assert str(counts) == "0 kernel launch(es): none"


def test_chain_and_args_kwargs_are_passed_through():
    x = check.randn((9,))
    assert profile.count_launches(launch.chain_ref, x, n_ops=6).total == 6
    out = []
    profile.count_launches(lambda t, k=1: out.append(t.numel() * k), x, k=3)
    assert out == [27]


def test_counting_restores_triton_and_counts_nothing_afterwards():
    from course_utils.triton_internals import launch_classes

    before = {cls: cls.run for cls in launch_classes()}
    with pytest.raises(ZeroDivisionError):
        profile.count_launches(lambda: 1 / 0)
    assert {cls: cls.run for cls in launch_classes()} == before


@pytest.mark.skipif(cu.on_gpu(), reason="checks the CPU message")
def test_cuda_kernel_table_needs_a_gpu():
    with pytest.raises(RuntimeError, match="count_launches"):
        profile.cuda_kernel_table(lambda: None)
