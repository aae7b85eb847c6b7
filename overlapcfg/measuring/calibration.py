"""``overlapcfg.calibrate``: measure this cluster and write a hardware profile the cost model reads.

Run on every rank of an initialized default process group (``torchrun``), in this order:

1. collectives (``overlapcfg.measuring.collectives``): each given group (the FSDP group; HSDP's replicate and the
   tensor-parallel group of a mesh) times all-gather, reduce-scatter and all-reduce over log-spaced sizes within
   its share of the budget; fits per kind of link (inside a host or across hosts) and kind;
2. kernels (``overlapcfg.measuring.kernels``): an elementwise kernel over log-spaced sizes (memory bandwidth; the
   per-kernel overhead is recorded), then the step's matmul shapes in its dtype (the achieved FLOP/s at the
   model's mix);
3. rank 0 builds the profile from the slowest rank's timings and broadcasts it: every rank returns the same
   numbers, and rank 0 alone writes the YAML (``hardware_home()/<name>.yaml`` unless told otherwise).

What is not measured comes from ``base`` (a datasheet profile) and is named in ``calibration.notes``: the
inter-node links when every group stayed inside one host, the other dtype's peak (scaled by the base's ratio).
On CUDA (NCCL) the same code times with CUDA events on the compute stream; issuing a collective costs the compute
stream nothing there, so no issue time is fitted.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import fx

from overlapcfg._version import __version__
from overlapcfg.cost.calibration import Calibration, CollectiveFits, KernelSamples
from overlapcfg.cost.hardware import HardwareProfile, PeakFlops, hardware_from, load_hardware, save_hardware
from overlapcfg.errors import OverlapConfigError, OverlapStateError
from overlapcfg.measuring.clock import Clock, default_device
from overlapcfg.measuring.collectives import (
    KINDS,
    GroupTimings,
    fit_collectives,
    group_hosts,
    log_sizes,
    time_group,
)
from overlapcfg.measuring.kernels import (
    MatmulMix,
    MatmulShape,
    chosen_shapes,
    default_shapes,
    matmul_mix,
    matmul_samples,
    memory_samples,
    memory_sizes,
    time_matmuls,
    time_memory,
)
from overlapcfg.passes.backend import CapturedStep

__all__ = ["CalibrationProgress", "calibrate", "profile_header"]

log = logging.getLogger(__name__)

MIN_BYTES = 4096
ROUGH_FIT = 0.25
"""A collective or memory fit whose residual is above this is called out in the profile's notes (and logged). Not
the matmul rate: one rate for every shape is off small shapes by design; its residual says by how much."""
COLLECTIVE_SHARE = 0.75
"""Of the budget, what the collectives get (the kernels take the rest, and at least their few sizes)."""


@dataclass(frozen=True, slots=True)
class CalibrationProgress:
    """Where a calibration stands, for a progress display."""

    phase: str
    """``dp_shard all_gather``, ``memory``, ``matmuls``, ``done``."""
    done: int
    total: int
    """Timings planned (sizes cut short by the budget are counted as done)."""
    elapsed: float


def calibrate(groups: Mapping[str, dist.ProcessGroup] | None = None, *,
              step: CapturedStep | Sequence[fx.GraphModule] | MatmulMix | None = None, name: str = "calibrated",
              base: HardwareProfile | str | None = None, budget_s: float = 60.0, max_bytes: int | None = None,
              dtype: torch.dtype | None = None, device: torch.device | str | None = None,
              save: bool | Path = True, progress: Callable[[CalibrationProgress], None] | None = None,
              ) -> HardwareProfile:
    """Measure collectives on ``groups`` (``{name: group}``; default the whole world as ``world``) and kernels at
    ``step``'s matmul shapes and dtype (a ``CapturedStep``, its graphs, or their ``matmul_mix``); return the
    calibrated profile, the same on every rank.

    ``base``: the datasheet profile unmeasured numbers come from (default ``cpu_gloo`` on CPU, ``h100_nvlink``
    on CUDA). ``budget_s``: wall seconds to aim for (each kind times at least a few sizes whatever the budget).
    ``max_bytes``: the largest collective (default 64 MiB on CPU, 1 GiB on CUDA). ``dtype``: of collectives and
    matmuls (default: the step's matmuls', else float32). ``save``: rank 0 writes the YAML to
    ``hardware_home()/<name>.yaml`` (True), to a given path, or not at all (False).
    Every rank of the default group must call it with the same arguments.
    """
    if not dist.is_initialized():
        raise OverlapStateError("calibrate: no process group; run under torchrun (or init_process_group) on every rank")
    started = time.perf_counter()
    clock = Clock(device if device is not None else default_device())
    base_hw = load_hardware(base if base is not None else ("h100_nvlink" if clock.cuda else "cpu_gloo"))
    if isinstance(step, MatmulMix):
        mix = step
    else:
        mix = matmul_mix([step.forward, step.backward] if isinstance(step, CapturedStep) else list(step or ()))
    shapes = mix.shapes or default_shapes(clock)
    dtype = dtype or mix.dtype or torch.float32
    max_bytes = max_bytes or (2**30 if clock.cuda else 2**26)
    hosts: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    world = cast(dist.ProcessGroup, dist.group.WORLD)  # initialized: checked above
    live = {n: g for n, g in (groups or {"world": world}).items() if dist.get_world_size(g) > 1}
    crosses = group_hosts(live, hosts)
    sizes = log_sizes(MIN_BYTES, max_bytes, per_octave=2)
    mem_sizes = memory_sizes(min(max_bytes, 2**28))
    chosen = chosen_shapes(shapes)
    ticker = _Ticker(progress, started, len(live) * len(KINDS) * len(sizes) + len(mem_sizes) + len(chosen))

    timings = []
    for group_name, group in live.items():
        timings.append(time_group(group_name, group, sizes=sizes, dtype=dtype, clock=clock,
                                  inter_node=crosses[group_name], budget_s=COLLECTIVE_SHARE * budget_s / len(live),
                                  progress=ticker.size(sizes)))
    memory = _slowest(time_memory(mem_sizes, clock, progress=ticker.one), clock)
    matmuls = _slowest(time_matmuls(chosen, dtype, clock, progress=ticker.one), clock)
    ticker("done", final=True)

    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = _build(name, base_hw, _Measured(timings, mem_sizes, memory, shapes, chosen, matmuls, dtype,
                                                     hosts), clock, budget_s, started)
        except Exception as err:  # every rank must hear of it, or the others wait in the broadcast forever
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    # what rank 0 broadcast: a profile's mapping (an exception was raised above)
    result = hardware_from(box[0], path="calibrate")  # type: ignore[arg-type]
    if save is not False and dist.get_rank() == 0:
        save_hardware(result, None if save is True else Path(save), root="calibrate.name",
                      header=profile_header(result))
    return result


@dataclass(frozen=True, slots=True)
class _Measured:
    """Every rank's timings, reduced to the slowest rank's (what rank 0 fits)."""

    collectives: Sequence[GroupTimings]
    memory_sizes: Sequence[int]
    memory: Sequence[float]
    shapes: Counter[MatmulShape]
    chosen: Sequence[MatmulShape]
    matmuls: Sequence[float]
    dtype: torch.dtype
    hosts: Sequence[str]


def _build(name: str, base: HardwareProfile, m: _Measured, clock: Clock, budget_s: float,
           started: float) -> dict[str, object]:
    """Rank 0: fit everything and assemble the profile (JSON form, for the broadcast)."""
    fits, samples = fit_collectives(m.collectives, measured_issue=not clock.cuda) if m.collectives else (None, ())
    mem = memory_samples(m.memory_sizes, m.memory)
    mm = matmul_samples(m.shapes, m.chosen, m.matmuls, m.dtype)
    record = Calibration(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__, overlapcfg_version=__version__, backend=str(dist.get_backend()),
        device=clock.describe(), world_size=dist.get_world_size(), hosts=len(set(m.hosts)), base=base.name,
        budget_seconds=budget_s, seconds=time.perf_counter() - started, groups=samples, kernels=(mem, mm))
    built = _profile(name, base, fits, mem, mm, m.dtype, clock, m.hosts, record)
    return built.model_dump(mode="json", exclude_none=True)


def _slowest(seconds: Sequence[float], clock: Clock) -> list[float]:
    """Per entry, the slowest rank's value (a step waits for its slowest rank)."""
    t = torch.tensor(list(seconds), dtype=torch.float64, device=clock.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class _Ticker:
    def __init__(self, fn: Callable[[CalibrationProgress], None] | None, started: float, total: int) -> None:
        self.fn, self.started, self.total, self.done = fn, started, total, 0
        self.phase = ""

    def __call__(self, phase: str, final: bool = False) -> None:
        self.phase = phase
        if final:
            self.done = self.total
        if self.fn is not None:
            self.fn(CalibrationProgress(phase, min(self.done, self.total), self.total,
                                        time.perf_counter() - self.started))

    def one(self, phase: str, _: int) -> None:
        self.done += 1
        self(phase)

    def size(self, sizes: Sequence[int]) -> Callable[[str, int], None]:
        """Per timed size; when a kind stops early on the budget, its remaining sizes count as done."""
        seen: dict[str, int] = {}

        def tick(phase: str, nbytes: int) -> None:
            if phase != self.phase and self.phase in seen:
                self.done += len(sizes) - seen[self.phase]  # the previous kind stopped early
            seen[phase] = seen.get(phase, 0) + 1
            self.done += 1
            self(phase)

        return tick


def _profile(name: str, base: HardwareProfile, fits: CollectiveFits | None, mem: KernelSamples, mm: KernelSamples,
             dtype: torch.dtype, clock: Clock, hosts: Sequence[str], record: Calibration) -> HardwareProfile:
    notes = []
    low = dtype in (torch.bfloat16, torch.float16)
    ratio = base.peak_flops.bf16 / base.peak_flops.fp32
    peak = PeakFlops(bf16=mm.rate, fp32=mm.rate / ratio) if low else PeakFlops(bf16=mm.rate * ratio, fp32=mm.rate)
    other = "fp32" if low else "bf16"
    notes.append(f"peak_flops.{other}: not measured; the measured rate scaled by {base.name}'s bf16/fp32 ratio "
                 f"({ratio:.1f})")
    rough = [f"{k.kind} on {g.name} {100 * k.residual:.0f}%" for g in record.groups for k in g.collectives
             if k.residual > ROUGH_FIT]
    rough += [f"memory kernel {100 * mem.residual:.0f}%"] if mem.residual > ROUGH_FIT else []
    if rough:
        note = (f"fits far from their own timings (RMS relative error): {', '.join(rough)}; a busy machine or a "
                "link that is not linear in size. Predictions inherit it: rerun on an idle machine, with a larger "
                "calibrate.budget_s, and check with mode=measure")
        log.warning("calibrate: %s", note)
        notes.append(note)
    intra = fits.intra_node if fits is not None else None
    inter = fits.inter_node if fits is not None else None
    if intra is None or intra.all_gather is None:
        notes.append(f"intra-node links: not measured (no group inside one host); {base.name}'s datasheet numbers")
    if inter is None or inter.all_gather is None:
        notes.append(f"inter-node links: not measured (no group crossed hosts); {base.name}'s datasheet numbers")
    per_host = max(hosts.count(h) for h in set(hosts))
    gpus = torch.cuda.device_count() if clock.cuda else max(per_host, base.gpus_per_node)
    if not clock.cuda:
        notes.append(f"gpus_per_node: {gpus} (the larger of {per_host} ranks on a host here and {base.name}'s "
                     f"{base.gpus_per_node}): groups up to that size are priced with the intra-node fits")
    intra_ag = intra.all_gather if intra is not None else None
    inter_ag = inter.all_gather if inter is not None else None
    try:
        return HardwareProfile(
            name=name,
            description=f"calibrated on {record.device}, {record.backend} x {record.world_size} "
                        f"({record.hosts} host{'s' if record.hosts > 1 else ''}), {record.date[:10]}; "
                        f"unmeasured numbers from {base.name}",
            peak_flops=peak, mem_bandwidth=mem.rate,
            intra_node_bandwidth=intra_ag.bandwidth if intra_ag else base.intra_node_bandwidth,
            inter_node_bandwidth=inter_ag.bandwidth if inter_ag else base.inter_node_bandwidth,
            latency=gather.latency if (gather := intra_ag or inter_ag) else base.latency,
            gpus_per_node=gpus, compute_efficiency=1.0, comm_efficiency=1.0, collectives=fits,
            calibration=record.model_copy(update={"notes": tuple(notes)}))
    except ValueError as err:  # pydantic: a fitted number out of range
        raise OverlapConfigError.single("calibrate", f"the calibrated profile is invalid: {err}") from None


def profile_header(profile: HardwareProfile) -> str:
    """The comment a calibrated profile's YAML starts with: what the numbers are and where they came from."""
    cal = profile.calibration
    assert cal is not None
    return (f"Calibrated by overlapcfg {cal.overlapcfg_version} (torch {cal.torch_version}) on {cal.date}: "
            f"{cal.device}, {cal.backend} x {cal.world_size}, {cal.seconds:.0f} s.\n"
            "collectives: per link and kind, the ring model's latency (per step) and bus bandwidth fitted by least "
            "squares\nto the timings under calibration.groups (residual: RMS relative error). mem_bandwidth: a + b "
            "over sizes;\npeak_flops: the achieved rate at the model's matmuls. Read by overlapcfg hardware=<name> "
            "/ load_hardware.")
