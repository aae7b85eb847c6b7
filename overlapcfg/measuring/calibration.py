"""``overlapcfg.calibrate``: measure this cluster and write a hardware profile the cost model reads.

Run on every rank of an initialized default process group (``torchrun``), in this order:

1. collectives (``overlapcfg.measuring.collective_fits``): each given group (the FSDP group; HSDP's replicate and the
   tensor-parallel group of a mesh) times all-gather, reduce-scatter and all-reduce over log-spaced sizes within
   its share of the budget; fits per kind of link (inside a host or across hosts) and kind;
2. kernels (``overlapcfg.measuring.kernels``): an elementwise kernel over log-spaced sizes up to well beyond the
   last-level cache (memory bandwidth; the per-kernel overhead is recorded), then the step's matmul shapes in fp32
   and in bf16 (the achieved FLOP/s at the model's mix, each dtype measured);
3. contention (``overlapcfg.measuring.contention``): per group, how much the step's compute slows with an
   all-gather in flight and the all-gather with compute running; then the rank skew (``overlapcfg.measuring.skew``):
   how far apart the ranks arrive at a blocking collective after a stretch of compute;
4. rank 0 builds the profile from the slowest rank's timings and broadcasts it: every rank returns the same
   numbers, and rank 0 alone writes the YAML (``hardware_home()/<name>.yaml`` unless told otherwise).

Every figure is checked before it is written (``calibration.rough_fits``, logged as a warning and shown by
``mode=measure``): a fit whose residual is above ``ROUGH_FIT`` (the kernel or link is not what the model's formula
says, or the machine was busy), and a figure above the device's datasheet (``overlapcfg.measuring.device``: a
cache or a timing error; the datasheet figure is kept instead).

What is not measured comes from ``base``, a datasheet profile of the device's own kind (on CUDA by default the
shipped GPU profile closest to the device, never the CPU one), and is named in ``calibration.notes``: the
inter-node links when every group stayed inside one host. On CUDA (NCCL) the same code times with CUDA events on
the compute stream; issuing a collective costs the compute stream nothing there, so no issue time is fitted.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, cast

import torch
import torch.distributed as dist
from pydantic import Field
from torch import fx

from overlapcfg._version import __version__
from overlapcfg.config.base import ByteCount
from overlapcfg.config.load import validate_value
from overlapcfg.cost.achievable import Achievable, MatmulRate, MatmulRates, MemoryRate, Skew, TimedMatmul
from overlapcfg.cost.hardware import (
    HardwareProfile,
    PeakFlops,
    hardware_from,
    load_hardware,
    save_hardware,
    shipped_hardware_names,
)
from overlapcfg.cost.measured_fits import (
    ROUGH_FIT,
    Calibration,
    CollectiveFits,
    Contention,
    ContentionSamples,
    KernelSamples,
    LinkContention,
)
from overlapcfg.errors import OverlapConfigError, OverlapStateError
from overlapcfg.measuring.attention_timing import (
    AttentionShape,
    AttentionTiming,
    attention_rates,
    share_peak,
    time_attention,
)
from overlapcfg.measuring.clock import Clock, default_device
from overlapcfg.measuring.collective_fits import (
    KINDS,
    GroupTimings,
    fit_collectives,
    group_hosts,
    log_sizes,
    time_group,
)
from overlapcfg.measuring.contention import ContentionTimings, contention_fit, time_contention, time_start_delay
from overlapcfg.measuring.device import DeviceFacts, device_facts
from overlapcfg.measuring.kernels import (
    MATMUL_DTYPES,
    MEMORY_CAP,
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
    time_views,
    timed_until_growing,
)
from overlapcfg.measuring.measure_result import CalibratedProfile, profile_header
from overlapcfg.measuring.skew import TRIALS, SkewTimings, skew_fit, skew_unit, time_skew, unit_runner
from overlapcfg.measuring.step_kernels import (
    InTurn,
    in_turn_note,
    launch_beyond_bytes,
    matmul_layouts_in_turn,
    matmuls_in_turn,
    replayed,
    time_in_turn,
    views_in_turn,
)
from overlapcfg.passes.backend import CapturedStep

__all__ = ["CalibrationProgress", "base_profile", "calibrate", "profile_header", "skew_trials", "timing_effort"]

log = logging.getLogger(__name__)

MIN_BYTES = 4096
COLLECTIVE_SHARE = 0.75
"""Of the budget, what the collectives get (the kernels take the rest, and at least their few sizes)."""
IN_TURN_SHARE = 0.1
"""Of the budget, what the in-turn replay of the step's kernels may take (at least one round of them)."""
FULL_EFFORT_BUDGET_S = 20.0
"""From this budget up, every kernel is timed for as long as its kind asks and the skew takes all its trials. Below
it both shrink in proportion to the budget (``timing_effort``): the kernels and the skew are timed whatever the
budget, and at their full length they alone took 10-25 s on 2 CPU cores, so a 3 s budget was not kept."""
MIN_EFFORT = 0.2
"""The least share of the full timing a short budget gets: each timing round at least a fifth of its length."""
MIN_SKEW_TRIALS = 4
"""The fewest skew trials per length, whatever the budget."""
BudgetSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""``calibrate.budget_s``: a finite number of seconds above 0."""


@dataclass(frozen=True, slots=True)
class CalibrationProgress:
    """Where a calibration stands, for a progress display."""

    phase: str
    """``dp_shard all_gather``, ``memory``, ``matmuls``, ``contention``, ``done``."""
    done: int
    total: int
    """Timings planned (sizes cut short by the budget are counted as done)."""
    elapsed: float


def calibrate(groups: Mapping[str, dist.ProcessGroup] | None = None, *,
              step: CapturedStep | Sequence[fx.GraphModule] | MatmulMix | None = None, name: str = "calibrated",
              base: HardwareProfile | str | None = None, budget_s: float = 60.0, max_bytes: int | None = None,
              dtype: torch.dtype | None = None, device: torch.device | str | None = None,
              save: bool | Path = True, progress: Callable[[CalibrationProgress], None] | None = None,
              cache_bytes: int | None = None) -> CalibratedProfile:
    """Measure collectives on ``groups`` (``{name: group}``; default the whole world as ``world``), kernels at
    ``step``'s matmul shapes (a ``CapturedStep``, its graphs, or their ``matmul_mix``) in fp32 and bf16, and the
    contention between the two; return the calibrated profile, the same on every rank (a ``CalibratedProfile``:
    a ``HardwareProfile`` that prints as the command's calibration table, ``to_yaml()`` its file).

    ``base``: the datasheet profile unmeasured numbers come from, of the device's own kind (default: ``cpu_gloo``
    on CPU; on CUDA the shipped GPU profile closest to the device, ``overlapcfg.measuring.device``); a CPU profile
    for a GPU, or the other way round, is refused. ``budget_s``: wall seconds to aim for (each kind times at least a
    few sizes whatever the budget). ``max_bytes``: the largest collective (default 64 MiB on CPU, 1 GiB on CUDA).
    ``dtype``: of collectives and of the contention runs' compute (default: the step's matmuls', else float32).
    ``save``: rank 0 writes the YAML to ``hardware_home()/<name>.yaml`` (True), to a given path, or not at all
    (False). ``cache_bytes``: the last-level cache the memory bandwidth is timed beyond (default: the size the
    device reports, ``overlapcfg.measuring.device``); the memory kernels run up to a few times it (capped at 1 GiB
    on a CPU), which is most of a short calibration on a CPU reporting hundreds of MiB. Give it where a virtual
    machine reports a cache it does not have; a smaller one times a faster, smaller range (the cache's bandwidth
    where the real cache is larger, and the profile's notes say which was used). Every rank of the default group
    must call it with the same arguments.
    """
    given_cache = None if cache_bytes is None else validate_value(ByteCount, cache_bytes, path="calibrate.cache_bytes")
    budget_s = validate_value(BudgetSeconds, budget_s, path="calibrate.budget_s")
    if not dist.is_initialized():
        raise OverlapStateError("calibrate: no process group; run under torchrun (or init_process_group) on every rank")
    started = time.perf_counter()
    clock = Clock(device if device is not None else default_device(), effort=timing_effort(budget_s))
    facts = device_facts(clock)
    if given_cache is not None:
        facts = dataclasses.replace(facts, cache_bytes=given_cache, cache_reported=facts.cache_bytes)
    base_hw = base_profile(base, facts)
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
    mem_sizes = memory_sizes(facts.cache_bytes, MEMORY_CAP[facts.kind])
    chosen = chosen_shapes(shapes)
    planned = len(live) * (len(KINDS) * len(sizes) + 1) + len(mem_sizes) + len(chosen) * len(MATMUL_DTYPES)
    ticker = _Ticker(progress, started, planned)

    timings = []
    for group_name, group in live.items():
        timings.append(time_group(group_name, group, sizes=sizes, dtype=dtype, clock=clock,
                                  inter_node=crosses[group_name], budget_s=COLLECTIVE_SHARE * budget_s / len(live),
                                  progress=ticker.size(sizes)))
    memory, _ = timed_until_growing(
        mem_sizes, facts.cache_bytes, lambda sizes: _slowest(time_memory(sizes, clock, progress=ticker.one), clock))
    views = _slowest([time_views(clock)], clock)[0]
    matmuls = {dt: _slowest(time_matmuls(chosen, dt, clock, progress=ticker.one, layouts=mix.layouts), clock)
               for dt in MATMUL_DTYPES}
    calls = sorted(mix.attention)
    backend, attention = time_attention(calls, dtype, clock)
    slowest = _slowest([t for pair in attention for t in pair], clock)
    attention = [(slowest[2 * i], slowest[2 * i + 1]) for i in range(len(calls))]
    in_turn, cpu_share = _in_turn(mix, clock, IN_TURN_SHARE * budget_s)
    fits = fit_collectives(timings, measured_issue=not clock.cuda)[0] if timings else None
    contended = []
    unit = skew_unit(mix)
    for group_name, group in live.items():
        link = (fits.inter_node if crosses[group_name] else fits.intra_node) if fits is not None else None
        mine = time_contention(group_name, group, inter_node=crosses[group_name],
                               fit=link.all_gather if link is not None else None, shape=chosen[0], dtype=dtype,
                               clock=clock, max_bytes=max_bytes)
        delay_bytes, delays = time_start_delay(group, unit=unit_runner(unit, dtype, clock), dtype=dtype, clock=clock)
        mine = dataclasses.replace(mine, delay_bytes=delay_bytes, delays=delays)
        every: list[ContentionTimings | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        contended.append([t for t in every if t is not None])
        ticker.one("contention", 0)
    skews = [time_skew(group_name, group, dtype=dtype, clock=clock, unit_spec=unit, trials=skew_trials(clock.effort))
             for group_name, group in live.items()]
    ticker("done", final=True)

    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = _build(name, base_hw, _Measured(timings, mem_sizes, memory, shapes, chosen, matmuls, dtype,
                                                     hosts, contended, mix.memory, views, skews, mix.layouts,
                                                     (backend, calls, attention), mix.attention_untimed,
                                                     in_turn, _left_out(mix, in_turn, clock), cpu_share),
                            clock, facts, budget_s, started)
        except Exception as err:  # every rank must hear of it, or the others wait in the broadcast forever
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    # what rank 0 broadcast: a profile's mapping (an exception was raised above)
    result = CalibratedProfile.of(hardware_from(box[0], path="calibrate"))  # type: ignore[arg-type]
    if save is not False and dist.get_rank() == 0:
        save_hardware(result, None if save is True else Path(save), root="calibrate.name",
                      header=profile_header(result))
    return result


def base_profile(base: HardwareProfile | str | None, facts: DeviceFacts, *,
                 root: str = "calibrate.base") -> HardwareProfile:
    """The datasheet profile unmeasured numbers come from: ``base``, or the device's own (``DeviceFacts.base``); one
    of another kind of device is refused (a CPU profile's 50 us latency and 5 GB/s links on a GPU, say)."""
    profile = load_hardware(base if base is not None else facts.base)
    if profile.device_kind != facts.kind:
        same = [n for n in shipped_hardware_names() if load_hardware(n).device_kind == facts.kind]
        raise OverlapConfigError.single(
            root, f"{profile.name!r} is a {profile.device_kind.upper()} profile, but calibration runs on a "
                  f"{facts.kind.upper()} ({facts.name}): its numbers would stand in for what is not measured here; "
                  f"choose a {facts.kind.upper()} profile ({', '.join(same)}) or leave the base unset "
                  f"({facts.base} for this device)")
    return profile


@dataclass(frozen=True, slots=True)
class _Measured:
    """Every rank's timings, reduced to the slowest rank's (what rank 0 fits)."""

    collectives: Sequence[GroupTimings]
    memory_sizes: Sequence[int]
    memory: Sequence[float]
    shapes: Counter[MatmulShape]
    chosen: Sequence[MatmulShape]
    matmuls: Mapping[torch.dtype, Sequence[float]]
    dtype: torch.dtype
    hosts: Sequence[str]
    contention: Sequence[Sequence[ContentionTimings]]
    kernels: Counter[int]
    """The step's memory-bound kernel sizes (``MatmulMix.memory``)."""
    views: float = 0.0
    """Seconds a view op's dispatch takes (slowest rank)."""
    skews: Sequence[SkewTimings] = ()
    """Per group, every rank's arrival waits."""
    layouts: Mapping[MatmulShape, str] | None = None
    """The layout each timed shape was timed in (the step's)."""
    attention: tuple[str, Sequence[AttentionShape], Sequence[AttentionTiming]] = ("math", (), ())
    """The backend SDPA used, the step's attention call shapes and their forward and backward seconds (slowest
    rank)."""
    attention_untimed: int = 0
    """The step's forward attention calls with no one shape to time at (``MatmulMix.attention_untimed``)."""
    in_turn: InTurn = ((), (), ())
    """The step's kernel calls timed in turn (slowest rank), with how often the step makes each."""
    unreplayable: int = 0
    """The step's kernel calls (nodes) not replayed: unreplayable (``MatmulMix.calls_unreplayable``) or past the
    replay's caps (``overlapcfg.measuring.step_kernels.replayed``)."""
    cpu_share: float = 1.0
    """The replay's wall time over its CPU time (``TurnTimes.cpu_share``; the largest of any rank)."""


def timing_effort(budget_s: float) -> float:
    """The share of the full kernel and skew timing a calibration of ``budget_s`` runs: 1 from
    ``FULL_EFFORT_BUDGET_S`` up, in proportion below it, never under ``MIN_EFFORT``."""
    return max(MIN_EFFORT, min(1.0, budget_s / FULL_EFFORT_BUDGET_S))


def skew_trials(effort: float) -> int:
    """Skew trials per length at ``effort``: that share of ``TRIALS``, never under ``MIN_SKEW_TRIALS``."""
    return max(MIN_SKEW_TRIALS, round(TRIALS * effort))


def _in_turn(mix: MatmulMix, clock: Clock, budget_s: float) -> tuple[InTurn, float]:
    """The step's most frequent kernel calls (``replayed``: within a count and a memory cap), in the order the step
    first makes them, timed in turn on every rank (the slowest rank's time of each), and the largest CPU share any
    rank's replay ran at (``TurnTimes.cpu_share``); nothing on a GPU (see ``overlapcfg.measuring.step_kernels``).
    A rank whose replay fails reports nothing timed, and still takes part in the reductions: every rank makes the
    same collective calls whatever happened on it."""
    if clock.cuda or not mix.calls:
        return ((), (), ()), 1.0
    calls = replayed(mix.calls)
    try:
        turns = time_in_turn(calls, clock.device, budget_s=budget_s)
        mine, share = turns.seconds, turns.cpu_share
    except Exception:  # kept to the back-to-back figures, never a hang of the other ranks
        log.warning("calibrate: the in-turn replay of the step's kernels failed on this rank", exc_info=True)
        mine, share = [None] * len(calls), 1.0
    *seconds, share = _slowest([-1.0 if s is None else s for s in mine] + [share], clock)
    return (calls, [mix.calls[c] for c in calls], [s if s >= 0 else None for s in seconds]), share


def _left_out(mix: MatmulMix, in_turn: InTurn, clock: Clock) -> int:
    """The step's kernel calls (nodes) not replayed on a CPU: unreplayable ones and those past the replay's caps
    (none on a GPU, which replays nothing by design)."""
    if clock.cuda:
        return 0
    replayed_calls = set(in_turn[0])
    return mix.calls_unreplayable + sum(n for c, n in mix.calls.items() if c not in replayed_calls)


def _build(name: str, base: HardwareProfile, m: _Measured, clock: Clock, facts: DeviceFacts, budget_s: float,
           started: float) -> dict[str, object]:
    """Rank 0: fit everything and assemble the profile (JSON form, for the broadcast)."""
    fits, samples = fit_collectives(m.collectives, measured_issue=not clock.cuda) if m.collectives else (None, ())
    mem = memory_samples(m.memory_sizes, m.memory, facts.cache_bytes, m.kernels)
    matmuls, replaced = matmuls_in_turn(m.in_turn, m.chosen, dict(m.layouts or {}), dict(m.matmuls))
    fitted = {dt: matmul_samples(m.shapes, m.chosen, seconds, dt) for dt, seconds in matmuls.items()}
    mms = {dt: f[0] for dt, f in fitted.items()}
    contention = [contention_fit(runs) for runs in m.contention]
    skews = [skew_fit(t) for t in m.skews]
    record = Calibration(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__, overlapcfg_version=__version__, backend=str(dist.get_backend()),
        device=clock.describe(), world_size=dist.get_world_size(), hosts=len(set(m.hosts)), base=base.name,
        budget_seconds=budget_s, seconds=time.perf_counter() - started, groups=samples,
        kernels=(mem, *mms.values()), contention=tuple(c[1] for c in contention), skew=tuple(s[1] for s in skews))
    timed = {dt: tuple(TimedMatmul(shape=s, layout=(m.layouts or {}).get(s, "nn"), seconds=t)
                       for s, t in zip(m.chosen, matmuls[dt], strict=True) if s in m.shapes)
             for dt in matmuls}
    for dt, by_kernel in matmul_layouts_in_turn(m.in_turn).items():  # the step's other layouts, as timed in turn
        if dt in timed:
            known = {(t.shape, t.layout) for t in timed[dt]}
            timed[dt] += tuple(TimedMatmul.model_validate({"shape": shape, "layout": layout, "seconds": sec})
                               for (shape, layout), sec in by_kernel.items() if (shape, layout) not in known)
    # validated, not model_copy: the lookup of timed kernels is built when the model is
    rates = {dt: (MatmulRate.model_validate({**f[1].model_dump(), "timed": timed[dt]}), f[2])
             for dt, f in fitted.items()}
    views = views_in_turn(m.in_turn)
    # the bytes are priced at the profile's bandwidth, the measured one capped at the datasheet (``_capped``)
    bandwidth = mem.rate if facts.mem_bandwidth is None else min(mem.rate, facts.mem_bandwidth)
    launch = launch_beyond_bytes(*m.in_turn, bandwidth=bandwidth)
    note = in_turn_note(m.in_turn, left_out=m.unreplayable, views=views, back_to_back_views=m.views, launch=launch,
                        back_to_back_launch=mem.overhead, matmuls=replaced, cpu_share=m.cpu_share)
    built = _profile(name, base, fits, mem, mms, contention, facts, clock, m.hosts, record, rates=rates,
                     views=m.views if views is None else views, skews=skews, attention=m.attention, dtype=m.dtype,
                     attention_untimed=m.attention_untimed, launch=launch, in_turn_note=note)
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


def _capped(what: str, measured: float, ceiling: float | None, unit: float, rough: list[str], notes: list[str],
            facts: DeviceFacts) -> float:
    """``measured``, or the datasheet ``ceiling`` where the measurement is above it (said in ``rough`` and
    ``notes``: a cache or a timing error, never the device)."""
    if ceiling is None or measured <= ceiling:
        return measured
    rough.append(f"{what} {measured / unit:.3g} above the datasheet {ceiling / unit:.3g}")
    notes.append(f"{what}: measured {measured / unit:.3g}, above {facts.name}'s datasheet {ceiling / unit:.3g} "
                 f"({facts.source}): a cache or a timing error, not the device; the datasheet figure is kept")
    return ceiling


def _profile(name: str, base: HardwareProfile, fits: CollectiveFits | None, mem: KernelSamples,
             mms: Mapping[torch.dtype, KernelSamples], contention: Sequence[tuple[Contention, ContentionSamples]],
             facts: DeviceFacts, clock: Clock, hosts: Sequence[str], record: Calibration, *,
             rates: Mapping[torch.dtype, tuple[MatmulRate, float]] | None = None, views: float = 0.0,
             skews: Sequence[tuple[Skew, object]] = (),
             attention: tuple[str, Sequence[AttentionShape], Sequence[AttentionTiming]] = ("math", (), ()),
             dtype: torch.dtype = torch.float32, attention_untimed: int = 0, launch: float | None = None,
             in_turn_note: str | None = None) -> HardwareProfile:
    notes: list[str] = [in_turn_note] if in_turn_note else []
    if clock.effort < 1.0:
        notes.append(f"budget: calibrate.budget_s {record.budget_seconds:g} s is under {FULL_EFFORT_BUDGET_S:g} s, so "
                     f"each kernel was timed for {100 * clock.effort:.0f} % of its usual length and the skew for "
                     f"{skew_trials(clock.effort)} of {TRIALS} trials: a quicker, "
                     "noisier profile")
    rough = [f"{k.kind} on {g.name} {100 * k.residual:.0f}%" for g in record.groups for k in g.collectives
             if k.residual > ROUGH_FIT]
    rough += [f"{k.what.split(' (')[0].replace('memory', 'memory kernel')} {100 * k.residual:.0f}%"
              for k in (mem, *mms.values()) if k.residual > ROUGH_FIT]
    rough += [f"contention on {c.group} {100 * c.residual:.0f}%" for _, c in contention if c.residual > ROUGH_FIT]
    if rough:
        notes.append(f"fits far from their own timings (RMS relative error): {', '.join(rough)}; a busy machine, "
                     "or a kernel or link the formula does not describe (one matmul rate for shapes of very "
                     "different efficiency). Predictions inherit it: rerun on an idle machine, with a larger "
                     "calibrate.budget_s, and check with mode=measure")
    if facts.cache_reported is not None:
        notes.append(f"mem_bandwidth: timed beyond a {facts.cache_bytes / 2**20:.0f} MiB last-level cache as given "
                     f"(calibrate.cache_bytes); the device reports {facts.cache_reported / 2**20:.0f} MiB")
    if "may time the cache" in mem.what:
        notes.append(f"mem_bandwidth: the largest buffers timed are within 2x the {facts.cache_bytes / 2**20:.0f} "
                     "MiB last-level cache (capped to spare memory): the memory's own bandwidth may be the cache's")
    if "at the step's" in mem.what:
        notes.append("mem_bandwidth: the rate at the step's own memory-bound kernel sizes, as the matmul rates are "
                     "at its matmuls (kernels that fit in the cache run at the cache's speed); the memory's own "
                     f"bandwidth is in the kernel record: {mem.what}")
    mem_bw = _capped("mem_bandwidth (GB/s)", mem.rate, facts.mem_bandwidth, 1e9, rough, notes, facts)
    # The peak each dtype's rate model is a share of: the best any timed shape reached (this machine's maximum
    # achievable matmul rate), capped at the datasheet; without the fitted models, the rate at the step's mix.
    peaks = {dt: _capped(f"matmul {str(dt).removeprefix('torch.')} (TFLOP/s)",
                         rates[dt][1] if rates and dt in rates else k.rate, facts.peak_for(dt), 1e12, rough, notes,
                         facts) for dt, k in mms.items()}
    peak = PeakFlops(bf16=peaks[torch.bfloat16], fp32=peaks[torch.float32])
    achievable = None
    if rates and torch.bfloat16 in rates and torch.float32 in rates:
        backend, calls, seconds = attention
        attention_rated = attention_rates(backend, calls, seconds, share_peak(peak, dtype))
        if attention_rated is not None:
            notes.append(f"attention: the step's {len(calls)} call shape(s) timed with SDPA's {backend} backend in "
                         f"{str(dtype).removeprefix('torch.')}; shares of the matmul peak per (length, head dim): "
                         + ", ".join(f"{p.seq_len}/{p.head_dim} forward {p.forward:.3g} backward {p.backward:.3g}"
                                     for p in attention_rated.backends[backend]))
        achievable = Achievable(
            matmul=MatmulRates(bf16=rates[torch.bfloat16][0], fp32=rates[torch.float32][0]),
            memory=MemoryRate(efficiency=1.0, launch_seconds=min(mem.overhead if launch is None else launch, 0.1),
                              view_seconds=min(views, 0.1)),
            attention=attention_rated)
    if attention_untimed:
        priced = "the share measured nearest their length and head dimension" \
            if achievable is not None and achievable.attention is not None else "the matmul rate"
        notes.append(f"attention: {attention_untimed} forward call(s) of the step not timed: their FLOPs do not "
                     "divide into one (batch x heads, length, head dim) shape (queries and keys of different "
                     f"lengths, say); priced at {priced}")
    skew = None
    for fitted_skew, _ in skews:  # several groups: the largest of each term (the wake-up: the group waking slowest)
        skew = fitted_skew if skew is None else Skew(
            relative=max(skew.relative, fitted_skew.relative), absolute=max(skew.absolute, fitted_skew.absolute),
            diffusion=max(skew.diffusion, fitted_skew.diffusion),
            wake=max(skew.wake, fitted_skew.wake, key=lambda w: w[-1].extra if w else 0.0))
    if rough:
        log.warning("calibrate: %s", "; ".join(rough))
    intra = fits.intra_node if fits is not None else None
    inter = fits.inter_node if fits is not None else None
    if intra is None or intra.all_gather is None:
        notes.append(f"intra-node links: not measured (no group inside one host); {base.name}'s datasheet numbers")
    if inter is None or inter.all_gather is None:
        notes.append(f"inter-node links: not measured (no group crossed hosts); {base.name}'s datasheet numbers")
    links: dict[bool, Contention] = {}
    for fitted, samples in contention:  # several groups on one kind of link: the largest slowdowns
        have = links.get(samples.inter_node)
        links[samples.inter_node] = fitted if have is None else Contention(
            compute_slowdown=max(have.compute_slowdown, fitted.compute_slowdown),
            comm_slowdown=max(have.comm_slowdown, fitted.comm_slowdown),
            start_delay=max(have.start_delay, fitted.start_delay))
    if not contention:
        notes.append("contention: not measured (no group of two or more ranks); compute and communication are "
                     "priced as if each ran alone")
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
            device_kind=facts.kind, peak_flops=peak, mem_bandwidth=mem_bw,
            intra_node_bandwidth=_widest(intra) or base.intra_node_bandwidth,
            inter_node_bandwidth=_widest(inter) or base.inter_node_bandwidth,
            latency=gather.latency if (gather := intra_ag or inter_ag) else base.latency,
            gpus_per_node=gpus, nics_per_node=1 if not clock.cuda else base.nics_per_node,
            compute_efficiency=1.0, comm_efficiency=1.0, collectives=fits, achievable=achievable, skew=skew,
            contention=LinkContention(intra_node=links.get(False), inter_node=links.get(True)) if links else None,
            calibration=record.model_copy(update={"notes": tuple(notes), "rough_fits": tuple(rough)}))
    except ValueError as err:  # pydantic: a fitted number out of range
        raise OverlapConfigError.single("calibrate", f"the calibrated profile is invalid: {err}") from None


def _widest(link: object) -> float | None:
    """The largest bandwidth of a link's fits: the link carried at least that (a profile's physical link must not
    be below a rate measured on it)."""
    if link is None:
        return None
    values = [f.bandwidth for f in (getattr(link, k) for k in ("all_gather", "reduce_scatter", "all_reduce"))
              if f is not None]
    return max(values) if values else None

