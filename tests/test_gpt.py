"""Chapter 11's GPT: the same model through torch ops and through the course's kernels."""

import pytest
import torch

import course_utils as cu
from course_utils import check, gpt
from course_utils.autograd import registry


def test_corpus_is_the_courses_own_text():
    text = gpt.corpus_text()
    assert "Kernel Fusion with Triton" in text and len(text) > 10_000
    data = gpt.tokens("héllo")
    assert data.dtype == torch.int64 and data.tolist() == list("héllo".encode())


def test_batches_are_reproducible_windows_with_next_token_targets():
    data = torch.arange(1000)
    a = list(gpt.batches(data, 3, 16, 4, seed=5))
    b = list(gpt.batches(data, 3, 16, 4, seed=5))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    x, y = a[0]
    assert x.shape == (3, 16) and torch.equal(y, x + 1)
    with pytest.raises(ValueError, match="too few"):
        next(gpt.batches(torch.arange(10), 1, 16, 1))


def test_twins_start_from_identical_parameters():
    a, b = gpt.twins(gpt.TINY, cu.DEVICE)
    assert a.ops.name == "torch" and b.ops.name == "course"
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb) and pa.data_ptr() != pb.data_ptr()


def test_course_ops_refuse_rather_than_fall_back(monkeypatch):
    monkeypatch.setitem(registry.COURSE_CANDIDATES, "attention", [("course_utils.no_such_module", "f", "nothing")])
    with pytest.raises(RuntimeError, match="no kernel yet for: attention"):
        registry.course_ops()
    assert any(r["op"] == "attention" and r["implementation"] == "missing" for r in registry.course_table())


def test_every_op_has_a_course_kernel():
    table = registry.course_table()
    assert [r["op"] for r in table] == ["layer_norm", "linear_gelu", "attention"]
    assert all(r["implementation"] != "missing" for r in table), table


def test_forward_and_gradients_agree_with_torch_ops():
    a, b = gpt.twins(gpt.TINY, cu.DEVICE)
    x, y = (t.to(cu.DEVICE) for t in next(gpt.batches(gpt.tokens(), 2, gpt.TINY.seq_len, 1)))
    la, lb = a(x, y)[1], b(x, y)[1]
    la.backward()
    lb.backward()
    # float32 on the CPU; on a GPU, tl.dot and cuBLAS may round float32 products through TF32
    atol, rtol = cu.pick(gpu=(2e-3, 2e-2), cpu=(1e-5, 1e-3))
    check.compare("loss", lb, la.detach().double(), atol=atol, rtol=rtol)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        check.compare(f"gradient of {name}", pb.grad, pa.grad.double(), atol=atol, rtol=rtol)


@pytest.mark.slow
def test_losses_agree_over_training_steps():
    a, b = gpt.twins(gpt.TINY, cu.DEVICE)
    data = gpt.tokens()
    la = gpt.train(a, data, steps=4, batch=2, progress=False, lr=1e-3)
    lb = gpt.train(b, data, steps=4, batch=2, progress=False, lr=1e-3)
    assert la[-1] < la[0]
    assert max(abs(p - q) / p for p, q in zip(la, lb)) < 1e-4


def test_sequence_longer_than_the_model_is_refused():
    m = gpt.GPT(gpt.TINY)
    with pytest.raises(ValueError, match="longer than the model"):
        m(torch.zeros(1, gpt.TINY.seq_len + 1, dtype=torch.int64))
