"""The traffic calculators and the time model, pinned by values worked out by hand (in comments)."""

import math

import pytest

from course_utils import traffic as T
from course_utils.traffic import Kernel, Op, Traffic

# ------------------------------------------------------------------------------------------
# dtypes and bad input
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,nbytes", [("bf16", 2), ("bfloat16", 2), ("torch.float16", 2), ("fp32", 4),
                                          ("float", 4), ("double", 8), ("fp8", 1), ("bool", 1), ("int8", 1)])
def test_dtype_bytes(dtype, nbytes):
    assert T.dtype_bytes(dtype) == nbytes


def test_dtype_bytes_of_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert T.dtype_bytes(torch.bfloat16) == 2
    assert T.dtype_bytes(torch.float32) == 4


def test_traffic_module_does_not_import_torch():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(T))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not any("torch" in n or n == "hardware" for n in names), names


@pytest.mark.parametrize("call,arg", [
    (lambda: T.elementwise_chain(3, 100, "float24"), "dtype"),
    (lambda: T.elementwise_chain(0, 100), "ops"),
    (lambda: T.elementwise_chain([], 100), "ops"),
    (lambda: T.elementwise_chain(-2, 100), "ops"),
    (lambda: T.elementwise_chain(2, 0), "shape"),
    (lambda: T.elementwise_chain(2, -5), "shape"),
    (lambda: T.elementwise_chain(2, (4, 0)), r"shape\[1\]"),
    (lambda: T.elementwise_chain(2, ()), "shape"),
    (lambda: T.elementwise_chain(2, 2.5), "shape"),
    (lambda: T.elementwise_chain([Op("add", ("matrix",))], 10), "ops"),
    (lambda: T.softmax(0, 10), "rows"),
    (lambda: T.softmax(10, -1), "cols"),
    (lambda: T.softmax(True, 10), "rows"),
    (lambda: T.bias_gelu_dropout(4, 4, mask="maybe"), "mask"),
    (lambda: T.layernorm(4, 0), "cols"),
    (lambda: T.gemm_epilogue(0, 4, 4), "m"),
    (lambda: T.gemm_epilogue(4, 4, 4, trailing="lazy"), "trailing"),
    (lambda: T.gemm_epilogue(4, 4, 4, epilogue=[]), "ops"),
    (lambda: T.attention(1, 1, 0, 64), "seq_len"),
    (lambda: T.attention(1, 1, 128, 64, block_m=0), "block_m"),
    (lambda: T.attention(1, 1, 128, 64, dtype="fp13"), "dtype"),
    (lambda: T.attention(1, 1, 128, 64, kv_reads="never"), "kv_reads"),
    (lambda: T.machine("GeForce 256"), "GPU"),
    (lambda: T.machine("t4", "bfloat16"), "dtype"),
    (lambda: T.machine(None, hbm_gbps=100), "gpu"),
    (lambda: T.machine("h100-sxm", hbm_gbps=-1), "hbm_gbps"),
    (lambda: T.estimate_time("a lot of bytes"), "traffic"),
    (lambda: T.ncu_case("gemm", 4, 4, "fp32"), "case"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()


# ------------------------------------------------------------------------------------------
# elementwise chains
# ------------------------------------------------------------------------------------------


def test_seed_headline_five_op_gelu_on_16384_bf16():
    # 5 unary ops, each reads and writes n = 16,384 bf16 values: 5 * 2 * 16,384 * 2 B = 327,680 B
    # (the seed's "327 KB"); fused: one read and one write, 2 * 16,384 * 2 = 65,536 B ("65 KB").
    c = T.elementwise_chain(5, 16384, "bf16")
    assert c.unfused.total_bytes == 327_680
    assert c.fused.total_bytes == 65_536
    assert (c.unfused.launches, c.fused.launches) == (5, 1)
    assert c.ratio == 5


@pytest.mark.parametrize("k", [1, 2, 7, 16])
def test_chain_on_a_64_mb_bf16_tensor(k):
    # 64 MB of bf16 is 32e6 elements; each unfused op reads 64 MB and writes 64 MB: 128e6 * k bytes.
    c = T.elementwise_chain(k, 32_000_000, "bfloat16")
    assert c.unfused.total_bytes == 128_000_000 * k
    assert c.fused.total_bytes == 128_000_000
    assert c.unfused.read_bytes == c.unfused.write_bytes == 64_000_000 * k


def test_chain_with_bias_scalar_and_full_operands():
    # shape (3, 5) fp32: n = 15, cols = 5, 4 B each. relu((x + bias) * s) + r:
    # unfused reads (15 + 5) + 15 + 15 + (15 + 15) = 80 elements = 320 B; writes 4 * 15 * 4 = 240 B.
    # fused reads x, bias, r = 15 + 5 + 15 = 35 elements = 140 B; writes 15 * 4 = 60 B.
    c = T.elementwise_chain(T.NCU_CHAIN_OPS, (3, 5), "fp32")
    assert (c.unfused.read_bytes, c.unfused.write_bytes) == (320, 240)
    assert (c.fused.read_bytes, c.fused.write_bytes) == (140, 60)
    assert c.ratio == pytest.approx(560 / 200)
    assert [k.read_bytes for k in c.unfused.kernels] == [80, 60, 60, 120]


def test_chain_row_operand_and_leading_dims():
    # shape (2, 3, 4): rows = 6, cols = 4, n = 24 fp16. One op with a per-row operand:
    # unfused reads 24 + 6 = 30 el = 60 B, writes 48 B; fused is the same single kernel.
    c = T.elementwise_chain([Op("scale rows", ("row",))], (2, 3, 4), "fp16")
    assert (c.unfused.read_bytes, c.unfused.write_bytes) == (60, 48)
    assert c.fused.total_bytes == c.unfused.total_bytes


def test_input_operand_is_free_when_fused():
    # x * x on 10 fp16 values: eager reads two streams of x (40 B) and writes 20 B; fused reads x once.
    c = T.elementwise_chain([Op("square", ("input",))], 10, "fp16")
    assert (c.unfused.read_bytes, c.unfused.write_bytes) == (40, 20)
    assert (c.fused.read_bytes, c.fused.write_bytes) == (20, 20)


def test_seed_bias_gelu_dropout_14n_vs_6n_counts_the_bias_as_a_full_tensor():
    # The seed's 14N vs 6N bytes (fp16) holds only if the bias is as large as x: unfused reads
    # (x + b) + t1 + t2 = 4N elements = 8N B and writes 3N el = 6N B; fused reads 2N el, writes N el.
    n = 1000
    c = T.elementwise_chain([Op("add", ("full",)), "gelu", "dropout"], n, "fp16")
    assert c.unfused.total_bytes == 14 * n
    assert c.fused.total_bytes == 6 * n


def test_gelu_eager_nine_ops():
    # n = 100 bf16 -> 200 B per tensor. Reads: x*x 2, t1*x 2, *c 1, x+t3 2, *c 1, tanh 1, 1+ 1, 0.5*x 1,
    # t8*t7 2 = 13 tensors = 2600 B; writes 9 tensors = 1800 B. Fused: 200 + 200.
    c = T.gelu_eager(100, "bf16")
    assert c.unfused.launches == 9
    assert (c.unfused.read_bytes, c.unfused.write_bytes) == (2600, 1800)
    assert c.fused.total_bytes == 400


# ------------------------------------------------------------------------------------------
# softmax, bias + GELU + dropout, LayerNorm
# ------------------------------------------------------------------------------------------


def test_softmax_convention():
    # M = 4 rows, N = 6 cols fp32: MN = 24. Eager reads 5MN + 2M = 128 el = 512 B and writes
    # 3MN + 2M = 80 el = 320 B: 8MN + 4M = 208 elements (the seed's "8MN + 4M", which are elements,
    # not bytes). Fused reads 24 el = 96 B and writes 96 B.
    c = T.softmax(4, 6, "fp32")
    assert (c.unfused.read_bytes, c.unfused.write_bytes) == (512, 320)
    assert (c.fused.read_bytes, c.fused.write_bytes) == (96, 96)
    assert c.unfused.total_bytes == (8 * 24 + 4 * 4) * 4
    assert c.unfused.launches == 5


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 1000), (4096, 4097)])
def test_softmax_general_formula(rows, cols):
    c = T.softmax(rows, cols, "bf16")
    mn, m = rows * cols, rows
    assert c.unfused.read_bytes == 2 * (5 * mn + 2 * m)
    assert c.unfused.write_bytes == 2 * (3 * mn + 2 * m)
    assert c.fused.total_bytes == 2 * 2 * mn


def test_bias_gelu_dropout_generated_and_saved_mask():
    # rows 2, cols 3 fp16: MN = 6, N = 3. Generated mask: unfused reads (6 + 3) + 6 + 6 = 21 el = 42 B,
    # writes 18 el = 36 B; fused reads 9 el = 18 B, writes 12 B. Eager native_dropout in training
    # writes a bool keep-mask for backward: 6 B more WRITTEN by the dropout kernel (nothing more
    # read), and the same 6 B written by a fused kernel that saves the mask.
    gen = T.bias_gelu_dropout(2, 3, "fp16", mask="generated")
    assert (gen.unfused.read_bytes, gen.unfused.write_bytes, gen.fused.read_bytes, gen.fused.write_bytes) \
        == (42, 36, 18, 12)
    saved = T.bias_gelu_dropout(2, 3, "fp16", mask="saved")
    assert (saved.unfused.read_bytes, saved.unfused.write_bytes) == (42, 42)
    assert (saved.fused.read_bytes, saved.fused.write_bytes) == (18, 18)
    assert saved.unfused.kernels[-1].write_bytes == 12 + 6 and saved.unfused.kernels[-1].read_bytes == 12
    # the old name modelled a random tensor read back from HBM: it now warns and counts the saved mask
    with pytest.warns(FutureWarning, match="native_dropout"):
        old = T.bias_gelu_dropout(2, 3, "fp16", mask="read")
    assert old.unfused.total_bytes == saved.unfused.total_bytes
    with pytest.raises(ValueError, match="mask"):
        T.bias_gelu_dropout(2, 3, "fp16", mask="drawn")


def test_seed_bias_gelu_dropout_table_in_mib():
    # N = 4,194,304 fp16 (8 MiB per tensor), as 1024 x 4096 with a 4096-long bias. Eager training
    # (native_dropout saves a bool mask): 3 x 8 MiB + 8 KiB bias read, 3 x 8 MiB + 4 MiB mask written;
    # fused with the mask generated in the kernel (backward regenerates it): 8 MiB + 8 KiB read, 8 MiB written.
    mib = 2**20
    unfused = T.bias_gelu_dropout(1024, 4096, "fp16", mask="saved").unfused
    fused = T.bias_gelu_dropout(1024, 4096, "fp16", mask="generated").fused
    assert unfused.read_bytes == 24 * mib + 8192
    assert unfused.write_bytes == 28 * mib
    assert (fused.read_bytes, fused.write_bytes) == (8 * mib + 8192, 8 * mib)


def test_layernorm():
    # rows 2, cols 3 fp32: MN = 6, M = 2, N = 3. Eager reads 7MN + 4M + 2N = 42 + 8 + 6 = 56 el = 224 B,
    # writes 5MN + 4M = 38 el = 152 B over 9 kernels. Fused reads MN + 2N = 12 el = 48 B, writes 24 B
    # (+ 2M = 4 el = 16 B with the saved mean and rstd).
    c = T.layernorm(2, 3, "fp32")
    assert (c.unfused.read_bytes, c.unfused.write_bytes, c.unfused.launches) == (224, 152, 9)
    assert (c.fused.read_bytes, c.fused.write_bytes) == (48, 24)
    assert T.layernorm(2, 3, "fp32", save_stats=True).fused.write_bytes == 40
    assert T.layernorm(2, 3, "bf16", save_stats=True).fused.write_bytes == 2 * 6 + 2 * 2 * 4  # float32 stats


# ------------------------------------------------------------------------------------------
# GEMM + epilogue, matmul accountant, attention
# ------------------------------------------------------------------------------------------


def test_gemm_epilogue_small():
    # m=2, n=3, k=4 bf16. GEMM reads A (8) + B (12) = 20 el = 40 B, writes C 6 el = 12 B, 48 FLOPs.
    # Eager epilogue: + bias reads 6 + 3 el = 18 B writes 12 B; gelu reads 12 B writes 12 B:
    # 70 B read, 36 B written. One trailing fused kernel: 40 + 18 read, 12 + 12 written = 82 B.
    # Fused epilogue: reads A, B, bias = 40 + 6 = 46 B, writes 12 B.
    c = T.gemm_epilogue(2, 3, 4, dtype="bf16")
    assert (c.unfused.read_bytes, c.unfused.write_bytes, c.unfused.launches) == (70, 36, 3)
    assert (c.fused.read_bytes, c.fused.write_bytes, c.fused.launches) == (46, 12, 1)
    assert T.gemm_epilogue(2, 3, 4, dtype="bf16", trailing="fused").unfused.total_bytes == 82
    assert c.unfused.kernels[0].flops == 48


def test_seed_gemm_output_is_one_mib():
    # 128 tokens x 4096 outputs in fp16: 524,288 elements = 1 MiB written by the GEMM.
    c = T.gemm_epilogue(128, 4096, 4096, dtype="fp16")
    assert c.unfused.kernels[0].write_bytes == 2**20


def test_matmul_chain_softmax_matmul_bias():
    # softmax(A) @ B + bias with A 2 x 4, B 4 x 3, fp32. Unfused: softmax kernel reads/writes A
    # (8 el = 32 B each), GEMM reads A' + B = 8 + 12 el = 80 B, writes 6 el = 24 B, bias add reads
    # 6 + 3 el = 36 B, writes 24 B: reads 148 B, writes 80 B. Fused: reads A, B, bias = 23 el = 92 B,
    # writes 24 B.
    c = T.matmul_chain(["softmax"], [Op("add bias", ("col",))], 2, 3, 4, "fp32")
    assert (c.unfused.read_bytes, c.unfused.write_bytes, c.unfused.launches) == (148, 80, 3)
    assert (c.fused.read_bytes, c.fused.write_bytes) == (92, 24)
    bare = T.matmul_chain([], [], 2, 3, 4, "fp32")
    assert bare.unfused.total_bytes == bare.fused.total_bytes == 104


def test_attention_small():
    # B=H=1, N=256, d=64 bf16: Q, K, V, O are 256*64*2 = 32,768 B; S is 256*256*2 = 131,072 B.
    # Standard: QK^T reads 65,536 writes 131,072; softmax reads and writes 131,072; PV reads
    # 131,072 + 32,768, writes 32,768: 360,448 read + 294,912 written = 655,360 B.
    # Flash, block_m 128: 2 query tiles each stream K and V (256 rows): K+V = 2 * 512 * 64 * 2 =
    # 131,072 B, plus Q 32,768 read and O 32,768 written: 196,608 B. Causal: the tiles stream 128 and
    # 256 rows: K+V = 2 * 384 * 64 * 2 = 98,304 B -> 163,840 B.
    c = T.attention(1, 1, 256, 64, "bf16", block_m=128)
    assert (c.unfused.read_bytes, c.unfused.write_bytes) == (360_448, 294_912)
    assert c.fused.total_bytes == 196_608
    assert T.attention(1, 1, 256, 64, "bf16", block_m=128, causal=True).fused.total_bytes == 163_840
    assert T.attention(1, 1, 256, 64, "bf16", causal=True).unfused.total_bytes == 655_360
    # K and V read once (every re-read served by L2): Q, K, V read, O written = 4 * 32,768 B
    assert T.attention(1, 1, 256, 64, "bf16", kv_reads="once").fused.total_bytes == 131_072
    # log-sum-exp saved: 256 rows x 4 B
    assert T.attention(1, 1, 256, 64, "bf16", save_lse=True).fused.write_bytes == 32_768 + 1024


def test_attention_flops():
    # 4 B H N^2 d: 4 * 1 * 2 * 128^2 * 32 = 4,194,304, halved when causal (flash only).
    c = T.attention(1, 2, 128, 32, "fp16")
    assert c.fused.flops == 4_194_304
    assert T.attention(1, 2, 128, 32, "fp16", causal=True).fused.flops == 2_097_152
    assert sum(k.flops for k in c.unfused.kernels if "softmax" not in k.name) == 4_194_304


def test_seed_attention_matrices():
    # 32 heads, N = 4096 bf16: S = 32 * 4096^2 * 2 = 1,073,741,824 B ("1.07 GB").
    assert T.attention(1, 32, 4096, 64, "bf16").unfused.kernels[0].write_bytes == 1_073_741_824
    # N = 8192 bf16: 128 MiB per (batch, head); batch 4 x 64 heads: 32 GiB.
    s = T.attention(4, 64, 8192, 128, "bf16").unfused.kernels[0].write_bytes
    assert s == 4 * 64 * 128 * 2**20 == 32 * 2**30


def test_attention_ratio_bounds():
    # N = 8192, d = 128, one head, bf16. Standard moves 4 * (N d) + 4 * N^2 elements (Q K read, S
    # written, S read, P written, P V read, O written). K/V read once: flash moves 4 N d, so the ratio
    # is 1 + N / d = 65 (the seed's "d / N = 1.6%, 60x"). Counting every K/V re-read from HBM with
    # tiles of 128 queries: 2 N d + 2 * (N / 128) * N d = 130 N d, ratio (512 + 32768) / 130... = 2.0.
    n, d = 8192, 128
    once = T.attention(1, 1, n, d, "bf16", kv_reads="once")
    assert once.ratio == pytest.approx(1 + n / d)
    per_tile = T.attention(1, 1, n, d, "bf16", block_m=128)
    assert per_tile.ratio == pytest.approx((4 * n * d + 4 * n * n) / (2 * n * d + 2 * (n // 128) * n * d))


def test_flash_kv_rows():
    # N = 300, tiles of 128: 3 tiles; non-causal 3 * 300 = 900 rows; causal 128 + 256 + 300 = 684.
    assert T.flash_kv_rows(300, 128, False) == 900
    assert T.flash_kv_rows(300, 128, True) == 684


# ------------------------------------------------------------------------------------------
# DRAM model and time model
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("footprint,expected", [(0, 1.0), (0.5, 1.0), (0.875, 0.5), (1.25, 0.0), (4, 0.0)])
def test_l2_hit_fraction(footprint, expected):
    # full reuse up to L2/2, none from 1.25 L2, linear in between: (1.25 - 0.875) / 0.75 = 0.5
    assert T.l2_hit_fraction(footprint * 1000, 1000) == pytest.approx(expected)
    assert T.l2_hit_fraction(10, 0) == 0.0


def test_dram_bytes_cold():
    # 100 MB read, 100 MB written, L2 of 50 MB: write share 0.5, resident 0.88 * 50 * 0.5 = 22 MB.
    read, write = T.dram_bytes_cold(Kernel("k", 100_000_000, 100_000_000), 50_000_000)
    assert read == 100_000_000
    assert write == pytest.approx(78_000_000)
    # a small output stays in L2 entirely
    assert T.dram_bytes_cold(Kernel("k", 1000, 1000), 50_000_000) == (1000.0, 0.0)


def test_time_model_memory_bound_with_launches():
    # 1e9 B read + 1e9 B written at 2000 GB/s = 1 ms, plus one launch of 10 us = 1010 us.
    t = Traffic("t", (Kernel("k", 10**9, 10**9, 0.0),))
    est = T.estimate_time(t, None, hbm_gbps=2000, peak_tflops=100, l2_bytes=0, launch_us=10)
    assert est.us == pytest.approx(1010)
    assert est.memory_s == pytest.approx(1e-3)
    assert est.launch_s == pytest.approx(10e-6)


def test_time_model_compute_bound():
    # 1e12 FLOPs at 100 TFLOP/s = 10 ms > 1 KB at any bandwidth; no launch overhead.
    t = Traffic("t", (Kernel("k", 500, 500, 1e12),))
    est = T.estimate_time(t, None, hbm_gbps=1000, peak_tflops=100, l2_bytes=0, launch_us=0)
    assert est.us == pytest.approx(10_000)


def test_time_model_overlapped_launches():
    # two kernels of 1 us of memory time each, launch 10 us: additive 2 + 20 = 22 us;
    # overlapped max(1, 10) * 2 = 20 us.
    t = Traffic("t", (Kernel("a", 500_000, 500_000), Kernel("b", 500_000, 500_000)))
    kw = dict(hbm_gbps=1000, peak_tflops=100, l2_bytes=0, launch_us=10)
    assert T.estimate_time(t, None, **kw).us == pytest.approx(22)
    assert T.estimate_time(t, None, overlap_launches=True, **kw).us == pytest.approx(20)


def test_time_model_l2_reuse():
    # two unary fp32 ops on 1e6 elements: kernel 1 moves 8e6 B; kernel 2 reads 4e6 B that kernel 1
    # wrote. With a 32e6 B L2 (footprint 8e6 = L2/4: full reuse) kernel 2 moves only its 4e6 B
    # write: 12e6 B at 1000 GB/s = 12 us. Without reuse: 16 us.
    c = T.elementwise_chain(2, 1_000_000, "fp32")
    kw = dict(hbm_gbps=1000, peak_tflops=100, l2_bytes=32_000_000, launch_us=0)
    est = T.estimate_time(c.unfused, None, **kw)
    assert est.us == pytest.approx(12)
    assert est.l2_hit_bytes == 4_000_000
    assert T.estimate_time(c.unfused, None, l2_reuse=False, **kw).us == pytest.approx(16)


def test_time_model_from_the_hardware_table():
    # one op on 64 MB bf16 on an H100 SXM (3350 GB/s): 128e6 / 3.35e12 s = 38.21 us + 10 us launch.
    c = T.elementwise_chain(1, 32_000_000, "bf16")
    est = T.estimate_time(c.unfused, "h100-sxm", "bf16")
    assert est.us == pytest.approx(128e6 / 3.35e12 * 1e6 + T.LAUNCH_OVERHEAD_US)
    # a device name works too, and a measured bandwidth replaces the datasheet's
    est2 = T.estimate_time(c.unfused, "NVIDIA H100 80GB HBM3", "bf16", hbm_gbps=3000)
    assert est2.us == pytest.approx(128e6 / 3.0e12 * 1e6 + T.LAUNCH_OVERHEAD_US)


def test_time_model_from_measured_ceilings():
    from course_utils import bench

    ceil = bench.Ceilings("NVIDIA H200", copy_gbps=4000.0, matmul_tflops=750.0)
    m = T.machine_from_ceilings(ceil)
    assert (m.hbm_gbps, m.peak_tflops, m.l2_bytes) == (4000.0, 750.0, 60 * 2**20)
    assert "measured" in m.name
    # one op on 64 MB at the measured 4000 GB/s: 128e6 / 4e12 s = 32 us, + 10 us launch
    c = T.elementwise_chain(1, 32_000_000, "bf16")
    assert T.estimate_time(c.unfused, m).us == pytest.approx(32 + T.LAUNCH_OVERHEAD_US)
    with pytest.raises(ValueError, match="l2_bytes"):
        T.machine_from_ceilings(bench.Ceilings("Mystery GPU", 1000.0, 100.0))
    assert T.machine_from_ceilings(bench.Ceilings("Mystery GPU", 1000.0, 100.0), l2_bytes=10).l2_bytes == 10
    with pytest.raises(ValueError, match="ceilings"):
        T.machine_from_ceilings({"copy_gbps": 1})


def test_speedup_of_long_chain_on_big_tensor_approaches_traffic_ratio():
    c = T.elementwise_chain(8, 2**30, "bf16")
    s = T.speedup(c, "h100-sxm", "bf16")
    # 2 GiB per op at 3350 GB/s = 641 us + 10 us launch, 8 times, against one such kernel: exactly 8
    # (2 GiB tensors are far larger than the 50 MiB L2: no reuse)
    assert s["traffic_ratio"] == 8
    assert s["estimated_speedup"] == pytest.approx(8)
    # on a tiny tensor the launches dominate: speedup is about the launch ratio
    tiny = T.speedup(T.elementwise_chain(8, 1024, "bf16"), "h100-sxm", "bf16")
    assert tiny["estimated_speedup"] == pytest.approx(8, rel=0.01)


def test_which_fusion_pays_off_depends_on_the_gpu():
    # a big bf16 GEMM is compute-bound: 2 * 8192^3 FLOPs at 989 TFLOP/s = 1.11 ms; its epilogue
    # (bias add + GELU on a 134 MB C, each reading and writing it) adds about 2 x 80 us + launches,
    # so fusing it saves ~14% although it cuts traffic 2.3x (939 MB -> 403 MB).
    big = T.speedup(T.gemm_epilogue(8192, 8192, 8192, dtype="bf16"), "h100-sxm", "bf16")
    assert big["estimated_speedup"] < 1.2
    assert big["traffic_ratio"] > 2
    # the same calculator says a long elementwise chain pays off on any GPU
    chain = T.speedup(T.elementwise_chain(6, 2**28, "fp16"), "t4", "fp16")
    assert chain["estimated_speedup"] > 5


def test_traffic_add_and_table():
    a = T.elementwise_chain(2, 10, "fp32")
    both = a.unfused + a.fused
    assert both.launches == 3
    assert both.total_bytes == a.unfused.total_bytes + a.fused.total_bytes
    rows = T.table([a])
    assert rows[0]["traffic ratio"] == 2 and rows[0]["unfused launches"] == 2


def test_format_bytes():
    assert T.format_bytes(327_680) == "327.7 KB"
    assert T.format_bytes(1_073_741_824) == "1.074 GB"
    assert T.format_bytes(12) == "12 B"


def test_ncu_case_matches_benchmark_definition():
    # the chain of benchmarks/ncu_traffic.py launches 4 kernels, softmax 5, fused versions 1
    assert [T.ncu_case(c, 8, 4096, "bf16").launches for c in
            ("chain-eager", "chain-fused", "softmax-eager", "softmax-fused")] == [4, 1, 5, 1]
    assert math.isclose(T.ncu_case("softmax-fused", 8, 4096, "fp32").total_bytes, 2 * 8 * 4096 * 4)


# ------------------------------------------------------------------------------------------
# the chapter's checkers: pass the right answer, fail (with the right hint) on the usual wrong ones
# ------------------------------------------------------------------------------------------

from course_utils.check import CheckFailure  # noqa: E402
from course_utils.checkers import traffic as CT  # noqa: E402


def good_chain(n_ops, numel, itemsize):
    return 2 * n_ops * numel * itemsize, 2 * numel * itemsize


def test_chain_checker_passes_the_solution(capsys):
    CT.check_chain_bytes(good_chain)
    assert capsys.readouterr().out.startswith("PASS chain_bytes")


@pytest.mark.parametrize("wrong,hint", [
    (lambda k, n, b: (k * n * b, 2 * n * b), "write"),
    (lambda k, n, b: (2 * k * n, 2 * n), "itemsize"),
    (lambda k, n, b: (2 * (k + 1) * n * b, 2 * n * b), "n kernels"),
    (lambda k, n, b: (2 * k * n * b, n * b), "writes its result once"),
    (lambda k, n, b: (2 * k * n * b, 2 * k * n * b), "intermediates never reach HBM"),
    (lambda k, n, b: (2 * k * n * b, 2 * n * b) if n < 2**31 else (0, 0), "unfused"),  # int32 overflow
    (lambda k, n, b: [2 * k * n * b, 2 * n * b], "tuple"),
    (lambda k, n, b: 1 / 0, "ZeroDivisionError"),
])
def test_chain_checker_fails_wrong_answers(wrong, hint):
    with pytest.raises(CheckFailure, match=hint):
        CT.check_chain_bytes(wrong)


def test_checkers_let_not_implemented_through():
    def stub(*args):
        raise NotImplementedError("Exercise 2.1")
    for check in (CT.check_chain_bytes, CT.check_softmax_bytes, CT.check_bias_gelu_dropout_bytes,
                  CT.check_kernel_time, CT.check_fusion_speedup):
        with pytest.raises(NotImplementedError):
            check(stub)


def good_softmax(m, n, b):
    return (8 * m * n + 4 * m) * b, 2 * m * n * b


def test_softmax_checker(capsys):
    CT.check_softmax_bytes(good_softmax)
    assert "PASS softmax_bytes" in capsys.readouterr().out
    with pytest.raises(CheckFailure, match="counts elements"):
        CT.check_softmax_bytes(lambda m, n, b: (8 * m * n + 4 * m, 2 * m * n * b))
    with pytest.raises(CheckFailure, match="row vectors"):
        CT.check_softmax_bytes(lambda m, n, b: (8 * m * n * b, 2 * m * n * b))
    with pytest.raises(CheckFailure, match="AND writes"):
        CT.check_softmax_bytes(lambda m, n, b: ((8 * m * n + 4 * m) * b, m * n * b))


def good_bgd(m, n, b):
    # three eager kernels (the dropout's keep-mask: 1 byte per element) vs one that regenerates the mask
    return (6 * m * n + n) * b + m * n, (2 * m * n + n) * b


def test_bias_gelu_dropout_checker(capsys):
    CT.check_bias_gelu_dropout_bytes(good_bgd)
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,hint", [
    # the quick count's mistake: a bias as large as x (14N vs 6N in fp16)
    (lambda m, n, b: (7 * m * n * b + m * n, 3 * m * n * b), "one value per column"),
    (lambda m, n, b: (6 * m * n * b + m * n, (2 * m * n + n) * b), "reads the bias"),
    (lambda m, n, b: ((6 * m * n + n) * b, (2 * m * n + n) * b), "keep-mask"),          # mask forgotten
    (lambda m, n, b: ((7 * m * n + n) * b, (2 * m * n + n) * b), "torch.bool"),         # mask at itemsize
    (lambda m, n, b: (7 * m * n + n, (2 * m * n + n) * b), "itemsize"),
    (lambda m, n, b: (good_bgd(m, n, b)[0], (2 * m * n + n) * b + m * n), "writes no mask"),  # fused saves it
])
def test_bias_gelu_dropout_checker_names_each_fault(wrong, hint):
    with pytest.raises(CheckFailure, match=hint):
        CT.check_bias_gelu_dropout_bytes(wrong)


def test_bias_gelu_dropout_checker_refuses_the_calculator():
    def bias_gelu_dropout_bytes(rows, cols, itemsize):
        saved = T.bias_gelu_dropout(rows, cols, CT.ITEMSIZES[itemsize], mask="saved")
        return saved.unfused.total_bytes, T.bias_gelu_dropout(rows, cols, CT.ITEMSIZES[itemsize]).fused.total_bytes
    with pytest.raises(CheckFailure, match="bias_gelu_dropout"):
        CT.check_bias_gelu_dropout_bytes(bias_gelu_dropout_bytes)


def good_time(nbytes, flops, hbm_gbps, peak_tflops, launch_us):
    return max(nbytes / (hbm_gbps * 1e9), flops / (peak_tflops * 1e12)) * 1e6 + launch_us


def test_kernel_time_checker(capsys):
    CT.check_kernel_time(good_time)
    assert "PASS kernel_time_us" in capsys.readouterr().out
    with pytest.raises(CheckFailure, match="not their sum"):
        CT.check_kernel_time(lambda nb, f, bw, pk, l: (nb / (bw * 1e9) + f / (pk * 1e12)) * 1e6 + l)
    with pytest.raises(CheckFailure, match="launch overhead"):
        CT.check_kernel_time(lambda nb, f, bw, pk, l: max(nb / (bw * 1e9), f / (pk * 1e12)) * 1e6)
    with pytest.raises(CheckFailure, match="microseconds, not seconds"):
        CT.check_kernel_time(lambda nb, f, bw, pk, l: max(nb / (bw * 1e9), f / (pk * 1e12)) + l * 1e-6)
    with pytest.raises(CheckFailure, match="larger of the two"):
        CT.check_kernel_time(lambda nb, f, bw, pk, l: min(nb / (bw * 1e9), f / (pk * 1e12)) * 1e6 + l)


def good_speedup(comparison, gpu, dtype):
    from course_utils import hardware

    spec = hardware.lookup(gpu)

    def total(traffic):
        return sum(good_time(k.total_bytes, k.flops, spec.hbm_gbps, spec.peak_tflops(dtype), T.LAUNCH_OVERHEAD_US)
                   for k in traffic.kernels)
    return total(comparison.unfused) / total(comparison.fused)


def test_fusion_speedup_checker(capsys):
    CT.check_fusion_speedup(good_speedup)
    assert "PASS fusion_speedup" in capsys.readouterr().out
    with pytest.raises(CheckFailure, match="traffic ratio alone"):
        CT.check_fusion_speedup(lambda c, gpu, dtype: c.ratio)
    with pytest.raises(CheckFailure, match="other way round"):
        CT.check_fusion_speedup(lambda c, gpu, dtype: 1 / good_speedup(c, gpu, dtype))
    # forgetting the launches is wrong too (no specific hint needed)
    with pytest.raises(CheckFailure, match="expected"):
        CT.check_fusion_speedup(lambda c, gpu, dtype: good_speedup(c, gpu, dtype) * 1.1)


def test_causal_mask_eager_counts_the_in_place_fill_over_s():
    # batch 2 x 3 heads, 5 x 7 scores, fp16: S is 6 * 35 * 2 = 420 bytes, the bool mask 35 bytes
    t = T.ops.causal_mask_eager(2, 3, 5, 7, "fp16")
    assert [(k.read_bytes, k.write_bytes) for k in t.kernels] == [(0, 35), (35, 35), (420 + 35, 420)]
    # square (N = 5, d = 7): the fill moves S twice, as much as the standard version's softmax kernel
    sq = T.ops.causal_mask_eager(2, 3, 5, 5, "fp16").kernels[2]
    soft = T.attention(2, 3, 5, 7, "fp16", causal=True).unfused.kernels[1]
    assert sq.read_bytes - 25 + sq.write_bytes == soft.read_bytes + soft.write_bytes == 600
    with pytest.raises(ValueError):
        T.ops.causal_mask_eager(0, 3, 5, 7)
