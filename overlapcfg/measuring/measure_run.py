"""``overlapcfg.measure``: run a user's training step under each config of a sweep on real ranks, and put the
measured step next to the simulator's prediction.

Per config, on every rank of the initialized default group:

1. a fresh ``backend(cfg)`` whose compilers run the transformed graphs as they are, timed
   (``overlapcfg.measuring.runner``), handed to ``make_step``, which builds the model, compiles it with that
   backend and returns a function running one training step;
2. ``warmup`` steps (the first compiles), then ``steps`` timed steps (every rank starts each step together): the
   time inside the graphs per step, and the whole step's wall time. By default every config is compiled first and
   the timed steps are taken in turns, one step of each config per round (``interleave``): on a machine whose load
   drifts (other jobs on shared cores, clocks throttling), every config sees the same drift;
3. ``profiled_steps`` under ``torch.profiler``: each collective's duration, and on a GPU the exposed
   communication (``overlapcfg.measuring.measured_trace``); on a CPU the exposed communication is the timed steps'
   own, their collective waits timed (``overlapcfg.measuring.runner``), the profiler's figure kept beside it;
4. for the reference config (the first ``strategy: none`` one, else the first), two more steps with every node
   timed: the ``NodeCosts`` the profile-guided prediction uses for every config, put on the clock of the
   reference's timed steps (``on_timed_clock``);
5. the prediction: ``simulate`` of the graphs this rank compiled, on ``hardware``; and again with the node costs.
   Both price the ranks' drift across the step's work between its graphs (``Pricing.between_graphs_seconds``:
   an eager loss between the compiled forward and backward) at what the reference config's timed steps measured
   there, unless ``pricing`` sets it.

The slowest rank's graph time counts for each step (a step waits for its slowest rank); rank 0 assembles the
``Measurement`` and every rank returns it. Dynamo keeps one compiled version per config (the same model code under
another backend each time; its recompile limit is raised for the sweep) and is reset before it.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from overlapcfg import compat
from overlapcfg.config import OverlapConfig, load_config
from overlapcfg.cost.hardware import HardwareProfile, load_hardware
from overlapcfg.cost.node_costs import NodeCosts
from overlapcfg.cost.prediction import Simulation
from overlapcfg.cost.price import collective_bytes
from overlapcfg.cost.pricing import Pricing, pricing_from
from overlapcfg.cost.simulator import simulate
from overlapcfg.errors import OverlapConfigError, OverlapStateError
from overlapcfg.graph.ops import collective_kind, is_collective_start
from overlapcfg.kinds import DIRECTIONS
from overlapcfg.measuring.clock import Clock, default_device
from overlapcfg.measuring.measure_result import MeasuredCollective, MeasuredConfig, Measurement
from overlapcfg.measuring.measured_trace import read_trace
from overlapcfg.measuring.runner import Recorder, merge_node_seconds
from overlapcfg.passes.backend import GraphBackend
from overlapcfg.passes.compile import backend as overlap_backend

__all__ = ["MeasureProgress", "StepFactory", "measure"]

StepFactory: TypeAlias = Callable[[GraphBackend], Callable[[], object]]
"""``make_step(backend) -> step``: build the model (the same, seeded, every time), ``torch.compile`` it with
``backend`` and return a function that runs one training step (forward, loss, backward, optimizer)."""

NODE_RUNS = 2


@dataclass(frozen=True, slots=True)
class MeasureProgress:
    """Where a sweep stands: config ``index`` of ``total``, ``phase`` of it (compile, timed, profiled, nodes)."""

    config: str
    index: int
    total: int
    phase: str
    elapsed: float


@dataclass(frozen=True, slots=True)
class _RankResult:
    """What one rank measured for one config (gathered to rank 0)."""

    graph_seconds: tuple[float, ...]
    wall_seconds: tuple[float, ...]
    between_seconds: tuple[float, ...]
    exposed: tuple[float, ...]
    profiled_seconds: tuple[float, ...]
    collectives: tuple[dict[str, tuple[float, ...]], ...]
    nodes: dict[str, dict[str, tuple[str, float]]]
    waited: tuple[float, ...] | None
    """Per timed step, seconds the collective waits blocked (None where they were not timed: a GPU)."""


def measure(make_step: StepFactory, configs: Mapping[str, Any], *, hardware: HardwareProfile | str,
            warmup: int = 3, steps: int = 10, profiled_steps: int = 2, node_costs: bool | str = True,
            interleave: bool = True, device: torch.device | str | None = None, config_root: str = "configs",
            progress: Callable[[MeasureProgress], None] | None = None,
            pricing: Pricing | Mapping[str, Any] | None = None) -> Measurement:
    """Measure each of ``configs`` (``{name: overlap config}``, a mapping or ``OverlapConfig`` each) with
    ``make_step`` and predict it on ``hardware``; see the module docstring for what is run.

    ``node_costs``: measure per-node durations on the reference config (True), on the named config, or not at all
    (False); they give each config's profile-guided prediction. ``interleave``: keep every config's model compiled
    at once and take the timed steps in turns (config 1, 2, ..., then again), so load that drifts during the sweep
    (other jobs, thermal limits) is shared fairly; costs one model per config in memory (False: one at a time).
    ``device``: where the step runs (default: the current CUDA device under NCCL, else the CPU), for the clock.
    ``pricing``: what the predictions assume (``overlapcfg.cost.pricing.Pricing``); by default the graphs as this
    sweep runs them: one kernel per op (``fusion`` ``auto`` is ``eager`` here), nothing beyond them (no optimizer:
    the measured time is the graphs'). Call on every rank, with the same arguments.
    """
    if not dist.is_initialized():
        raise OverlapStateError("measure: no process group; run under torchrun (or init_process_group) on every rank")
    if steps < 1 or warmup < 1 or profiled_steps < 1:
        raise OverlapConfigError("measure: warmup, steps and profiled_steps must each be at least 1 (warmup compiles)")
    started = time.perf_counter()
    hw = load_hardware(hardware)
    priced = pricing_from(pricing, path="pricing")
    if priced.fusion == "auto":  # the sweep runs the graphs as they are: one kernel per op
        priced = pricing_from({**priced.model_dump(), "fusion": "eager"}, path="pricing")
    loaded = {str(name): load_config(cfg if isinstance(cfg, OverlapConfig) else dict(cfg),
                                     root=f"{config_root}.{name}") for name, cfg in configs.items()}
    if not loaded:
        raise OverlapConfigError("measure: no configs to measure")
    reference = _reference(loaded, node_costs)
    clock = Clock(device if device is not None else default_device())
    given = {str(name): cfg for name, cfg in configs.items()}
    graphs, measured = {}, {}

    def tell(name: str, index: int, phase: str) -> None:
        if progress is not None:
            progress(MeasureProgress(name, index, len(loaded), phase, time.perf_counter() - started))

    def finish(p: _Prepared, index: int) -> None:
        tell(p.name, index, "profiled")
        mine = _profiled(p, clock, profiled_steps, p.name == reference)
        gathered: list[_RankResult | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        graphs[p.name], measured[p.name] = p.graphs, [g for g in gathered if g is not None]

    if interleave:  # every config compiled and kept; timed steps taken in turns, so drifting load hits all alike
        compat.dynamo_reset()
        with compat.dynamo_recompile_limit(len(loaded) + 1):
            prepared = []
            for index, (name, cfg) in enumerate(loaded.items()):
                tell(name, index, "compile")
                prepared.append(_prepare(make_step, name, cfg, clock, warmup))
            for round_ in range(steps):
                tell("all", round_ * len(loaded) // steps, f"timed round {round_ + 1}/{steps}")
                for p in prepared:
                    _timed_step(p, clock)
            for index, p in enumerate(prepared):
                finish(p, index)
    else:
        for index, (name, cfg) in enumerate(loaded.items()):
            compat.dynamo_reset()
            tell(name, index, "compile")
            p = _prepare(make_step, name, cfg, clock, warmup)
            tell(name, index, "timed")
            for _ in range(steps):
                _timed_step(p, clock)
            finish(p, index)
    costs = None
    if reference is not None:
        costs = merge_node_seconds([r.nodes for r in measured[reference]],
                                   f"{reference} on {dist.get_backend()} x {dist.get_world_size()}, median of "
                                   f"{NODE_RUNS} node-timed steps")
        costs = on_timed_clock(costs, measured[reference])
    between = statistics.median(s for r in measured[_reference(loaded, True) or next(iter(loaded))]
                                for s in r.between_seconds)
    if priced.between_graphs_seconds is None:  # the step's own work outside its graphs, the same in every config
        priced = priced.model_copy(update={"between_graphs_seconds": between})
    box: list[Any] = [None]
    if dist.get_rank() == 0:  # rank 0's graphs and prediction; every rank returns the same numbers
        try:
            rows = [_row(name, given[name], cfg, graphs[name], measured[name], hw, costs, priced)
                    for name, cfg in loaded.items()]
            box[0] = Measurement(
                hardware=hw, world_size=dist.get_world_size(), backend=str(dist.get_backend()),
                device=clock.describe(), date=_now(),
                torch_version=torch.__version__, warmup=warmup, steps=steps, profiled_steps=profiled_steps,
                node_costs=costs.source if costs is not None else None, between_graphs_s=between,
                configs=tuple(rows)).to_dict()
        except Exception as err:  # every rank must hear of it, or the others wait in the broadcast forever
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    if progress is not None:
        progress(MeasureProgress("", len(loaded), len(loaded), "done", time.perf_counter() - started))
    return Measurement.from_json(box[0]).attach(costs)


def on_timed_clock(costs: NodeCosts, ranks: Sequence[_RankResult]) -> NodeCosts:
    """``costs`` scaled onto the clock of the reference config's timed steps: the node-timed steps run once, at the
    end of the sweep, through an interpreter, under whatever load the machine had then; the timed steps are the
    clock every config is measured on. The factor makes the nodes' sum equal to the timed steps' compute: their
    median graph time, less the share of it the profiled steps spent waiting on communication (``clock_scale``;
    1.0 where either is missing)."""
    timed = statistics.median(max(r.graph_seconds[i] for r in ranks) for i in range(len(ranks[0].graph_seconds)))
    profiled = statistics.median(max(r.profiled_seconds[i] for r in ranks)
                                 for i in range(len(ranks[0].profiled_seconds)))
    exposed = statistics.median(statistics.mean(r.exposed[i] for r in ranks) for i in range(len(ranks[0].exposed)))
    total = sum(s for nodes in costs.graphs.values() for _, s in nodes.values())
    if total <= 0 or profiled <= 0 or exposed >= profiled:
        return costs
    scale = timed * (1 - exposed / profiled) / total
    graphs = {g: {n: (sig, s * scale) for n, (sig, s) in nodes.items()} for g, nodes in costs.graphs.items()}
    return NodeCosts(source=costs.source, graphs=graphs, clock_scale=scale)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _reference(loaded: Mapping[str, OverlapConfig], node_costs: bool | str) -> str | None:
    if node_costs is False:
        return None
    if isinstance(node_costs, str):
        if node_costs not in loaded:
            raise OverlapConfigError(f"measure: node_costs={node_costs!r} names no config; have {', '.join(loaded)}")
        return node_costs
    return next((n for n, c in loaded.items() if c.strategy == "none"), next(iter(loaded)))


@dataclass(slots=True)
class _Prepared:
    """One config compiled and warmed up: its step, its recorder, and what it has measured so far."""

    name: str
    step: Callable[[], object]
    recorder: Recorder
    graphs: dict[str, Any]
    graph_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    between_s: list[float] = field(default_factory=list)
    waited_s: list[float] = field(default_factory=list)


def _prepare(make_step: StepFactory, name: str, cfg: OverlapConfig, clock: Clock, warmup: int) -> _Prepared:
    recorder = Recorder(clock)
    built = overlap_backend(cfg)
    built.compiler, built.bw_compiler = recorder.compiler("forward"), recorder.compiler("backward")
    step = make_step(built)
    for _ in range(warmup):
        step()
    if set(built.graphs) != set(DIRECTIONS):
        raise OverlapStateError(
            f"measure: the step compiled {sorted(built.graphs) or 'no graphs'} through the backend, "
            "expected one forward and one backward graph (one compiled region, fullgraph=True)")
    return _Prepared(name, step, recorder, built.graphs)


def _timed_step(p: _Prepared, clock: Clock) -> None:
    p.recorder.mode = "timed"
    _align(clock)
    start = clock.mark()
    p.step()
    p.wall_s.append(clock.seconds(start, clock.mark()))
    p.between_s.append(p.recorder.between_regions())
    p.graph_s.append(sum(p.recorder.take_regions().values()))
    p.waited_s.append(p.recorder.take_waited())
    p.recorder.mode = "plain"


def _profiled(p: _Prepared, clock: Clock, profiled_steps: int, nodes: bool) -> _RankResult:
    """The profiler's steps (exposed communication, collectives) and, for the reference, the node-timed ones."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(profiled_steps):
            _align(clock)
            p.step()
            clock.sync()
    trace = read_trace(prof.events(), steps=profiled_steps, cuda=clock.cuda)
    node_seconds: dict[str, dict[str, tuple[str, float]]] = {}
    if nodes:
        p.recorder.mode = "nodes"
        for _ in range(NODE_RUNS):
            _align(clock)
            p.step()
        p.recorder.mode = "plain"
        node_seconds = p.recorder.node_seconds()
    return _RankResult(tuple(p.graph_s), tuple(p.wall_s), tuple(p.between_s), trace.exposed, trace.graph_seconds,
                       trace.collectives, node_seconds,
                       tuple(p.waited_s) if p.recorder.waits_timed else None)


def _align(clock: Clock) -> None:
    """Every rank starts the next step together, with the device idle."""
    clock.sync()
    dist.barrier()


def _row(name: str, given: Any, cfg: OverlapConfig, graphs: Mapping[str, Any], ranks: Sequence[_RankResult],
         hw: HardwareProfile, costs: NodeCosts | None, pricing: Pricing) -> MeasuredConfig:
    ws = dist.get_world_size()
    gms = [graphs[g] for g in DIRECTIONS]
    sim = simulate(gms, hw, world_size=ws, names=DIRECTIONS, pricing=pricing)
    profiled = simulate(gms, hw, world_size=ws, names=DIRECTIONS, node_costs=costs, pricing=pricing) \
        if costs is not None else None
    per_step = [max(r.graph_seconds[i] for r in ranks) for i in range(len(ranks[0].graph_seconds))]
    walls = [max(r.wall_seconds[i] for r in ranks) for i in range(len(ranks[0].wall_seconds))]
    profiled_exposed = [statistics.mean(r.exposed[i] for r in ranks) for i in range(len(ranks[0].exposed))]
    # the timed steps' own waits where every rank timed them (CPU), else the profiler's (see ``Recorder``)
    timed = all(r.waited is not None for r in ranks)
    per_rank = [r.waited if timed and r.waited is not None else r.exposed for r in ranks]
    exposed = [statistics.mean(w[i] for w in per_rank) for i in range(len(per_rank[0]))]
    profiled_s = [max(r.profiled_seconds[i] for r in ranks) for i in range(len(ranks[0].profiled_seconds))]
    overrides = cfg.model_dump(mode="json") if isinstance(given, OverlapConfig) else dict(given)
    measured_step = statistics.median(per_step)
    tokens, params = sim.tokens_per_step, sim.model_params
    return MeasuredConfig(
        predicted_skew_s=sim.skew_seconds, tokens_per_step=tokens,
        predicted_tokens_per_second=sim.tokens_per_second, predicted_mfu=sim.mfu,
        measured_tokens_per_second=tokens / measured_step if tokens and measured_step > 0 else None,
        measured_mfu=6 * params * tokens / (measured_step * sim.peak_flops)
        if tokens and params and measured_step > 0 and sim.peak_flops > 0 else None,
        name=name, overrides=overrides, config=cfg.model_dump(mode="json"),
        predicted_step_s=sim.step_seconds, predicted_exposed_s=sim.exposed_comm_seconds,
        measured_step_s=measured_step, measured_spread_s=_iqr(per_step),
        measured_exposed_s=statistics.median(exposed), measured_wall_s=statistics.median(walls),
        measured_exposed_by_rank_s=tuple(statistics.median(w) for w in per_rank),
        measured_exposed_in="timed steps" if timed else "profiled steps",
        measured_profiled_exposed_s=statistics.median(profiled_exposed),
        measured_profiled_step_s=statistics.median(profiled_s),
        step_seconds=tuple(per_step),
        predicted_profiled_step_s=profiled.step_seconds if profiled is not None else None,
        predicted_profiled_exposed_s=profiled.exposed_comm_seconds if profiled is not None else None,
        cost_sources=sim.cost_sources, profiled_cost_sources=profiled.cost_sources if profiled is not None else (),
        collectives=_collectives(gms, sim, ranks))


def _iqr(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def _collectives(gms: Sequence[Any], sim: Simulation, ranks: Sequence[_RankResult]) -> tuple[MeasuredCollective, ...]:
    """Each collective start of the graphs with its predicted and (matched in issue order) measured duration."""
    predicted = {(e.graph, e.node): e.end - e.start for e in sim.events if e.stream.startswith("comm:")}
    out = []
    for graph, gm in zip(DIRECTIONS, gms, strict=True):
        starts = [n for n in gm.graph.nodes if is_collective_start(n)]
        samples = [d.get(graph, ()) for r in ranks for d in r.collectives]
        matched = [s for s in samples if len(s) == len(starts)]
        for i, node in enumerate(starts):
            values = [s[i] for s in matched]
            out.append(MeasuredCollective(
                graph=graph, node=node.name, kind=collective_kind(node) or "other", bytes=collective_bytes(node),
                predicted_s=predicted.get((graph, node.name), 0.0),
                measured_s=statistics.median(values) if values else None))
    return tuple(out)
