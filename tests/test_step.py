"""Chapter 12's step by hand (course_utils.step): the same gradients as the autograd step, the same
training, and clear refusals of the models it does not support."""

import copy

import pytest
import torch

import course_utils as cu
from course_utils import gpt, step
from course_utils.ops import norms

pytestmark = pytest.mark.machinery   # left out of the newest-Triton run (pyproject.toml says why)


def _model(dtype=None, layers=2):
    """dtype None: the device's training recipe, float32 on the CPU, bf16 weights with float32 masters on a
    GPU (float32 weights there mean autocast, which the step by hand refuses)."""
    cfg = gpt.GPTConfig(n_layer=layers, n_head=2, d_model=32, seq_len=24)
    m = gpt.GPT(cfg, seed=3).to(cu.DEVICE).use("course")
    if dtype is None and cu.on_gpu():
        return gpt.bf16_weights(m)
    return m.to(dtype=dtype or torch.float32)


def _batch(cfg, batch=3, seed=1):
    x, y = next(gpt.batches(gpt.tokens(), batch, cfg.seq_len, 1, seed=seed))
    return x.to(cu.DEVICE), y.to(cu.DEVICE)


# float32: the same kernels in the same order give the same bits; float16: the same up to the order of
# the GEMMs' sums (cuBLAS or the CPU's BLAS may pick another for a transposed product)
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-3}


@pytest.mark.parametrize("dtype", [None, torch.float16], ids=["recipe", "float16"])
def test_hand_gradients_equal_autograd(dtype):
    m = _model(dtype)
    dtype = next(m.parameters()).dtype
    diffs = step.grads_match(m, *_batch(m.cfg))
    assert len(diffs) == 1 + len(list(m.parameters()))
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= TOL[dtype], f"{worst}: {diffs[worst]:.2e}"


def test_a_float32_residual_stream_by_hand_equals_autograd():
    """Half-precision weights and branches, the residual stream in float32 (what autocast keeps): the
    stream's gradient stays float32 and each branch gets its own dtype's copy, as autograd's casts do."""
    m = _model(torch.float16)
    m.residual_dtype = torch.float32
    diffs = step.grads_match(m, *_batch(m.cfg))
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= TOL[torch.float16], f"{worst}: {diffs[worst]:.2e}"


def test_a_dropped_residual_gradient_is_caught(monkeypatch):
    """The fault a hand-written backward invites: the residual stream's gradient not carried through
    the fused add + LayerNorm (its ds input dropped). The comparison must see it."""
    m = _model()
    real = norms.add_layer_norm_bwd
    monkeypatch.setattr(step.Nm, "add_layer_norm_bwd", lambda dy, ds, *a: real(dy, None, *a))
    diffs = step.grads_match(m, *_batch(m.cfg))
    assert diffs["blocks.0.qkv.weight"] > 1e-2 and diffs["wte.weight"] > 1e-2
    assert diffs["loss"] == 0.0                      # the forward is untouched


def test_hand_training_follows_the_autograd_step():
    a = _model(layers=1)
    b = copy.deepcopy(a)
    opt_a, opt_b = gpt.optimizer(a), gpt.optimizer(b)
    hand = step.HandStep(b, opt_b)
    for seed in range(3):
        x, y = _batch(a.cfg, seed=seed)
        la = gpt.train_step(a, opt_a, x, y)
        lb = hand(x, y)
        assert torch.allclose(la, lb, rtol=1e-6, atol=0), (seed, la.item(), lb.item())
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert pb.grad is None                       # zeroed (set to None) after the step, as train_step does
        assert torch.allclose(pa, pb, rtol=1e-5, atol=1e-7), n


def test_refusals_say_what_is_expected():
    m = _model(torch.float16)
    m.residual_dtype = torch.float64
    with pytest.raises(ValueError, match="residual stream"):
        step.HandStep(m, None)
    m.residual_dtype = None
    x, y = _batch(m.cfg)
    long = torch.cat([x, x], dim=1)
    with pytest.raises(ValueError, match="longer than the model's seq_len"):
        step.HandStep(m, None).forward(long, torch.cat([y, y], dim=1))


def test_the_compiled_step_by_hand_trains_as_the_eager_one():
    """compiled=True: forward and backward as one torch.compile'd function of the registered ops (no
    autograd in the graph): the eager step by hand's gradients, up to the order of Inductor's sums (it fuses
    the bias gradients' column sums), and its losses over two steps."""
    a = _model(layers=1)
    b = copy.deepcopy(a)
    eager, compiled = step.HandStep(a, gpt.optimizer(a)), step.HandStep(b, gpt.optimizer(b), compiled=True)
    torch.compiler.reset()
    # float32 (the CPU): the order of a sum; bf16 (a GPU): one rounding of the glue Inductor fuses
    grad_tol, loss_tol = (1e-5, 1e-5) if next(a.parameters()).dtype == torch.float32 else (2e-2, 1e-3)
    x, y = _batch(a.cfg, seed=0)
    la, lb = eager.grads(x, y), compiled.grads(x, y)
    assert torch.allclose(la, lb, rtol=loss_tol, atol=0), (la.item(), lb.item())
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa.grad.float() - pb.grad.float()).abs().max() <= grad_tol * pa.grad.float().abs().max(), n
    a.zero_grad(set_to_none=True)
    b.zero_grad(set_to_none=True)
    for seed in range(1, 3):
        x, y = _batch(a.cfg, seed=seed)
        la, lb = eager(x, y), compiled(x, y)
        assert torch.allclose(la, lb, rtol=loss_tol, atol=0), (seed, la.item(), lb.item())


# --------------------------------------------------------------------------- the whole model as one autograd node


def _hand_grads(m, x, y):
    hand = step.HandStep(m, opt=None)
    loss, dh, dwte, ctx = hand.forward(x, y)
    return loss, {id(p): g for p, g in hand.gradients(x, dh, dwte, ctx)}


def test_one_node_the_model_gives_the_step_by_hands_loss_and_gradients_bit_for_bit():
    m = _model()
    x, y = _batch(m.cfg)
    loss_h, grads_h = _hand_grads(m, x, y)
    one = step.OneNode(m)
    _, loss = one(x, y)
    assert loss.grad_fn is not None and type(loss.grad_fn).__name__ == "ModelFunctionBackward"
    loss.backward()
    assert torch.equal(loss.detach(), loss_h)
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, grads_h[id(p)]), n


def test_one_node_scales_by_the_losss_own_gradient():
    """(4 * loss).backward(): every gradient four times the plain loss's (the node reads its incoming
    gradient; a node that assumed 1 would pass the test above and fail this one). Four, a power of two:
    in bf16 every rounding of the scaled backward is the plain one's, scaled (3 rounds differently, and
    the bf16 gradients then differ from 3 x the float32 ones by more than the tolerance: seen on an H100)."""
    m = _model()
    tol = TOL[next(m.parameters()).dtype]
    x, y = _batch(m.cfg)
    _, grads_h = _hand_grads(m, x, y)
    _, loss = step.OneNode(m)(x, y)
    (4 * loss).backward()
    for n, p in m.named_parameters():
        want = 4 * grads_h[id(p)].float()
        err = (p.grad.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        assert err <= tol, f"{n}: {err:.2e}"


def test_one_node_trains_as_the_autograd_step_does():
    """Three steps of gpt.train_step on OneNode and on the model of one node a block: the same losses."""
    a = _model()
    b = copy.deepcopy(a).use("course-blocks")
    x, y = _batch(a.cfg)
    one, oa, ob = step.OneNode(a), gpt.optimizer(a), gpt.optimizer(b)
    for _ in range(3):
        la = gpt.train_step(one, oa, x, y)
        lb = gpt.train_step(b, ob, x, y)
        torch.testing.assert_close(la, lb, rtol=TOL[next(a.parameters()).dtype], atol=0)
    assert all(p.grad is None for p in a.parameters())   # train_step's zero_grad(set_to_none=True)


def test_one_node_refuses_a_second_backward_and_inference_clearly():
    m = _model()
    x, y = _batch(m.cfg)
    one = step.OneNode(m)
    _, loss = one(x, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    with pytest.raises(ValueError, match="OneNode trains"):
        one(x, None)
    with torch.no_grad(), pytest.raises(ValueError, match="OneNode trains"):
        one(x, y)
