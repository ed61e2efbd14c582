"""A pytest plugin for the grader's nbval run (copied in as the run's ``conftest.py``; stdlib and nbval only).

nbval waits for a cell's reply until the cell timeout, so a kernel that dies inside a cell (a
segmentation fault in a kernel run on the CPU, ``os._exit``, the out-of-memory killer) used to be
reported as a cell that "ran longer than the time limit" after the whole limit had passed. This
plugin polls the kernel process while nbval waits and fails the cell at once with
:class:`KernelDiedError`, saying how the process ended.
"""

from __future__ import annotations

import signal
import time
from queue import Empty

POLL_S = 1.0


class KernelDiedError(RuntimeError):
    """The kernel process ended while a cell ran."""


def describe(km) -> str:
    """How the kernel process ended: 'exit code 3' or 'signal 11 (SIGSEGV)'."""
    code = None
    for owner in (getattr(km, "provisioner", None), km):
        process = getattr(owner, "process", None) or getattr(owner, "kernel", None)
        if hasattr(process, "poll"):
            code = process.poll()
            break
    if code is None:
        return "its exit status is unknown"
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def pytest_configure(config):
    from nbval import kernel as nbval_kernel

    original = nbval_kernel.RunningKernel.get_message
    if getattr(original, "_grader_watch", False):
        return

    def get_message(self, stream, timeout=None):
        if stream != "shell":
            return original(self, stream, timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            try:
                return original(self, stream, timeout=step)
            except Empty:
                if not self.km.is_alive():
                    raise KernelDiedError(f"the kernel process died while this cell ran: {describe(self.km)}") \
                        from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    get_message._grader_watch = True
    nbval_kernel.RunningKernel.get_message = get_message
