"""Cross-entropy from logits (course_utils/kernels/cross_entropy.py): loss and gradient against float64,
vocabularies spanning several tiles, large and -inf logits, int32 targets, a bad target, bad inputs."""

import pytest
import torch
import torch.nn.functional as F

import course_utils as cu
from course_utils import check
from course_utils.kernels import cross_entropy as K


def _ref64(logits, targets, dloss):
    x = logits.detach().double().requires_grad_(True)
    loss = F.cross_entropy(x, targets.long())
    (g,) = torch.autograd.grad(loss, x, dloss.double())
    return loss, g


@pytest.mark.parametrize("rows,vocab,dtype,block", [
    (1, 1, torch.float32, None),
    (7, 37, torch.float32, None),
    (9, 300, torch.float32, 64),      # five tiles, the last one ragged
    (5, 129, torch.float16, 32),
], ids=str)
def test_loss_and_gradient_match_float64(nan_empty, rows, vocab, dtype, block):
    logits = check.randn((rows, vocab), dtype, scale=3.0, outliers=0.05, outlier_scale=30.0)
    targets = torch.randint(0, vocab, (rows,), device=cu.DEVICE)
    loss, lse = K.cross_entropy_teaching(logits, targets, block=block)
    dloss = check.randn((), torch.float32) + 2.0
    dlogits = K.cross_entropy_backward_teaching(dloss, logits, targets, lse, block=block)
    want, grad = _ref64(logits, targets, dloss)
    assert loss.dtype == torch.float32 and loss.shape == () and dlogits.dtype == dtype
    check.compare("loss", loss, want, atol=1e-5, rtol=1e-5)
    check.compare("lse", lse, torch.logsumexp(logits.double(), dim=1), atol=1e-5, rtol=1e-5)
    check.compare("dlogits", dlogits, grad, dtype=dtype)


def test_strided_rows_int32_targets_and_masked_logits(nan_empty):
    base = check.randn((6, 80), scale=50.0)      # |logits| up to ~200: exp would overflow without the max
    logits = base[:, 3:70]
    logits[:, 10] = float("-inf")                 # a masked-out vocabulary entry
    targets = torch.randint(11, 67, (6,), dtype=torch.int32, device=cu.DEVICE)
    loss, lse = K.cross_entropy_teaching(logits, targets, block=16)
    dloss = torch.tensor(1.0, device=cu.DEVICE)
    dlogits = K.cross_entropy_backward_teaching(dloss, logits, targets, lse, block=16)
    want, grad = _ref64(logits, targets, dloss)
    check.compare("loss", loss, want, atol=1e-4, rtol=1e-5)
    check.compare("dlogits", dlogits, grad)


def test_a_target_outside_the_vocabulary_gives_nan():
    logits = torch.randn(3, 10, device=cu.DEVICE)
    loss, _ = K.cross_entropy_teaching(logits, torch.tensor([1, 10, 2], device=cu.DEVICE))
    assert torch.isnan(loss)
    loss, _ = K.cross_entropy_teaching(logits, torch.tensor([1, -1, 2], device=cu.DEVICE))
    assert torch.isnan(loss)


D = cu.DEVICE


@pytest.mark.parametrize("logits,targets,err,match", [
    (torch.randn(2, 3, 4, device=D), torch.zeros(2, dtype=torch.long, device=D), ValueError, "2-D"),
    (torch.randn(2, 4, device=D), torch.zeros(3, dtype=torch.long, device=D), ValueError, "targets must be"),
    (torch.randn(2, 4, device=D), torch.zeros(2, device=D), ValueError, "int64 or int32"),
    (torch.randn(2, 4, device=D).long(), torch.zeros(2, dtype=torch.long, device=D), TypeError, "float32, float16"),
    (torch.randn(4, 2, device=D).t(), torch.zeros(2, dtype=torch.long, device=D), ValueError, "unit stride"),
    (torch.randn(2, 0, device=D), torch.zeros(2, dtype=torch.long, device=D), ValueError, "empty"),
], ids=["3-D", "rows", "float targets", "int logits", "column-major", "no vocab"])
def test_bad_inputs_say_what_was_expected(logits, targets, err, match):
    with pytest.raises(err, match=match):
        K.cross_entropy_teaching(logits, targets)
