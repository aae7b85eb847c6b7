"""Replay a scheduled graph on one compute stream and one stream per process group, and predict its cost.

The replay is the schedule's own semantics, nothing more: nodes run in graph order; a collective start is issued
when the compute stream reaches it and runs on its group's stream after whatever that stream already holds; a
wait blocks the compute stream until its collective is done (``overlapcfg.cost.replay``, the streams the tuner's
quick score replays its events on too). So a schedule's quality is exactly the stall time it leaves
(``exposed_comm_seconds``), and ``step_seconds >= max(compute, busiest stream)`` holds by construction.

Memory is replayed alongside: every non-view node allocates its outputs when it runs and frees them after the
last node reading them (through views) has run. Storages that hold gathered parameters (an all-gather's output
and copies of its slices) count as unsharded parameters; the rest allocated inside the graphs as activations.
Inputs are not counted (the shards, and in backward the saved activations, exist before the graph starts).

Costs: each kernel by the roofline on the profile, or by its measured duration
when ``node_costs`` has one for that node (``overlapcfg.cost.node_costs``); each collective by the ring model,
with the profile's measured fits where calibration made them, and the compute stream paying the fit's issue time
at each start. ``Simulation.cost_sources`` says which source priced how much.

Contention: where the profile has measured slowdowns (``HardwareProfile.contention``, from calibration), compute
runs slower while a collective is in flight and the collective slower while compute runs (the rates are in
``overlapcfg.cost.replay``); ``Simulation.contention_seconds`` is the compute time lost to it. Datasheet profiles
have none. Deliberately not modelled: NCCL's channel tuning. ``overlapcfg mode=calibrate`` measures the rest, and
``overlapcfg mode=measure`` shows how far the prediction is from a measured step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.cost.hardware import HardwareProfile, load_hardware
from overlapcfg.cost.node_costs import Footing, NodeCosts
from overlapcfg.cost.prediction import ComputeShare, CostSource, Event, Simulation, StreamTime
from overlapcfg.cost.price import (
    collective_bytes,
    collective_cost,
    collective_kind,
    iter_tensors,
    node_kind,
    tensor_bytes,
)
from overlapcfg.cost.pricer import measured_footing, node_seconds, priced_plan
from overlapcfg.cost.pricing import Pricing, pricing_from
from overlapcfg.cost.pricing_plan import OptimizerStep, optimizer_step
from overlapcfg.cost.replay import Memory, Streams
from overlapcfg.cost.throughput import throughput
from overlapcfg.graph.collectives import feeds_compute, find_collectives
from overlapcfg.graph.ops import group_name, started_by

__all__ = ["COMPUTE_STREAM", "Event", "GroupPlacement", "Simulation", "measured_footing", "node_seconds",
           "optimizer_phase", "simulate",
           "storage_plan", "traced_group_size", "value_bytes"]

COMPUTE_STREAM = "compute"
COMPUTE_PARTS = ("matmul", "attention", "memory", "optimizer", "other")
NORM_SHARE = 0.0
"""Share of the optimizer phase's compute run before the gradient norm's all-reduce (the norm's own pass is
small next to the optimizer's; the skew the all-reduce waits for is the backward's, counted from its end)."""


@dataclass(frozen=True, slots=True)
class GroupPlacement:
    """How one process group of the graph is laid out at the predicted scale: its ranks and whether its ring
    crosses nodes. HSDP at 8 nodes x 8 GPUs: the shard group is ``GroupPlacement(8, inter_node=False)``, the
    replicate group ``GroupPlacement(8, inter_node=True)`` (same size, very different links)."""

    size: int
    inter_node: bool | None = None
    """None: decided by size (``size > gpus_per_node``)."""
    ranks_per_node: int | None = None
    """Ranks of the group on each node, for the NICs a ring across nodes drives; None: whole nodes for a group
    larger than a node, one rank per node for a smaller one placed across nodes (HSDP's replicate group)."""


def _placements(g: fx.GraphModule, world_size: int, traced_world_size: int | None,
                groups: Mapping[str, GroupPlacement] | None,
                ) -> tuple[dict[str, GroupPlacement], set[fx.Node], set[fx.Node]]:
    """Each collective group's placement, and the collectives no schedule can hide (role ``other``: tensor and
    sequence parallel activations sit between the compute that makes and the compute that reads them).

    A group the caller does not place: the whole traced world scales to ``world_size``; a sub-group (HSDP, TP)
    keeps its traced size, since nothing says how it would grow. Last: the parameter all-gathers, the only ones
    in-flight and unsharded-parameter memory count (an activation all-gather is neither)."""
    out: dict[str, GroupPlacement] = dict(groups or {})
    blocking: set[fx.Node] = set()
    found = find_collectives(g.graph, lambda _node: None)
    sizes = {c.start: c.group_size for c in found}
    for c in found:
        if c.role == "other" and feeds_compute(c):
            blocking.add(c.start)
        if c.group in out:
            continue
        size = c.group_size
        if size is None and c.partner is not None and traced_world_size and sizes.get(c.partner):
            size = traced_world_size // int(sizes[c.partner] or 1)  # HSDP: replicas = world / shard group
        whole = size is None or traced_world_size is None or size == traced_world_size
        out[c.group] = GroupPlacement(world_size if whole else int(size or world_size))
    gathers = {c.start for c in found if c.role == "fsdp_all_gather"}
    return out, blocking, gathers


def _label(node: fx.Node, labels: Mapping[str, str] | None) -> str:
    if labels and node.name in labels:
        return labels[node.name]
    return node.name


class _Storages:
    """Live storages by alias root: their bytes and category, counted in ``memory`` until their last reader."""

    def __init__(self) -> None:
        self.memory = Memory()
        self.live: dict[str, tuple[int, bool]] = {}

    def alloc(self, key: str, nbytes: int, is_param: bool) -> None:
        if key in self.live or nbytes <= 0:
            return
        self.live[key] = (nbytes, is_param)
        self.memory.alloc(nbytes, is_param)

    def free(self, key: str) -> None:
        self.memory.free(*self.live.pop(key, (0, False)))


def value_bytes(node: fx.Node, as_dtype: torch.dtype | None) -> int:
    """Bytes of ``node``'s value (every tensor in ``meta["val"]``), each costed as ``as_dtype`` if given."""
    return sum(tensor_bytes(t, as_dtype) for t in iter_tensors(node.meta.get("val")))


def storage_plan(graph: fx.Graph, gathers: set[fx.Node],
                 ) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, bool], dict[fx.Node, fx.Node]]:
    """(alias root of each node, root holds unsharded params, last reader of each root): views and waits alias
    their input, a collective writing into a buffer (``out=``) aliases it; a storage holds unsharded parameters if
    a parameter all-gather (``gathers``) fills it, or it is a merged all-gather's copy-in buffer, or a copy made
    only of such storages. The one rule for the simulator and the tuner's profile."""
    root: dict[fx.Node, fx.Node] = {}
    param: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        kind = node_kind(node)
        inputs = node.all_input_nodes
        if kind in ("free", "wait") and inputs:
            root[node] = root[inputs[0]]
        elif kind == "collective" and isinstance(node.kwargs.get("out"), fx.Node):
            root[node] = root[node.kwargs["out"]]  # writes into a bucket buffer allocated by its copy-in
            if node in gathers:  # whoever allocated it, it now holds gathered parameters
                param[root[node]] = True
        else:
            root[node] = node
        if root[node] is node:
            if kind == "collective":
                param[node] = node in gathers  # a parameter all-gather, not an activation one (sequence parallel)
            elif "_pre_bucket_all_gather" in str(node.target):
                param[node] = True
            else:  # a copy of gathered weights (the copy-out of a merged bucket) is still an unsharded weight
                param[node] = kind == "memory" and bool(inputs) and all(param.get(root[i], False) for i in inputs)
    last: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for inp in node.all_input_nodes:
            last[root[inp]] = node
    return root, param, last


class _Tally:
    """Seconds and nodes per (part, source), for ``Simulation.cost_sources``."""

    def __init__(self) -> None:
        self.parts: dict[tuple[str, str], list[float]] = {}

    def add(self, part: str, source: str, seconds: float) -> None:
        slot = self.parts.setdefault((part, source), [0, 0.0])
        slot[0] += 1
        slot[1] += seconds

    def sources(self) -> tuple[CostSource, ...]:
        return tuple(CostSource(part=p, source=s, nodes=int(n), seconds=sec)
                     for (p, s), (n, sec) in self.parts.items())


def simulate(gm: fx.GraphModule | Sequence[fx.GraphModule], hardware: HardwareProfile | str, *, world_size: int,
             names: Sequence[str] | None = None, labels: Mapping[str, Mapping[str, str]] | None = None,
             traced_world_size: int | None = None, as_dtype: torch.dtype | None = None,
             groups: Mapping[str, GroupPlacement] | None = None, node_costs: NodeCosts | None = None,
             pricing: Pricing | Mapping[str, Any] | None = None, pricing_path: str = "pricing") -> Simulation:
    """Predict one step of ``gm`` (or of several graphs run back to back: forward then backward) at ``world_size``.

    ``labels[graph][node]`` names events in the timeline (bucket names); ``traced_world_size`` lets the copy-in of
    merged buckets be costed at ``world_size`` (read from the graph's collectives when omitted). ``as_dtype``
    costs every floating tensor as that dtype (``torch.bfloat16``: mixed-precision training from an fp32 trace).
    ``groups`` places process groups by name (``GroupPlacement``); each group has its own stream.
    ``node_costs``: measured durations of the graphs' nodes (``NodeCosts``, keyed by the ``names`` of the graphs),
    used instead of the kernel model where they match. ``pricing``: what the prediction assumes besides the
    hardware (``overlapcfg.cost.pricing.Pricing``: checkpointing, fusion, optimizer, attention backend, tokens);
    its faults are reported under ``pricing_path``.
    """
    hw = load_hardware(hardware)
    priced = pricing_from(pricing, path=pricing_path)
    graphs = [gm] if isinstance(gm, fx.GraphModule) else list(gm)
    names = list(names) if names is not None else (["graph"] if len(graphs) == 1 else
                                                   ["forward", "backward", *map(str, range(2, len(graphs)))])
    events: list[Event] = []
    streams = Streams(hw.skew)
    peak_param = peak_act = 0
    blocking_comm = 0.0
    tally = _Tally()
    running: list[tuple[int, fx.Node]] = []
    plan, footing = priced_plan(graphs, names, hw, priced, world_size=world_size,
                                traced_world_size=traced_world_size, as_dtype=as_dtype, node_costs=node_costs,
                                path=f"{pricing_path}.activation_checkpointing")
    parts: dict[str, list[float]] = {}
    flops = 0.0
    shard: tuple[int, int] | None = None
    for gi, (graph_name, g) in enumerate(zip(names, graphs, strict=True)):
        graph_labels = (labels or {}).get(graph_name, {})
        kinds: dict[fx.Node, str] = {}
        placement, blocking, param_gathers = _placements(g, world_size, traced_world_size, groups)
        if param_gathers and shard is None:
            first = next(iter(param_gathers))
            shard = (placement.get(group_name(first), GroupPlacement(world_size)).size, 0)
        root, is_param, last = storage_plan(g.graph, param_gathers)
        mem = _Storages()
        traced = traced_world_size or traced_group_size(g)
        for node in g.graph.nodes:
            kind = node_kind(node)
            if kind == "collective":
                ckind = kinds[node] = collective_kind(node) or "other"  # a start always has a kind
                nbytes = collective_bytes(node, as_dtype)
                group = group_name(node)
                stream = f"comm:{group}"
                place = placement.get(group, GroupPlacement(world_size))
                priced_c = collective_cost(ckind, nbytes, hw, place.size, inter_node=place.inter_node,
                                           ranks_per_node=place.ranks_per_node)
                issue, dur = priced_c.issue_seconds, priced_c.seconds
                at = streams.t
                streams.issue(node, stream, dur, issue_seconds=issue,
                              inflight_bytes=nbytes if node in param_gathers else 0,
                              slowdown=priced_c.slowdown, ranks=place.size)
                if issue > 0:
                    events.append(Event(graph_name, node.name, COMPUTE_STREAM, "issue", at, streams.t,
                                        _label(node, graph_labels), nbytes))
                    tally.add("issue", "fitted", issue)
                    share = parts.setdefault("other", [0, 0.0])
                    share[0] += 1
                    share[1] += issue
                tally.add("collectives", priced_c.source, dur)
                if node in blocking:
                    blocking_comm += dur
                running.append((len(events), node))  # its span is known once it has ended
                events.append(Event(graph_name, node.name, stream, ckind, 0.0, 0.0, _label(node, graph_labels),
                                    nbytes))
            elif kind == "wait":
                start_node = started_by(node)
                at = streams.t
                if start_node is not None and streams.wait(start_node) > 0:
                    events.append(Event(graph_name, node.name, COMPUTE_STREAM, "wait", at, streams.t,
                                        _label(node, graph_labels), waits_on=kinds[start_node]))
            elif kind in ("compute", "memory", "free"):
                ws_now, traced_now = _copy_in_sizes(node, placement, world_size, traced)
                price = node_seconds(node, graph_name, hw, node_costs, world_size=ws_now,
                                     traced_world_size=traced_now, as_dtype=as_dtype, plan=plan, graph_index=gi,
                                     footing=footing)
                seconds, part = price.seconds, price.part
                flops += price.flops
                if seconds > 0 or part == "attention":  # views cost nothing: no part of compute
                    share = parts.setdefault(part, [0, 0.0])
                    share[0] += 1
                    share[1] += seconds
                if seconds > 0:
                    at = streams.run(seconds)
                    events.append(Event(graph_name, node.name, COMPUTE_STREAM, price.kind, at, streams.t,
                                        _label(node, graph_labels), price.bytes))
                    tally.add("compute", price.source, seconds)
            if node in root and root[node] is node and node.op == "call_function":
                mem.alloc(node.name, value_bytes(node, as_dtype), is_param.get(node, False))
            for inp in node.all_input_nodes:
                r = root[inp]
                if last.get(r) is node and r.op != "placeholder":
                    mem.free(r.name)
        peak_param, peak_act = max(peak_param, mem.memory.peak_param), max(peak_act, mem.memory.peak_act)
        streams.end_graph()  # the next graph starts when this one's collectives are done (the step's results)
        if gi + 1 < len(graphs) and priced.between_graphs_seconds:
            streams.between_graphs(priced.between_graphs_seconds)
        for at_index, node in running:
            start, end = streams.spans[node]
            events[at_index] = replace(events[at_index], start=start, end=end)
        running.clear()
    flops += plan.recompute.flops if plan.recompute.at else 0
    ranks = shard[0] if shard is not None else world_size
    step_params = plan.facts.params // ranks if plan.facts.params else 0
    optimizer = optimizer_step(plan, hw, step_params, ranks)
    if optimizer.seconds or optimizer.norm_seconds:
        at = streams.t
        optimizer_phase(streams, optimizer)
        events.append(Event("optimizer", "optimizer", COMPUTE_STREAM, "memory", at, streams.t, optimizer.describe))
        tally.add("compute", "achievable" if hw.achievable is not None else "roofline", optimizer.seconds)
        share = parts.setdefault("optimizer", [0, 0.0])
        share[0] += 1
        share[1] += optimizer.seconds
    compute, comm, exposed = streams.compute, streams.comm, streams.exposed
    if streams.contended > 0:
        tally.add("contention", "fitted", streams.contended)
    busy = {COMPUTE_STREAM: compute, **streams.busy}
    comm_bound = max(streams.busy.values(), default=0.0)
    peak = hw.dense_peak(plan.facts.dtype)
    rate = throughput(plan.facts, streams.t, flops, peak)
    return Simulation(
        hardware=hw.name, world_size=world_size, step_seconds=streams.t, compute_seconds=compute, comm_seconds=comm,
        exposed_comm_seconds=exposed, contention_seconds=streams.contended, skew_seconds=streams.skewed,
        wake_seconds=streams.woken, start_delay_seconds=streams.delayed,
        overlap_ratio=max(0.0, 1.0 - exposed / comm) if comm > 0 else None,
        lower_bound_seconds=max(compute + blocking_comm, comm_bound), peak_inflight_bytes=streams.peak_inflight,
        peak_unsharded_param_bytes=peak_param, peak_activation_bytes=peak_act,
        streams=tuple(StreamTime(stream=s, busy_seconds=b) for s, b in busy.items()),
        cost_sources=tally.sources(), node_costs=_costs_text(node_costs, footing),
        compute_parts=tuple(ComputeShare(part=p, nodes=int(parts[p][0]), seconds=parts[p][1])
                            for p in COMPUTE_PARTS if p in parts), attention_calls=plan.attention.calls,
        tokens_per_step=plan.facts.tokens, model_params=plan.facts.params, graph_flops=flops, peak_flops=peak,
        tokens_per_second=rate.tokens_per_second, mfu=rate.mfu, graph_mfu=rate.graph_mfu,
        pricing=priced.model_copy(update={"fusion": plan.fusion}).model_dump(mode="json"),
        recompute=plan.recompute.describe(), optimizer=optimizer.describe, throughput_note=plan.facts.why,
    ).with_events(tuple(events))


def optimizer_phase(streams: Streams, step: OptimizerStep) -> None:
    """After the backward (every stream idle): the gradient norm's pass, its all-reduce across the shard group (a
    blocking collective: the skew applies), then the rest of clipping and the optimizer; one rule for the simulator
    and the tuner's quick score."""
    if step.norm_seconds and step.norm_ranks > 1:
        first = step.seconds * NORM_SHARE
        streams.run(first)
        streams.issue("grad_norm", "comm:grad_norm", step.norm_seconds, ranks=step.norm_ranks)
        streams.wait("grad_norm")
        streams.run(step.seconds - first)
    else:
        streams.run(step.seconds)
    streams.end_graph()


def _costs_text(node_costs: NodeCosts | None, footing: Footing | None) -> str | None:
    if node_costs is None:
        return None
    scale = f", x{node_costs.clock_scale:.3g} to the timed steps' clock" if node_costs.clock_scale != 1.0 else ""
    lines = footing.describe() if footing is not None else ""
    return node_costs.source + scale + (f"; unmeasured nodes on its footing: {lines}" if lines else "")


def _copy_in_sizes(node: fx.Node, placement: Mapping[str, GroupPlacement], world_size: int,
                   traced: int | None) -> tuple[int, int | None]:
    """A merged all-gather's copy-in reads this rank's shards, whose size follows the all-gather's own group (the
    shard group of an HSDP mesh, not the whole world): its traced size and its placed size."""
    if node.target is not compat.pre_bucket_all_gather:
        return world_size, traced
    for user in node.users:
        if node_kind(user) == "collective" and collective_kind(user) == "all_gather":
            size = next((a for a in user.args if isinstance(a, int) and not isinstance(a, bool)), None)
            place = placement.get(group_name(user))
            if size and place is not None:
                return place.size, size
    return world_size, traced


def traced_group_size(gm: fx.GraphModule) -> int | None:
    for node in gm.graph.nodes:
        if node_kind(node) == "collective":
            size = next((a for a in node.args if isinstance(a, int) and not isinstance(a, bool)), None)
            if size:
                return size
    return None
