"""Shared by the test suite and the notebooks' nbval runs.

Tests that hold 8-20 GiB of GPU memory at once (the 2^31-element checks) are marked ``bigmem`` and
take a machine-wide lock while they run, so that under pytest-xdist they never run side by side and
exhaust the card (``-m "not bigmem"`` leaves them out). A lock rather than an ``xdist_group``: the
groups need ``--dist loadgroup``, which pytest 9 with pytest-xdist 3.8 silently ignores.
"""

from __future__ import annotations

import fcntl
import os
import tempfile

import pytest

# test function names (without parameters) that allocate several GiB of GPU memory
BIGMEM = {
    "test_gpu_more_than_2_31_elements",    # attention, gemm
    "test_past_2_31_elements_on_gpu",      # softmax, autograd elementwise
    "test_past_2_31_elements_on_the_gpu",  # elementwise
    "test_gpu_int64_offsets",              # layernorm
}
LOCK_PATH = os.path.join(tempfile.gettempdir(), "course-bigmem.lock")


def pytest_itemcollected(item):
    if getattr(item, "originalname", item.name) in BIGMEM:
        item.add_marker(pytest.mark.bigmem)


@pytest.fixture(autouse=True)
def _one_bigmem_test_at_a_time(request):
    if request.node.get_closest_marker("bigmem") is None:
        yield
        return
    with open(LOCK_PATH, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield
