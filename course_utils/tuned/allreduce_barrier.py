"""The tuned all-reduce's barrier (:mod:`.allreduce`, point 1): a vector of W flags, one lane per peer,
every peer signalled at once. A flag is a counter: the signaller adds 1 (release), the waiter polls until
it is at least 1, then takes 1 back (acquire), so a signal needs no answer and one flag serves every
barrier of a call. The pads are back to zero after every call.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def peer_lanes(rank, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """Lanes 0..WORLD_P2-1, one per rank, and which of them are peers (neither this rank nor padding)."""
    lanes = tl.arange(0, WORLD_P2)
    return lanes, (lanes < WORLD) & (lanes != rank)


@triton.jit
def signal_all(pad_table_ptr, rank, slot, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """Add 1 to flag ``slot + rank`` on every peer's pad at once, with release semantics (the rows this
    program stored before are visible to whoever sees the count)."""
    tl.debug_barrier()   # every thread of the program has stored its part of the rows
    lanes, peer = peer_lanes(rank, WORLD, WORLD_P2)
    pads = tl.load(pad_table_ptr + lanes, mask=peer, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_add(pads + slot + rank, 1, mask=peer, sem="release", scope="sys")


@triton.jit
def wait_all(pad_ptr, rank, slot, max_spins, WORLD: tl.constexpr):
    """Wait until every peer's flag ``slot + peer`` on this rank's pad is at least 1, then take one from each
    with acquire semantics (what the peer stored before it signalled is visible after). True if every peer
    came within ``max_spins`` rounds in all; if not, nothing is taken and the pad is left as it was.

    Every decision here is made on the value of a *scalar* atomic: one thread performs it and Triton hands
    its value to every thread of the program, so all warps agree. A flag read with a tensor load is loaded
    again by every warp that holds a copy of its lane, at its own moment: one warp can see the count reach
    1, leave the loop and take it back to 0 while another warp, which read it a moment earlier, spins on
    the 0 until ``max_spins`` runs out, and then the two go different ways (tests/test_allreduce_tuned.py
    reads the PTX for it; the interpreter runs a program as one thread and cannot show it)."""
    arrived = 0
    spins = 0
    for i in tl.static_range(1, WORLD):   # the peers in turn: the slowest one sets the time anyway
        flag = pad_ptr + slot + (rank + i) % WORLD
        count = tl.atomic_add(flag, 0, sem="relaxed", scope="sys")   # a read that is never cached or hoisted
        while (count < 1) & (spins < max_spins):
            count = tl.atomic_add(flag, 0, sem="relaxed", scope="sys")
            spins += 1
        arrived += (count >= 1).to(tl.int32)
    came = arrived == WORLD - 1
    if came:
        for i in tl.static_range(1, WORLD):
            tl.atomic_add(pad_ptr + slot + (rank + i) % WORLD, -1, sem="acquire", scope="sys")
    tl.debug_barrier()   # no thread reads a peer's rows before the counts were taken
    return came
