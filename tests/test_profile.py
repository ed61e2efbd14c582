"""count_launches: what a check cell prints about fusion must be right, and the same on CPU and GPU."""

from __future__ import annotations

import pytest
import torch

import course_utils as cu
from course_utils import check, profile
from course_utils.kernels import launch


def softmax_5_ops(x):
    m = x.max(dim=1, keepdim=True).values
    e = torch.exp(x - m)
    s = e.sum(dim=1, keepdim=True)
    return e / s


def test_eager_softmax_counts_five_launches():
    x = check.randn((7, 33))
    counts = profile.count_launches(softmax_5_ops, x)
    assert counts.total == 5, counts
    assert set(counts.torch) == {"max", "sub", "exp", "sum", "div"}
    assert not counts.triton


def test_a_triton_kernel_counts_one_and_hides_the_interpreters_own_torch_ops():
    x = check.randn((1000,))
    launch.add_one(x)  # compile first
    counts = profile.count_launches(launch.add_one, x)
    assert counts.total == 1, counts
    assert counts.triton == {"add_one_kernel": 1}
    assert not counts.torch  # empty_like is an allocation, not a kernel
    assert "1x add_one_kernel" in str(counts)


def test_views_and_allocations_count_zero():
    x = check.randn((6, 10))

    def views(t):
        a = t.view(60).reshape(3, 20).t()
        b = t.unsqueeze(0).squeeze(0).transpose(0, 1).permute(1, 0)[1:4]
        torch.empty(5, device=t.device)
        torch.empty_like(t)
        return a, b, t.narrow(1, 2, 3), t.expand(2, 6, 10)

    counts = profile.count_launches(views, x)
    assert counts.total == 0, counts
    assert str(counts) == "0 kernel launch(es): none"


def test_chain_and_args_kwargs_are_passed_through():
    x = check.randn((9,))
    assert profile.count_launches(launch.chain_ref, x, n_ops=6).total == 6
    out = []
    profile.count_launches(lambda t, k=1: out.append(t.numel() * k), x, k=3)
    assert out == [27]


def test_counting_restores_triton_and_counts_nothing_afterwards():
    from course_utils.triton_internals import launch_classes

    before = {cls: cls.run for cls in launch_classes()}
    with pytest.raises(ZeroDivisionError):
        profile.count_launches(lambda: 1 / 0)
    assert {cls: cls.run for cls in launch_classes()} == before


@pytest.mark.skipif(cu.on_gpu(), reason="checks the CPU message")
def test_cuda_kernel_table_needs_a_gpu():
    with pytest.raises(RuntimeError, match="count_launches"):
        profile.cuda_kernel_table(lambda: None)


# ------------------------------------------------------------------ chapter 12: a step's kernels and host time


@pytest.mark.parametrize("kernel, ops, category", [
    ("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_NNT", ("aten::mm",), "GEMM"),
    ("void at::native::elementwise_kernel<128, 4, ...>", ("aten::copy_", "aten::_to_copy", "aten::to"), "cast"),
    ("void at::native::elementwise_kernel<128, 4, ...>", ("aten::copy_", "aten::contiguous"), "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, AddFunctor>", ("aten::add",), "elementwise glue"),
    ("void at::native::(anonymous)::GammaBetaBackwardCUDAKernel", ("aten::native_layer_norm_backward",), "norm"),
    ("void at::native::reduce_kernel<512, 1, ...>", ("aten::sum", "aten::native_layer_norm_backward"), "norm"),
    ("multi_tensor_apply_kernel<FusedAdamMathFunctor>", ("aten::_fused_adamw_",), "optimizer"),
    ("void at::native::elementwise_kernel<...>", ("aten::mul_", "Optimizer.step#AdamW.step"), "optimizer"),
    ("pytorch_flash::flash_fwd_kernel<...>", ("aten::_flash_attention_forward",), "attention"),
    ("attn_fwd_tuned_kernel", ("course::attention",), "attention"),
    ("cross_entropy_bwd_kernel", (), "loss"),
    ("void at::native::cunn_SoftMaxForward<...>", ("aten::_log_softmax", "aten::cross_entropy_loss"), "loss"),
    ("triton_per_fused_add_native_layer_norm_0", ("CompiledFunction",), "norm"),
    ("Memcpy DtoD (Device -> Device)", (), "copy"),
    ("add_layer_norm_fwd_kernel", ("course::add_layer_norm",), "norm"),
    # Inductor's kernels by what they do, whatever launched them: a fused dtype conversion is a cast
    ("triton_poi_fused__to_copy_0", ("CompiledFunction",), "cast"),
    ("triton_poi_fused__to_copy_clone_t_12", ("CompiledFunctionBackward",), "cast"),
    ("triton_poi_fused_clone_3", ("CompiledFunction",), "copy"),
    ("triton_red_fused__to_copy_add_native_layer_norm_4", ("CompiledFunction",), "norm"),
    ("triton_per_fused__to_copy_sum_7", ("CompiledFunctionBackward",), "elementwise glue"),
])
def test_categorize_names_a_kernel_by_its_name_else_the_nearest_operator(kernel, ops, category):
    assert profile.categorize(kernel, ops) == category
    assert category in profile.CATEGORIES


def test_by_category_sums_launches_and_gpu_time_per_step():
    import pandas as pd
    k = pd.DataFrame({"kernel": ["a", "b", "c", "d"], "ops": ["", "", "", ""],
                      "category": ["GEMM", "GEMM", "cast", "elementwise glue"], "us": [100.0, 300.0, 10.0, 30.0]})
    t = profile.by_category(k, steps=2).set_index("category")
    assert list(t.index[:-1]) == list(profile.CATEGORIES)
    assert t.loc["GEMM", "launches"] == 1.0 and t.loc["GEMM", "gpu_ms"] == pytest.approx(0.2)
    assert t.loc["attention", "launches"] == 0 and t.loc["cast", "gpu_ms"] == pytest.approx(0.005)
    assert t.iloc[-1]["launches"] == 2.0 and t.iloc[-1]["gpu_ms"] == pytest.approx(0.22)


def test_host_split_charges_python_to_its_file_and_builtins_to_their_caller():
    x = torch.ones(64, device=cu.DEVICE)

    def step():  # a course wrapper's Python, then torch's functional Python, then a bare builtin
        launch.add_one(x)
        torch.nn.functional.relu(x)
        sum(range(20_000))
    split = profile.host_split(step, calls=3)
    assert list(split) == list(profile.HOST_BUCKETS)
    assert split["course's Python wrappers"] > 0 and split["PyTorch modules and functional (Python)"] > 0
    assert split["other Python"] > 0                # sum(range(...)) called from this test's own function
    assert split["autograd engine (C++)"] == 0.0    # no backward in this step


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_step_kernels_needs_a_gpu():
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        profile.step_kernels(lambda: None)


def test_fusion_accounts_count_the_glue_each_fusion_removes():
    from course_utils import gpt
    cfg, batch, params = gpt.GPU, 8, 1000
    acc = profile.fusion_accounts(cfg, batch, params)
    assert tuple(acc) == profile.FUSIONS
    M, d, L, V = batch * cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.vocab
    adam = acc["+ AdamW(fused=True)"]
    assert adam.unfused.total_bytes == 18 * params * 4 and adam.fused.total_bytes == 7 * params * 4
    assert (adam.unfused.launches, adam.fused.launches) == (7, 1)
    qkv = acc["+ attention reads q, k, v by strides"]
    assert qkv.saved_bytes == L * (3 * 2 * M * d * 2 + 2 * 3 * M * d * 2) and qkv.unfused.launches == 4 * L
    ln = acc["+ residual add + LayerNorm in one kernel"]
    assert (ln.unfused.launches, ln.fused.launches) == (3 * 2 * L, 2 * L)
    # per site: the LayerNorm's re-read of s, the add of s's two gradients (reads 2, writes 1), less the
    # fused backward's read of the outside gradient of s
    assert ln.saved_bytes == 2 * L * (1 + 3 - 1) * M * d * 4
    mlp = acc[profile.FUSIONS[3]]
    assert mlp.saved_bytes == L * 2 * M * 4 * d * 2 and (mlp.unfused.launches, mlp.fused.launches) == (2 * L, L)
    loss = acc[profile.FUSIONS[4]]
    assert (loss.unfused.launches, loss.fused.launches) == (6, 3)
    assert loss.saved_bytes == 30 * M * V - 8 * M   # 36 MV bytes of float32 round trips against 6 MV of bf16
    head = acc[profile.FUSIONS[5]]   # one read of the bf16 logits from HBM instead of two (the other from cache)
    assert (head.unfused.launches, head.fused.launches) == (2, 1) and head.saved_bytes == 2 * M * V + 12 * M
    bf16 = acc[profile.FUSIONS[6]]   # autocast's two casts per weight, and 2 bytes less of gradient read
    assert bf16.unfused.total_bytes == 40 * params and bf16.fused.total_bytes == 28 * params


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_kernels_sees_every_category_of_a_training_step_on_the_gpu():
    from course_utils import gpt
    model = gpt.GPT(gpt.TINY).cuda()
    opt = gpt.optimizer(model)
    x, y = (t.cuda() for t in next(gpt.batches(gpt.tokens(), 2, gpt.TINY.seq_len, 1)))
    step = lambda: gpt.train_step(model, opt, x, y)  # noqa: E731
    step()
    k = profile.step_kernels(step, steps=1)
    assert {"GEMM", "attention", "norm", "loss", "optimizer", "cast"} <= set(k["category"]), \
        k.groupby("category")["kernel"].first()
    assert len(k) > 20 and (k["us"] > 0).all() and k["ops"].str.len().gt(0).mean() > 0.9


def test_kernels_are_tied_to_their_operators_on_either_profiler_api():
    """torch >= 2.12 links each kernel event to its operator's id; older releases list the kernels on
    the operator (``FunctionEvent.kernels``). Both give the same rows."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    linear = NS(name="aten::linear", cpu_parent=None, device_type=DeviceType.CPU, id=1, linked_correlation_id=0)
    mm = NS(name="aten::mm", cpu_parent=linear, device_type=DeviceType.CPU, id=2, linked_correlation_id=0)
    launch = NS(name="cudaLaunchKernel", cpu_parent=mm, device_type=DeviceType.CPU, id=90, linked_correlation_id=2)
    gemm = NS(name="sm90_gemm", device_type=DeviceType.CUDA, id=3, linked_correlation_id=2,
              time_range=NS(elapsed_us=lambda: 12.5))
    new = list(profile._kernels_with_their_ops([linear, mm, launch, gemm], DeviceType))
    old_linear = NS(name="aten::linear", cpu_parent=None, device_type=DeviceType.CPU, kernels=[])
    old_mm = NS(name="aten::mm", cpu_parent=old_linear, device_type=DeviceType.CPU,
                kernels=[NS(name="sm90_gemm", duration=12.5)])
    old = list(profile._kernels_with_their_ops([old_linear, old_mm], DeviceType))
    assert new == old == [("sm90_gemm", ["aten::mm", "aten::linear"], 12.5)]
    # older releases: a kernel launched under no operator is only among the device's events, and counts once
    dev = [NS(name=n, device_type=DeviceType.CUDA, time_range=NS(elapsed_us=lambda us=us: us))
           for n, us in (("sm90_gemm", 12.5), ("multi_tensor_adamw_kernel", 40.0))]
    got = list(profile._kernels_with_their_ops([old_linear, old_mm, *dev], DeviceType))
    assert got == [("sm90_gemm", ["aten::mm", "aten::linear"], 12.5), ("multi_tensor_adamw_kernel", [], 40.0)]
    # a record_function range on the GPU's timeline (the optimizer's step) spans kernels: it is not counted as one
    step = NS(name="MasterAdamW.step", cpu_parent=None, device_type=DeviceType.CPU, kernels=[])
    gpu_range = NS(name="MasterAdamW.step", device_type=DeviceType.CUDA, time_range=NS(elapsed_us=lambda: 41.0))
    got = list(profile._kernels_with_their_ops([old_linear, old_mm, step, *dev, gpu_range], DeviceType))
    assert got == [("sm90_gemm", ["aten::mm", "aten::linear"], 12.5), ("multi_tensor_adamw_kernel", [], 40.0)]
