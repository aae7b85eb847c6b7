"""What the device says about itself and what its datasheet says: the facts calibration checks its timings against.

- ``cache_bytes``: the last-level cache (a GPU's L2, a CPU's largest cache level). A memory-bandwidth timing of a
  buffer that fits in it measures the cache, not the memory: the memory kernel is timed well beyond it.
- ``mem_bandwidth`` and ``peak_flops``: the datasheet ceilings. A measured figure above one is a timing error or a
  cache effect, never the device: calibration says so and keeps the datasheet figure. On CUDA the memory ceiling
  is read off the device (``2 x memory clock x bus width``: 3.35 TB/s for an H100 SXM, 4.8 TB/s for an H200);
  dense matmul peaks come from the table below, by device name. On a CPU neither is known (None): nothing to cap.
- ``base``: the shipped profile that stands in for what calibration does not measure (the links between nodes):
  one of the device's own kind, never the CPU profile for a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from overlapcfg.measuring.clock import Clock

__all__ = ["DEFAULT_CPU_CACHE", "DeviceFacts", "GPU_DATASHEETS", "device_facts"]

DEFAULT_CPU_CACHE = 32 * 2**20
"""Last-level cache assumed where the operating system does not say (``/sys`` unreadable)."""


@dataclass(frozen=True, slots=True)
class _Datasheet:
    bf16: float
    """Dense bf16 tensor-core FLOP/s (no sparsity)."""
    fp32: float
    """Plain fp32 FLOP/s (not TF32)."""
    mem_bandwidth: float
    """HBM bytes/s, where the device does not report its memory clock and bus."""
    base: str


GPU_DATASHEETS: tuple[tuple[str, _Datasheet], ...] = (
    # Matched in order, by substring of torch.cuda.get_device_name (the more specific names first).
    # H100 PCIe datasheet: 756 TFLOP/s bf16 dense, 51 fp32, 2.0 TB/s HBM2e.
    ("H100 PCIe", _Datasheet(756e12, 51e12, 2.0e12, "h100_nvlink")),
    # H100 NVL: 835 TFLOP/s bf16 dense, 60 fp32, 3.9 TB/s.
    ("H100 NVL", _Datasheet(835e12, 60e12, 3.9e12, "h100_nvlink")),
    # H200 SXM (nvidia.com/en-us/data-center/h200): the H100's compute, 4.8 TB/s HBM3e.
    ("H200", _Datasheet(989e12, 67e12, 4.8e12, "h100_nvlink")),
    # H100 SXM5: 989 TFLOP/s bf16 dense, 67 fp32, 3.35 TB/s HBM3.
    ("H100", _Datasheet(989e12, 67e12, 3.35e12, "h100_nvlink")),
    # A100 SXM4: 312 TFLOP/s bf16 dense, 19.5 fp32; 2.0 TB/s (80 GB; the 40 GB part reports its own 1.6).
    ("A100", _Datasheet(312e12, 19.5e12, 2.0e12, "a100_ib")),
)
GPU_FALLBACK_BASE = "h100_nvlink"


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """The device a calibration runs on, and its ceilings (see the module docstring)."""

    name: str
    kind: Literal["gpu", "cpu"]
    cache_bytes: int
    mem_bandwidth: float | None
    """Datasheet memory bandwidth (bytes/s), or None where unknown."""
    peak_flops: dict[str, float] = field(default_factory=dict)
    """Datasheet dense matmul FLOP/s by dtype name (``bfloat16``, ``float32``); empty where unknown."""
    source: str = ""
    """Where the ceilings come from, for notes."""
    base: str = "cpu_gloo"
    """The shipped profile of this kind of device that stands in for unmeasured numbers."""
    cache_reported: int | None = None
    """What the device reports as ``cache_bytes``, where the caller gave another (``calibrate(cache_bytes=...)``)."""

    def peak_for(self, dtype: torch.dtype) -> float | None:
        name = "bfloat16" if dtype in (torch.bfloat16, torch.float16) else str(dtype).removeprefix("torch.")
        return self.peak_flops.get(name)


def device_facts(clock: Clock) -> DeviceFacts:
    """The facts of ``clock``'s device (see the module docstring)."""
    if not clock.cuda:
        return DeviceFacts(name=clock.describe(), kind="cpu", cache_bytes=_cpu_cache_bytes(), mem_bandwidth=None,
                           source="no datasheet for a CPU", base="cpu_gloo")
    props = torch.cuda.get_device_properties(clock.device)
    name = str(props.name)
    sheet = next((s for key, s in GPU_DATASHEETS if key in name), None)
    clock_khz = int(getattr(props, "memory_clock_rate", 0) or 0)
    bus_bits = int(getattr(props, "memory_bus_width", 0) or 0)
    if clock_khz > 0 and bus_bits > 0:
        bandwidth: float | None = 2 * clock_khz * 1e3 * bus_bits / 8  # double data rate
        source = f"memory {2 * clock_khz / 1e6:.2f} GT/s x {bus_bits} bits (device)"
    else:
        bandwidth = sheet.mem_bandwidth if sheet is not None else None
        source = "memory from the datasheet table" if sheet is not None else "memory ceiling unknown"
    peaks = {"bfloat16": sheet.bf16, "float32": sheet.fp32} if sheet is not None else {}
    source += "; matmul peaks from the datasheet table" if sheet is not None else "; matmul peaks unknown"
    return DeviceFacts(name=name, kind="gpu", cache_bytes=int(getattr(props, "L2_cache_size", 0) or 50 * 2**20),
                       mem_bandwidth=bandwidth, peak_flops=peaks, source=source,
                       base=sheet.base if sheet is not None else GPU_FALLBACK_BASE)


_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)


def _cpu_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest cache level of CPU 0 (Linux ``/sys``), else ``DEFAULT_CPU_CACHE``."""
    sizes = []
    for entry in sorted(root.glob("index*/size")) if root.is_dir() else ():
        try:
            match = _SIZE.match(entry.read_text())
        except OSError:
            continue
        if match:
            sizes.append(int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2).upper()])
    return max(sizes, default=DEFAULT_CPU_CACHE)
