"""GPU check of the ops' cheaper launch (course_utils/tuned/launch.py) against the plain launch, < 3 minutes.

    COURSE_MODE=cuda python tools/gpu_checks/fast_launch.py [--timed]

Each tuned op runs its first candidate plan (no timed choice: it would compile every candidate); step 1b
launches every attention tile configuration (forward and backward) fast and plain. ``--timed`` keeps the
ops' timed choices instead (slower).

1. every op of ``course_utils.ops.OPS`` plus ``attention_qkv`` and ``linear_cross_entropy``, on odd shapes,
   in bfloat16, float16 and float32, once on fresh (aligned) inputs and (bfloat16, float32) once with the
   main input a view ``buf[1:]`` of a contiguous buffer (a data pointer off the 16-byte grid: the
   alignment key): outputs and gradients of the fast path (its cache filled by a first call, then a
   second call compared) against the plain ``kernel[grid]`` path (``launch.ENABLED = False``), bit for
   bit. Where two plain runs already differ (float atomics in a tile plan), the fast run must be as
   close to the plain one as the two plain runs are to each other; the table says which;
1b. every forward and backward tile configuration of the tuned attention, fast against plain;
2. a CUDA graph of a GPT block's ops, forward and backward (fast path on, captured and replayed twice on
   new inputs copied in), against eager plain runs on the same inputs, bit for bit;
3. ``course_utils.ops.host_overhead_table()`` with the fast path on and off, and one bare launch of a
   one-element kernel three ways; a short table last.

Under the interpreter (COURSE_MODE=interpreter, CPU) it runs a small float32/float16 smoke of step 1
(both paths are the plain one there) and skips the rest.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from checklog import RESULTS, record  # noqa: E402  (tools/gpu_checks, the script's folder)

import course_utils as cu  # noqa: E402
from course_utils import ops  # noqa: E402
from course_utils.tuned import launch as L  # noqa: E402

GPU = cu.on_gpu()
DEV = cu.DEVICE


class CountingCache(dict):
    """The launch cache, counting the lookups that found a compiled kernel (the fast launches)."""
    hits = 0

    def get(self, key, default=None):
        value = super().get(key, default)
        if value is not None:
            CountingCache.hits += 1
        return value


# --------------------------------------------------------------------------- the cases

B, N, H, HD, V = 2, 37, 3, 40, 1001        # odd sizes: 37 tokens, head dim 40 (padded to 64), vocabulary 1001
D = H * HD


def _tensor(g, shape, dtype, scale=1.0, offset=False):
    """A leaf of ``shape``: fresh memory, or (offset) a view one element into a buffer, so its data pointer
    is 2 or 4 bytes off a 16-byte boundary (contiguous all the same)."""
    n = 1
    for s in shape:
        n *= s
    buf = (torch.randn(n + 1, generator=g, device=DEV) * scale).to(dtype)
    t = buf[1:] if offset else buf[:n].clone()
    return t.view(shape).detach().requires_grad_(True)


def _inputs(name, dtype, offset, seed=0):
    """(call, leaves): ``call(*leaves)`` runs op ``name`` and returns its outputs as a tuple."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    targets = torch.randint(0, V, (B * N,), generator=torch.Generator(device=DEV).manual_seed(7), device=DEV)

    def t(*shape, scale=1.0, dt=dtype, off=False):
        return _tensor(g, shape, dt, scale, off and offset)

    causal = True
    if name == "layer_norm":
        return (lambda x, w, b: (ops.layer_norm(x, w, b, 1e-5),)), [t(B, N, D, scale=2.0, off=True), t(D), t(D)]
    if name == "add_layer_norm":
        res = torch.float32 if dtype != torch.float32 else dtype   # the residual stream in float32, as GPT keeps it
        return (lambda x, r, w, b: ops.add_layer_norm(x, r, w, b, 1e-5)), [
            t(B, N, D, off=True), t(B, N, D, dt=res, off=True), t(D, dt=res), t(D, dt=res, scale=0.1)]
    if name == "linear_gelu":
        return (lambda x, w, b: (ops.linear_gelu(x, w, b),)), [t(B, N, D, off=True), t(4 * D, D, scale=D ** -0.5),
                                                               t(4 * D, scale=0.1)]
    if name == "attention":
        def attention(qkv):
            q, k, v = qkv.view(B, N, 3, H, HD).permute(2, 0, 3, 1, 4)
            return (ops.attention(q, k, v, causal, HD ** -0.5),)
        return attention, [t(B, N, 3 * D, scale=0.5, off=True)]
    if name == "attention_qkv":
        return (lambda qkv: (ops.attention_qkv(qkv, H, causal),)), [t(B, N, 3 * D, scale=0.5, off=True)]
    if name == "cross_entropy":   # the same targets for every seed (a CUDA graph's replays keep them)
        return (lambda lg: (ops.cross_entropy(lg, targets),)), [t(B * N, V, scale=3.0, off=True)]
    if name == "bias_gelu_dropout":
        seed_t = torch.tensor([1234], dtype=torch.int64, device=DEV)
        return (lambda x, b: (ops.bias_gelu_dropout(x, b, 0.1, seed_t),)), [t(B, N, 4 * D, off=True),
                                                                           t(4 * D, scale=0.1)]
    if name == "linear_cross_entropy":
        return (lambda h, w: (ops.linear_cross_entropy(h, w, targets),)), [t(B * N, D, off=True),
                                                                            t(V, D, scale=D ** -0.5)]
    raise ValueError(name)


NAMES = tuple(ops.OPS) + ("attention_qkv", "linear_cross_entropy")


def _run(name, dtype, offset):
    """Outputs and gradients (of every floating leaf) of one call on the case's inputs (made again, the same)."""
    call, leaves = _inputs(name, dtype, offset)
    outs = call(*leaves)
    g = torch.Generator(device=DEV).manual_seed(1)
    dys = [torch.randn(o.shape, generator=g, device=DEV).to(o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, leaves, dys, allow_unused=True)
    return [o.detach() for o in outs] + [gr for gr in grads if gr is not None]


def _max_diff(a, b) -> float:
    return max(((x.double() - y.double()).abs().max().item() if x.numel() else 0.0) for x, y in zip(a, b))


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                                    for x, y in zip(a, b))


def _verdict(what, plain, plain2, fast) -> str:
    """"bitwise" when the two plain runs agree and fast equals them; else fast must be as close to plain as
    the plain runs are to each other (float atomics add in a different order every run)."""
    if _same(plain, plain2):
        if not _same(plain, fast):
            raise AssertionError(f"{what}: fast != plain, largest difference {_max_diff(plain, fast):.3g}")
        return "bitwise"
    noise, diff = _max_diff(plain, plain2), _max_diff(plain, fast)
    if diff > 2 * noise:
        raise AssertionError(f"{what}: fast differs by {diff:.3g}, two plain runs by {noise:.3g}")
    return f"non-deterministic (plain runs differ by {noise:.2g}; fast by {diff:.2g})"


def _both(run, what):
    """(verdict, fast launches) of ``run()`` (a list of tensors) by the plain path twice and the fast path."""
    L.ENABLED = False
    run()                                     # plans chosen and cached, kernels compiled
    plain, plain2 = run(), run()
    L.ENABLED = True
    run()                                     # fills the launch cache
    hits = CountingCache.hits
    fast = run()
    used = CountingCache.hits - hits
    if GPU and used == 0:
        raise AssertionError(f"{what}: the fast path launched nothing from its cache")
    return _verdict(what, plain, plain2, fast)


def _compare(name, dtype, offset) -> str:
    return _both(lambda: _run(name, dtype, offset), f"{name} {dtype} offset={offset}")


def fast_equals_plain(dtypes):
    def check():
        verdicts = {}
        for dtype in dtypes:
            for name in NAMES:
                for offset in (False, True) if dtype != torch.float16 else (False,):   # 2- and 4-byte offsets
                    v = _compare(name, dtype, offset)
                    verdicts.setdefault(v, []).append(f"{name}/{str(dtype)[6:]}{'/off' if offset else ''}")
        return "; ".join(f"{v}: {len(cases)} cases" + ("" if v == "bitwise" else f" ({', '.join(cases)})")
                         for v, cases in verdicts.items()) + f"; {CountingCache.hits} fast launches"
    return check


def every_attention_tile(dtype=torch.bfloat16):
    """Each forward and backward tile configuration of the tuned attention on this GPU (descriptor modes
    included: d = 64 and N = 256 let the inputs take tensor descriptors), launched fast and plain."""
    from course_utils import hardware
    from course_utils.tuned import attention as F_
    from course_utils.tuned import attention_backward as B_
    Bq, Hq, Nq, Dq = 2, 4, 256, 64
    g = torch.Generator(device=DEV).manual_seed(3)
    q, k, v, do = (torch.randn(Bq, Hq, Nq, Dq, generator=g, device=DEV).to(dtype) for _ in range(4))
    info, scale, verdicts = hardware.device_info(q), Dq ** -0.5, {}

    def fwd(cfg):
        o = q.new_empty((Bq, Nq, Hq, Dq)).permute(0, 2, 1, 3)
        lse = torch.empty((Bq, Hq, Nq), dtype=torch.float32, device=DEV)
        F_._launch_tuned(cfg, q, k, v, o, lse, scale, True)
        return [o, lse]

    o, lse = fwd(F_.attention_configs(info, Dq, dtype, True)[0])
    delta = B_.delta_rows(o, do)

    def bwd(cfg):
        grads = [torch.empty_like(t) for t in (q, k, v)]
        B_._launch(cfg, q, k, v, do, lse, delta, *grads, scale, True)
        return grads

    for cfg in F_.attention_configs(info, Dq, dtype, True):
        verdicts.setdefault(_both(lambda cfg=cfg: fwd(cfg), f"forward {cfg}"), []).append(f"fwd {cfg}")
    for cfg in B_.backward_configs(info, Dq, dtype):
        verdicts.setdefault(_both(lambda cfg=cfg: bwd(cfg), f"backward {cfg}"), []).append(f"bwd {cfg}")
    return "; ".join(f"{v}: {len(c)} tiles" + ("" if v == "bitwise" else f" ({', '.join(c)})")
                     for v, c in verdicts.items())


# --------------------------------------------------------------------------- CUDA graph


GRAPH_OPS = ("layer_norm", "add_layer_norm", "linear_gelu", "attention_qkv", "linear_cross_entropy", "cross_entropy")


def graphed_block():
    """Capture the fast path's forward + backward of several ops in one CUDA graph; replay it on new inputs
    copied into its static ones; compare each replay with eager plain runs on those inputs."""
    dtype = torch.bfloat16
    statics = {name: _inputs(name, dtype, offset=True, seed=10) for name in GRAPH_OPS}
    dys, results, verdicts = {}, {}, {}

    def step():
        for name, (call, leaves) in statics.items():
            outs = call(*leaves)
            if name not in dys:
                g = torch.Generator(device=DEV).manual_seed(1)
                dys[name] = [torch.randn(o.shape, generator=g, device=DEV).to(o.dtype) for o in outs]
            grads = torch.autograd.grad(outs, leaves, dys[name])
            results[name] = list(outs) + list(grads)

    L.ENABLED = True
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    hits = CountingCache.hits
    with torch.cuda.graph(graph):
        step()
    captured = CountingCache.hits - hits
    if captured == 0:
        raise AssertionError("no fast launch inside the capture")
    for replay, seed in enumerate((11, 12)):
        for name, (_, leaves) in statics.items():
            _, fresh = _inputs(name, dtype, offset=True, seed=seed)
            with torch.no_grad():
                for s, f in zip(leaves, fresh):
                    s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        L.ENABLED = False
        for name in statics:
            def eager(name=name, seed=seed):
                call, fresh = _inputs(name, dtype, offset=True, seed=seed)
                outs = call(*fresh)
                return [t.detach() for t in list(outs) + list(torch.autograd.grad(outs, fresh, dys[name]))]
            got = [r.detach().clone() for r in results[name]]
            verdicts.setdefault(_verdict(f"replay {replay}: {name}", eager(), eager(), got), set()).add(name)
        L.ENABLED = True
    return (f"{len(GRAPH_OPS)} ops, {captured} fast launches captured, 2 replays against eager plain runs: "
            + "; ".join(f"{v}: {sorted(n)}" for v, n in verdicts.items()))


# --------------------------------------------------------------------------- host time


def _per_call_us(fn, n=2000) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return us


HOST = {}


def host_tables():
    from course_utils.ops.overhead import touch_kernel
    for enabled in (True, False):
        L.ENABLED = enabled
        HOST[enabled] = ops.host_overhead_table()
    L.ENABLED = True
    one = torch.zeros(1, device=DEV)
    HOST["bare"] = {
        "touch_kernel[(1,)](x)": _per_call_us(lambda: touch_kernel[(1,)](one)),
        "launch(touch_kernel, ...)": _per_call_us(lambda: L.launch(touch_kernel, "touch", (1,), (one,), {})),
        "x.add_(1)": _per_call_us(lambda: one.add_(1.0)),
    }
    return "tables below"


def print_host():
    if not HOST:
        return
    on, off = HOST[True], HOST[False]
    print("\nhost microseconds per call (course wrapper), fast launch on / off "
          f"({cu.env.device_name()}):")
    print(f"{'op':34s} {'fwd on':>8s} {'fwd off':>8s} {'fwd+bwd on':>11s} {'fwd+bwd off':>12s} {'aten f+b':>9s}")
    for (_, a), (_, b) in zip(on.iterrows(), off.iterrows()):
        if str(a["op"]).startswith("("):
            continue
        print(f"{a['op']:34s} {a['course_us']:8.1f} {b['course_us']:8.1f} {a['course_fwd_bwd_us']:11.1f} "
              f"{b['course_fwd_bwd_us']:12.1f} {a['aten_fwd_bwd_us']:9.1f}")
    print("one bare launch of a one-element kernel:")
    for k, v in HOST["bare"].items():
        print(f"  {k:30s} {v:6.1f} us")


def main():
    start = time.perf_counter()
    L._CACHE = CountingCache()
    L.clear()
    if "--timed" not in sys.argv:   # each tuned op's first candidate plan: no timed choice (minutes of compiles)
        from course_utils.tuned import choice
        choice.fastest = lambda cands, key, launch, cache, **kw: cands[0]
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if GPU else (torch.float32, torch.float16)
    record("fast path == plain path (outputs, gradients)", fast_equals_plain(dtypes))
    if GPU:
        record("every attention tile, fast == plain", every_attention_tile)
        record("CUDA graph capture + replay", graphed_block)
        record("host overhead, fast on / off", host_tables)
    else:
        print("interpreter: the CUDA graph and the host times need a GPU (skipped)")
    print(f"\nfast_launch checks ({cu.env.device_name()}, {time.perf_counter() - start:.0f} s):")
    for name, status, detail in RESULTS:
        print(f"  {status:4s}  {name}: {detail}")
    print_host()
    sys.exit(any(s == "FAIL" for _, s, _ in RESULTS))


if __name__ == "__main__":
    main()
