"""What the GPU check runs on: GPU model (NVML), torch and CUDA versions, and the optional kernels."""

from __future__ import annotations

import torch


def describe() -> list[str]:
    from pretrain.blocks.kernels import optional_module
    from pretrain.observe.peak import gpu_name, lookup_peak_tflops

    lines = [f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        name = gpu_name(device)
        peak = lookup_peak_tflops(name, "bf16")
        lines.append(f"GPU: {name}, capability {torch.cuda.get_device_capability(device)}, "
                     f"bf16 peak {peak if peak else 'unknown'} TFLOP/s")
    else:
        lines.append("GPU: none visible")
    for module, use in (("flash_attn", "flash-attn"), ("transformer_engine.pytorch", "Transformer Engine")):
        found = optional_module(module) is not None
        lines.append(f"{use}: {'installed' if found else 'not installed (torch SDPA / PyTorch layers serve instead)'}")
    return lines


if __name__ == "__main__":
    print("\n".join(describe()))
