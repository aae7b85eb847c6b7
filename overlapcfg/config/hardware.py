"""Hardware profiles for the cost model: peak compute, memory bandwidth and the network, as plain pydantic models.

The shipped profiles are ``conf/hardware/*.yaml``, the ``overlapcfg`` command's ``hardware`` group
(``hardware=h100_nvlink``; user apps do not see it: they pass a name or a profile to ``explain``), each number
sourced in a YAML comment; ``load_hardware(name)`` reads them without Hydra. Bandwidths are per GPU and per
direction: a ring all-gather or reduce-scatter sends and receives at the same time on different links, so the
bidirectional figures vendors quote are halved.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from overlapcfg.config.base import ConfigModel
from overlapcfg.config.load import validate_config
from overlapcfg.config.presets import command_conf_dir
from overlapcfg.errors import OverlapConfigError, closest, natural_key

__all__ = ["HardwareProfile", "PeakFlops", "hardware_names", "load_hardware"]

GROUP = "hardware"


class PeakFlops(ConfigModel):
    """Dense peak FLOP/s per dtype (no sparsity). Dtypes not listed fall back to ``fp32``."""

    bf16: float = Field(gt=0)
    """Tensor-core bf16 (fp16 is costed the same)."""
    fp32: float = Field(gt=0)
    """Plain fp32 (not TF32): what an fp32 model gets without ``allow_tf32``."""


class HardwareProfile(ConfigModel):
    """One accelerator and its network, as the cost model sees it (SI units: FLOP/s, bytes/s, seconds)."""

    name: str
    """Short name shown in reports (the YAML file name for shipped profiles)."""
    description: str = ""
    """One line: which part and which interconnect."""
    peak_flops: PeakFlops
    """Dense peak compute per dtype."""
    mem_bandwidth: float = Field(gt=0)
    """Device memory bandwidth (bytes/s): the roofline's slope for memory-bound ops."""
    intra_node_bandwidth: float = Field(gt=0)
    """Per-GPU, per-direction bandwidth between GPUs of one node (bytes/s); used when the group fits in a node."""
    inter_node_bandwidth: float = Field(gt=0)
    """Per-GPU, per-direction bandwidth across nodes (bytes/s); a ring spanning nodes is limited by it."""
    latency: float = Field(ge=0)
    """Per-hop latency of a ring step (seconds): the alpha of the alpha-beta model, paid (p - 1) times."""
    gpus_per_node: int = Field(ge=1)
    """Devices per node: groups of at most this many ranks use ``intra_node_bandwidth``."""
    compute_efficiency: float = Field(1.0, gt=0, le=1)
    """Fraction of peak FLOP/s and memory bandwidth kernels reach; 1.0 is the pure roofline (optimistic)."""
    comm_efficiency: float = Field(1.0, gt=0, le=1)
    """Fraction of link bandwidth collectives reach (bus bandwidth / link bandwidth); 1.0 is optimistic."""

    def flops_for(self, dtype_name: str) -> float:
        """Peak FLOP/s for ``bfloat16``/``float16``/``bf16`` (tensor cores) or anything else (fp32)."""
        if dtype_name in ("bfloat16", "float16", "bf16", "fp16"):
            return self.peak_flops.bf16 * self.compute_efficiency
        return self.peak_flops.fp32 * self.compute_efficiency

    def link_bandwidth(self, world_size: int) -> float:
        """Per-direction bandwidth a ring over ``world_size`` ranks runs at (the slowest link it crosses)."""
        bw = self.intra_node_bandwidth if world_size <= self.gpus_per_node else self.inter_node_bandwidth
        return bw * self.comm_efficiency


def hardware_dir() -> Path:
    return command_conf_dir() / GROUP


def hardware_names() -> tuple[str, ...]:
    """Shipped profile names in natural order (``conf/hardware/*.yaml``)."""
    return tuple(sorted((p.stem for p in hardware_dir().glob("*.yaml")), key=natural_key))


@cache
def _load(name: str) -> HardwareProfile:
    data: Any = yaml.safe_load((hardware_dir() / f"{name}.yaml").read_text()) or {}
    if not isinstance(data, dict):
        raise OverlapConfigError.single(GROUP, f"conf/hardware/{name}.yaml is not a mapping")
    data.setdefault("name", name)
    return hardware_from(data, path=GROUP)


def hardware_from(data: HardwareProfile | dict[str, Any], *, path: str = GROUP) -> HardwareProfile:
    """Validate a mapping (a Hydra node converted to a container, say) into a profile; faults name ``path``."""
    if isinstance(data, HardwareProfile):
        return data
    return validate_config(HardwareProfile, data, root=path, header="invalid hardware profile")


def load_hardware(name: str | HardwareProfile) -> HardwareProfile:
    """A shipped profile by name; an unknown name lists the available ones, closest first."""
    if isinstance(name, HardwareProfile):
        return name
    if not isinstance(name, str):
        raise TypeError(f"load_hardware takes a profile name or a HardwareProfile, got {type(name).__name__}; "
                        "validate a mapping with hardware_from(data)")
    names = hardware_names()
    if name not in names:
        contains = [n for n in names if name.lower() in n.lower()]  # 'h100' -> 'h100_nvlink' first
        near = closest(name, names, n=len(names), cutoff=0.0)
        ordered = list(dict.fromkeys([*contains, *near, *names]))
        raise OverlapConfigError.single(GROUP, f"unknown hardware profile {name!r}; available (closest first): "
                                               f"{', '.join(ordered)}")
    return _load(name)
