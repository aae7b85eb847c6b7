"""The tuner's compact model of a traced step, read once from one real ``apply`` at the finest grouping.

A *unit* is one module owning FSDP parameters (``layers.0.attention.wq``). Every candidate the tuner scores
groups whole units into buckets, and merging changes only sizes and counts: a bucket's copy-in, collective and
copy-out cost the sum of its units' (each is a bandwidth-bound copy or a bandwidth term, linear in bytes) plus one
collective latency; its all-gather waits where its earliest unit waited and its reduce-scatter is issued where
its latest unit was. Compute never moves. So one ``apply`` of the unit plan with every depth at 0 (each collective
next to its use) holds everything needed to replay any grouping and schedule (``overlapcfg.tuning.quick``) without
touching a graph again.

Per graph a profile keeps the nodes no schedule moves ("fixed": compute, and everything outside a collective's
copy-in / copy-out chain) as prefix sums of their cost, and per unit and collective kind one record of its costs
and positions. Positions are node indices of the unit graph, i.e. the manual scheduler's own sort keys: fixed
nodes, all-gather waits and reduce-scatter starts keep their relative order under every grouping and schedule.
Where the original graph issued an all-gather (the scheduler leaves the first bucket there when that is before
the first compute) is read from the untransformed graph.

Costs come from ``overlapcfg.cost.simulator.node_seconds`` and ``overlapcfg.cost.price``, the functions
``simulate`` uses, at the hardware, world size and dtype of the search, with measured node durations
(``NodeCosts``) where given; a profile is built per (hardware, world size, dtype, node costs). The unit graph
keeps the untransformed graph's nodes and names, so a profile of the untransformed step prices them both alike.
What moves with a collective is what the scheduler moves (``overlapcfg.graph.schedule.exclusive_ancestors`` and
``exclusive_descendants``); which storages hold unsharded parameters is the simulator's rule
(``overlapcfg.cost.simulator.storage_plan``).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from overlapcfg.config import OverlapConfig, load_config
from overlapcfg.config.depths import DEPTH_FIELDS, FOLLOWED
from overlapcfg.cost.hardware import HardwareProfile
from overlapcfg.cost.node_costs import MEASURABLE_KINDS, Footing, NodeCosts
from overlapcfg.cost.price import collective_bytes, compute_seconds, iter_tensors, node_kind
from overlapcfg.cost.pricer import node_seconds, priced_plan
from overlapcfg.cost.pricing import Pricing, pricing_from
from overlapcfg.cost.pricing_plan import StepPlan, optimizer_step
from overlapcfg.cost.replay import Streams
from overlapcfg.cost.simulator import optimizer_phase, storage_plan, value_bytes
from overlapcfg.errors import UnsupportedGraphError
from overlapcfg.graph.meta import merged_mark
from overlapcfg.graph.ops import collective_kind, group_name, is_collective_start, is_compute_node, started_by
from overlapcfg.graph.schedule import exclusive_ancestors, exclusive_descendants
from overlapcfg.kinds import DIRECTIONS
from overlapcfg.passes.applied import apply_step
from overlapcfg.passes.backend import CapturedStep
from overlapcfg.tuning.step_cache import cached

__all__ = ["GraphProfile", "ParamCopy", "Profile", "UnitCollective", "build_profile", "unit_config"]

log = logging.getLogger(__name__)

MERGED_KINDS = ("all_gather", "reduce_scatter")


@dataclass(frozen=True, slots=True)
class ParamCopy:
    """One parameter as a merged all-gather hands it out: the merge helpers ``reshape`` its slice of the gathered
    buffer, a view where strides allow (the collective carries it alone, or its shard is one row), else a copy
    (``overlapcfg.tuning.quick`` decides per bucket)."""

    shape: tuple[int, ...]
    """Unsharded shape."""
    numel: int
    bytes: int
    """Unsharded bytes as costed."""
    copy_seconds: float
    """What the copy costs where one is made."""
    last_reader: float
    """Position of the last node reading it (or a view of it): where its storage is freed, or, a view, where it
    stops holding the buffer."""


@dataclass(frozen=True, slots=True)
class UnitCollective:
    """One unit's merged collective of one kind in one graph, with what moving or merging it needs."""

    unit: int
    """Index into ``Profile.units``."""
    kind: str
    """``all_gather`` or ``reduce_scatter``."""
    key: str
    """Units merge only with units of the same key (process group and dtype), as the bucketer does."""
    group: str
    """Process-group name: collectives of one group share one stream."""
    group_size: int
    """Ranks of the group as traced (the gathered buffer is laid out ``group_size`` x shard)."""
    cost_bytes: int
    """Full-size bytes as costed (the search's dtype)."""
    traced_bytes: int
    """Full-size bytes as traced: what ``max_inflight_bytes`` counts."""
    issue_cost: float
    """Seconds of the copy-in chain issued with the collective."""
    wait_cost: float
    """Seconds of the chain after the wait, parameter copies left out (they depend on the bucket)."""
    start: float
    """Position of the start: reduce-scatter where merging puts it; all-gather where the original graph issued
    it (only the first bucket of a direction can stay there)."""
    wait: float
    """Position of the all-gather's wait (it never moves); unused for reduce-scatters (their waits move)."""
    consumer: float | None
    """Reduce-scatter: the first node outside its wait chain reading the result (the wait may not move past it)."""
    buffer_bytes: int
    """All-gather: bytes of the gathered buffer, alive from issue until copied out (or, alone, until last read)."""
    params: tuple[ParamCopy, ...]
    """All-gather: the parameters it hands out."""
    sources: tuple[tuple[int, int], ...] = ()
    """The traced collectives merged into it, graph order: ``(cost bytes, traced bytes)`` each; what an unmerged
    kind (``OverlapPolicy.unmerged``) issues instead, one collective each."""
    raw_issue_cost: float = 0.0
    """Seconds of the traced nodes in the issue chain (a shard's cast): what stays of it unmerged."""
    raw_wait_cost: float = 0.0
    """Seconds of the traced nodes in the wait chain (a gradient's cast after a reduce-scatter): what stays of it
    unmerged (the copies out of the bucket buffer go)."""


@dataclass(frozen=True, slots=True)
class GraphProfile:
    """One graph (forward or backward) of the step, reduced to what a schedule can change."""

    name: str
    fixed: tuple[int, ...]
    """Node indices of the fixed nodes, ascending."""
    prefix: tuple[float, ...]
    """``prefix[n]``: seconds of the first ``n`` fixed nodes (``len(fixed) + 1`` entries)."""
    first_compute: int | None
    """Node index of the first FLOP-counted node (where a direction's first all-gather is hoisted to)."""
    collectives: tuple[UnitCollective, ...]
    params: tuple[tuple[float, float, int], ...] = ()
    """Unsharded-parameter storages made by fixed nodes (a cast of a gathered weight): ``(position, position of
    the last reader, bytes)``; they live where they are under every schedule."""

    def fixed_before(self, position: float) -> int:
        """How many fixed nodes come before a node at ``position``."""
        return bisect.bisect_left(self.fixed, position)

    def compute_between(self, start: float, end: float) -> float:
        """Seconds of the fixed nodes in ``[start, end)``."""
        return self.prefix[self.fixed_before(end)] - self.prefix[self.fixed_before(start)]


@dataclass(frozen=True, slots=True)
class Profile:
    """Everything the quick model needs about one traced step at one hardware, world size and dtype."""

    units: tuple[str, ...]
    """Parameter-owning modules, model order."""
    graphs: tuple[GraphProfile, ...]
    """Forward, then backward."""
    module_fqns: tuple[str, ...]
    """The model's modules, for resolving candidate plans."""
    hardware: HardwareProfile
    world_size: int
    as_dtype: torch.dtype | None
    seconds: float
    """Time taken to build it (the one real ``apply``)."""
    node_costs: NodeCosts | None = None
    """Measured node durations the costs used where they matched (None: the kernel model throughout)."""
    plan: StepPlan | None = None
    """The step's pricing plan (checkpointing, fusion, throughput facts) the costs were made under."""
    pricing: Pricing | None = None
    """What the costs assumed besides the hardware (the full checks simulate with it too)."""
    optimizer_seconds: float = 0.0
    """The optimizer phase after the backward (``overlapcfg.cost.simulator.optimizer_phase``), replayed once: it
    does not depend on the schedule."""
    optimizer_compute: float = 0.0
    """Its compute (the rest of it, the norm's all-reduce, is exposed communication)."""


def unit_config(owners: Sequence[str]) -> OverlapConfig:
    """The finest plan: one bucket per parameter-owning module, every depth 0, no verification (nothing runs)."""
    return load_config({"strategy": "manual", "verify": False,
                        "plan": {"buckets": list(owners), "require_full_coverage": True, "name": "units"},
                        "policy": {name: 0 for name in DEPTH_FIELDS if name not in FOLLOWED}})


def build_profile(step: CapturedStep, hardware: HardwareProfile, *, world_size: int,
                  as_dtype: torch.dtype | None = None, node_costs: NodeCosts | None = None,
                  pricing: Pricing | None = None, pricing_path: str = "pricing") -> Profile:
    """Apply the unit plan once to copies of ``step``'s graphs (once per step: ``overlapcfg.tuning.step_cache``)
    and read the profile off the result;
    ``node_costs``: measured node durations, used where they match (as ``simulate`` uses them); ``pricing``: what
    the prediction assumes (``overlapcfg.cost.pricing.Pricing``)."""
    started = time.perf_counter()
    owners = tuple(step.param_owners)
    if not owners or "" in owners:
        raise UnsupportedGraphError("tune: the step has no parameter-owning submodules to bucket"
                                    if not owners else "tune: the root module owns FSDP parameters directly; "
                                    "only submodules can be bucketed, so the tuner cannot group them")
    # The unit plan's rewrite does not depend on the machine: made once per step (only read from here on).
    graphs = cached(step, "unit graphs",
                    lambda: {a.name: a.graph for a in apply_step(step, unit_config(owners)).graphs})
    priced = pricing_from(pricing, path=pricing_path)
    plan, footing = priced_plan([graphs[name] for name in DIRECTIONS], DIRECTIONS, hardware, priced,
                                world_size=world_size, traced_world_size=step.world_size, as_dtype=as_dtype,
                                node_costs=node_costs, path=f"{pricing_path}.activation_checkpointing")
    costs = _Costs(hardware, world_size, step.world_size, as_dtype, node_costs, plan, footing)
    profiles = tuple(_graph_profile(name, graphs[name], step.graph(name), costs) for name in DIRECTIONS)
    streams = Streams(hardware.skew)
    params = plan.facts.params // world_size if plan.facts.params else 0
    optimizer_phase(streams, optimizer_step(plan, hardware, params, world_size))
    seconds = time.perf_counter() - started
    log.info("tune: profiled %d units on %s at %d ranks in %.2fs", len(owners), hardware.name, world_size, seconds)
    return Profile(units=owners, graphs=profiles, module_fqns=tuple(step.module_fqns), hardware=hardware,
                   world_size=world_size, as_dtype=as_dtype, seconds=seconds, node_costs=node_costs, plan=plan,
                   pricing=priced, optimizer_seconds=streams.t, optimizer_compute=streams.compute)


def _made_by_merging(start: fx.Node, original: set[str]) -> set[fx.Node]:
    """``start`` and the nodes merging inserted to feed it (a reduce-scatter's copy-in), up to the graph's own."""
    chain = {start}
    stack = [start]
    while stack:
        for node in stack.pop().all_input_nodes:
            if node not in chain and node.op == "call_function" and node.name not in original \
                    and started_by(node) is None and all(u in chain for u in node.users):
                chain.add(node)
                stack.append(node)
    return chain


def _dtype(node: fx.Node) -> str:
    return next((str(t.dtype) for t in iter_tensors(node.meta.get("val"))), "?")


class _Costs:
    """Node costs at the search's hardware, world size and dtype, measured where ``node_costs`` has the node
    (``overlapcfg.cost.simulator.node_seconds``, as ``simulate`` prices it)."""

    def __init__(self, hw: HardwareProfile, world_size: int, traced_world_size: int,
                 as_dtype: torch.dtype | None, node_costs: NodeCosts | None, plan: StepPlan,
                 footing: Footing | None = None) -> None:
        self.world_size, self.traced_world_size = world_size, traced_world_size
        self.hw = hw
        self.as_dtype = as_dtype
        self.node_costs = node_costs
        self.plan = plan
        self.footing = footing

    def __call__(self, node: fx.Node, graph: str | None = None) -> float:
        if graph is not None and node_kind(node) in MEASURABLE_KINDS:
            return node_seconds(node, graph, self.hw, self.node_costs, world_size=self.world_size,
                                traced_world_size=self.traced_world_size, as_dtype=self.as_dtype, plan=self.plan,
                                graph_index=DIRECTIONS.index(graph), footing=self.footing).seconds
        # a one-node graph's clone (``copy_of``): a bucket's copy-out, priced by its bytes as chain nodes are
        seconds = compute_seconds(node, self.hw, world_size=self.world_size, traced_world_size=self.traced_world_size,
                                  as_dtype=self.as_dtype, eager=self.plan.eager, fixed=False).seconds
        return self.footing.price(node_kind(node), seconds) if self.footing is not None else seconds

    def copy_of(self, node: fx.Node) -> float:
        """What a copy of ``node``'s value costs: a one-node graph holding ``aten.clone`` of it, costed by the
        same function (the merge helpers copy every parameter of a bucket holding two or more)."""
        graph = fx.Graph()
        source = graph.placeholder("source")
        source.meta["val"] = node.meta.get("val")
        clone = graph.call_function(torch.ops.aten.clone.default, (source,))
        clone.meta["val"] = node.meta.get("val")
        return self(clone)


def _graph_profile(name: str, gm: fx.GraphModule, original: fx.GraphModule, costs: _Costs) -> GraphProfile:
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    original_names = {n.name for n in original.graph.nodes}
    traced = {n.name: n for n in original.graph.nodes if is_collective_start(n)}
    cost = {n: costs(n, name) for n in nodes if n.op == "call_function"}
    chains = []
    moved: set[fx.Node] = set()
    for start in (n for n in nodes if is_collective_start(n)):
        mark = merged_mark(start)
        kind = collective_kind(start)
        if mark is None or mark.part != "start" or kind not in MERGED_KINDS:
            raise UnsupportedGraphError(
                f"tune: {name} graph: collective {start.name} ({kind}) is not an FSDP all-gather or reduce-scatter "
                "the pass bucketed; the tuner models graphs whose only collectives are FSDP's (no tensor-parallel "
                "or HSDP all-reduce traffic yet)")
        waits = sorted((u for u in start.users if started_by(u) is start), key=index.__getitem__)
        if kind == "all_gather":
            issue = set(exclusive_ancestors(start, index))  # what the scheduler moves with the all-gather
            after = {n for n in exclusive_descendants(waits, index) if n in waits or n.name not in original_names}
        else:  # the start and the copy-in merging made for it stay together; the wait chain moves
            issue = _made_by_merging(start, original_names)
            after = set(exclusive_descendants(waits, index))
        chains.append((start, mark, kind, issue, waits, after))
        moved |= issue | after
    fixed_nodes = [n for n in nodes if n.op == "call_function" and n not in moved]
    strays = [n.name for n in fixed_nodes if n.name not in original_names]
    if strays:
        raise AssertionError(f"tune: {name} graph: nodes made by merging outside every collective's chain: "
                             f"{strays[:5]}")
    fixed = tuple(index[n] for n in fixed_nodes)
    prefix = [0.0]
    for n in fixed_nodes:
        prefix.append(prefix[-1] + cost[n])
    first_compute = next((index[n] for n in fixed_nodes if is_compute_node(n)), None)
    original_start = _original_starts(original, {n.name for n in fixed_nodes}, fixed)
    root, param, last = _storages(gm.graph)
    records = []
    for start, mark, kind, issue, waits, after in chains:
        consumer: float | None = None
        buffer, params = 0, tuple[ParamCopy, ...]()
        wait_cost = sum(cost.get(n, 0.0) for n in after)
        if kind == "all_gather":
            where = min((original_start[s] for s in mark.sources if s in original_start),
                        default=float(index[start]))
            buffer = value_bytes(root[start], costs.as_dtype)
            leaves = sorted((n for n in after if any(u not in after for u in n.users)), key=index.__getitem__)
            params = tuple(ParamCopy(shape=tuple(n.meta["val"].shape), numel=int(n.meta["val"].numel()),
                                     bytes=value_bytes(n, costs.as_dtype),
                                     copy_seconds=cost[n] if root[n] is n else costs.copy_of(n),
                                     last_reader=float(_last_alias_reader(n, root, index))) for n in leaves)
            wait_cost -= sum(p.copy_seconds for p, n in zip(params, leaves, strict=True) if root[n] is n)
        else:
            where = float(index[start])
            readers = [index[u] for n in after for u in n.users if u.op != "output" and u not in after]
            consumer = float(min(readers)) if readers else None
        sources = tuple((collective_bytes(traced[s], costs.as_dtype), collective_bytes(traced[s]))
                        for s in mark.sources if s in traced)
        records.append(UnitCollective(
            sources=sources,
            raw_issue_cost=sum(cost.get(n, 0.0) for n in issue if n.name in original_names),
            raw_wait_cost=sum(cost.get(n, 0.0) for n in after if n.name in original_names),
            unit=mark.bucket, kind=kind, key=f"{group_name(start)}:{_dtype(start)}", group=group_name(start),
            group_size=next((a for a in start.args if isinstance(a, int) and not isinstance(a, bool)), 1),
            cost_bytes=collective_bytes(start, costs.as_dtype), traced_bytes=collective_bytes(start),
            issue_cost=sum(cost.get(n, 0.0) for n in issue), wait_cost=max(0.0, wait_cost),
            start=where, wait=float(index[waits[0]]) if waits else float(index[start]), consumer=consumer,
            buffer_bytes=buffer, params=params))
    held = tuple((float(index[n]), float(index[last.get(n, n)]), value_bytes(n, costs.as_dtype)) for n in fixed_nodes
                 if root[n] is n and param.get(n, False))
    return GraphProfile(name=name, fixed=fixed, prefix=tuple(prefix), first_compute=first_compute,
                        collectives=tuple(records), params=held)


def _last_alias_reader(node: fx.Node, root: dict[fx.Node, fx.Node], index: dict[fx.Node, int]) -> int:
    """Index of the last node reading ``node``'s value directly or through views of it."""
    last, stack, seen = index[node], [node], {node}
    while stack:
        for user in stack.pop().users:
            last = max(last, index[user])
            if root.get(user) is root[node] and user not in seen:
                seen.add(user)
                stack.append(user)
    return last


def _storages(graph: fx.Graph) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, bool], dict[fx.Node, fx.Node]]:
    """``overlapcfg.cost.simulator.storage_plan``, every all-gather a parameter's (the profile admits no other):
    both count the same bytes."""
    gathers = {n for n in graph.nodes if node_kind(n) == "collective" and collective_kind(n) == "all_gather"}
    return storage_plan(graph, gathers)


def _original_starts(original: fx.GraphModule, fixed_names: set[str], fixed: tuple[int, ...]) -> dict[str, float]:
    """Position in the unit graph of each collective start of the untransformed graph: just after the fixed node
    that preceded it there (fixed nodes are original nodes, so their names carry over)."""
    out: dict[str, float] = {}
    seen = 0
    for node in original.graph.nodes:
        if node.name in fixed_names:
            seen += 1
        elif is_collective_start(node):
            out[node.name] = fixed[seen - 1] + 0.5 if seen else -0.5
    return out
