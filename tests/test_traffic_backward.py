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


def test_layernorm_backward_saves_two_floats_per_row_instead_of_x_hat():
    c = B.layernorm_backward(1000, 512, "float32", block_m=100)
    assert c.unfused.kernels[0].read_bytes == 2 * 1000 * 512 * 4 + 512 * 4
    assert c.fused.kernels[0].read_bytes - c.unfused.kernels[0].read_bytes == 2 * 1000 * 4
    assert "saved_bytes recomputed=8000" in c.notes and "saved_bytes stored=2048000" in c.notes


def test_attention_backward_by_hand():
    bh, n, d, b = 2 * 3, 128, 64, 2
    c = B.attention_backward(2, 3, n, d, "bfloat16", block_m=64, block_n=64)
    t, s, mm = bh * n * d * b, bh * n * n * b, 2.0 * bh * n * n * d
    assert c.unfused.total_bytes == (s + 2 * t) + (2 * t + s) + 3 * s + (s + 2 * t) + (s + 2 * t)
    assert c.unfused.flops == 4 * mm + 4.0 * bh * n * n
    pre, kv, dq = c.fused.kernels
    assert (pre.read_bytes, pre.write_bytes) == (2 * t, bh * n * 4)
    # two key tiles, each visiting all 128 query rows: Q and dO (bf16) and lse and D (fp32) per row
    assert kv.read_bytes == 2 * t + bh * 2 * n * (2 * d * b + 8)
    assert kv.flops == 4 * mm and dq.flops == 3 * mm           # recomputation: 7 products against 4
    assert f"saved_bytes standard={s}" in c.notes


def test_causal_attention_backward_visits_fewer_tiles():
    full = B.attention_backward(1, 1, 256, 64, block_n=64)
    causal = B.attention_backward(1, 1, 256, 64, block_n=64, causal=True)
    assert causal.fused.total_bytes < full.fused.total_bytes
    assert causal.unfused.total_bytes == full.unfused.total_bytes  # the standard version computes all of S


def test_atomic_dq_costs_a_read_and_write_per_key_tile():
    c = B.attention_backward(1, 2, 256, 32, "float16", block_n=64, dq="atomic")
    atomics = [k for k in c.fused.kernels if "atomic" in k.name][0]
    assert atomics.read_bytes == atomics.write_bytes == 4 * 2 * 256 * 32 * 4


@pytest.mark.parametrize("kwargs", [{"dq": "both"}, {"seq_len": 0}])
def test_bad_arguments_raise(kwargs):
    args = {"batch": 1, "heads": 1, "seq_len": 16, "head_dim": 16, **kwargs}
    with pytest.raises(ValueError):
        B.attention_backward(**args)
