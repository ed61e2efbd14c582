"""MasterAdamW's gradient tables: the int64 device tensors of the gradients' addresses that its one kernel reads.

Each step looks the table up by the tuple of the gradients' ``data_ptr()`` and builds one only when an
address changed (:class:`GradTables`; ``course_utils.tuned.adamw`` says why a table and when it moves).
Eager tables live in rows allocated once, with the optimizer: a table allocated when it is built would
shift the caching allocator's blocks, so that the next backward's gradients land elsewhere and force the
next rebuild, every step (seen on an H100 in the profile of chapter 12's step by hand). A row's pinned host
copy is rewritten only after its last upload is done (one CUDA event per row). A table built during a CUDA
graph capture comes from a pinned buffer set aside before the capture and lives in the graph's pool; it, and
any eager table a capture reads, is kept for the optimizer's life.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

POINTER_ALIGN = 16         # bytes: parameters and gradients start on 16-byte boundaries (vector loads)
SPARE_PINNED = 2           # pinned host buffers kept ready for tables built during a capture
MAX_EAGER_TABLES = 8       # eager gradient tables kept (least recently built dropped first)


class GradTables:
    """The gradient tables of one optimizer over ``params`` (one dtype, one device, contiguous; their
    addresses fixed when it was built): :meth:`table` returns the current gradients' table."""

    def __init__(self, params: list, dtype: torch.dtype, device: torch.device, numels: list[int]):
        self.params, self.dtype, self.device, self.numels = params, dtype, device, numels
        self.cuda = device.type == "cuda"
        self.weight_addresses = [p.data_ptr() for p in params]
        self.tables: OrderedDict[tuple, tuple] = OrderedDict()   # key -> (device table, host buffer, row)
        self.captured: set[tuple] = set()      # tables a CUDA graph reads: kept for the optimizer's life
        self.spare: list[torch.Tensor] = []    # pinned host buffers for tables built inside a capture
        n = len(params)
        self.rows = torch.empty((MAX_EAGER_TABLES, n), dtype=torch.int64, device=device)
        self.host_rows = torch.empty((MAX_EAGER_TABLES, n), dtype=torch.int64, device="cpu", pin_memory=self.cuda)
        self.copied = [torch.cuda.Event() if self.cuda else None for _ in range(MAX_EAGER_TABLES)]
        self.free_rows = list(range(MAX_EAGER_TABLES))
        self.rebuilds = 0
        self.top_up_spare()

    def capturing(self) -> bool:
        return self.cuda and torch.cuda.is_current_stream_capturing()

    def _host_buffer(self) -> torch.Tensor:
        return torch.empty(len(self.params), dtype=torch.int64, device="cpu", pin_memory=self.cuda)

    def top_up_spare(self) -> None:
        """Pinned buffers for the tables of a later capture (a capture forbids allocating pinned memory)."""
        while len(self.spare) < SPARE_PINNED:
            self.spare.append(self._host_buffer())

    def _check_grads(self) -> None:
        """On each rebuild: the parameters are where the weight table says, each gradient fits its parameter."""
        for i, (p, addr) in enumerate(zip(self.params, self.weight_addresses)):
            if p.data_ptr() != addr or p.dtype != self.dtype or p.numel() != self.numels[i]:
                raise RuntimeError(f"parameter {i} was replaced since MasterAdamW was built (p.data = ..., or "
                                   "model.to() afterwards): build the optimizer after converting the model")
            g = p.grad
            if g is None:
                continue
            if g.dtype != self.dtype or g.shape != p.shape:
                raise TypeError(f"the gradient of parameter {i} is {g.dtype} {tuple(g.shape)}; expected the "
                                f"parameter's {self.dtype} {tuple(p.shape)}")
            if g.device != self.device:
                raise ValueError(f"the gradient of parameter {i} is on {g.device}, the parameter on {self.device}")
            if g.layout != torch.strided or not g.is_contiguous() or g.data_ptr() % POINTER_ALIGN:
                raise ValueError(f"the gradient of parameter {i} is not a contiguous dense tensor on a "
                                 f"{POINTER_ALIGN}-byte boundary (sparse, strided or an odd view)")

    def _new_table(self, key: tuple) -> torch.Tensor:
        self._check_grads()
        capturing = self.capturing()
        if capturing and not self.spare:
            raise RuntimeError("MasterAdamW: no pinned buffer left for a table built inside a CUDA graph capture; "
                               "run one eager step() between captures")
        if not capturing:
            self._evict(MAX_EAGER_TABLES - 1)
        row = self.free_rows.pop() if self.free_rows and not capturing else None
        if row is not None:       # a row of the eager tables: its last copy must be done before the host rewrites it
            if self.copied[row] is not None:
                self.copied[row].synchronize()
            host, table = self.host_rows[row], self.rows[row]
        else:                     # a capture's table (the graph's pool), or every row held by a captured table
            host = self.spare.pop() if capturing else self._host_buffer()
            table = torch.empty(len(key), dtype=torch.int64, device=self.device)
        host.copy_(torch.tensor(key, dtype=torch.int64))     # host memory: no device work yet
        table.copy_(host, non_blocking=True)                   # captured as a copy node when capturing
        if row is not None and self.copied[row] is not None:
            self.copied[row].record()
        self.tables[key] = (table, host, row)                 # the host buffer lives as long as the table
        self.rebuilds += 1
        if capturing:
            self.captured.add(key)
        return table

    def _evict(self, keep: int) -> None:
        """Drop the oldest eager tables until ``keep`` remain; their rows are free again."""
        eager = [k for k in self.tables if k not in self.captured]
        for k in eager[:max(0, len(eager) - keep)]:
            row = self.tables.pop(k)[2]
            if row is not None:
                self.free_rows.append(row)

    def table(self) -> torch.Tensor:
        key = tuple([0 if (g := p.grad) is None else g.data_ptr() for p in self.params])
        found = self.tables.get(key)
        if found is None:
            return self._new_table(key)
        if key not in self.captured and self.capturing():
            self.captured.add(key)                            # a graph reads it now: never drop it
        return found[0]
