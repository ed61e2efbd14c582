"""The course's kernels do float32 math when their float arguments come as fp64, as torch.compile passes them.

A plain ``kernel[grid](...)`` passes a Python float as an fp32 scalar; the code Inductor generates for a
``triton_op`` passes it as fp64 (its signature for chapter 7's forward said ``'qk_scale': 'fp64'``). A
kernel that used the argument as it came then computed in fp64: slower (an H100 runs fp64 at a fraction of
its fp32 rate), other bits than eager, and the attention forward did not compile at all (``tl.dot``'s
float32 accumulator check failed once ``s * qk_scale`` had made p and acc fp64). Each kernel converts its
float arguments to float32 first (``tl.cast(x, tl.float32)``); this test holds them to it.

Every launch the ops make (and the teaching launchers behind them) is recorded on the CPU as if on an
H100 (``course_utils.aot.pretend``), bound as ``kernel[grid]`` would bind it for sm_90, its fp32 scalars
retyped fp64, and compiled to PTX here, without a GPU. In the PTX, the only fp64 left may be the
parameter itself and its one conversion to f32 (``cvt.rn.f32.f64``): no fp64 add, mul, fma, div, sqrt,
compare or conversion to f64. Every launch of the compile matrix is also bound, so a kernel that takes a
float and is not compiled here (nor listed as launched by no op) fails the test.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Each case is one launcher call (tiles small where the launcher lets us choose). Shapes: the
# attention forward's first case gives Inductor's constants of the failed build (causal, lse, d = 64,
# 64 x 64 tiles, 3 stages, pointer loads, no grouped heads); the second folds q_scale into q (Q_REGS).
_SCRIPT = r"""
import json, os, re, sys, traceback
import triton, triton.language
import course_utils
os.environ.pop("TRITON_INTERPRET", None)
import torch
from course_utils import aot, aot_compile, hardware
from course_utils import triton_internals as internals
from course_utils.kernels import add_layernorm, attention, attention_backward, cross_entropy, elementwise
from course_utils.kernels import fused_classifier, gelu_backward, gemm, layernorm, layouts
from course_utils.tuned import attention as TA, attention_backward as TB, bias_gelu_dropout as TD
from course_utils.tuned import elementwise as TE, gelu_backward as TG, gemm as TM, layernorm as TL

E, bf, f16 = aot.empty, torch.bfloat16, torch.float16

def qkv(d, n=128, heads=2):
    return E(1, heads, n, d, dtype=bf), E(1, heads, n, d, dtype=bf), E(1, heads, n, d, dtype=bf)

def bwd_args(d, n=128):
    q, k, v = qkv(d, n)
    return q, k, v, E(1, 2, n, d, dtype=bf), E(1, 2, n, dtype=torch.float32), E(1, 2, n, d, dtype=bf)

x, b, seed = E(64, 96, dtype=bf), E(96, dtype=bf), torch.zeros(1, dtype=torch.int64)
logits, targets = E(8, 500, dtype=bf), torch.zeros(8, dtype=torch.int64)
info = hardware.DeviceInfo.for_arch(90)
bwd64 = TB.BwdConfig(32, 64, 64, 32, 4, 2)
CASES = {
    "attention forward, Inductor's constants": lambda: TA.flash_attention(
        *qkv(64), True, return_lse=True, config=TA.TileConfig(64, 64, 4, 3, 0)),
    "attention forward, q_scale in q": lambda: TA.flash_attention(
        *qkv(128), True, return_lse=True, config=TA.TileConfig(64, 64, 4, 3, 0, True)),
    "attention backward": lambda: TB.flash_attention_backward(*bwd_args(64), True, config=bwd64),
    "attention backward, first Hopper tiles": lambda: TB.flash_attention_backward(
        *bwd_args(64), True, config=TB.backward_configs(info, 64, bf)[0]),
    "attention backward, atomic dQ": lambda: TB.flash_attention_backward(
        *bwd_args(64), True, config=TB.BwdConfig(32, 64, 64, 32, 4, 2, atomic_dq=True)),
    "attention teaching": lambda: attention.flash_attention_teaching(*qkv(64), True, return_lse=True),
    "attention backward teaching": lambda: attention_backward.flash_attention_backward_teaching(
        *bwd_args(64), True),
    "layer_norm": lambda: TL.layer_norm(x, b, b, 1e-5),
    "layer_norm teaching": lambda: layernorm.layer_norm_teaching(x, b, b, 1e-5),
    "rms_norm teaching": lambda: layernorm.rms_norm_teaching(x, b, 1e-6),
    "add_layer_norm": lambda: add_layernorm.add_layer_norm_teaching(x, x, b, b, 1e-5),
    "bias_gelu_scale": lambda: TE.bias_gelu_scale(x, b, 0.5),
    "bias_gelu_dropout": lambda: TE.bias_gelu_dropout(x, b, 0.1, 7),
    "bias_gelu_scale teaching": lambda: elementwise.bias_gelu_scale_teaching(x, b, 0.5),
    "bias_gelu_dropout teaching": lambda: elementwise.bias_gelu_dropout_teaching(x, b, 0.1, 7),
    "keep mask": lambda: elementwise.dropout_keep_mask_teaching((64, 96), 0.1, 7),
    "strided bias_gelu_dropout": lambda: layouts.bias_gelu_strided(x.t(), E(64, dtype=bf), E(96, 64, dtype=bf),
                                                                    0.5, 0.1, 7, times_inverse=False),
    "seeded dropout": lambda: TD.bias_gelu_dropout(x, b, 0.1, seed),
    "seeded dropout backward": lambda: TD.bias_gelu_dropout_backward(x, x, b, 0.1, seed),
    "gelu backward": lambda: TG.bias_gelu_backward(x, x, b),
    "gelu backward with dropout": lambda: gelu_backward.bias_gelu_backward_teaching(x, x, b, p=0.1, seed=7),
    "cross_entropy backward": lambda: cross_entropy.cross_entropy_backward_teaching(
        torch.ones((), dtype=torch.float32), logits, targets, E(8, dtype=torch.float32)),
    "fused classifier": lambda: fused_classifier.fused_classifier_teaching(logits, targets, 0.125),
    "gemm epilogue with dropout": lambda: gemm.matmul_teaching(E(64, 64, dtype=f16), E(64, 64, dtype=f16),
                                                                gelu=True, p=0.1, seed=7),
    "tuned gemm, descriptors, dropout": lambda: TM.linear_gelu(E(128, 64, dtype=f16), E(64, 64, dtype=f16),
                                                               E(64, dtype=f16), p=0.1, seed=7,
                                                               config=TM.TileConfig(64, 64, 32, 4, 2, tma=True)),
    "tuned gemm, split-K, dropout": lambda: TM.linear_gelu(E(32, 256, dtype=f16), E(256, 64, dtype=f16),
                                                           E(64, dtype=f16), p=0.1, seed=7,
                                                           config=TM.TileConfig(32, 32, 32, 4, 2, split_k=2)),
}
ONLY = set(sys.argv[1:])
target = internals.gpu_target(90)
modules = aot.kernel_modules()
rows = []
for what, call in CASES.items():
    if ONLY and what not in ONLY:
        continue
    with aot.pretend(info, modules) as launches:
        call()
    for launch in launches:
        src, options = internals.bind(launch.kernel, launch.args, launch.kwargs, target)
        floats = [name for name, ty in src.signature.items() if ty == "fp32"]   # a Python float, as bound
        names = launch.kernel.arg_names
        row = {"case": what, "kernel": aot_compile.kernel_name(launch.kernel), "fp64": floats,
               "constants": {names[key[0]]: value for key, value in src.constants.items()}}
        if floats:
            sig = {name: "fp64" if name in floats else ty for name, ty in src.signature.items()}
            try:
                compiled = internals.compile_for(type(src)(src.fn, sig, src.constants, src.attrs), target, options)
                row["f64_lines"] = [line for line in compiled.asm["ptx"].splitlines() if ".f64" in line]
            except Exception as e:  # noqa: BLE001 - reported per kernel
                inner = e
                while inner.__cause__ is not None or inner.__context__ is not None:
                    inner = inner.__cause__ or inner.__context__
                last = traceback.extract_tb(inner.__traceback__)[-1]   # Triton's failed check, e.g. tl.dot's assert
                row["error"] = (f"{aot_compile.describe(e)} | {type(inner).__name__} {str(inner)[-300:]} at "
                                f"{os.path.basename(last.filename)}:{last.lineno}: {last.line}")
        rows.append(row)
# Every launch of the compile matrix (each module's compile_cases): which kernels take a float at all
matrix = {}
for module in ([] if ONLY else modules):
    for what, call in aot.cases_for(module, info):
        with aot.pretend(info, modules) as launches:
            call()
        for launch in launches:
            src, _ = internals.bind(launch.kernel, launch.args, launch.kwargs, target)
            floats = [name for name, ty in src.signature.items() if ty == "fp32"]
            if floats:
                matrix.setdefault(aot_compile.kernel_name(launch.kernel), set()).update(floats)
print(json.dumps({"rows": rows, "matrix": {k: sorted(v) for k, v in matrix.items()}}))
"""

# The constants of the forward in Inductor's build that failed (its log: torch 2.11, Triton 3.6, an H100)
INDUCTOR_CONSTANTS = {"stride_qd": 1, "stride_kd": 1, "stride_vd": 1, "stride_od": 1, "group": 1, "BLOCK_M": 64,
                      "BLOCK_N": 64, "BLOCK_D": 64, "CAUSAL": True, "STORE_LSE": True, "TMA": 0,
                      "DOT_PRECISION": None, "NUM_STAGES": 3, "Q_REGS": False, "EVEN_D": True}

# Every kernel that takes a float argument and that the ops (or the teaching launchers behind them) launch
EXPECTED = {
    "course_utils.tuned.attention.attn_fwd_tuned_kernel": {"qk_scale", "q_scale"},
    "course_utils.tuned.attention_backward_kernels.attn_bwd_dkdv_tuned_kernel": {"qk_scale", "sm_scale"},
    "course_utils.tuned.attention_backward_kernels.attn_bwd_dq_tuned_kernel": {"qk_scale", "sm_scale"},
    "course_utils.kernels.attention.attn_fwd_kernel": {"sm_scale"},
    "course_utils.kernels.attention_backward.attn_bwd_dkdv_kernel": {"sm_scale"},
    "course_utils.kernels.attention_backward.attn_bwd_dq_kernel": {"sm_scale"},
    "course_utils.tuned.layernorm_kernels.norm_fwd_kernel": {"eps"},
    "course_utils.kernels.layernorm.layer_norm_fwd_kernel": {"eps"},
    "course_utils.kernels.layernorm.rms_norm_fwd_kernel": {"eps"},
    "course_utils.kernels.add_layernorm.add_layer_norm_fwd_kernel": {"eps"},
    "course_utils.tuned.elementwise.bias_gelu_scale_tuned_kernel": {"scale"},
    "course_utils.tuned.elementwise.bias_gelu_dropout_tuned_kernel": {"p", "keep_scale"},
    "course_utils.kernels.elementwise.bias_gelu_scale_kernel": {"scale"},
    "course_utils.kernels.elementwise.bias_gelu_dropout_kernel": {"p"},
    "course_utils.kernels.elementwise.keep_mask_kernel": {"p"},
    "course_utils.kernels.layouts.bias_gelu_strided_kernel": {"scale", "p", "keep_scale"},
    "course_utils.tuned.bias_gelu_dropout.bias_gelu_dropout_seeded_kernel": {"p", "keep_scale"},
    "course_utils.tuned.bias_gelu_dropout.bias_gelu_dropout_seeded_bwd_kernel": {"p", "keep_scale"},
    "course_utils.kernels.gelu_backward.bias_gelu_backward_kernel": {"p", "keep_scale"},
    "course_utils.kernels.cross_entropy.cross_entropy_bwd_kernel": {"inv_n_rows"},
    "course_utils.kernels.fused_classifier.fused_classifier_kernel": {"scale_value"},
    "course_utils.kernels.gemm.matmul_kernel": {"p", "keep_scale"},
    "course_utils.tuned.gemm._gemm_tma_persistent": {"p", "keep_scale"},
    "course_utils.tuned.gemm._splitk_epilogue_kernel": {"p", "keep_scale"},
}

# Kernels that take a float but that no op launches: the optimizer's (its step runs outside the ops) and the
# all-reduce's (chapter 13, several GPUs); they keep the arguments as they come
NOT_FROM_OPS = {"course_utils.kernels.adamw.adamw_kernel", "course_utils.tuned.adamw.multi_tensor_adamw_kernel",
                "course_utils.kernels.allreduce.all_reduce_add_rms_norm_kernel",
                "course_utils.tuned.allreduce.one_shot_kernel", "course_utils.tuned.allreduce.two_shot_kernel"}

# An fp64 instruction other than the parameter's declaration, its load and its conversion to f32
_F64 = re.compile(r"\.f64\b")
_ALLOWED = re.compile(r"^\s*(?:\.param\s+\.f64\b|ld\.param\.(?:f|b)64\b|cvt\.rn\.f32\.f64\b)")


def fp64_instructions(ptx: str) -> list[str]:
    """The PTX lines that compute in fp64 (or convert to it): what a kernel doing float32 math has none of."""
    return [line.strip() for line in ptx.splitlines() if _F64.search(line) and not _ALLOWED.search(line)]


def test_the_fp64_filter_keeps_the_conversion_and_flags_arithmetic():
    ptx = (".param .f64 k_param_3,\n\tld.param.b64 \t%rd4, [k_param_3];\n\tcvt.rn.f32.f64 \t%r1, %rd4;\n"
           "\tmul.f32 \t%r2, %r1, %r3;\n")
    assert fp64_instructions(ptx) == []
    bad = ptx + ("\tcvt.f64.bf16 \t%rd7, %rs1;\n\tfma.rn.f64 \t%rd12, %rd5, %rd7, %rd11;\n"
                 "\tsetp.ge.f64 \t%p1, %rd1, %rd2;\n")
    assert fp64_instructions(bad) == ["cvt.f64.bf16 \t%rd7, %rs1;", "fma.rn.f64 \t%rd12, %rd5, %rd7, %rd11;",
                                      "setp.ge.f64 \t%p1, %rd1, %rd2;"]


@pytest.fixture(scope="module")
def recorded():
    import triton
    if not any((Path(triton.__file__).parent / "backends" / "nvidia" / "bin").glob("ptxas*")):
        pytest.skip("Triton's CUDA backend (with its ptxas) ships in the Linux wheel only")
    from course_utils import aot, triton_internals
    broken = [p for p in triton_internals.problems()
              if p.split(" ")[0] in ("create_function_from_signature", "JITFunction._pack_args", "compiler")]
    if broken:
        pytest.skip(f"the sm_90 compile on the CPU needs Triton internals that changed: {broken}")
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=aot.subprocess_env(), capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled(recorded):
    return recorded["rows"]


def test_every_float_argument_is_fp64_in_the_compiles(compiled):
    """The compiles are the ones meant: every expected kernel was launched, with exactly its float
    arguments typed fp64 (the test cannot pass by compiling nothing, or fp32 arguments)."""
    seen: dict[str, set] = {}
    for row in compiled:
        if row["fp64"]:
            seen.setdefault(row["kernel"], set()).update(row["fp64"])
    assert seen == EXPECTED
    for row in compiled:
        if "f64_lines" in row:
            params = [line for line in row["f64_lines"] if re.match(r"\s*\.param\s+\.f64\b", line)]
            assert len(params) == len(row["fp64"]), (row["case"], row["kernel"])


def test_every_kernel_of_the_compile_matrix_that_takes_a_float_is_checked(recorded):
    """A kernel that takes a float argument, anywhere in the compile matrix, is either one this test compiles
    with fp64 arguments or one no op launches. A new one: cast its floats first, then add a case and its entry
    to EXPECTED (or, if no op launches it, to NOT_FROM_OPS)."""
    matrix = {k: set(v) for k, v in recorded["matrix"].items()}
    unchecked = {k: v for k, v in matrix.items() if k not in EXPECTED and k not in NOT_FROM_OPS}
    assert not unchecked, f"kernels with float arguments that no test here compiles as fp64: {unchecked}"
    assert {k: matrix.get(k) for k in EXPECTED} == EXPECTED
    assert NOT_FROM_OPS <= set(matrix)


def test_attention_forward_compiles_with_inductor_s_signature(compiled):
    rows = [r for r in compiled if r["case"] == "attention forward, Inductor's constants"]
    assert [r["kernel"] for r in rows] == ["course_utils.tuned.attention.attn_fwd_tuned_kernel"]
    row = rows[0]
    assert row["fp64"] == ["qk_scale", "q_scale"]
    constants = {k: v for k, v in row["constants"].items() if k in INDUCTOR_CONSTANTS}
    assert constants == INDUCTOR_CONSTANTS
    assert "error" not in row, row.get("error")


def test_no_kernel_computes_in_fp64(compiled):
    failures = {}
    for row in compiled:
        if not row["fp64"]:
            continue
        if "error" in row:
            failures[f"{row['case']}: {row['kernel']}"] = row["error"]
        elif fp64_instructions("\n".join(row["f64_lines"])):
            failures[f"{row['case']}: {row['kernel']}"] = fp64_instructions("\n".join(row["f64_lines"]))[:4]
    assert not failures, json.dumps(failures, indent=1)


# ----------------------------------------------------------------------------- attention, ready to be visible
# Once course_utils/ops/attn.py registers attention as triton_ops on a GPU (its _VISIBLE, after a GPU check), their
# functions run on a tracer's tensors with nothing cached while AOTAutograd traces them: every launch must go
# through wrap_triton (recorded here), with the scales as Python floats (which Inductor's code passes as fp64).


def test_attention_functions_trace_cold_through_wrap_triton(monkeypatch):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from course_utils.ops import attn as A
    launched = []

    class Recorder:
        def __init__(self, kernel):
            self.name = kernel.fn.__name__

        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append((self.name, [a for a in args if type(a) is float]))

    monkeypatch.setattr(torch.library, "wrap_triton", Recorder)
    monkeypatch.setattr(A, "PLANS", {})
    monkeypatch.setattr(A, "VALID", set())
    from course_utils import env
    with FakeTensorMode(), torch.device(env.DEVICE):   # the ops refuse a CPU tensor on a GPU host
        q, k, v, do = (torch.randn(2, 3, 40, 16) for _ in range(4))
        o, lse = A.attention_fwd(q, k, v, True, 0.25)
        A.attention_bwd(do, q, k, v, o, lse, True, 0.25)
        qkv = torch.randn(2, 40, 3 * 3 * 16)
        o, lse = A.attention_qkv_fwd(qkv, 3, True, 0.25)
        dqkv = A.attention_qkv_bwd(torch.randn(o.shape), qkv, o, lse, 3, True, 0.25)
    assert dqkv.shape == qkv.shape
    qk = 0.25 * 1.4426950408889634   # the scale times log2(e): the kernels work in base 2
    one_pass = [("attn_fwd_tuned_kernel", [qk, 1.0]), ("attn_bwd_preprocess_kernel", []),
                ("attn_bwd_dkdv_tuned_kernel", [qk, 0.25]), ("attn_bwd_dq_tuned_kernel", [qk, 0.25])]
    assert launched == one_pass * 2
