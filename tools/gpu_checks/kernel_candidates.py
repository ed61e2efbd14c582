"""Every candidate of the two timed choices still short of their targets (issue 29), checked, then timed.

(a) LayerNorm backward, N in {768, 4096, 8192, 16384}, bf16 and fp32, x of 256 MiB (and 8192 and 16384
    rows at N=768, chapter 12's GPT width). Each candidate of ``backward_candidates`` (the default design,
    "both") runs once against a float32 autograd reference on the same inputs (dx, dw, db); a candidate
    that does not fit this GPU is listed as "no fit". The timed choice then times them all (its
    ``choice.TIMES``: the backward alone, column sums included, best of 3 medians), and interleaved
    rounds time the chosen backward beside Liger-Kernel's backward, and forward + backward through
    autograd for ours, Liger-Kernel's, ``F.layer_norm`` and ``torch.compile(F.layer_norm)``. Last, the
    column sum that ends every backward, at N=768 with narrower column blocks (more programs).
(b) FlashAttention at d=128, bf16, B*H*N = 16 x 16384 (N 4096 and 16384), causal and not. Each forward
    tile configuration and each backward configuration (the candidates of ``backward_configs`` plus the
    ``ATTN_TRIES``, which are not candidates) is first checked against float32 math on a small
    problem with the same tile flags (o, dq, dk, dv); then the forward alone per configuration and
    forward + backward per backward configuration, beside SDPA's cuDNN and flash backends.

Prints a compact table last: per case the best of ours, the reference's time and reference_ms / ours_ms
(>= 1.0: ours is faster; issue 29 asks >= 1.0 against Liger-Kernel and torch.compile, >= 0.8 against
cuDNN). CSVs go to --out (default results/kernel_candidates). Under 5 minutes on an H100 (each section
stops starting cases when its time budget is spent, and says so). Run from the repository root:

    python tools/gpu_checks/kernel_candidates.py --out /tmp/kc      # --only ln | --only attn
    python tools/gpu_checks/kernel_candidates.py --smoke            # tiny shapes, no timing (CPU interpreter)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import layernorm_gap as G  # noqa: E402  (its inputs, plan names, fwd_bwd)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import course_utils as cu  # noqa: E402
from course_utils import env, hardware, timing  # noqa: E402
from course_utils.tuned import attention as TA  # noqa: E402
from course_utils.tuned import attention_backward as TB  # noqa: E402
from course_utils.tuned import choice  # noqa: E402
from course_utils.tuned import layernorm as T  # noqa: E402
from course_utils.tuned import layernorm_autograd as A  # noqa: E402

EPS = G.EPS
INPUT_BYTES = G.INPUT_BYTES
LN_NS = (768, 4096, 8192, 16384)
LN_ROWS_768 = (8192, 16384)          # chapter 12's step: (batch x sequence) rows of width 768
LN_TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # max |err| / max(|ref|, 1) vs float32
ATTN_NS = (4096, 16384)
ATTN_TOKENS = 16 * 16384             # B * H * N: the benchmark's 16K tokens x 16 heads
ATTN_TOL = 2e-2                      # bf16 against float32 math, max |err| / max |ref|
ROUNDS = 3
# Backward configurations timed beside the candidates (not candidates: a winner here is one to add); every
# configuration costs two compiles per mask (a few seconds each on an H100 host), so only two
ATTN_TRIES = [TB.BwdConfig(64, 128, 64, 128, 8, 3), TB.BwdConfig(64, 128, 128, 64, 8, 3, True, tma=True)]
# Forward tiles timed beside the candidates: attention_tiles_explore.csv has 128 x 128 (8 warps, 3 stages) 2-3%
# behind 64 x 64 at N=4096 non-causal and 9% causal. The warp-specialized tries (TileConfig.ws at ae746ed) were
# slower in every case on an H200 (results/h200/attention_ws_tries.csv) and are gone; next: 64 rows against 128 keys a
# tile (half the loop's trips and its per-tile softmax overhead), and a 4th stage
FWD_TRIES = [TA.TileConfig(128, 128, 8, 3, 2, True), TA.TileConfig(64, 128, 4, 2, 2, True),
             TA.TileConfig(64, 128, 8, 2, 2, True), TA.TileConfig(64, 64, 4, 4, 2, True)]


def rel_err(got, ref) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1.0))


# Candidates that failed here (wrong, or an error other than "does not fit"): left out of every timed choice
# for the rest of the run (the functions below filter them), and named in the summary (exit status 1).
EXCLUDED: set = set()
FAILURES: list[str] = []


def failed(what, tag, e: BaseException | None = None, err: float = math.nan) -> str:
    """Record a failed candidate: its note for the table (an exception, or a wrong result)."""
    if e is not None and choice.out_of_resources(e):
        return "no fit"
    note = f"ERROR {type(e).__name__}: {str(e)[:150]}" if e is not None else f"WRONG (err {err:.2e})"
    EXCLUDED.add(what)
    FAILURES.append(f"{tag} {what}: {note}")
    return note


def leave_out_failures():
    """Every timed choice of this process skips the EXCLUDED candidates (the launchers look these up by name)."""
    for module, name in ((T, "backward_candidates"), (TB, "backward_configs"), (TA, "attention_configs")):
        fn = getattr(module, name)
        setattr(module, name, lambda *a, fn=fn, **k: [c for c in fn(*a, **k) if c not in EXCLUDED])


# --------------------------------------------------------------------------- (a) LayerNorm


def liger_parts():
    """Liger-Kernel's autograd Function and its forward/backward functions, or None (a skipped row)."""
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction, layer_norm_backward, layer_norm_forward
    except Exception as e:  # noqa: BLE001 - a missing peer is a skipped row
        print(f"liger rows skipped: liger_kernel does not import ({type(e).__name__}: {str(e)[:100]})")
        return None
    return LigerLayerNormFunction, layer_norm_forward, layer_norm_backward


def ln_reference(x, w, b, dy):
    """float32 autograd on the GPU: (dx, dw, db)."""
    ref = [t.detach().float().requires_grad_() for t in (x, w, b)]
    return torch.autograd.grad(F.layer_norm(ref[0], ref[0].shape[-1:], ref[1], ref[2], EPS), ref, dy.float())


def ln_case(n, m, dtype, lg, compiled, smoke) -> tuple[list[dict], list[dict]]:
    """One (N, rows, dtype): per-candidate rows (check, choice time) and the interleaved timings."""
    x, w, b, dy = G.inputs(m, n, dtype, env.DEVICE)
    want = ln_reference(x, w, b, dy)
    info = hardware.device_info()
    _, mean, rstd = T._forward(x, w, b, EPS, False, True, "candidates")
    cands = T.backward_candidates(m, n, dtype.itemsize, info)
    tag = {"dtype": str(dtype)[6:], "N": n, "rows": m}
    cand_rows = []
    for p in cands:
        row = {**tag, "plan": G.name(p) + (f" s={p.stages}" if p.stages else "") + (f" c={p.chunk}" if p.chunk else "")}
        try:
            got = T.layer_norm_backward(dy, x, w, mean, rstd, plan=p)
            row["err"] = max(rel_err(g, r) for g, r in zip(got, want))
            row["ok"] = row["err"] <= LN_TOL[dtype]
            if not row["ok"]:
                row["note"] = failed(p, tag, err=row["err"])
        except Exception as e:  # noqa: BLE001 - recorded; the run goes on without this candidate
            row["err"], row["ok"], row["note"] = float("nan"), None, failed(p, tag, e)
        cand_rows.append(row)
    cands = [p for p in cands if p not in EXCLUDED]
    key = (m, n, dtype, dtype, False, False, str(x.device), T.BACKWARD_DESIGN)
    T._BEST.pop(key, None)
    choice.TIMES.pop(key, None)
    T.layer_norm_backward(dy, x, w, mean, rstd)  # the timed choice (on a GPU), as autograd's first call makes it
    chosen = T._BEST.get(key, cands[0])
    seen = choice.TIMES.get(key, {})
    for row, p in zip(cand_rows, cands):
        row["choice_ms"] = seen.get(p, float("nan")) if seen.get(p) is not None else float("nan")
        row["chosen"] = p == chosen
    xs = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
    impls = {"bwd ours": lambda: T.layer_norm_backward(dy, x, w, mean, rstd),
             "fwd+bwd ours": G.fwd_bwd(lambda x, w, b: A.layer_norm_autograd(x, w, b, EPS), xs, dy),
             "fwd+bwd torch": G.fwd_bwd(lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS), xs, dy)}
    if compiled is not None:
        impls["fwd+bwd compile"] = G.fwd_bwd(lambda x, w, b: compiled(x, (n,), w, b, EPS), xs, dy)
    if lg is not None:
        fn, fwd, bwd = lg
        impls["fwd+bwd liger"] = G.fwd_bwd(lambda x, w, b: fn.apply(x, w, b, EPS), xs, dy)
        try:  # its backward alone: functions whose signatures change between Liger-Kernel versions
            _, _, lmean, lrstd, *_ = fwd(x, w, b, EPS)
            got = bwd(dy, x, w, b, lmean, lrstd)
            cand_rows.append({**tag, "plan": "liger", "err": max(rel_err(g, r) for g, r in zip(got, want))})
            impls["bwd liger"] = lambda: bwd(dy, x, w, b, lmean, lrstd)
        except Exception as e:  # noqa: BLE001 - a skipped row, said
            cand_rows.append({**tag, "plan": "liger", "note": f"backward alone skipped: {type(e).__name__}: {e}"[:150]})
    if smoke:
        for f in impls.values():
            f()
        return cand_rows, [{**tag, "impl": k, "ms": float("nan")} for k in impls]
    errors: dict = {}
    got = timing.time_rounds(impls, ROUNDS, errors=errors, warmup=3, rep=20)
    rows = [{**tag, "impl": k, "ms": t.median, "p20": t.p20, "p80": t.p80} for k, t in got.items()]
    rows += [{**tag, "impl": k, "ms": float("nan"), "note": e[:120]} for k, e in errors.items()]
    rows.append({**tag, "impl": "chosen plan", "ms": float("nan"), "note": G.name(chosen)})
    return cand_rows, rows


COLUMN_SUM_TILES = ((32, 64), (32, 32), (64, 32), (32, 16), (64, 16))  # (BLOCK_M, BLOCK_N); the first ships


def column_sum_tries(smoke) -> list[dict]:
    """Chapter 12's step spends 26 column sums a step at N=768 (6.3 us each on an H100, training_kernels.csv):
    the shipped tiles give 12 programs; narrower column blocks give more. Checked against torch.sum first."""
    from course_utils.kernels.layernorm import column_sum_kernel
    rows = []
    for parts in ((5,) if smoke else (132, 264, 528)):
        n = 40 if smoke else 768
        part = torch.randn(parts, n, device=env.DEVICE)
        want = part.double().sum(0)
        impls = {}
        for bm, bn in COLUMN_SUM_TILES:
            out = torch.empty(n, device=env.DEVICE, dtype=torch.bfloat16 if not smoke else torch.float16)

            def run(out=out, bm=bm, bn=bn):
                column_sum_kernel[(triton.cdiv(n, bn),)](out, part, parts, n, BLOCK_M=bm, BLOCK_N=bn)
                return out
            err = float((run().double() - want).abs().max() / want.abs().max())
            if err > 1e-2:
                FAILURES.append(f"column_sum BLOCK_M={bm} BLOCK_N={bn}: WRONG (err {err:.2e})")
                continue
            impls[f"column_sum {parts}x{n} BLOCK_M={bm} BLOCK_N={bn} ({triton.cdiv(n, bn)} programs)"] = run
        got = {k: math.nan for k in impls} if smoke else {
            k: t.median for k, t in timing.time_rounds(impls, ROUNDS, warmup=3, rep=20).items()}
        rows += [{"impl": k, "ms": ms} for k, ms in got.items()]
    return rows


def ln_section(smoke, budget_s) -> tuple[list, list]:
    lg = None if smoke else liger_parts()
    # issue 29's shapes first (widest rows first), then chapter 12's width: a spent budget drops the last ones
    dtypes = (torch.float16, torch.float32) if smoke else (torch.bfloat16, torch.float32)  # interpreter: no bf16
    cases = []
    for n in ((300, 64) if smoke else sorted(LN_NS, reverse=True)):
        for dtype in dtypes:
            rows = [37] if smoke else [INPUT_BYTES // (n * dtype.itemsize)] + (list(LN_ROWS_768) if n == 768 else [])
            cases += [(n, m, dtype) for m in rows]
    cand_rows, time_rows, t0 = [], [], time.time()
    for n, m, dtype in cases:
        if time.time() - t0 > budget_s:
            print(f"  layernorm budget spent: skipped N={n} rows={m} {dtype}", flush=True)
            continue
        compiled = None
        if not smoke:
            # one graph per case, as benchmarks/layernorm.py: past torch._dynamo.config.recompile_limit (8)
            # shapes dynamo would run the function eagerly, silently
            torch.compiler.reset()
            compiled = torch.compile(F.layer_norm, dynamic=False)
        c, r = ln_case(n, m, dtype, lg, compiled, smoke)
        cand_rows += c
        time_rows += r
        print(f"  layernorm {str(dtype)[6:]} N={n} rows={m}: {len(c)} checked ({time.time() - t0:.0f} s)", flush=True)
        if not smoke:
            torch.cuda.empty_cache()
    time_rows += [{"dtype": "float32", "N": 768, "rows": 0, **r} for r in column_sum_tries(smoke)]
    return cand_rows, time_rows


# --------------------------------------------------------------------------- (b) attention


def attn_reference(q, k, v, do, causal):
    """float32 math: (o, dq, dk, dv)."""
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    s = qf @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    o = torch.softmax(s, -1) @ vf
    return (o.detach(), *torch.autograd.grad(o, (qf, kf, vf), do.float()))


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def attn_check(fwd_cfgs, bwd_cfgs, peers, dtype, smoke) -> list[dict]:
    """Every configuration and peer on a small problem with the big one's tile flags (N a multiple of
    every tile), causal and not, against float32 math."""
    n, h = (64, 2) if smoke else (1024, 16)  # 16 heads, as timed: the same integer specializations, no new compile
    rows = []
    for causal in (False, True):
        q, k, v, do = (torch.randn(1, h, n, 128 if not smoke else 16, device=env.DEVICE, dtype=dtype)
                       for _ in range(4))
        want = attn_reference(q, k, v, do, causal)
        tries = [(f"fwd {c}", c, lambda c=c: (TA.flash_attention(q, k, v, causal, config=c),)) for c in fwd_cfgs]
        for c in bwd_cfgs:
            def fb(c=c):
                qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
                o = TB.flash_attention_autograd(qq, kk, vv, causal=causal, config=c)
                return (o, *torch.autograd.grad(o, (qq, kk, vv), do))
            tries.append((f"bwd {short(c)}", c, fb))
        for name, fn in peers.items():
            def fp(fn=fn):
                qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
                o = fn(qq, kk, vv, causal)
                return (o, *torch.autograd.grad(o, (qq, kk, vv), do))
            tries.append((name, name, fp))
        for name, cfg, fn in tries:
            row = {"causal": causal, "impl": name}
            try:
                got = fn()
                row["err"] = max(rel_err(g, r) for g, r in zip(got, want))
                row["ok"] = row["err"] <= ATTN_TOL
                if not row["ok"]:
                    row["note"] = failed(cfg, f"attention causal={causal}", err=row["err"])
            except Exception as e:  # noqa: BLE001 - recorded; the run goes on without this configuration
                row["err"], row["ok"], row["note"] = float("nan"), None, failed(cfg, f"attention causal={causal}", e)
            rows.append(row)
    return rows


def short(c) -> str:
    if isinstance(c, TA.TileConfig):
        return (f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages} tma{c.tma}" + (" qregs" if c.q_regs else ""))
    return f"{c.block_m1}x{c.block_n1}/{c.block_m2}x{c.block_n2} w{c.num_warps} s{c.num_stages}" + \
        (" atomic" if c.atomic_dq else "") + (" tma" if c.tma else "")


def attn_section(smoke, budget_s) -> tuple[list, list]:
    from torch.nn.attention import SDPBackend
    info = hardware.device_info()
    dtype = torch.float32 if smoke else torch.bfloat16  # the interpreter's bf16 arithmetic is wrong
    d = 16 if smoke else 128
    fwd_cfgs = list(dict.fromkeys(TA.attention_configs(info, d, dtype, False) + ([] if smoke else FWD_TRIES)))
    bwd_cfgs = list(dict.fromkeys(TB.backward_configs(info, d, dtype) + ([] if smoke else ATTN_TRIES)))
    n_cands = len(TB.backward_configs(info, d, dtype))
    peers = {} if smoke else {"sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                              "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    check_rows = attn_check(fwd_cfgs, bwd_cfgs, peers, dtype, smoke)
    fits = {r["impl"] for r in check_rows if r["ok"]} - {r["impl"] for r in check_rows if not r["ok"]}
    time_rows, t0 = [], time.time()
    for n in ((64,) if smoke else ATTN_NS):
        for causal in (False, True):
            if time.time() - t0 > budget_s:
                print(f"  attention budget spent: skipped N={n} causal={causal}", flush=True)
                continue
            b, h = (1, 2) if smoke else (max(ATTN_TOKENS // (16 * n), 1), 16)
            q, k, v, do = (torch.randn(b, h, n, d, device=env.DEVICE, dtype=dtype) for _ in range(4))
            xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
            flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)  # forward: 2 products of N x N x d
            tag = {"N": n, "causal": causal, "B": b, "H": h}
            fwd = {"fwd default": lambda: TA.flash_attention(q, k, v, causal)}
            fwd.update({f"fwd {short(c)}": (lambda c=c: TA.flash_attention(q, k, v, causal, config=c))
                        for c in fwd_cfgs if f"fwd {c}" in fits})
            both = {"fwd+bwd default": lambda: torch.autograd.grad(TB.flash_attention_autograd(*xs, causal), xs, do)}
            for c in bwd_cfgs:
                if f"bwd {short(c)}" in fits:
                    name = f"fwd+bwd {short(c)}" + ("" if bwd_cfgs.index(c) < n_cands else " (try)")
                    both[name] = lambda c=c: torch.autograd.grad(
                        TB.flash_attention_autograd(*xs, causal, config=c), xs, do)
            for name, fn in peers.items():
                fwd[f"fwd {name}"] = lambda fn=fn: fn(q, k, v, causal)
                both[f"fwd+bwd {name}"] = lambda fn=fn: torch.autograd.grad(fn(*xs, causal), xs, do)
            impls = {**fwd, **both}
            if smoke:
                for f in impls.values():
                    f()
                time_rows += [{**tag, "impl": k, "ms": float("nan")} for k in impls]
                continue
            impls["fwd default"]()  # the timed choices, before any timing
            impls["fwd+bwd default"]()
            chosen = f"fwd {short(TA.last_config)}, bwd {short(TB.last_config)}"
            errors: dict = {}
            got = timing.time_rounds(impls, ROUNDS, errors=errors, warmup=2, rep=8)
            for k, t in got.items():
                f = flops * (3.5 if k.startswith("fwd+bwd") else 1.0)  # FlashAttention-2's count: 2 + 5 products
                time_rows.append({**tag, "impl": k, "ms": t.median, "p20": t.p20, "p80": t.p80,
                                  "tflops": f / t.median / 1e9, "note": chosen if "default" in k else ""})
            time_rows += [{**tag, "impl": k, "ms": float("nan"), "note": e[:120]} for k, e in errors.items()]
            print(f"  attention N={n} causal={causal}: {len(impls)} timed ({time.time() - t0:.0f} s)", flush=True)
    return check_rows, time_rows


# --------------------------------------------------------------------------- summary


def best_of(df, prefix, exclude):
    ours = df[df.impl.str.startswith(prefix) & ~df.impl.str.contains("|".join(exclude)) & df.ms.notna()]
    return ours.loc[ours.ms.idxmin()] if len(ours) else None


def summary(ln_cands, ln_times, attn_times):
    import pandas as pd
    lines = []
    if len(ln_times):
        t = pd.DataFrame(ln_times)
        c = pd.DataFrame(ln_cands)
        sums = t[t.impl.str.startswith("column_sum")]
        for parts, g in sums.groupby(sums.impl.str.split(" ").str[1], sort=False):
            if g.ms.notna().any():
                best = g.loc[g.ms.idxmin()]
                lines.append(f"column_sum {parts}: shipped {g.ms.iloc[0] * 1e3:6.2f} us, best {best.ms * 1e3:6.2f} us "
                             f"({best.impl.split(' ', 2)[2]})")
        t = t[~t.impl.str.startswith("column_sum")]
        for (dt, n, m), g in t.groupby(["dtype", "N", "rows"], sort=False):
            ms = dict(zip(g.impl, g.ms))
            cc = c[(c.dtype == dt) & (c.N == n) & (c.rows == m) & (c.plan != "liger")]
            best = cc.loc[cc.choice_ms.idxmin()] if cc.choice_ms.notna().any() else None
            fb = ms.get("fwd+bwd ours", math.nan)
            lines.append(f"LN {dt:>8} N={n:>5} rows={m:>6}  best bwd {best.plan if best is not None else '-':<34} "
                         f"{best.choice_ms if best is not None else math.nan:7.3f} ms | bwd liger/ours "
                         f"{ms.get('bwd liger', math.nan) / ms.get('bwd ours', math.nan):5.2f} | fwd+bwd "
                         f"{fb:6.3f} ms, liger/ours {ms.get('fwd+bwd liger', math.nan) / fb:5.2f}, "
                         f"compile/ours {ms.get('fwd+bwd compile', math.nan) / fb:5.2f}, "
                         f"torch/ours {ms.get('fwd+bwd torch', math.nan) / fb:5.2f}")
    if len(attn_times):
        t = pd.DataFrame(attn_times)
        for (n, causal), g in t.groupby(["N", "causal"], sort=False):
            for what, ref in (("fwd", "fwd sdpa_cudnn"), ("fwd+bwd", "fwd+bwd sdpa_cudnn")):
                best = best_of(g, what + " ", ["sdpa", "fwd+bwd"] if what == "fwd" else ["sdpa"])
                r = g[g.impl == ref].ms
                ref_ms = float(r.iloc[0]) if len(r) else math.nan
                if best is not None:
                    lines.append(f"attn d=128 N={n:>5} causal={causal!s:<5} {what:<7} best {best.impl:<44} "
                                 f"{best.ms:7.3f} ms | cudnn {ref_ms:7.3f} ms, cudnn/ours {ref_ms / best.ms:5.3f}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kernel_candidates", help="directory for the CSVs")
    ap.add_argument("--only", choices=("ln", "attn"), help="one section only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, nothing timed (runs on the interpreter)")
    ap.add_argument("--ln-budget", type=float, default=150.0, help="seconds after which no new LayerNorm case starts")
    ap.add_argument("--attn-budget", type=float, default=60.0, help="the same for attention")
    args = ap.parse_args(argv)
    if not args.smoke and not cu.on_gpu():
        print("kernel_candidates.py needs a CUDA GPU (or --smoke under the interpreter)", file=sys.stderr)
        return 2
    import pandas as pd
    pd.set_option("display.width", 250)
    torch.manual_seed(0)
    leave_out_failures()
    t0 = time.time()
    print(env.banner())
    ln_cands, ln_times, attn_checks, attn_times = [], [], [], []
    if args.only in (None, "ln"):
        ln_cands, ln_times = ln_section(args.smoke, args.ln_budget)
    if args.only in (None, "attn"):
        attn_checks, attn_times = attn_section(args.smoke, args.attn_budget)
    os.makedirs(args.out, exist_ok=True)
    for name, rows in (("ln_candidates", ln_cands), ("ln_times", ln_times), ("attn_checks", attn_checks),
                       ("attn_times", attn_times)):
        if rows:
            pd.DataFrame(rows).to_csv(os.path.join(args.out, f"{name}.csv"), index=False)
    if ln_cands:
        print("\nLayerNorm backward candidates (err: max |err| / max(|ref|, 1) vs float32; choice_ms: the timed "
              "choice's best of 3 medians, column sums included):")
        print(pd.DataFrame(ln_cands).to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    if attn_checks:
        print("\nattention checks against float32 math (N=1024, B=1, H=16), causal and not:")
        df = pd.DataFrame(attn_checks)
        print(df.groupby("impl", sort=False).agg(err=("err", "max"), ok=("ok", "all")).to_string(
            float_format=lambda x: f"{x:.2e}"))
    if attn_times:
        print("\nattention d=128 bf16 times:")
        print(pd.DataFrame(attn_times).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if ln_times:
        print("\nLayerNorm times (median of interleaved rounds):")
        print(pd.DataFrame(ln_times).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"\ndone in {time.time() - t0:.0f} s; CSVs in {args.out}")
    print("\nSUMMARY (reference_ms / ours_ms: >= 1 means ours is faster)")
    for line in summary(ln_cands, ln_times, attn_times):
        print(line)
    for line in FAILURES:  # left out of the timed choices above
        print("FAILED", line)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
