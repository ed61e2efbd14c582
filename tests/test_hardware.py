"""The GPU spec table, looking GPUs up by name, DeviceInfo, and the measured ceilings."""

from __future__ import annotations

import pytest
import torch

import course_utils as cu
from course_utils import hardware
from course_utils.hardware import SPECS, DeviceInfo, lookup

REQUIRED = {"t4", "l4", "a10g", "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "rtx3090", "rtx4090"}


def test_table_has_the_gpus_of_the_course_and_sane_numbers():
    assert REQUIRED <= set(SPECS)
    for key, s in SPECS.items():
        assert s.key == key
        assert s.arch in {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90"}
        assert 100 <= s.hbm_gbps <= 10_000 and 10 <= s.sms <= 200
        assert s.smem_per_block_kib <= s.smem_per_sm_kib
        assert s.tflops["float32"] < s.tflops["float16"]  # tensor cores beat the FP32 pipes
        if "bfloat16" in s.tflops:
            assert s.arch != "sm_75"
            assert s.tflops["tf32"] == pytest.approx(s.tflops["bfloat16"] / 2, rel=0.01)


@pytest.mark.parametrize("key, gbps, sms, l2, bf16", [
    ("h100-sxm", 3350, 132, 50, 989), ("h100-pcie", 2000, 114, 50, 756), ("h200", 4800, 132, 60, 989),
    ("a100-80gb", 2039, 108, 80, 312), ("a100-80gb-pcie", 1935, 108, 80, 312), ("a100-40gb", 1555, 108, 40, 312),
    ("l4", 300, 58, 48, 121),
])
def test_datasheet_numbers(key, gbps, sms, l2, bf16):
    s = SPECS[key]
    assert (s.hbm_gbps, s.sms, s.l2_mib, s.peak_tflops("bfloat16")) == (gbps, sms, l2, bf16)


def test_t4_has_no_bf16_and_says_so():
    with pytest.raises(ValueError, match="no bfloat16"):
        SPECS["t4"].peak_tflops("bfloat16")


def test_ridge_and_l2_bytes():
    h = SPECS["h100-sxm"]
    assert h.ridge_flops_per_byte("bfloat16") == pytest.approx(989e12 / 3350e9)
    assert h.l2_bytes == 50 * 2**20


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-PCIE-40GB", "a100-40gb"), ("Tesla T4", "t4"),
    ("NVIDIA L4", "l4"), ("NVIDIA A10G", "a10g"), ("NVIDIA GeForce RTX 4090", "rtx4090"), ("h200", "h200"),
])
def test_lookup_by_device_name(name, key):
    assert lookup(name).key == key


@pytest.mark.parametrize("bad", ["NVIDIA L40S", "NVIDIA RTX 6000 Ada Generation", "AMD Instinct MI300X"])
def test_lookup_matches_whole_words_only(bad):
    with pytest.raises(ValueError, match="unknown GPU"):
        lookup(bad)


@pytest.mark.parametrize("bad", ["", "   ", None, 3])
def test_lookup_rejects_non_names(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        lookup(bad)


def test_device_info():
    t4 = DeviceInfo.for_arch(75)
    assert (t4.arch, t4.has_bf16, t4.smem_per_block_bytes) == (75, False, 64 * 1024)
    h = DeviceInfo.for_arch(90)
    assert h.has_bf16 and h.sms == 132 and h.smem_per_block_bytes == 227 * 1024
    with pytest.raises(ValueError, match="sm_70"):
        DeviceInfo.for_arch(70)
    assert DeviceInfo.from_spec(SPECS["l4"]).arch == 89


@pytest.mark.skipif(cu.on_gpu(), reason="checks interpreter mode")
def test_without_a_gpu():
    assert hardware.device_info() == hardware.INTERPRETER_DEVICE
    assert hardware.current() is None
    with pytest.raises(RuntimeError, match="recorded"):
        hardware.measure_copy_gbps(2**20)
    with pytest.raises(RuntimeError, match="recorded"):
        hardware.measure_matmul_tflops(64)


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="needs a CUDA GPU")
def test_measured_ceilings_are_below_the_datasheet_and_not_absurd():
    info = hardware.device_info()
    p = torch.cuda.get_device_properties(0)
    assert info.sms == p.multi_processor_count
    spec = hardware.current()
    copy = hardware.measure_copy_gbps(2**28)
    mm = hardware.measure_matmul_tflops(4096)
    if spec is not None:
        assert 0.3 * spec.hbm_gbps < copy < 1.05 * spec.hbm_gbps
        assert 0.2 * spec.peak_tflops("bfloat16") < mm < 1.05 * spec.peak_tflops("bfloat16")
