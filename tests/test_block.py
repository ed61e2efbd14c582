"""One autograd node a block (course_utils.ops.block): the same loss and gradients as the op-by-op path, bit
for bit, one node where the op-by-op path records many, and the op-by-op path wherever the node does not
apply (no grad, a KV cache, autocast)."""

import copy

import pytest
import torch

import course_utils as cu
from course_utils import gpt
from course_utils.autograd import registry
from course_utils.ops import block as B


def _pair(dtype=torch.float32, layers=2, residual=None):
    cfg = gpt.GPTConfig(n_layer=layers, n_head=2, d_model=32, seq_len=24)
    per_op = gpt.GPT(cfg, seed=3).to(cu.DEVICE).use("course").to(dtype=dtype)
    per_op.residual_dtype = residual
    return per_op, copy.deepcopy(per_op).use("course-blocks")


def _batch(cfg, batch=3, seed=1):
    x, y = next(gpt.batches(gpt.tokens(), batch, cfg.seq_len, 1, seed=seed))
    return x.to(cu.DEVICE), y.to(cu.DEVICE)


def _loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _nodes(loss) -> list[str]:
    """The names of every autograd node the loss's backward visits (leaves' AccumulateGrad left out)."""
    seen, todo, names = set(), [loss.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ != "AccumulateGrad":
            names.append(type(fn).__name__)
        todo += [f for f, _ in fn.next_functions]
    return names


@pytest.mark.parametrize("dtype,residual", [(torch.float32, None), (torch.float16, None),
                                            (torch.float16, torch.float32)], ids=["fp32", "fp16", "fp16+fp32 stream"])
def test_one_node_a_block_gives_the_op_by_op_gradients_bit_for_bit(dtype, residual):
    per_op, blocks = _pair(dtype, residual=residual)
    x, y = _batch(per_op.cfg)
    loss_a, grads_a = _loss_and_grads(per_op, x, y)
    loss_b, grads_b = _loss_and_grads(blocks, x, y)
    assert torch.equal(loss_a, loss_b)
    for name, g in grads_a.items():
        assert grads_b[name] is not None and grads_b[name].dtype == g.dtype, name
        assert torch.equal(grads_b[name], g), f"{name}: max |diff| {(grads_b[name] - g).abs().max().item():.2e}"


def test_a_block_is_one_node_where_the_op_by_op_path_records_many():
    per_op, blocks = _pair(layers=3)
    x, y = _batch(per_op.cfg)
    nodes_a, nodes_b = _nodes(per_op(x, y)[1]), _nodes(blocks(x, y)[1])
    assert nodes_b.count("BlockFunctionBackward") == 3
    assert len(nodes_a) - len(nodes_b) >= 3 * 12, (len(nodes_a), len(nodes_b))   # 17 a block with torch 2.13


def test_the_op_by_op_path_wherever_one_node_does_not_apply():
    per_op, blocks = _pair()
    x, y = _batch(per_op.cfg)
    with torch.no_grad():                                  # inference: no node at all, the same logits
        assert torch.equal(per_op(x), blocks(x))
    cache = gpt.KVCache(blocks.cfg, x.shape[0])            # decoding with a cache: the ops one by one
    with torch.no_grad():
        assert torch.equal(blocks(x[:, :5], cache=cache), per_op(x[:, :5]))
    _, loss = blocks(x, y)
    assert "BlockFunctionBackward" in _nodes(loss)


def test_block_nodes_need_every_library_op():
    with pytest.raises(ValueError, match="block_nodes needs every op"):
        registry.course_ops(gemm_epilogue=True, block_nodes=True)
    with pytest.raises(ValueError, match="'course-blocks'"):
        registry.ops("course-block")
    assert registry.ops("course").block is None and registry.ops("course-blocks").block is B.block
