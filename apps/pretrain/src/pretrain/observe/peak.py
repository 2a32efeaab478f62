"""Peak dense FLOP/s of a GPU for the dtype its matmuls run in (the denominator of MFU).

The GPU model comes from NVML (the name of the device with this CUDA device's UUID, so
``CUDA_VISIBLE_DEVICES`` remapping is handled), else from torch. ``[log].peak_tflops`` overrides.
"""

from __future__ import annotations

import torch

# Dense TFLOP/s per device, no sparsity: name fragment (matched longest first) -> (bf16, tf32, fp8).
# fp8 None: no FP8 tensor cores (Ampere and older).
PEAK_TFLOPS = {
    "GB200": (2500.0, 1250.0, 5000.0),
    "B200": (2250.0, 1100.0, 4500.0),
    "H200 NVL": (835.0, 417.0, 1670.0),  # the datasheet's 1671 / 835 / 3341 with sparsity, halved
    "H200": (989.0, 494.0, 1979.0),
    "H100 PCIe": (756.0, 378.0, 1513.0),
    "H100": (989.0, 494.0, 1979.0),
    "H800": (989.0, 494.0, 1979.0),
    "H20": (148.0, 74.0, 296.0),
    "A100": (312.0, 156.0, None),
    "A800": (312.0, 156.0, None),
    "L40S": (362.0, 183.0, 733.0),
    "L4": (121.0, 60.0, 242.5),
    "A10G": (70.0, 35.0, None),
    "A10": (125.0, 62.5, None),
    "V100": (125.0, 15.7, None),
    "MI300X": (1307.0, 654.0, 2615.0),
    "MI250X": (383.0, 95.7, None),
}
DTYPES = ("bf16", "fp32", "fp8")


def lookup_peak_tflops(device_name: str, dtype: str = "bf16") -> float | None:
    """Peak dense TFLOP/s of a GPU by its name (e.g. 'NVIDIA H100 80GB HBM3') for ``dtype``
    (bf16; fp32 = TF32 tensor cores; fp8), or None if unknown."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}")
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_TFLOPS[key][DTYPES.index(dtype)]
    return None


def gpu_name(device: torch.device) -> str:
    """The GPU's model name from NVML, or torch's name for it when NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            name = pynvml.nvmlDeviceGetName(handle)
            return name.decode() if isinstance(name, bytes) else name
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no such call in this torch, or a non-NVIDIA GPU
        return torch.cuda.get_device_name(device)


def matmul_dtype(autocast_bf16: bool, fp8: str) -> str:
    """The dtype the model's matmuls run in: fp8 under TE's FP8 autocast, bf16 under autocast, else fp32 (TF32)."""
    return "fp8" if fp8 != "off" else ("bf16" if autocast_bf16 else "fp32")


def peak_flops(device: torch.device, dtype: str = "bf16", given_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: ``given_tflops`` if > 0, else the known GPU's; None on the CPU or unknown."""
    if given_tflops > 0:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    tflops = lookup_peak_tflops(gpu_name(device), dtype)
    return None if tflops is None else tflops * 1e12
