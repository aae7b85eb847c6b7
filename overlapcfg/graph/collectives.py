"""Finding the collectives of a graph and saying which are FSDP's, which direction they run and who owns them.

Pure reading: nothing here changes a graph. Everything is returned in graph order so later stages can make
deterministic decisions without sorting by anything but positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.errors import UnsupportedGraphError
from overlapcfg.graph.gradients import (
    ends_as_gradient,
    flows_to_outputs,
    hsdp_pairs,
    is_partial_gradient_scatter,
    partial_sum_root,
    reduced_again,
)
from overlapcfg.graph.meta import is_merged, merged_mark, owner
from overlapcfg.graph.ops import (
    collective_kind,
    group_name,
    is_collective_start,
    is_compute_node,
    is_transparent,
    node_direction,
    reached_users,
    started_by,
)
from overlapcfg.graph.parameters import InputEvidence, graph_inputs, placeholder_sources
from overlapcfg.kinds import CollectiveKind, Direction

if TYPE_CHECKING:
    from overlapcfg.graph.attribution import ModuleFqnFn

__all__ = [
    "Collective",
    "CollectiveRole",
    "feeds_compute",
    "find_collectives",
    "is_parameter_gather",
    "no_hsdp_on_activation_groups",
    "one_owner_per_shared_gradient",
    "partial_gradients",
    "parameter_sources",
    "positions",
]


CollectiveRole: TypeAlias = Literal["fsdp_all_gather", "fsdp_reduce_scatter", "hsdp_all_reduce", "other"]
"""What a collective does for data parallelism; the one vocabulary the passes, records and report use.

- ``fsdp_all_gather``: gathers one parameter's shards (or a bucket of them) before use;
- ``fsdp_reduce_scatter``: reduces a parameter's gradient and scatters it to its shard owners;
- ``hsdp_all_reduce``: the replicate-group half of an HSDP gradient reduction: an all-reduce chained with an FSDP
  reduce-scatter of the same gradient, before it (DTensor reduces one mesh dimension at a time: torchtitan's
  SimpleFSDP ``hybrid_shard``) or after it (sharders that reduce-scatter first, then all-reduce the shard);
- ``other``: everything else (tensor/sequence parallel activations, expert all-to-alls, user collectives). The
  passes never merge or move these across their data dependencies.
"""


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective start and the wait that completes it."""

    start: fx.Node
    waits: tuple[fx.Node, ...]
    """Usually one; a coalesced collective has one per output."""
    kind: CollectiveKind
    role: CollectiveRole
    """See ``CollectiveRole``: an FSDP parameter all-gather (parameter inputs through transparent ops only), an
    FSDP gradient reduce-scatter (result flows to the graph outputs through unary ops only, possibly through an
    HSDP all-reduce), an HSDP all-reduce chained with one, or other."""
    direction: Direction
    group: str
    group_size: int | None
    """Ranks in the group as the graph states them (all-gathers and reduce-scatters carry it; an all-reduce
    does not, so it is read from the live process group when there is one, else ``None``)."""
    dtype: torch.dtype
    unsharded_bytes: int
    """All-gather output / reduce-scatter input: the full-size tensor the collective makes or consumes."""
    module_fqn: str | None
    params: tuple[str, ...] = ()
    """The parameters it carries: FQNs where the aot descriptors name them, else placeholder names (all-gathers),
    read before merging erases the original nodes. Several: an already merged bucket."""
    partner: fx.Node | None = None
    """HSDP: the other half of the gradient reduction (an all-reduce's reduce-scatter and vice versa)."""
    note: str | None = None
    """Why a collective that looks like data-parallel traffic was left as ``other`` (said in the pass record)."""
    unattributed: str | None = None
    """An all-gather shaped like an FSDP parameter gather whose inputs the graph cannot confirm as parameters, or a
    reduce-scatter on an FSDP group whose result neither feeds compute nor ends as a gradient the way overlapcfg
    recognizes one: why. Left alone as ``other``, and counted as uncovered by the pass."""

    @property
    def fsdp(self) -> bool:
        """Data-parallel parameter or gradient traffic the passes may bucket (every role but ``other``)."""
        return self.role != "other"


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Index of every node in graph order: the only tie-breaker the passes use."""
    return {n: i for i, n in enumerate(graph.nodes)}


def parameter_sources(start: fx.Node) -> tuple[str, ...] | None:
    """Names of ``placeholder_sources(start)`` (see there)."""
    found = placeholder_sources(start)
    return None if found is None else tuple(n.name for n in found)


def is_parameter_gather(start: fx.Node, inputs: InputEvidence) -> bool:
    """An FSDP all-gather by the graph's own evidence: it gathers graph inputs through transparent ops alone (one
    input: FSDP; several: a merged bucket) that ``inputs`` confirms as parameter shards, and (where only the
    structure confirms them) the gathered value feeds compute."""
    return _gather_verdict(start, inputs) == "parameter"


def _gather_verdict(start: fx.Node, inputs: InputEvidence) -> str:
    """``parameter``, ``undecided`` (shaped like an FSDP gather, inputs unconfirmed) or ``other``."""
    sources = placeholder_sources(start)
    if not sources:
        return "other"  # an activation gather (sequence / tensor parallel), or a gather of a constant
    verdicts = [inputs.verdict(s) for s in sources]
    if any(v is False for v in verdicts):
        return "other"  # a tangent, an integer input, a user input the tracer's state list does not name
    if all(v in ("descriptor", "saved_view") for v in verdicts):
        return "parameter"
    waits = [u for u in start.users if started_by(u) is start]
    if not any(_computes_from(waits)):
        return "other"
    return "parameter" if None not in verdicts else "undecided"


def _params(start: fx.Node, kind: str, inputs: InputEvidence) -> tuple[str, ...]:
    found = owner(start)
    if found is not None:
        return (found.param_fqn,)
    if kind != "all_gather":
        return ()
    names = inputs.state or {}
    return tuple(names.get(name, name) for name in parameter_sources(start) or ())


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors of a node's value: one, or a coalesced collective's list of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _nbytes(node: object) -> int:
    if isinstance(node, (list, tuple)):  # a coalesced reduce-scatter's input list
        return sum(_nbytes(n) for n in node)
    if not isinstance(node, fx.Node):
        return 0
    return sum(int(t.numel()) * t.element_size() for t in _tensors(node.meta.get("val")))


def _group_size(start: fx.Node, kind: CollectiveKind) -> int | None:
    """The group size argument (all-gathers: ``args[1]``, reduce-scatters: ``args[2]``); all-reduces have none,
    so the live process group answers when one is registered under that name."""
    position = {"all_gather": 1, "reduce_scatter": 2}.get(kind)
    args = compat.unwrapped_call(start)[1]
    size = args[position] if position is not None and len(args) > position else None
    if isinstance(size, int):
        return int(size)
    return compat.registered_group_size(group_name(start))


def _role(start: fx.Node, kind: CollectiveKind, waits: list[fx.Node], partner: fx.Node | None,
          inputs: InputEvidence) -> CollectiveRole:
    """Evidence, strongest first: our bucketer merged it, the aot descriptors tied it to a parameter, or its
    structure: an all-gather of confirmed parameter inputs through transparent ops only (``is_parameter_gather``),
    a reduce-scatter whose result ends as a gradient (``gradients``: returned through unary ops, directly or
    through its HSDP all-reduce, summed with other uses' partials, or consumed by an optimizer update traced into
    the graph) and goes through no other reduce-scatter, an all-reduce chained with such a reduce-scatter."""
    mark = merged_mark(start)
    owned = owner(start) is not None
    if kind == "all_gather":
        return "fsdp_all_gather" if mark is not None or owned or is_parameter_gather(start, inputs) else "other"
    if kind == "reduce_scatter":
        if mark is None and reduced_again(waits):
            return "other"  # descriptors name the parameter for both halves: structure decides which is FSDP's
        fsdp = (mark is not None or owned or partner is not None or flows_to_outputs(start)
                or is_partial_gradient_scatter(start, waits) or (len(waits) == 1 and ends_as_gradient(waits[0])))
        return "fsdp_reduce_scatter" if fsdp else "other"
    # The plain op only: torch's all-reduce merge takes single tensors (a coalesced all-reduce is left alone).
    if start.target is compat.ALL_REDUCE and ((mark is not None and mark.kind == "all_reduce") or partner is not None):
        return "hsdp_all_reduce"
    return "other"


def find_collectives(
    graph: fx.Graph,
    module_fqn_fn: ModuleFqnFn,
    *,
    direction: Direction | None = None,
    state_inputs: Mapping[str, str] | None = None,
) -> list[Collective]:
    """Every waited ``_c10d_functional`` collective in graph order, with its role (``CollectiveRole``).

    ``direction`` forces one direction for all (a forward or a backward graph from aot_autograd); ``None`` reads
    it per node (whole-step graphs). Reduce-scatters and HSDP all-reduces are always backward. ``state_inputs``:
    the tracer's ``{placeholder name: parameter FQN}`` (``overlapcfg.graph.parameters``), further evidence.
    """
    waits_of: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        start = started_by(node)
        if start is not None:
            waits_of.setdefault(start, []).append(node)
    inputs = graph_inputs(graph, backward=_is_backward_graph(graph, direction), state=state_inputs)
    partners = hsdp_pairs(waits_of)
    out: list[Collective] = []
    for start, waits in waits_of.items():
        kind = collective_kind(start) or "other"
        partner = partners.get(start)
        role = _role(start, kind, waits, partner, inputs)
        fsdp = role != "other"
        if kind == "reduce_scatter":
            source = compat.unwrapped_call(start)[1][0]
            size_node = source if isinstance(source, (fx.Node, list, tuple)) else start
        else:
            size_node = start
        vals = _tensors(start.meta.get("val"))
        if fsdp and not vals:
            # Sizes drive the byte cap and the report: guessing 0 bytes would silently disable the cap.
            raise UnsupportedGraphError(
                f"overlapcfg.apply: FSDP collective {start.name} has no meta['val'] fake tensor; "
                "run the pass on a traced graph (aot_autograd or inductor post-grad) that has them")
        dtype = vals[0].dtype if vals else torch.float32
        dirn: Direction = "backward" if role in ("fsdp_reduce_scatter", "hsdp_all_reduce") or kind == \
            "reduce_scatter" else (direction or node_direction(start))
        # An HSDP all-reduce belongs to whoever owns the gradient it reduces: its reduce-scatter.
        owner_node = partner if role == "hsdp_all_reduce" and partner is not None else start
        owner_kind = "reduce_scatter" if owner_node is not start else kind
        out.append(Collective(start, tuple(waits), kind, role, dirn, group_name(start), _group_size(start, kind),
                              dtype, _nbytes(size_node), module_fqn_fn(owner_node) if fsdp else None,
                              _params(owner_node, owner_kind, inputs) if fsdp else (), partner))
    index = positions(graph)
    out.sort(key=lambda c: index[c.start])
    out = no_hsdp_on_activation_groups(out)
    out = _undecided(out, inputs)
    out = one_owner_per_shared_gradient(out)
    owner_of = {c.start: c.module_fqn for c in out if c.role == "fsdp_reduce_scatter"}
    return [dataclasses.replace(c, module_fqn=owner_of.get(c.partner, c.module_fqn))
            if c.role == "hsdp_all_reduce" and c.partner is not None else c for c in out]


def feeds_compute(c: Collective) -> bool:
    """Whether the collective's result is read by compute (through views, casts and splits): an activation
    collective (tensor / sequence parallel, expert all-to-all), on the critical path between the compute that
    makes and the compute that reads it. A gradient's reduction, which flows to the outputs or into another
    collective, is not."""
    return any(_computes_from(c.waits))


def _computes_from(waits: Iterable[fx.Node]) -> Iterator[bool]:
    """For each node reached from ``waits`` through anything but the output and collectives: whether it computes
    (is neither transparent nor a merged bucket's copy-in)."""
    def passes(user: fx.Node) -> bool:  # not the output, nor into another collective or its wait
        return user.op != "output" and not is_collective_start(user) and started_by(user) is None

    for user in reached_users(waits, passes):
        yield passes(user) and user.op == "call_function" and not is_transparent(user) \
            and user.target is not compat.pre_bucket_reduce_scatter


def _reaches_compute(waits: Iterable[fx.Node]) -> bool:
    """Whether anything reached from ``waits`` (through anything but the output and collectives) is a matmul,
    attention or another op with a FLOP formula."""
    def passes(user: fx.Node) -> bool:
        return user.op != "output" and not is_collective_start(user) and started_by(user) is None

    return any(user.op == "call_function" and is_compute_node(user) for user in reached_users(waits, passes))


def _is_backward_graph(graph: fx.Graph, direction: Direction | None) -> bool:
    """A split backward graph: forced, or every compute node tagged ``autograd_backward`` (a whole-step graph holds
    forward compute too)."""
    if direction is not None:
        return direction == "backward"
    compute = [n for n in graph.nodes if n.op == "call_function" and is_compute_node(n)]
    return bool(compute) and all(node_direction(n) == "backward" for n in compute)


UNRECOGNIZED_GRADIENT = (
    "their results reach no matmul or attention, so they reduce no activation, yet they do not end as a "
    "parameter's gradient the way overlapcfg recognizes one (returned through views and casts, summed with the "
    "other partial gradients of the same parameter, or consumed by an optimizer update traced into the graph)")
"""Why a reduce-scatter on an FSDP group is counted as uncovered (``_undecided``)."""


def _undecided(collectives: list[Collective], inputs: InputEvidence) -> list[Collective]:
    """Collectives shaped like FSDP's that the graph's evidence cannot confirm, on a group that carries FSDP traffic
    (a tensor-parallel group's activation collectives are not FSDP-shaped in this sense): all-gathers whose inputs
    cannot be confirmed as parameters, and reduce-scatters whose result reaches no matmul or attention (an
    activation's would, on its way to the loss's gradient) yet does not end as a gradient (nor goes through
    another reduce-scatter: tensor parallel's half of a 2-D reduction). Left alone and
    marked ``unattributed`` with the cause, so the pass counts them as uncovered and ``strict`` /
    ``require_full_coverage`` refuse the graph instead of silently leaving them unbucketed."""
    dp_groups = {c.group for c in collectives if c.fsdp}
    # Reduce-scatters: only on groups that carry FSDP's own traffic and no activations (a tensor-parallel group with
    # sequence parallel reduce-scatters activation gradients whose path to compute can pass through its gathers).
    activation_groups = {c.group for c in collectives if c.role == "other" and _reaches_compute(c.waits)}
    gradient_groups = {c.group for c in collectives if c.role in ("fsdp_all_gather", "fsdp_reduce_scatter")}
    reason = inputs.undecided_reason()

    def undecided(c: Collective) -> str | None:
        if c.fsdp or c.group not in dp_groups:
            return None
        if c.kind == "all_gather" and _gather_verdict(c.start, inputs) == "undecided":
            return reason
        if c.kind == "reduce_scatter" and c.group in gradient_groups and c.group not in activation_groups \
                and not _reaches_compute(c.waits) and not reduced_again(c.waits):
            return UNRECOGNIZED_GRADIENT
        return None

    return [dataclasses.replace(c, unattributed=why) if (why := undecided(c)) is not None else c
            for c in collectives]


def no_hsdp_on_activation_groups(collectives: list[Collective]) -> list[Collective]:
    """An all-reduce chained with an FSDP reduce-scatter is HSDP's replicate half only on a group that carries
    gradients alone. On a group that also carries activations (a tensor-parallel group: sequence-parallel
    gathers, row-parallel all-reduces), the same chain is tensor parallel's reduction of a replicated weight's
    partial gradient (norm weights), and tensor-parallel collectives are never merged or moved."""
    activation_groups = {c.group for c in collectives if c.role == "other" and feeds_compute(c)}
    demoted = {c.start for c in collectives if c.role == "hsdp_all_reduce" and c.group in activation_groups
               and not is_merged(c.start)}
    if not demoted:
        return collectives
    note = (f"{len(demoted)} all-reduce(s) on group(s) "
            f"{', '.join(sorted({repr(c.group) for c in collectives if c.start in demoted}))} are chained with FSDP "
            "reduce-scatters like HSDP's, but their group also carries activation collectives (tensor parallel): "
            "left alone, never bucketed")
    return [dataclasses.replace(c, role="other", module_fqn=None, params=(), partner=None, note=note)
            if c.start in demoted else dataclasses.replace(c, partner=None) if c.partner in demoted else c
            for c in collectives]


def one_owner_per_shared_gradient(collectives: list[Collective]) -> list[Collective]:
    """The partial gradients of one shared parameter (one reduce-scatter per use, summed: ``partial_sum_root``)
    belong to one module: **the one that used the parameter first in forward**, i.e. the partial whose
    reduce-scatter backward issues last (graph order). That is also the owner the aot descriptors name (dynamo
    names a parameter by its first access), so a graph with descriptors (``overlapcfg.backend``) and one without
    (``apply`` on a captured graph) bucket a shared gradient in the same bucket, whatever the number of uses."""
    for members in _partial_sums(collectives):
        first_user = collectives[members[-1]].module_fqn  # graph order: the last issued
        if len(members) > 1 and first_user is not None:
            for i in members:
                collectives[i] = dataclasses.replace(collectives[i], module_fqn=first_user)
    return collectives


def _partial_sums(collectives: list[Collective]) -> list[list[int]]:
    """Indices of the FSDP reduce-scatters summed into one gradient (``partial_sum_root``), one list per gradient,
    each in the order of ``collectives``."""
    sums: dict[fx.Node, list[int]] = {}
    for i, c in enumerate(collectives):
        if c.kind == "reduce_scatter" and c.fsdp and len(c.waits) == 1:
            root = partial_sum_root(c.waits[0])
            if root is not None:
                sums.setdefault(root, []).append(i)
    return list(sums.values())


def partial_gradients(collectives: Iterable[Collective]) -> list[tuple[Collective, ...]]:
    """The FSDP reduce-scatters of one gradient summed from several partials (a parameter shared by several
    modules, or a module run several times a step: a chunked loss's head), per gradient, in graph order. Bucketed,
    the partials are merged into their bucket's reduce-scatter, so all of them stay alive until it is issued."""
    found = list(collectives)
    return [tuple(found[i] for i in members) for members in _partial_sums(found) if len(members) > 1]
