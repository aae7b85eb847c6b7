"""Hardware profiles for the cost model: peak compute, memory bandwidth and the network, as plain pydantic models.

The shipped profiles are ``conf/hardware/*.yaml``, the ``overlapcfg`` command's ``hardware`` group
(``hardware=h100_nvlink``; user apps do not see it: they pass a name or a profile to ``explain``), each number
sourced in a YAML comment; ``load_hardware(name)`` reads them without Hydra. Bandwidths are per GPU and per
direction: a ring all-gather or reduce-scatter sends and receives at the same time on different links, so the
bidirectional figures vendors quote are halved.

Profiles you make (``overlapcfg mode=calibrate``, or by hand) live in the user directory, ``hardware_home()``:
``$OVERLAPCFG_HOME/hardware/`` if set, else ``$XDG_CONFIG_HOME/overlapcfg/hardware/`` (``~/.config/...``). A name
there works wherever a shipped name does (``hardware=<name>`` on the command line, whose search path includes the
directory, and ``load_hardware(name)``); a shipped name always wins, so calibration refuses one. ``load_hardware``
also takes a path to a YAML file. A calibrated profile adds measured ``collectives`` fits and a ``calibration``
record (``overlapcfg.cost.measured_fits``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

from omegaconf import DictConfig
from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from overlapcfg.config.base import ConfigModel, measured
from overlapcfg.config.load import config_data, validate_config
from overlapcfg.config.presets import command_conf_dir
from overlapcfg.config.safe_yaml import dump_yaml
from overlapcfg.config.yaml_files import check_path
from overlapcfg.cost.achievable import Achievable, Fraction, Skew
from overlapcfg.cost.measured_fits import Calibration, CollectiveFit, CollectiveFits, Contention, LinkContention
from overlapcfg.errors import OverlapConfigError, OverlapUsageError, closest_first, natural_key
from overlapcfg.files import write_atomic

__all__ = ["HardwareProfile", "PeakFlops", "hardware_home", "hardware_names", "hardware_yaml", "load_hardware",
           "save_hardware", "shipped_hardware_names"]

GROUP = "hardware"
HEADER = "invalid hardware profile"
HOME_ENV = "OVERLAPCFG_HOME"
"""Environment variable naming the user's overlapcfg directory (profiles in its ``hardware/``)."""


FlopRate = Annotated[float, measured("FLOP/s", 1e6, 1e18, example="1 MFLOP/s to 1 EFLOP/s")]
"""Peak compute of one device: far below a single CPU core, or above any accelerator, is a typo or a unit mix-up."""
ByteRate = Annotated[float, measured("bytes/s", 1e6, 1e15, example="1 MB/s to 1 PB/s")]
"""A memory or link bandwidth of one device, per direction."""
Latency = Annotated[float, measured("seconds", 1e-9, 1.0, example="1 ns to 1 s")]
"""Per-step latency of a ring: above 0 (no link answers in no time) up to a second."""


class PeakFlops(ConfigModel):
    """Dense peak FLOP/s per dtype (no sparsity). Dtypes not listed fall back to ``fp32``."""

    bf16: FlopRate
    """Tensor-core bf16 (fp16 is costed the same)."""
    fp32: FlopRate
    """Plain fp32 (not TF32): what an fp32 model gets without ``allow_tf32``."""


class HardwareProfile(ConfigModel):
    """One accelerator and its network, as the cost model sees it (SI units: FLOP/s, bytes/s, seconds).

    Every number is finite and within what hardware has (``FlopRate``, ``ByteRate``, ``Latency``): ``.inf`` or
    ``1e300`` in a profile is an error naming the field and the range, not a prediction of zero seconds."""

    name: str
    """Short name shown in reports (the YAML file name for shipped profiles)."""
    description: str = ""
    """One line: which part and which interconnect."""
    device_kind: Literal["gpu", "cpu"] = "gpu"
    """What computes: ``gpu`` or ``cpu``. Calibration takes a base profile of the device's own kind for the numbers
    it does not measure (a CPU profile's links and peaks say nothing about a GPU)."""
    peak_flops: PeakFlops
    """Dense peak compute per dtype."""
    mem_bandwidth: ByteRate
    """Device memory bandwidth (bytes/s): the roofline's slope for memory-bound ops."""
    intra_node_bandwidth: ByteRate
    """Per-GPU, per-direction bandwidth between GPUs of one node (bytes/s); used when the group fits in a node."""
    inter_node_bandwidth: ByteRate
    """Per-GPU, per-direction bandwidth across nodes (bytes/s); a ring spanning nodes is limited by it."""
    latency: Latency
    """Per-hop latency of a ring step (seconds): the alpha of the alpha-beta model, paid (p - 1) times."""
    gpus_per_node: int = Field(ge=1)
    """Devices per node: groups of at most this many ranks use ``intra_node_bandwidth``."""
    nics_per_node: int = Field(1, ge=1)
    """Network cards per node (rails): a ring spanning whole nodes runs a channel through each at once, so its
    inter-node bus bandwidth is ``inter_node_bandwidth`` (per NIC) times the NICs its ranks drive."""
    compute_efficiency: Fraction = 1.0
    """A further factor on every kernel's rate (after ``achievable``); 1.0: none."""
    comm_efficiency: Fraction = 1.0
    """Fraction of link bandwidth collectives reach where the profile has no ``collectives`` rate for the kind and
    link (bus bandwidth / link bandwidth); 1.0 is optimistic."""
    achievable: Achievable | None = None
    """What kernels reach of the peaks above, by kind and shape (``overlapcfg.cost.achievable``); null: the peaks
    themselves (the pure roofline, an optimistic bound)."""
    skew: Skew | None = None
    """How far apart ranks arrive at a collective (calibrated by ``overlapcfg.calibrate``; a default in the shipped
    profiles); null: they arrive together."""
    contention: LinkContention | None = None
    """Measured slowdowns of compute and communication while they overlap (``overlapcfg.calibrate``), per kind of
    link; null: none (each runs as if alone, the datasheet profiles' optimistic assumption)."""
    collectives: CollectiveFits | None = None
    """Measured per-kind fits (``overlapcfg.calibrate``) that replace the ring model's datasheet numbers for the
    kinds and links they cover; null: the datasheet numbers above for everything."""
    calibration: Calibration | None = None
    """Provenance of a calibrated profile: date, torch version, backend, world size, sizes, residuals."""

    @model_validator(mode="after")
    def _physical(self) -> HardwareProfile:
        """A collective rate above the link it runs on is a typo or a unit mix-up (an algorithm bandwidth through
        NVLink SHARP included): refused, naming the field."""
        for link, physical, field in ((self.collectives and self.collectives.intra_node, self.intra_node_bandwidth,
                                       "intra_node"),
                                      (self.collectives and self.collectives.inter_node, self.inter_node_bandwidth,
                                       "inter_node")):
            if link is None:
                continue
            for kind in type(link).model_fields:
                fit = getattr(link, kind)
                if fit is None:
                    continue
                for name in ("bandwidth", "nvls_bandwidth"):
                    value = getattr(fit, name)
                    if value is not None and value > physical * (1 + 1e-9):
                        raise PydanticCustomError(
                            "above_link", "collectives.{field}.{kind}.{name}: {value} bytes/s is above the physical "
                            "link, {field}_bandwidth {physical} bytes/s",
                            {"field": field, "kind": kind, "name": name, "value": f"{value:.4g}",
                             "physical": f"{physical:.4g}"})
        return self

    def flops_for(self, dtype_name: str) -> float:
        """Peak FLOP/s for ``bfloat16``/``float16``/``bf16`` (tensor cores) or anything else (fp32)."""
        if dtype_name in ("bfloat16", "float16", "bf16", "fp16"):
            return self.peak_flops.bf16 * self.compute_efficiency
        return self.peak_flops.fp32 * self.compute_efficiency

    def dense_peak(self, dtype_name: str) -> float:
        """The datasheet's dense peak for ``dtype_name``, the denominator of MFU (no efficiency applied)."""
        return self.peak_flops.bf16 if dtype_name in ("bfloat16", "float16", "bf16", "fp16") else \
            self.peak_flops.fp32

    def contention_for(self, inter_node: bool) -> Contention | None:
        """The measured contention of a collective on that kind of link, if calibration made one."""
        if self.contention is None:
            return None
        return self.contention.inter_node if inter_node else self.contention.intra_node

    def collective_fit(self, kind: str, inter_node: bool) -> CollectiveFit | None:
        """The measured fit for ``kind`` on that kind of link, if calibration made one."""
        if self.collectives is None:
            return None
        link = self.collectives.inter_node if inter_node else self.collectives.intra_node
        return getattr(link, kind, None) if link is not None and kind in type(link).model_fields else None


def hardware_dir() -> Path:
    return command_conf_dir() / GROUP


def hardware_home() -> Path:
    """The user's profile directory (``$OVERLAPCFG_HOME/hardware``, else ``$XDG_CONFIG_HOME`` or ``~/.config``
    ``/overlapcfg/hardware``); it need not exist."""
    return user_conf_dir() / GROUP


def user_conf_dir() -> Path:
    """The user's overlapcfg directory (``hardware/`` inside it); the ``overlapcfg`` command searches it."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "overlapcfg"


def shipped_hardware_names() -> tuple[str, ...]:
    """Shipped profile names in natural order (``conf/hardware/*.yaml``)."""
    return tuple(sorted((p.stem for p in hardware_dir().glob("*.yaml")), key=natural_key))


def hardware_names() -> tuple[str, ...]:
    """Every profile a name can select: the shipped ones, then the user's (``hardware_home()``) that no shipped
    name shadows, each in natural order."""
    shipped = shipped_hardware_names()
    home = hardware_home()
    user = sorted((p.stem for p in home.glob("*.yaml") if p.stem not in shipped), key=natural_key) \
        if home.is_dir() else []
    return (*shipped, *user)


@cache
def _load(name: str) -> HardwareProfile:
    return _read(hardware_dir() / f"{name}.yaml", name)


def _read(path: Path, name: str) -> HardwareProfile:
    # The one reader of configs (``overlapcfg.config.load.config_data``), limits included: ``${key}`` references
    # between the profile's own keys mean what they mean when the command composes the profile
    # (``hardware=<name>``), resolvers are refused there as here, and ``save_hardware``'s ``\${`` reads back as ``${``.
    data = config_data(path, GROUP, what="hardware profile", header=HEADER)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise OverlapConfigError.single(GROUP, f"{path} is not a mapping")
    data.setdefault("name", name)
    return validate_config(HardwareProfile, data, root=GROUP, header=f"{HEADER} in {str(path)!r}")  # the file too


def hardware_from(data: HardwareProfile | Mapping[str, Any] | DictConfig, *, path: str = GROUP) -> HardwareProfile:
    """Validate a mapping, or the ``hardware`` node of a Hydra config (the ``overlapcfg`` command's), into a
    profile; faults name ``path``. A node is read as a profile file is (``${key}`` references honoured, resolvers
    refused: ``overlapcfg.config.load.config_data``)."""
    if isinstance(data, HardwareProfile):
        return data
    plain = config_data(data, path, header=HEADER)
    return validate_config(HardwareProfile, plain, root=path, header=HEADER)


def load_hardware(name: str | Path | HardwareProfile) -> HardwareProfile:
    """A profile by name (shipped, then the user's), or from a YAML file's path (a ``Path``, or a string ending in
    ``.yaml``/``.yml`` or holding a ``/``); an unknown name lists the available ones, closest first."""
    if isinstance(name, HardwareProfile):
        return name
    if isinstance(name, Path) or (isinstance(name, str) and (name.endswith((".yaml", ".yml")) or "/" in name)):
        check_path(name, GROUP, what="hardware profile")
        path = Path(name).expanduser()
        if not path.is_file():
            raise OverlapConfigError.single(GROUP, f"no hardware profile file {str(path)!r}")
        return _read(path, path.stem)
    if not isinstance(name, str):
        raise OverlapUsageError(f"load_hardware takes a profile name, a path or a HardwareProfile, got "
                                f"{type(name).__name__}; validate a mapping with hardware_from(data)")
    if name in shipped_hardware_names():
        return _load(name)
    names = hardware_names()
    if name not in names:  # closest first, as the command line lists them ('h100' -> 'h100_nvlink' first)
        raise OverlapConfigError.single(GROUP, f"unknown hardware profile {name!r}; available (closest first): "
                                               f"{', '.join(closest_first(name, names))} (or a path to a YAML file; "
                                               f"your own profiles live in {hardware_home()})")
    return _read(hardware_home() / f"{name}.yaml", name)


def save_hardware(profile: HardwareProfile, path: Path | None = None, *, header: str = "",
                  root: str = GROUP) -> Path:
    """Write ``profile`` as YAML (default: ``hardware_home()/<name>.yaml``), atomically: a reader never sees half
    a file. A name a shipped profile has is refused (the shipped one would always win); faults name ``root``."""
    if path is None:
        if profile.name in shipped_hardware_names():
            raise OverlapConfigError.single(root, f"{profile.name!r} is a shipped profile's name, which would "
                                                  "always be found first; choose another name")
        path = hardware_home() / f"{profile.name}.yaml"
    check_path(path, root, what="hardware profile")
    return write_atomic(path, hardware_yaml(profile, header=header))


def hardware_yaml(profile: HardwareProfile, *, header: str = "") -> str:
    """``profile`` as the YAML ``save_hardware`` writes: ``header`` as comment lines, then the fields (it reads back
    as written)."""
    body = dump_yaml(profile.model_dump(mode="json", exclude_none=True), width=120)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comment + body
