"""GPU kernel selection on the CPU: what `auto` picks, and one clear error for a kernel asked for but missing."""

import pytest
import torch

from pretrain.config import load_config
from pretrain.errors import UsageError
from pretrain.blocks.kernels import select_kernels
from pretrain.observe.peak import lookup_peak_tflops, matmul_dtype

CUDA = torch.device("cuda", 0)


def cfg(*overrides):
    return load_config(None, list(overrides))


@pytest.fixture
def no_optional_libraries(monkeypatch):
    """As on a machine without flash-attn and Transformer Engine, whatever this one has."""
    monkeypatch.setattr("pretrain.blocks.kernels.optional_module", lambda name: None)
    monkeypatch.setattr("pretrain.blocks.kernels.grouped_mm_available", lambda device: True)  # no CUDA query


def test_cpu_auto_keeps_the_cpu_kernels():
    c = cfg()
    k = select_kernels(c.model, c.train, torch.device("cpu"))
    assert (k.attention, k.attention_kernel, k.backend, k.fp8, k.fused_adamw, k.grouped_mm) == \
        ("auto", "sdpa", "torch", "off", False, False)  # fp32 on the CPU: no bf16 grouped GEMM


def test_cuda_auto_without_flash_attn_uses_torch_sdpa_fused_adamw_and_grouped_gemm(no_optional_libraries):
    c = cfg()
    k = select_kernels(c.model, c.train, CUDA)
    assert (k.attention_kernel, k.fused_adamw, k.grouped_mm) == ("sdpa", True, True)
    assert "attention=sdpa" in k.describe() and "adamw=fused" in k.describe()


def test_cuda_auto_with_flash_attn_uses_it(monkeypatch):
    monkeypatch.setattr("pretrain.blocks.kernels.optional_module", lambda name: object() if name == "flash_attn" else None)
    monkeypatch.setattr("pretrain.blocks.kernels.grouped_mm_available", lambda device: True)
    c = cfg()
    assert select_kernels(c.model, c.train, CUDA).attention_kernel == "flash"


@pytest.mark.parametrize("override,missing", [("model.attention_backend=flash", "flash_attn"),
                                              ("model.backend=te", "transformer_engine")])
def test_asking_for_a_missing_library_is_one_clear_error(no_optional_libraries, override, missing):
    c = cfg(override)
    with pytest.raises(UsageError) as e:
        select_kernels(c.model, c.train, CUDA)
    message = str(e.value)
    assert "\n" not in message and missing in message and override.split("=")[0].split(".")[1] in message
    assert "install" in message


@pytest.mark.parametrize("override", ["model.attention_backend=flash", "model.backend=te"])
def test_gpu_only_kernels_on_the_cpu_are_refused(override):
    c = cfg(override)
    with pytest.raises(UsageError, match="CUDA only"):
        select_kernels(c.model, c.train, torch.device("cpu"))


def test_fp8_needs_the_te_backend_and_bad_values_are_named():
    with pytest.raises(UsageError, match="backend='te'"):
        cfg("train.fp8=delayed")
    for override, key in (("train.device=tpu", "[train].device"), ("model.backend=jax", "[model].backend"),
                          ("model.attention_backend=xformers", "[model].attention_backend"), ("train.fp8=e5m2", "[train].fp8")):
        with pytest.raises(UsageError, match=key.replace("[", r"\[").replace("]", r"\]")):
            cfg(override)


def test_mfu_peak_follows_the_matmul_dtype():
    assert matmul_dtype(True, "off") == "bf16" and matmul_dtype(False, "off") == "fp32"
    assert matmul_dtype(True, "delayed") == "fp8"
    assert lookup_peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert lookup_peak_tflops("NVIDIA H200", "fp8") == 1979.0
    assert lookup_peak_tflops("NVIDIA H200 141GB HBM3e", "bf16") == 989.0  # SXM under its long NVML name
    assert lookup_peak_tflops("NVIDIA H200 NVL", "bf16") == 835.0  # the PCIe card: lower clocks and power
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no FP8 tensor cores
