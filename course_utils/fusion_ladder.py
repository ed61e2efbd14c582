"""What each fusion of chapter 12's GPT step should save: the traffic model's prediction, fusion by fusion.

:data:`FUSIONS` names the fusion ladder's rungs in order (``benchmarks/training.py`` measures each one);
:func:`fusion_accounts` lists the kernels of one training step before and after each rung, as the course's
traffic model (:mod:`course_utils.traffic`) counts them.
"""

from __future__ import annotations

#: The fusion ladder's steps, in order (benchmarks/training.py measures each one).
FUSIONS = ("+ AdamW(fused=True)", "+ attention reads q, k, v by strides", "+ residual add + LayerNorm in one kernel",
           "+ bias + GELU fused with the MLP's first GEMM", "+ fused cross-entropy",
           "+ LM head and loss in one op (logits never written whole)",
           "+ bf16 weights, float32 masters in one AdamW kernel (the course's step)")


def fusion_accounts(cfg, batch: int, n_params: int) -> dict:
    """``{fusion: traffic.Comparison}``: the kernels one training step runs before and after each fusion
    of :data:`FUSIONS` (forward and backward, every layer), as the course's traffic model counts them.

    M = batch x seq_len rows of width d; bf16 activations (2 bytes), a float32 residual stream and
    float32 optimizer state (4 bytes), P parameters, vocabulary V. A kernel's ``reuse_bytes`` are the
    reads of what the kernel before it wrote (``traffic.estimate_time(..., l2_reuse=True)`` lets L2
    serve them). Modelled, not measured:

    - AdamW: the foreach version's seven passes over the parameters (lerp m; v *= b2; v += g*g; sqrt;
      divide; add eps; p -= lr m / denom: 18 P floats) against one fused pass (reads p, g, m, v and
      writes p, m, v: 7 P); one launch per pass (each is a few multi-tensor launches in reality).
    - q, k, v: three copies forward (Md each, read and written) and one in backward (3Md), per layer.
    - residual add + LayerNorm, at 2 x n_layer sites: forward, the add (reads x and the bf16 branch,
      writes s) and the LayerNorm reading s again; backward, the add that sums the two gradients of s.
    - bias + GELU: chapter 9's comparison (the GEMM writes z, one kernel reads it and writes GELU(z)),
      forward only: what the backward does is the op's choice (see the measurement).
    - the loss: cast to float32, log-softmax, NLL, and their backward (three kernels each way) against
      one pass each way over the bf16 logits (and the mean of the rows' losses).
    """
    from . import traffic as T

    L, d, V = cfg.n_layer, cfg.d_model, cfg.vocab
    M = batch * cfg.seq_len
    md16, md32 = M * d * 2, M * d * 4

    def pair(name, unfused, fused):
        return T.Comparison(name, T.Traffic("unfused", tuple(T.Kernel(*k) for k in unfused)),
                            T.Traffic("fused", tuple(T.Kernel(*k) for k in fused)))

    adam = [(n, r * n_params * 4, w * n_params * 4, 0, (n != "lerp m") * n_params * 4) for n, r, w in (
        ("lerp m", 2, 1), ("v *= b2", 1, 1), ("v += g*g", 2, 1), ("sqrt v", 1, 1), ("/ bias corr.", 1, 1),
        ("+ eps", 1, 1), ("p -= lr m / denom", 3, 1))]
    out = {FUSIONS[0]: pair(FUSIONS[0], adam, [("fused AdamW", 4 * n_params * 4, 3 * n_params * 4)])}
    copies = [(f"{t}.contiguous() L{i}", md16, md16) for i in range(L) for t in "qkv"]
    copies += [(f"dqkv copy L{i}", 3 * md16, 3 * md16) for i in range(L)]
    out[FUSIONS[1]] = pair(FUSIONS[1], copies, [])
    sites = 2 * L
    add_ln = [k for i in range(sites) for k in (   # the LayerNorm re-reads the s the add just wrote
        (f"add site {i}", md32 + md16, md32), (f"LayerNorm site {i}", md32, md32, 0, md32),
        (f"grad accumulate site {i}", 2 * md32, md32))]
    # one kernel forward; its backward reads the gradient of s from outside too (md32) instead of an add
    fused_ln = [(f"add + LayerNorm site {i}, + its backward's read of ds", 2 * md32 + md16, 2 * md32)
                for i in range(sites)]
    out[FUSIONS[2]] = pair(FUSIONS[2], add_ln, fused_ln)
    mlp = T.gemm_epilogue(M, 4 * d, d, trailing="fused")
    out[FUSIONS[3]] = T.Comparison(FUSIONS[3], T.Traffic("unfused", mlp.unfused.kernels * L),
                                   T.Traffic("fused", mlp.fused.kernels * L))
    mv = M * V
    loss = [("logits.float()", 2 * mv, 4 * mv), ("log_softmax", 4 * mv, 4 * mv, 0, 4 * mv),
            ("nll_loss", 4 * M + 8 * M, 4, 0, 4 * M), ("nll backward", 8 * M, 4 * mv),
            ("log_softmax backward", 8 * mv, 4 * mv, 0, 4 * mv), ("cast back", 4 * mv, 2 * mv, 0, 4 * mv)]
    out[FUSIONS[4]] = pair(FUSIONS[4], loss, [("loss, online softmax", 2 * mv + 8 * M, 8 * M), ("mean", 4 * M, 4),
                                              ("gradient", 2 * mv + 8 * M, 2 * mv)])
    # the head's GEMM writes the bf16 logits either way; the fused op's one kernel per chunk reads them, writes
    # the loss and the gradient in place (its second pass over a row re-reads it from the cache), instead of
    # a loss kernel and a gradient kernel that each read the logits from HBM
    out[FUSIONS[5]] = pair(FUSIONS[5], [("loss, online softmax", 2 * mv + 8 * M, 8 * M),
                                        ("gradient", 2 * mv + 8 * M, 2 * mv)],
                           [("loss and gradient in place, per chunk", 2 * mv + 8 * M, 2 * mv + 4 * M, 0, 2 * mv)])
    # float32 weights under autocast: each weight cast to bf16 once per forward (read 4 P, write 2 P), each
    # gradient back to float32 (read 2 P, write 4 P), AdamW on float32 (reads p, g, m, v; writes p, m, v);
    # bf16 weights: one kernel reads g (bf16), the float32 master, m and v, writes them and the bf16 weight
    P = n_params
    out[FUSIONS[6]] = pair(FUSIONS[6], [("weights to bf16 (autocast)", 4 * P, 2 * P),
                                        ("gradients to float32", 2 * P, 4 * P),
                                        ("fused AdamW, float32", 16 * P, 12 * P)],
                           [("AdamW on float32 masters, writes the bf16 weights", 14 * P, 14 * P)])
    return out
