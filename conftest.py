"""Scheduling for pytest-xdist (``--dist loadgroup``, as the Makefile runs the suites).

- A notebook's cells run in order in one kernel: every cell of one notebook goes to one worker.
- Tests that hold 8-20 GiB of GPU memory at once (the 2^31-element checks) share one group, so
  they never run side by side and exhaust the card; they are marked ``bigmem`` too
  (``-m "not bigmem"`` leaves them out).
Every other test is handed out one at a time, so a file with many slow cases spreads over workers.
"""

from __future__ import annotations

import pytest

# test function names (without parameters) that allocate several GiB of GPU memory
BIGMEM = {
    "test_gpu_more_than_2_31_elements",   # attention, gemm
    "test_past_2_31_elements_on_gpu",     # softmax, autograd elementwise
    "test_past_2_31_elements_on_the_gpu",  # elementwise
    "test_gpu_int64_offsets",             # layernorm
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.path)
        if path.endswith(".ipynb"):
            item.add_marker(pytest.mark.xdist_group(name=item.path.stem))
        elif getattr(item, "originalname", item.name) in BIGMEM:
            item.add_marker(pytest.mark.bigmem)
            item.add_marker(pytest.mark.xdist_group(name="bigmem"))
