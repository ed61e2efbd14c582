"""Where an all-reduce kernel's pointers point (chapter 13): W symmetric buffers and W signal pads, and
the int64 tables of their addresses that :mod:`course_utils.kernels.allreduce` takes.

- :class:`SimulatedRanks`: W ranks in one process (the CPU under Triton's interpreter, or one GPU):
  W buffers and pads of this process; a call runs every rank's publish half, then every reduce half.
- :class:`SymmetricRanks`: this process's rank of a real group, one process per GPU under torchrun:
  the peers' buffers and pads mapped by PyTorch's symmetric memory (``symm_mem.empty``,
  ``symm_mem.rendezvous``); a call is one launch per rank, both halves. No multicast.
"""

from __future__ import annotations

import torch

SPINS_GPU = 2**26            # about a minute of tries: a lost peer ends the wait instead of hanging the job
SPINS_SIMULATED = 2          # a simulated peer that has not signalled will not signal during this launch
PROGRAMS_PER_SM = 4          # at 4 warps a program: every program resident at once (RESIDENT_WARPS_PER_SM)
RESIDENT_WARPS_PER_SM = 16   # 512 threads an SM: resident together whenever a thread needs <= 128 registers
PROGRAMS_SIMULATED = 3       # under the interpreter: a few programs, so rows wrap around the grid
ALIGN_BYTES = 16             # every buffer and pad address: a 128-bit load never straddles it


class Ranks:
    """W symmetric buffers (two halves of ``capacity`` elements each) and W signal pads, their address
    tables, and the schedule a call runs: ``(rank, publish, reduce)``. A pad holds ``2 * programs * W``
    int32 flags: the first half for the teaching kernels' flags (set 0 -> 1, reset 1 -> 0), the second,
    from ``tuned_pad_offset``, for the counters of course_utils/tuned/allreduce.py, so that calls of the
    two kinds back to back never meet on one flag."""

    def __init__(self, world_size: int, capacity: int, dtype: torch.dtype, max_programs: int, max_spins: int):
        self.world_size, self.capacity, self.dtype = world_size, capacity, dtype
        self.max_programs, self.max_spins, self.calls = max_programs, max_spins, 0
        self.tuned_pad_offset = max_programs * world_size
        self.pad_size = 2 * max_programs * world_size

    def tables(self, buffer_ptrs, pad_ptrs, device):
        buffer_ptrs, pad_ptrs = list(buffer_ptrs), list(pad_ptrs)
        odd = [hex(p) for p in buffer_ptrs + pad_ptrs if p % ALIGN_BYTES]
        if odd:   # the kernels declare these addresses 16-byte aligned (vector loads)
            raise RuntimeError(f"symmetric memory: addresses {odd} are not {ALIGN_BYTES}-byte aligned")
        self.buf_table = torch.tensor(list(buffer_ptrs), dtype=torch.int64, device=device)
        self.pad_table = torch.tensor(list(pad_ptrs), dtype=torch.int64, device=device)

    def programs(self, num_warps: int) -> int:
        """How many programs a launch of ``num_warps`` warps may have: every one must be resident at once on a
        GPU (a program that spins on its peers holds its SM; one that was never scheduled never signals).
        Simulated ranks run one program at a time and take ``max_programs``."""
        return self.max_programs

    def next_offset(self) -> int:
        """Element offset of the half this call uses (calls alternate halves)."""
        self.calls += 1
        return (self.calls % 2) * self.capacity

    def staging(self, shape, rank: int | None = None) -> torch.Tensor:
        """The part of ``rank``'s buffer (default: this process's first rank) that the *next* call publishes
        from: a producer that writes its output there (``torch.matmul(..., out=)``) saves the call its copy
        (course_utils/tuned/allreduce.py, ``in_buffer=True``). Safe to write once the previous call returned
        on this stream: its wait proved every peer done with this half."""
        rank = self.local_ranks[0] if rank is None else rank
        numel = int(torch.Size(shape).numel())
        if numel > self.capacity:
            raise ValueError(f"staging: {numel} elements do not fit the symmetric buffers' {self.capacity}")
        start = ((self.calls + 1) % 2) * self.capacity
        return self.buffer_of(rank)[start:start + numel].view(shape)


class SimulatedRanks(Ranks):
    """W ranks in one process (CPU under the interpreter, or one GPU): all publishes, then all reduces."""

    def __init__(self, world_size: int, capacity: int, dtype=torch.float32, device=None, max_programs=None):
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:   # a tensor's device names its index: cuda:0, not cuda
            device = torch.device("cuda", torch.cuda.current_device())
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        programs = max_programs or (PROGRAMS_SIMULATED if device.type == "cpu" else 64)
        super().__init__(world_size, capacity, dtype, programs, SPINS_SIMULATED)
        self.device = device
        self.buffers = [torch.full((2 * capacity,), float("nan"), dtype=dtype, device=device)
                        for _ in range(world_size)]
        self.pads = [torch.zeros(self.pad_size, dtype=torch.int32, device=device) for _ in range(world_size)]
        self.tables([b.data_ptr() for b in self.buffers], [p.data_ptr() for p in self.pads], device)
        self.local_ranks = list(range(world_size))

    def schedule(self):
        return [(r, True, False) for r in self.local_ranks] + [(r, False, True) for r in self.local_ranks]

    def buffer_of(self, rank: int) -> torch.Tensor:
        return self.buffers[rank]


class SymmetricRanks(Ranks):
    """This process's rank of a real group: peers' buffers and pads from torch symmetric memory (no
    multicast). Collective: every rank of ``group`` constructs it with the same arguments."""

    def __init__(self, capacity: int, dtype=torch.bfloat16, group=None):
        import warnings

        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        group = group or dist.group.WORLD
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)   # needed before torch 2.9, then a no-op
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(group.group_name)
        device = torch.device("cuda", torch.cuda.current_device())
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        super().__init__(dist.get_world_size(group), capacity, dtype, PROGRAMS_PER_SM * self.sms, SPINS_GPU)
        self.device = device
        self.buffer = symm_mem.empty(2 * capacity, dtype=dtype, device=device)
        self.pad = symm_mem.empty(self.pad_size, dtype=torch.int32, device=device)
        self.pad.zero_()   # our own flags (not torch's signal pad, which torch's ops use)
        torch.cuda.synchronize()
        self.local_ranks = [dist.get_rank(group)]
        self.handles = [symm_mem.rendezvous(t, group.group_name) for t in (self.buffer, self.pad)]
        self.tables(*(self._peer_ptrs(h, t, group) for h, t in zip(self.handles, (self.buffer, self.pad))), device)
        dist.barrier(group)   # every pad is zero before anyone signals

    def _peer_ptrs(self, handle, t, group) -> list[int]:
        """Every rank's address of ``t``: ``buffer_ptrs`` name each rank's allocation, and ``t`` may sit at an
        offset inside it (torch's memory pool), the same offset on every rank or the layout is not symmetric."""
        import torch.distributed as dist
        offset = t.data_ptr() - handle.buffer_ptrs[self.local_ranks[0]]
        offsets = [None] * self.world_size
        dist.all_gather_object(offsets, offset, group)
        if len(set(offsets)) != 1 or offset < 0:
            raise RuntimeError(f"symmetric memory: the tensor sits at different offsets on the ranks ({offsets}); "
                               "allocate the same tensors in the same order on every rank")
        return [p + offset for p in handle.buffer_ptrs]

    def schedule(self):
        return [(self.local_ranks[0], True, True)]

    def programs(self, num_warps: int) -> int:
        """At most RESIDENT_WARPS_PER_SM warps an SM (4 programs of 4 warps, 1 of 16), never more than the pads
        have flags for."""
        return max(1, min(self.max_programs, self.sms * RESIDENT_WARPS_PER_SM // num_warps))

    def buffer_of(self, rank: int) -> torch.Tensor:
        if rank != self.local_ranks[0]:
            raise ValueError(f"rank {self.local_ranks[0]} can stage only into its own buffer, not rank {rank}'s")
        return self.buffer
