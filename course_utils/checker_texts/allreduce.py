"""The texts of chapter 13's all-reduce checker (:mod:`course_utils.checkers.allreduce`): the hint every failure
ends with, and what each named fault means, keyed by the fault's name."""

from __future__ import annotations

HINT = ("publish half: copy your rows of x into your buffer (tl.load(buf_table_ptr + rank) cast to a pointer, "
        "+ buf_offset), then on every peer set flag pid * WORLD + rank with tl.atomic_cas(flag, 0, 1, "
        "sem='release', scope='sys'); reduce half: on your own pad wait for flag pid * WORLD + peer with "
        "tl.atomic_cas(flag, 1, 0, sem='acquire', scope='sys') (at most max_spins tries), and only if every "
        "peer's flag came, read every rank's buffer at the same offset and sum in float32.")
FAULTS = {
    "no barrier": "your reduce half read the peers' buffers while no peer had published. Wait for every "
                  "peer's flag before the first load of a peer's buffer, and skip the reduce if a flag did not come",
    "barrier before the writes": "the flags said 'published' before the rows were in the buffer: a peer read "
                                 "the old contents. Store your rows into your buffer first, then signal",
    "only the own buffer read": "the sum holds your own rows only: load each rank r's buffer address from "
                                "buf_table_ptr + r, for every r in tl.static_range(WORLD)",
    "wrong peer offset": "the peers' rows were read at another offset than your own: symmetric buffers have "
                         "the same layout on every rank, so a peer's row is at its buffer + buf_offset + "
                         "row * n_cols, exactly like yours",
    "norm applied before the sum": "y is the norm of the summed stream: sum the ranks' x, add the residual, "
                                   "then normalize; normalizing each rank's part first gives another result",
    "signal pad never reset": "after the call the pads still hold flags: the next call's wait would pass at "
                              "once and read old data. The waiting rank resets its flag (atomic_cas(flag, 1, 0))",
    "averaged instead of summed": "the result is the mean over the ranks, the sum divided by WORLD: the "
                                  "all-reduce sums (a data-parallel step divides once, elsewhere)",
    "own rows left out": "the sum holds the peers' rows but not your own: the all-reduce sums every rank's "
                         "buffer, yours included, for r in tl.static_range(WORLD)",
    "x added instead of the residual": "s holds the sum plus your x again, not the residual: the residual row is "
                                       "at r_ptr (the same offset), x_ptr is your part of the sum",
    "y and s swapped": "s holds the normalized row: store s = sum + residual at s_ptr and y = RMSNorm(s) * w at y_ptr",
    "residual added twice": "s holds the sum plus twice the residual: add r_ptr's row once, s = sum + residual",
    "residual not added": "s is the ranks' sum alone: add the residual row (r_ptr, at the same offset) to the "
                          "float32 sum before you store s",
    "norm of the sum without the residual": "y normalizes the ranks' sum before the residual was added: y is the "
                                            "RMSNorm of s = sum + residual, the s you stored",
    "weight missing": "y is the normalized s without the weight: multiply by w (w_ptr, one per column)",
    "mean over BLOCK_N": "the mean of s^2 divides by BLOCK_N, the tile's width, not by n_cols: the masked lanes "
                         "are zeros, not columns; mean(s^2) = tl.sum(s * s) / n_cols",
    "the row's RMS is wrong": "y is s * w times another factor per row than 1 / sqrt(mean(s^2) + eps): s is right, "
                              "so the norm's scale is off. mean(s^2) = tl.sum(s * s) / n_cols over the stored s "
                              "(lanes past n_cols loaded as 0.0), then the square root, with eps inside it",
    "eps outside the square root": "y divides by sqrt(mean(s^2)) + eps, not by sqrt(mean(s^2) + eps): where a "
                                   "row's mean square is as small as eps the two differ by up to sqrt(2). eps "
                                   "goes under the root: 1 / tl.sqrt(tl.sum(s * s, axis=0) / n_cols + eps)",
    "statistics in x's dtype": "mean(s^2) was taken on s in x's dtype: the squares of the check's loud rows (a "
                               "massive activation in the residual stream, as large models carry) overflow "
                               "float16's 65504, so their y came out 0. Cast the stored s to float32 "
                               "(s.to(tl.float32)) before squaring and summing; only the stores are in x's dtype",
    "sum in x's dtype": "the sum was accumulated in x's dtype, rounding after every rank's add: accumulate in "
                        "float32 (tl.zeros((BLOCK_N,), tl.float32), each load .to(tl.float32)) and round once, "
                        "at the store",
    "ranks summed in different orders": "the ranks hold different bits of the same sum: every rank must get the "
                                        "same bits (replicas of a data-parallel step drift apart otherwise), so "
                                        "sum the buffers in one order on every rank, r = 0..WORLD-1, rather than "
                                        "your own x first",
    "rows past the grid never written": "only the first rows, one per program, were reduced: there are fewer "
                                        "programs than rows, so each program loops over rows pid, pid + "
                                        "programs, ... (tl.range(pid, n_rows, tl.num_programs(0))) in both halves",
    "wrong flag index": "after every rank published, the pads did not hold one flag at pid * WORLD + src on "
                        "every peer's pad for each sender src and program pid: the publisher sets flag pid * WORLD "
                        "+ rank (its own rank, not the peer's) on each peer's pad, one flag per program",
    "waits on the peers' pads": "your reduce went ahead when only your own rank had published: it took the flags "
                                "you set on the peers' pads, not the peers' flags on yours. Wait on your own pad "
                                "(tl.load(pad_table_ptr + rank)) for flag pid * WORLD + p of every peer p",
    "rows BLOCK_N apart": "your rows were BLOCK_N apart, not n_cols: rows are contiguous, n_cols apart, in x, "
                          "out and the buffers, so a row's offsets are row * n_cols + cols (cols < n_cols masked); "
                          "BLOCK_N is only the tile's width",
    "reduce never ran": "every rank had published and the pads held every flag, yet the reduce wrote nothing: "
                        "it waited for a flag no peer sets (your own rank's, p == rank, or another slot than "
                        "pid * WORLD + p on your own pad) and gave up after max_spins",
    "wait never gives up": "your reduce half, launched before any peer published, still waits: a wait that "
                           "ignores max_spins spins forever when a flag does not come (a hung job on GPUs). Retry "
                           "the atomic_cas at most max_spins times, count the flags that did not come, and skip "
                           "the reduce if one is missing",
    "rows split otherwise than published": "a flag says that program pid of a peer published its rows, pid, pid + "
                                           "programs, ...: your reduce half read rows of a program whose flag it "
                                           "never waited for (a race on GPUs: the check's schedule hides it). "
                                           "Split the rows the same way in both halves: tl.range(pid, n_rows, "
                                           "tl.num_programs(0))",
    "rows WORLD apart": "your reduce half stepped through the rows by WORLD, not by the number of programs: rows "
                        "that no program reaches were never written (and where WORLD < programs, rows were "
                        "reduced by programs that never waited for them). Step by tl.num_programs(0) in both halves",
    "norm of s before its rounding": "y normalizes the float32 sum, not the s you stored: the next layer reads "
                                     "the stored s, so normalize that one, s.to(tl.float32) after rounding it to "
                                     "x's dtype, and round y once at its store",
    "sum in 16 bits": "the sum was accumulated in a 16-bit dtype, rounding after every rank's add: accumulate in "
                      "float32 (tl.zeros((BLOCK_N,), tl.float32), each load .to(tl.float32)) and round once, at "
                      "the store",
}

