"""FlashAttention backward and the autograd Function, against float64 autograd (CPU sizes are tiny)."""

from __future__ import annotations

import pytest
import torch

import course_utils as cu
from course_utils import check
from course_utils.kernels import attention as A
from course_utils.kernels import attention_backward as AB
from course_utils.tuned import attention as TA
from course_utils.tuned import attention_backward as TB

DEV = cu.DEVICE
# max |error| / max |reference| per gradient. float32 dots run in IEEE float32 on a GPU too (TF32 would
# leave ~1e-3); the GPU's float32 tolerance allows for sums over ~1000 keys or queries.
TOL = {torch.float32: 3e-5 if cu.on_gpu() else 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

# (batch, heads, kv_heads, n_q, n_kv, head_dim, causal): ragged lengths, odd head dims, grouped-query,
# multi-query, causal with fewer and with more keys than queries (bottom-right)
CASES = [(1, 2, 2, 17, 17, 16, False), (1, 2, 2, 37, 37, 40, True), (2, 4, 2, 20, 33, 24, True),
         (1, 3, 1, 33, 20, 80, True), (1, 2, 2, 9, 41, 32, False), (1, 2, 1, 64, 64, 16, True)]


def _inputs(b, h, h_kv, n, n_kv, d, dtype, device=DEV):
    g = check.generator()
    q = torch.randn(b, h, n, d, generator=g, device=device).to(dtype)
    k, v = (torch.randn(b, h_kv, n_kv, d, generator=g, device=device).to(dtype) for _ in range(2))
    do = torch.randn(b, h, n, d, generator=g, device=device).to(dtype)
    return q, k, v, do


def _close(got, ref, dtype, what=""):
    for name, g, r in zip("qkv", got, ref):
        assert g.shape == r.shape and g.dtype == dtype, (name, g.shape, g.dtype)
        assert torch.isfinite(g).all(), f"d{name} {what}: not finite"
        err = ((g.double() - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
        assert err < TOL[dtype], f"d{name} {what}: relative error {err:.2e} > {TOL[dtype]:.0e}"


def _teaching(q, k, v, do, causal):
    o, lse = A.flash_attention_teaching(q, k, v, causal=causal, return_lse=True)
    return AB.flash_attention_backward_teaching(q, k, v, o, lse, do, causal=causal)


def _tuned(config):
    def run(q, k, v, do, causal):
        o, lse = TA.flash_attention(q, k, v, causal=causal, return_lse=True)
        return TB.flash_attention_backward(q, k, v, o, lse, do, causal=causal, config=config)
    return run


def _autograd(q, k, v, do, causal):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = TB.flash_attention_autograd(q, k, v, causal=causal)
    o.backward(do)
    return q.grad, k.grad, v.grad


IMPLS = {"teaching": _teaching, "tuned": _tuned(None),
         "tuned-atomic-dq": _tuned(TB.BwdConfig(16, 32, 32, 16, 4, 1, True)),
         "tuned-tall-tiles": _tuned(TB.BwdConfig(32, 16, 16, 32, 4, 1)), "autograd": _autograd}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gradients_match_float64_autograd(impl, case):
    dtype = torch.float32
    q, k, v, do = _inputs(*case[:6], dtype)
    causal = case[6]
    ref = AB.attention_backward_ref(q.double(), k.double(), v.double(), do.double(), causal=causal)
    _close(IMPLS[impl](q, k, v, do, causal), ref, dtype, f"{impl} {case}")


# whole tiles in every head (the descriptor path's condition), causal with more and with fewer keys, GQA, MQA
TMA_CASES = [(1, 2, 2, 64, 64, 16, False), (2, 4, 2, 64, 96, 32, True), (1, 3, 1, 96, 64, 16, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("case", TMA_CASES, ids=str)
def test_tma_backward_matches_float64(monkeypatch, case, atomic, dtype):
    """The tensor-descriptor loads (q, dO in the dK/dV pass; k, v in the dQ pass), into NaN-filled outputs."""
    cfg = TB.BwdConfig(16, 32, 32, 16, 4, 1, atomic, tma=True)
    q, k, v, do = _inputs(*case[:6], dtype)
    assert TB._use_tma(cfg, q, k, v, do)
    ref = AB.attention_backward_ref(q.double(), k.double(), v.double(), do.double(), causal=case[6])
    o, lse = TA.flash_attention(q, k, v, causal=case[6], return_lse=True)
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: (lambda t: t.fill_(float("nan")) if t.is_floating_point()
                                                          else t)(real(*a, **kw)))
    got = TB.flash_attention_backward(q, k, v, o, lse, do, causal=case[6], config=cfg)
    _close(got, ref, dtype, f"tma atomic={atomic} {case}")


def test_tma_backward_falls_back_to_pointers_where_descriptors_do_not_fit():
    cfg = TB.BwdConfig(16, 32, 32, 16, 4, 1, tma=True)
    even = _inputs(1, 2, 2, 64, 64, 16, torch.float32)
    assert TB._use_tma(cfg, *even)
    for why, (q, k, v, do) in {"ragged rows": _inputs(1, 2, 2, 40, 64, 16, torch.float32),
                               "ragged keys": _inputs(1, 2, 2, 64, 40, 16, torch.float32),
                               "padded head dim": _inputs(1, 2, 2, 64, 64, 24, torch.float32),
                               "strided dO": (*even[:3], even[3].transpose(1, 2).contiguous().transpose(1, 2))}.items():
        assert not TB._use_tma(cfg, q, k, v, do), why
        ref = AB.attention_backward_ref(q.double(), k.double(), v.double(), do.double(), causal=True)
        o, lse = TA.flash_attention(q, k, v, causal=True, return_lse=True)
        _close(TB.flash_attention_backward(q, k, v, o, lse, do, causal=True, config=cfg), ref, torch.float32, why)
    assert not TB._use_tma(TB.BwdConfig(16, 32, 32, 16, 4, 1), *even)


@pytest.mark.parametrize("impl", ["teaching", "autograd"])
def test_float16_and_scale(impl):
    q, k, v, do = _inputs(1, 2, 1, 24, 24, 32, torch.float16)
    ref = AB.attention_backward_ref(q.double(), k.double(), v.double(), do.double(), causal=True, sm_scale=0.3)
    if impl == "teaching":
        o, lse = A.flash_attention_teaching(q, k, v, causal=True, sm_scale=0.3, return_lse=True)
        got = AB.flash_attention_backward_teaching(q, k, v, o, lse, do, causal=True, sm_scale=0.3)
    else:
        q2, k2, v2 = (t.clone().requires_grad_(True) for t in (q, k, v))
        TB.flash_attention_autograd(q2, k2, v2, causal=True, sm_scale=0.3).backward(do)
        got = q2.grad, k2.grad, v2.grad
    _close(got, ref, torch.float16, impl)


def test_strided_inputs_and_broadcast_output_gradient():
    # (batch, seq, heads, d) memory viewed as (batch, heads, seq, d), and dO = ones expanded (from .sum())
    g = check.generator()
    q, k, v = (torch.randn(1, 21, 2, 16, generator=g, device=DEV).transpose(1, 2).requires_grad_(True)
               for _ in range(3))
    TB.flash_attention_autograd(q, k, v, causal=True).sum().backward()
    ref = AB.attention_backward_ref(q.double(), k.double(), v.double(), torch.ones(q.shape, dtype=torch.float64,
                                    device=DEV), causal=True)
    _close((q.grad, k.grad, v.grad), ref, torch.float32, "strided")


def test_matches_torch_autograd_of_the_reference_through_a_loss():
    q, k, v, _ = _inputs(1, 4, 2, 19, 19, 16, torch.float32)
    w = torch.randn(16, device=DEV)
    grads = []
    for fn in (TB.flash_attention_autograd, A.attention_ref):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        (fn(qq, kk, vv, causal=True) @ w).square().mean().backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    _close(grads[0], [x.double() for x in grads[1]], torch.float32, "loss")


def test_empty_and_bad_inputs():
    q, k, v, do = _inputs(0, 2, 2, 5, 5, 16, torch.float32)
    o, lse = TA.flash_attention(q, k, v, return_lse=True)
    assert all(t.shape == s.shape for t, s in zip(TB.flash_attention_backward(q, k, v, o, lse, do), (q, k, v)))
    q, k, v, do = _inputs(1, 2, 2, 8, 8, 16, torch.float32)
    o, lse = TA.flash_attention(q, k, v, return_lse=True)
    for fn in (TB.flash_attention_backward, AB.flash_attention_backward_teaching):
        with pytest.raises(ValueError, match="do must be"):
            fn(q, k, v, o, lse, do.half())
        with pytest.raises(ValueError, match="do must be"):
            fn(q, k, v, o, lse, do[:, :, :4])
        with pytest.raises(ValueError, match="lse"):
            fn(q, k, v, o, lse.double(), do)
        with pytest.raises(ValueError, match="lse"):
            fn(q, k, v, o, lse[:, :1], do)
        with pytest.raises(TypeError, match="float16"):
            fn(*(t.double() for t in (q, k, v, o)), lse, do.double())
        with pytest.raises(ValueError, match="multiple of k/v heads"):
            fn(q, k[:, :1].expand(1, 3, 8, 16), v[:, :1].expand(1, 3, 8, 16), o, lse, do)
    with pytest.raises(ValueError, match="head_dim"):
        TB.flash_attention_autograd(*(torch.zeros(1, 1, 4, 300, device=DEV) for _ in range(3)))


def test_a_pinned_config_reaches_the_backward_and_repeats_bit_for_bit():
    q, k, v, do = _inputs(1, 4, 2, 21, 21, 16, torch.float32)
    cfg = TB.BwdConfig(16, 16, 16, 16, 4, 1)
    runs = []
    for _ in range(2):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        TB.flash_attention_autograd(qq, kk, vv, causal=True, config=cfg).backward(do)
        assert TB.last_config == cfg
        runs.append(torch.cat([t.grad.flatten() for t in (qq, kk, vv)]))
    assert torch.equal(runs[0], runs[1])


def test_configs_fit_every_device():
    from course_utils import hardware
    for arch in (75, 80, 86, 89, 90):
        info = hardware.DeviceInfo.for_arch(arch)
        for d in (16, 40, 64, 96, 128, 256):
            for dtype in (torch.float16, torch.float32):
                cfgs = TB.backward_configs(info, d, dtype)
                assert cfgs == [TB.SMALLEST_BWD] or all(
                    c.smem_bytes(d, dtype.itemsize) <= info.smem_per_block_bytes for c in cfgs), (arch, d, cfgs)
                assert cfgs != [TB.SMALLEST_BWD] or (d > 128 and info.smem_per_block_bytes < 100 * 1024)
    assert TB.backward_configs(hardware.INTERPRETER_DEVICE, 64, torch.float16) == [TB.INTERPRETER_BWD]


# ---- full sizes on a GPU, bf16/fp16 ---------------------------------------------------------------
GPU_CASES = [(2, 8, 8, 1024, 1024, 64, False), (2, 8, 8, 1024, 1024, 128, True), (1, 16, 4, 777, 777, 80, True),
             (1, 8, 1, 500, 1100, 96, True), (1, 8, 2, 1100, 500, 128, True), (2, 4, 4, 1000, 1000, 256, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_full_sizes(dtype, case):
    q, k, v, do = _inputs(*case[:6], dtype)
    causal = case[6]
    ref = AB.attention_backward_ref(q.double(), k.double(), v.double(), do.double(), causal=causal)
    _close(_autograd(q, k, v, do, causal), ref, dtype, f"autograd {case}")
    _close(_teaching(q, k, v, do, causal), ref, dtype, f"teaching {case}")
    for cfg in TB.backward_configs(cu.hardware.device_info(), case[5], dtype):
        _close(_tuned(cfg)(q, k, v, do, causal), ref, dtype, f"{cfg} {case}")
        _close(_tuned(TB.BwdConfig(**{**cfg.__dict__, "atomic_dq": True}))(q, k, v, do, causal), ref, dtype,
               f"atomic {cfg} {case}")


# A float32 backward compiles slowly: one launch of a 32 x 64 tile configuration of the d=96 case took 55 s on
# an H200 with nothing else running, 182 s among make test-gpu's 16 workers; the smallest configuration, 40 s
# among them (results/h200/test_gpu_s14.log). So float32 has that one tile (backward_configs), which
# test_gradients_match_float64_autograd's default path runs too. Each launch is its own test, so that make
# test-gpu runs them side by side.
F32_CASES = GPU_CASES[3:5]


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["teaching", "tuned", "tuned-atomic-dq"])
@pytest.mark.parametrize("case", F32_CASES, ids=str)
def test_gpu_float32_gradients_at_float32_tolerance(case, path):
    """float32 in, float32 accuracy out: every tl.dot of the backward in IEEE float32, not TF32.

    Two of the full-size cases (grouped-query, N_q != N_k, causal), through the teaching backward and
    the smallest tuned tile configuration, with dQ by its own pass and by atomics."""
    q, k, v, do = _inputs(*case[:6], torch.float32)
    causal = case[6]
    ref = AB.attention_backward_ref(q.double(), k.double(), v.double(), do.double(), causal=causal)
    info = cu.hardware.device_info()
    # the forward at one fixed tile (its choice is not under test): o and lse for the backward
    o, lse = TA.flash_attention(q, k, v, causal=causal, return_lse=True,
                                config=TA.attention_configs(info, case[5], torch.float32, causal)[0])
    if path == "teaching":
        got, what = AB.flash_attention_backward_teaching(q, k, v, o, lse, do, causal=causal), "teaching"
    else:
        cfg = TB.backward_configs(info, case[5], torch.float32)[-1]
        what = TB.BwdConfig(**{**cfg.__dict__, "atomic_dq": path == "tuned-atomic-dq"})
        got = TB.flash_attention_backward(q, k, v, o, lse, do, causal=causal, config=what)
    _close(got, ref, torch.float32, f"{what} {case}")
