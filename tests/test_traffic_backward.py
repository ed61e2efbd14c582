"""Chapter 11's backward accounting, pinned by values worked out by hand."""

import pytest

from course_utils.traffic import backward as B


def test_bias_gelu_backward_by_hand():
    # 64 x 32 bf16 (2 bytes), dropout: eager reads dy + mask, then dy' + z, then dz; fused reads dy, x, b.
    c = B.bias_gelu_backward(64, 32, "bfloat16", p=0.1, block_m=32)
    mn = 64 * 32
    assert [k.read_bytes for k in c.unfused.kernels] == [mn * 2 + mn, 2 * mn * 2, mn * 2]
    assert [k.write_bytes for k in c.unfused.kernels] == [mn * 2, mn * 2, 32 * 2]
    fused, reduce = c.fused.kernels
    assert fused.read_bytes == 2 * mn * 2 + 32 * 2
    assert fused.write_bytes == mn * 2 + 2 * 32 * 4          # dx and two rows of float32 partial sums
    assert (reduce.read_bytes, reduce.write_bytes) == (2 * 32 * 4, 32 * 2)
    assert f"saved_bytes eager={mn * 2 + mn}" in c.notes and f"saved_bytes fused={mn * 2}" in c.notes
    assert B.bias_gelu_backward(64, 32, p=0.0).unfused.launches == 2


def test_layernorm_backward_eager_and_fused_both_save_mean_and_rstd():
    # 1000 x 512 fp32, 100-row tiles: eager reads dy and x twice (dx kernel, dw/db kernel), fused once
    c = B.layernorm_backward(1000, 512, "float32", block_m=100)
    mn, stats = 1000 * 512 * 4, 2 * 1000 * 4
    dx, dwdb = c.unfused.kernels
    assert (dx.read_bytes, dx.write_bytes) == (2 * mn + 512 * 4 + stats, mn)
    assert (dwdb.read_bytes, dwdb.write_bytes) == (2 * mn + stats, 2 * 512 * 4)
    fused, reduce = c.fused.kernels
    assert (fused.read_bytes, fused.write_bytes) == (2 * mn + 512 * 4 + stats, mn + 2 * 10 * 512 * 4)
    assert (reduce.read_bytes, reduce.write_bytes) == (2 * 10 * 512 * 4, 2 * 512 * 4)
    assert c.notes[:2] == ("saved_bytes eager=8000", "saved_bytes fused=8000")
    assert "saved_bytes x_hat=2048000" in c.notes


def test_attention_backward_by_hand():
    bh, n, d, b = 2 * 3, 128, 64, 2
    c = B.attention_backward(2, 3, n, d, "bfloat16", block_m=64, block_n=64)
    t, s, mm, stats = bh * n * d * b, bh * n * n * b, 2.0 * bh * n * n * d, bh * n * 4
    assert c.unfused.total_bytes == (s + 2 * t) + (2 * t + s) + 3 * s + (s + 2 * t) + (s + 2 * t)
    assert c.unfused.flops == 4 * mm + 4.0 * bh * n * n
    pre, kv, dq = c.fused.kernels
    assert (pre.read_bytes, pre.write_bytes) == (2 * t, stats)
    # logical, like the standard version: Q, K, V, dO, lse and D read once per pass
    assert (kv.read_bytes, kv.write_bytes) == (4 * t + 2 * stats, 2 * t)
    assert (dq.read_bytes, dq.write_bytes) == (4 * t + 2 * stats, t)
    assert kv.flops == 4 * mm and dq.flops == 3 * mm           # recomputation: 7 products against 4
    assert f"saved_bytes standard={s}" in c.notes
    # without L2: each of the 2 key tiles reads all 128 query rows (Q, dO in bf16, lse and D in fp32),
    # each of the 2 query tiles all 128 key rows (K, V): one of each pair is the logical read
    assert B.attention_backward_rereads(2, 3, n, d, "bfloat16", block_m=64, block_n=64) == \
        bh * (2 * n - n) * (2 * d * b + 8) + bh * (2 * n - n) * 2 * d * b


def test_the_flop_count_is_stated_once():
    assert B.BACKWARD_PRODUCTS == {"separate": 7, "atomic": 5} and B.FORWARD_PRODUCTS == 2
    assert B.backward_flop_factor("separate") == 3.5 and B.backward_flop_factor("atomic") == 2.5
    for dq in B.DQ_MODES:
        c = B.attention_backward(1, 2, 256, 32, dq=dq)
        assert c.fused.flops - c.fused.kernels[0].flops == B.BACKWARD_PRODUCTS[dq] * 2.0 * 2 * 256 * 256 * 32
        assert c.unfused.flops - 4.0 * 2 * 256 * 256 == B.STANDARD_BACKWARD_PRODUCTS * 2.0 * 2 * 256 * 256 * 32


def test_causal_attention_backward_rereads_fewer_tiles():
    full = B.attention_backward_rereads(1, 1, 256, 64, block_n=64)
    causal = B.attention_backward_rereads(1, 1, 256, 64, block_n=64, causal=True)
    assert 0 < causal < full
    assert B.attention_backward(1, 1, 256, 64, causal=True).unfused.total_bytes == \
        B.attention_backward(1, 1, 256, 64).unfused.total_bytes  # the standard version computes all of S


def test_atomic_dq_by_hand():
    # 4 key tiles of 64, 2 heads of 256 x 32 fp16: the dQ float32 buffer (2 * 256 * 32 * 4 bytes) written once
    # logically; without L2 every key tile reads and writes it (8 visits), less the one logical write
    c = B.attention_backward(1, 2, 256, 32, "float16", block_n=64, dq="atomic")
    f32 = 2 * 256 * 32 * 4
    kv, convert = c.fused.kernels[1:]
    assert kv.write_bytes == 2 * (2 * 256 * 32 * 2) + f32 and convert.read_bytes == f32
    extra = B.attention_backward_rereads(1, 2, 256, 32, "float16", block_n=64, dq="atomic")
    assert extra == 2 * (4 * 256 - 256) * (2 * 32 * 2 + 8) + (2 * 4 - 1) * f32


@pytest.mark.parametrize("kwargs", [{"dq": "both"}, {"seq_len": 0}])
def test_bad_arguments_raise(kwargs):
    args = {"batch": 1, "heads": 1, "seq_len": 16, "head_dim": 16, **kwargs}
    with pytest.raises(ValueError):
        B.attention_backward(**args)
    with pytest.raises(ValueError):
        B.attention_backward_rereads(**args)
