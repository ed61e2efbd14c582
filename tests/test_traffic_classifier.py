"""The LM head + cross-entropy calculators (course_utils/traffic/classifier.py): hand-worked bytes and
memory of the three versions on a tiny case, and what they say at GPT-2 small's shape."""

import pytest

from course_utils import traffic
from course_utils.traffic import classifier as C


def _totals(hv):
    return hv.traffic.read_bytes, hv.traffic.write_bytes, hv.saved_bytes, hv.peak_bytes


def test_hand_worked_tiny_case():
    # rows 4, vocab 10, d 3, bf16 (2 bytes), chunks of 3 rows (3 + 1); n = 40 logits
    v = C.lm_head_loss(4, 10, 3, "bf16", chunk_rows=3)
    assert list(v) == list(C.VERSIONS)
    # eager: GEMM 84/80, .float() 80/160, log_softmax 160/160, nll 48/4, zeros 0/160, scatter 32/16,
    # log_softmax_backward 320/160, cast 160/80, dh 140/24, dW 104/60; saved: log-probs 160;
    # peak: 3 float32 copies in log_softmax_backward = 480
    assert _totals(v["eager"]) == (1128, 904, 160, 480)
    assert v["eager"].traffic.launches == 10
    # unchunked: GEMM 84/80, loss 112/32, dlogits 128/80, dh 140/24, dW 104/60; saved: logits + lse = 96;
    # peak: logits + dlogits + lse = 176
    assert _totals(v["unchunked fused"]) == (568, 276, 96, 176)
    # chunked: scale 32/4; chunk 0: GEMM 78/60, classifier 88/72, dh 120/18, dW 78/120 (writes the
    # accumulator); chunk 1: GEMM 66/20, classifier 32/24, dh 80/6, dW 26 + 120/120; loss 16/4,
    # cast 120/60, backward 24/24 and 60/60; saved dh + dW = 84; peak: buffer 60 + losses 16 + 84 + acc 120
    assert _totals(v["chunked fused"]) == (940, 592, 84, 280)
    assert v["chunked fused"].traffic.launches == 1 + 2 * 4 + 4
    gemm_flops = {sum(k.flops for k in hv.traffic.kernels if " @ " in k.name) for hv in v.values()}
    assert gemm_flops == {6 * 4 * 10 * 3}              # the same three GEMMs, chunked or not


def test_gpt2_small_memory_and_bytes():
    for rows in (8192, 16384):
        v = traffic.lm_head_loss(rows, 50304, 768)
        eager, unchunked, chunked = (v[k] for k in C.VERSIONS)
        n = rows * 50304
        assert eager.peak_bytes == 12 * n            # three float32 (rows x vocab) tensors at once
        assert unchunked.saved_bytes >= 2 * n and chunked.saved_bytes < unchunked.saved_bytes / 8
        assert chunked.peak_bytes < 600 * 2**20 + 3 * 50304 * 768 * 4 + rows * 768 * 2 * 2
        assert chunked.traffic.total_bytes < eager.traffic.total_bytes / 2
    rows = traffic.lm_head_table(8192, 50304, 768)
    assert [r["version"] for r in rows][:2] == ["eager", "unchunked fused"] and "4096 rows" in rows[2]["version"]


def test_chunk_rule_is_the_tuned_paths():
    from course_utils.tuned import linear_cross_entropy as T
    assert T.chunk_rows_for is C.chunk_rows_for
    assert C.chunk_rows_for(8192, 50304, 2) == 4096 and C.chunk_rows_for(7, 50304, 2) == 7


@pytest.mark.parametrize("args,kw,text", [
    ((0, 10, 3), {}, "rows"),
    ((4, 10, 3), {"chunk_rows": 0}, "chunk_rows"),
    ((4, 10, 3, "int8"), {}, "dtype"),
    ((4, 10, 3, "fp9"), {}, "unknown dtype"),
])
def test_bad_arguments(args, kw, text):
    with pytest.raises(ValueError, match=text):
        C.lm_head_loss(*args, **kw)
