"""The LM head fused with its cross-entropy on a GPU, at GPT-2 small's shapes (8192 and 16384 rows, vocabulary
50304, width 768, bf16, the head tied: logits = h @ wte.T).

1. Correctness against float32 torch (``F.cross_entropy(F.linear(h.float(), w.float()))`` and its gradients):
   the course's chunked version (``course_utils.ops.linear_ce.linear_cross_entropy``) must be within fixed
   tolerances and no worse than 2x eager bf16's own error (eager also rounds the logits to bf16); a batch
   with ignored rows (-100) and with a bad target (NaN) on a small shape; a CUDA graph of forward +
   backward replayed on new inputs matches eager.
2. Time of forward + backward (``torch.autograd.grad`` of the loss for h and w; ``do_bench`` median, ms)
   for eager (F.linear + F.cross_entropy(logits.float())), ``torch.compile`` of that function, and the
   course's version; and the course's chunked path with other chunk sizes (the default is
   ``chunk_rows_for``: the fewest chunks of at most 256 MiB of logits).
3. Peak memory above the inputs of one forward + backward, measured (``torch.cuda.max_memory_allocated``,
   :func:`course_utils.traffic.measure_peak_memory`) next to the model's (:func:`course_utils.traffic.lm_head_loss`).

The table printed last has one row per (rows, version). Run from the repository root (a few minutes,
most of them torch.compile):

    python tools/gpu_checks/linear_cross_entropy.py          # (--smoke: tiny sizes on the CPU, times meaningless)
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
import triton

import course_utils as cu
from course_utils import traffic
from course_utils.ops import linear_ce as L
from course_utils.tuned import linear_cross_entropy as T

ROWS = (8192, 16384)
VOCAB, WIDTH = 50304, 768
DTYPE = torch.bfloat16
CHUNKS = (512, 1024, 4096)          # other chunk sizes timed next to the default
LOGIT_STD = 3.0                     # a trained model's logits spread (GPT-2's initial ones are ~0.5)
TOL = {"loss": 5e-3, "dh": 3e-2, "dw": 3e-2}   # relative to max|reference| (loss: to |loss|)
SMOKE = False


def inputs(rows, vocab, d, dtype, seed=0):
    gen = torch.Generator(device=cu.DEVICE).manual_seed(seed)
    h = torch.randn(rows, d, device=cu.DEVICE, generator=gen).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, d, device=cu.DEVICE, generator=gen) * LOGIT_STD * d ** -0.5).to(dtype).requires_grad_(True)
    t = torch.randint(0, vocab, (rows,), device=cu.DEVICE, generator=gen)
    return h, w, t


def loss_and_grads(fn, h, w, t):
    loss = fn(h, w, t)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), gh, gw


def errors(got, want):
    """Relative errors (loss: to |loss|; dh, dw: max|diff| / max|reference|), NaN counted as infinite."""
    out = {}
    for name, g, r in zip(("loss", "dh", "dw"), got, want):
        g, r = g.float(), r.float()
        if bool(torch.isnan(g).any()):
            out[name] = float("inf")
        else:
            out[name] = float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
    return out


def check_correctness(rows) -> tuple[bool, dict]:
    h, w, t = inputs(rows, VOCAB, WIDTH, DTYPE)
    ref32 = loss_and_grads(lambda h, w, t: F.cross_entropy(F.linear(h, w), t), *(x.detach().float().requires_grad_(True)
                                                                                 for x in (h, w)), t)
    course = errors(loss_and_grads(L.linear_cross_entropy, h, w, t), ref32)
    eager = errors(loss_and_grads(T.linear_cross_entropy_ref, h, w, t), ref32)
    ok = all(course[k] <= max(TOL[k], 2 * eager[k]) for k in TOL) and all(course[k] <= 4 * TOL[k] for k in TOL)
    print(f"{'ok ' if ok else 'BAD'} {rows} rows: rel err vs float32 torch, course / eager bf16: "
          + ", ".join(f"{k} {course[k]:.1e} / {eager[k]:.1e}" for k in TOL), flush=True)
    return ok, course


def check_ignore_and_bad_targets() -> bool:
    h, w, t = inputs(1000, 5003, 64, DTYPE, seed=1)
    t[::7] = -100
    ref32 = loss_and_grads(lambda h, w, t: F.cross_entropy(F.linear(h, w), t),
                           *(x.detach().float().requires_grad_(True) for x in (h, w)), t)
    e = errors(loss_and_grads(L.linear_cross_entropy, h, w, t), ref32)
    ok = all(e[k] <= TOL[k] for k in TOL)
    t[3] = 5003
    bad = bool(torch.isnan(L.linear_cross_entropy(h, w, t)))
    print(f"{'ok ' if ok else 'BAD'} ignore_index=-100 on every 7th row: "
          + ", ".join(f"{k} {v:.1e}" for k, v in e.items()))
    print(f"{'ok ' if bad else 'BAD'} a target outside the vocabulary gives a NaN loss", flush=True)
    return ok and bad


def check_cuda_graph() -> bool:
    """Forward + backward captured once, replayed on new h: the same numbers as an eager call."""
    if not torch.cuda.is_available():
        print("-- CUDA graph check skipped (no GPU)")
        return True
    h, w, t = inputs(2048, VOCAB, WIDTH, DTYPE, seed=2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            loss_and_grads(L.linear_cross_entropy, h, w, t)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = loss_and_grads(L.linear_cross_entropy, h, w, t)
    fresh, _, _ = inputs(2048, VOCAB, WIDTH, DTYPE, seed=3)
    with torch.no_grad():
        h.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    want = loss_and_grads(L.linear_cross_entropy, h, w, t)
    same = all(torch.equal(a, b) for a, b in zip(static, want))
    e = errors(static, want)
    ok = all(v <= 1e-3 for v in e.values())      # cuBLAS may pick another algorithm under capture
    print(f"{'ok ' if ok else 'BAD'} CUDA graph of forward + backward, replayed on new h, against an eager call: "
          f"bitwise equal {same}; rel err " + ", ".join(f"{k} {v:.1e}" for k, v in e.items()), flush=True)
    return ok


def median_ms(fn) -> float:
    if not cu.on_gpu():   # --smoke: one wall-clock call, to exercise the script
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def time_versions(rows, compiled) -> dict[str, float]:
    h, w, t = inputs(rows, VOCAB, WIDTH, DTYPE)
    runs = {"eager": T.linear_cross_entropy_ref, "torch.compile": compiled, "course": L.linear_cross_entropy}
    default = T.chunk_rows_for(rows, VOCAB, DTYPE.itemsize)
    for c in CHUNKS:
        if c != default and c < rows:
            runs[f"course, chunk {c}"] = lambda h, w, t, c=c: T.linear_cross_entropy(h, w, t, chunk_rows=c)
    out = {}
    for name, fn in runs.items():
        step = lambda fn=fn: torch.autograd.grad(fn(h, w, t), (h, w))  # noqa: E731
        step()
        step()
        out[name] = median_ms(step)
        print(f"  {rows} rows {name:>20}: {out[name]:.3f} ms fwd+bwd", flush=True)
    return out


def main(argv) -> int:
    global ROWS, VOCAB, WIDTH, DTYPE, CHUNKS, SMOKE
    if "--smoke" in argv:
        ROWS, VOCAB, WIDTH, DTYPE, CHUNKS, SMOKE = (96,), 301, 16, torch.float32, (32,), True
    elif not cu.on_gpu():
        print("tools/gpu_checks/linear_cross_entropy.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    start = time.time()
    print(f"dweight accumulated in float32 by cuBLAS (torch.addmm out_dtype): "
          f"{T._fp32_out_dtype_gemm(torch.empty(1, device=cu.DEVICE))}")
    ok = True
    errs = {}
    for rows in ROWS:
        good, errs[rows] = check_correctness(rows)
        ok &= good
    if not SMOKE:
        ok &= check_ignore_and_bad_targets()
    ok &= check_cuda_graph()
    print("dweight: accumulated by torch.addmm(out_dtype=float32) in place: "
          f"{T.ACCUMULATE_IN_PLACE.get(torch.empty(0, device=cu.DEVICE).device, True)}")
    if not ok:
        print("FAIL: the course's version disagrees (above); no timings")
        return 1
    compiled = torch.compile(T.linear_cross_entropy_ref, backend="inductor" if cu.on_gpu() else "aot_eager")
    table = []
    for rows in ROWS:
        times = time_versions(rows, compiled)
        model = traffic.lm_head_loss(rows, VOCAB, WIDTH, str(DTYPE))
        peaks = (traffic.measure_peak_memory(rows, VOCAB, WIDTH, str(DTYPE)) if cu.on_gpu() else {})
        modelled = {"eager": model["eager"].peak_bytes, "course": model["chunked fused"].peak_bytes,
                    "torch.compile": model["unchunked fused"].peak_bytes}
        for name, ms in times.items():
            peak = peaks.get({"torch.compile": "compile"}.get(name, name))
            table.append((rows, name, ms, times["eager"] / ms, times["torch.compile"] / ms,
                          peak, modelled.get(name)))
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    gb = lambda b: "" if b is None else f"{b / 1e9:.3f}"  # noqa: E731
    print(f"\n{cu.env.device_name()}, torch {torch.__version__}, triton {triton.__version__}, {DTYPE}, vocab {VOCAB}, "
          f"d {WIDTH}, {time.time() - start:.0f} s. ms: fwd+bwd median; x: eager/this and compile/this (>1: "
          f"this is faster); peak: GB above the inputs, measured (model: traffic.lm_head_loss; for compile the "
          f"model is the unchunked fused bound). Course errors vs float32: "
          + "; ".join(f"{r}: " + ", ".join(f"{k} {v:.1e}" for k, v in e.items()) for r, e in errs.items()))
    print(f"{'rows':>6} {'version':>20} {'ms':>8} {'x eager':>8} {'x compile':>9} {'peak GB':>8} {'model GB':>9}")
    for rows, name, ms, xe, xc, peak, mod in table:
        print(f"{rows:>6} {name:>20} {ms:>8.3f} {xe:>8.2f} {xc:>9.2f} {gb(peak):>8} {gb(mod):>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
