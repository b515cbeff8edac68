"""Device facts several engines share: the vendors and device classes, GPU-visible memory, kernel dispatch cost."""

from __future__ import annotations

from simengine.config.hardware import Hardware

ALL_VENDORS = frozenset({"nvidia", "amd", "huawei", "apple", "intel", "qualcomm"})
ALL_CLASSES = frozenset({"datacenter", "workstation", "consumer", "edge", "mobile"})
# ESTIMATE: Metal lets the GPU wire only recommendedMaxWorkingSetSize, ~75% of unified memory on Macs above 36 GB
# (printed by llama.cpp's ggml_metal_init and by MLC); the hardware YAML gives the whole unified memory.
APPLE_GPU_WORKING_SET = 0.75


def gpu_visible_bytes(hw: Hardware) -> float:
    """Memory the GPU runtime reports as usable (Apple: the Metal working set)."""
    return hw.memory_bytes * (APPLE_GPU_WORKING_SET if hw.vendor == "apple" else 1.0)


def launch_cost_s(hw: Hardware) -> float:
    """Per-kernel dispatch cost by runtime. ESTIMATE: CUDA/HIP ~4 us (NVIDIA Best Practices), Metal encode ~5 us,
    OpenCL on Adreno ~10 us (enqueue through the Android driver)."""
    return {"apple": 5e-6, "qualcomm": 10e-6}.get(hw.vendor, 4e-6)
