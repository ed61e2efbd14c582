"""The texts of chapter 8's checkers (:mod:`course_utils.checkers.bench`): what each named fault of a timer
(8.1), a bandwidth probe (8.2) and a roofline (8.3) means and what to fix, keyed by the fault's name."""

from __future__ import annotations

TIMER_FAULTS = {
    "fn never called": "you never called fn(), so nothing was timed: a number that does not come from the "
                       "GPU's clock fits one kernel at most. Call fn() between two recorded events",
    "no clock read": "you called fn() but never read a clock (no gpu.Event() pair, no host_time()): the number "
                     "you return was not measured. Record an event before and after each call",
    "seconds": "your number is about 1/1000 of the kernel's time: you returned seconds. elapsed_time already "
               "gives milliseconds, and time_kernel returns milliseconds: do not divide by 1000",
    "microseconds": "your number is about 1000x the kernel's time: you returned microseconds. elapsed_time "
                    "already gives milliseconds, and time_kernel returns milliseconds: do not multiply by 1000",
    "zero": "your events enclose no call of fn (start and end recorded back to back): record start, call fn(), "
            "then record end",
    "negative": "end.elapsed_time(start) is negative: elapsed_time is measured from the event it is called on, "
                "so call start.elapsed_time(end)",
    "not divided by the calls": "one event pair encloses {calls} calls of fn and you did not divide by their "
                                "number: time each call between its own pair of events (the flush outside it), "
                                "or divide the pair's time by the calls it encloses",
    "many calls in one pair": "one event pair encloses {calls} calls of fn{flushes}: back to back, the calls wait "
                              "for their launches (or for the flushes between them). Record an event pair around "
                              "each single call, flush before the start event, and take the median",
    "sum of the repetitions": "your number is about the sum of your {reps} repetitions: time_kernel returns the "
                              "time of one call, the median of the repetitions' times, not their total",
    "flush inside the events": "gpu.flush_l2() runs between your start event and fn(), so every repetition "
                               "timed the flush too: flush first, then record the start event, call fn(), record "
                               "the end event",
    "synchronize inside the events": "you synchronized between fn() and the end event: the end event then "
                                     "waits for the host (the synchronization's own cost and the next launch). "
                                     "Record the end event right after fn(), and synchronize once after the loop",
    "synchronize before the start event": "you synchronized right before the start event: the GPU sat idle "
                                          "while the host launched fn(), and that launch time is in your events. "
                                          "Queue the flush, record start, call fn(), record end, without a "
                                          "synchronize in the loop (one after it)",
    "flush before each repetition": "{working_set}you flushed it {flushes} times for {reps} timed calls: "
                                    "unflushed, a repetition runs from L2 (too fast) or, with nothing queued "
                                    "before its start event, waits for fn's launch (too slow). Call "
                                    "gpu.flush_l2() before each repetition's start event",
    "minimum": "your number is below the kernel's true time with every repetition warm, synchronized and "
               "flushed: the minimum (or a low percentile) keeps the luckiest repetition. Report the median",
}

BANDWIDTH_FAULTS = {
    "kernel never called": "you made a kernel but never called it, so nothing was measured: time it "
                           "(bench.time_ms(k, device=gpu)) and divide its nbytes by that time",
    "never synchronized": "you never synchronized: the host clock ran ahead of the GPU, so your time is how fast "
                          "the host filled the queue, not how long the copies took. Time the kernel with "
                          "bench.time_ms(k, device=gpu) (it synchronizes) and divide nbytes by its median",
    "returned a Timing": "you returned the Timing (milliseconds), not a bandwidth: divide the kernel's nbytes "
                         "by its median time (bench.gbps(k.nbytes, t))",
    "half the bytes": "half of what the kernel's time gives: you counted only the bytes read (or only those "
                      "written). nbytes is what the kernel moves, reads plus writes: divide all of it by the time",
    "twice the bytes": "twice what the kernel's time gives: you counted the bytes twice. nbytes already is reads "
                       "plus writes: divide it once by the time",
    "GiB": "0.93x of what the kernel's time gives: you divided by 2**30 (GiB/s). The exercise asks for GB/s, "
           "1e9 bytes per second",
    "MiB": "0.95x of what the kernel's time gives: you converted bytes with 2**20 (MiB) and milliseconds with "
           "1e3. GB/s is nbytes / (ms * 1e-3) / 1e9",
    "milliseconds as seconds": "1/1000 of what the kernel's time gives: you divided bytes by milliseconds as "
                               "if they were seconds. GB/s is nbytes / (ms * 1e-3) / 1e9",
    "seconds as milliseconds": "1000x what the kernel's time gives: a time in seconds was used as "
                               "milliseconds (or bytes were not divided by 1e9). GB/s is nbytes / (ms * 1e-3) / 1e9",
    "a small working set made the number": "a working set under 4x L2 ({small} bytes) made your number: it ran "
                                           "from L2 or was dominated by the kernel's start-up cost. Report the "
                                           "bandwidth of the working set of at least 4x L2",
    "CUDA graph": "with cuda_graph=True one replay holds {calls} calls and time_ms divides by them: the slow "
                  "calls stay in that average, as in a mean. A kernel this large is not launch-bound: time it "
                  "without cuda_graph, each call its own repetition, and keep the median",
}

ROOF_FAULTS = {
    "max": "a kernel is limited by the lower of its two ceilings: min, not max",
    "GFLOP/s": "Units: FLOP/byte x GB/s is GFLOP/s; divide by 1000 for TFLOP/s",
    "x1000": "the memory roof is 1e6 times too high: FLOP/byte x GB/s is GFLOP/s, so divide by 1000 for "
             "TFLOP/s (do not multiply)",
    "1024": "Units: GB/s and TFLOP/s are decimal (1e9, 1e12): divide GFLOP/s by 1000, not 1024",
    "no compute ceiling": "above the ridge point you return intensity x bandwidth, past the compute ceiling: the "
                          "roofline is min(peak_tflops, intensity x bandwidth)",
    "no memory roof": "at a low intensity you return the compute ceiling: the memory roof, intensity x "
                      "bandwidth (GFLOP/s, / 1000 for TFLOP/s), is the lower one there",
    "bytes per FLOP": "you divided by the intensity: it is FLOPs per byte, so FLOP/s = intensity x bytes per "
                      "second (multiply)",
    "FLOP/s": "you returned FLOP/s: the answer is in TFLOP/s (peak_tflops is already TFLOP/s, and "
              "intensity x bw_gbps is GFLOP/s)",
    "ridge": "you returned the compute ceiling at an intensity below the ridge point (peak x 1000 / bandwidth "
             "= {ridge:.4g} FLOP/byte): check where your switch from the memory roof to the compute ceiling is",
    "past the ridge": "you returned the memory roof at an intensity above the ridge point (peak x 1000 / "
                      "bandwidth = {ridge:.4g} FLOP/byte), where the compute ceiling is lower: take the min",
    "course roofline": "your function ran the course's roofline code ({where}): that is the answer the check "
                       "compares with. Write min(peak_tflops, intensity x bw_gbps / 1000) yourself",
}
