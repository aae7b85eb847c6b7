"""Finding the collectives of a graph and saying which are FSDP's, which direction they run and who owns them.

Pure reading: nothing here changes a graph. Everything is returned in graph order so later stages can make
deterministic decisions without sorting by anything but positions.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
from torch import fx

from overlapcfg import compat
from overlapcfg.graph.attribution import ModuleFqnFn
from overlapcfg.graph.meta import META_KEY

__all__ = [
    "Collective",
    "CollectiveKind",
    "CollectiveRole",
    "Direction",
    "ModuleFqnFn",
    "feeds_compute",
    "find_collectives",
    "data_inputs",
    "group_name",
    "is_compute_node",
    "node_direction",
    "collective_kind",
    "is_collective_start",
    "is_parameter_gather",
    "is_parameter_placeholder",
    "mark_saved_parameter_views",
    "saved_parameter_views",
    "parameter_sources",
    "placeholder_sources",
    "started_by",
    "positions",
    "wait_of",
]


CollectiveKind: TypeAlias = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "other"]
"""The one classification of ``_c10d_functional`` collectives (merged and coalesced forms included)."""
Direction: TypeAlias = Literal["forward", "backward"]
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

    @property
    def fsdp(self) -> bool:
        """Data-parallel parameter or gradient traffic the passes may bucket (every role but ``other``)."""
        return self.role != "other"


def group_name(start: fx.Node) -> str:
    """The process-group name argument of a ``_c10d_functional`` collective (always its last positional; a
    ``control_deps`` wrapper's is that of the op it wraps)."""
    arg = compat.unwrapped_call(start)[1][-1]
    if isinstance(arg, fx.Node):  # compile-on-one-rank graphs pass the group as a graph input
        return f"<node {arg.name}>"
    return str(arg)


def wait_of(start: fx.Node) -> fx.Node | None:
    """The single ``wait_tensor`` reading ``start``; ``None`` if there is none or several."""
    waits = [u for u in start.users if compat.is_wait_tensor(u)]
    return waits[0] if len(waits) == 1 else None


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Index of every node in graph order: the only tie-breaker the passes use."""
    return {n: i for i, n in enumerate(graph.nodes)}


_WAIT = compat.WAIT_TENSOR
_CONTROL_DEPS = compat.control_deps


def data_inputs(node: fx.Node) -> tuple[fx.Node, ...]:
    """The nodes ``node`` reads (a ``control_deps`` wrapper's ordering edges are not reads)."""
    return compat.unwrap_control_deps(node)[1]  # type: ignore[return-value]


def is_collective_start(node: fx.Node) -> bool:
    """A ``_c10d_functional`` op other than ``wait_tensor`` (what a wait completes)."""
    if node.op != "call_function":
        return False
    target = compat.unwrap_control_deps(node)[0] if node.target is _CONTROL_DEPS else node.target
    return compat.is_functional_collective(target) and target is not _WAIT


def started_by(node: fx.Node) -> fx.Node | None:
    """If ``node`` is a wait (also one wrapped by ``insert_overlap_deps``), the collective start it waits on."""
    if node.op != "call_function":
        return None
    if node.target is _WAIT:
        start = node.args[0] if node.args else None
    elif node.target is _CONTROL_DEPS:
        target, inputs, _ = compat.unwrap_control_deps(node)
        start = inputs[0] if target is _WAIT and inputs else None
    else:
        return None
    if not isinstance(start, fx.Node):
        return None
    if start.target is operator.getitem and isinstance(start.args[0], fx.Node):  # coalesced collectives
        start = start.args[0]
    return start if is_collective_start(start) else None


_KINDS: tuple[tuple[str, CollectiveKind], ...] = (
    ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"), ("all_reduce", "all_reduce"),
    ("all_to_all", "all_to_all"),
)


def collective_kind(node: fx.Node) -> CollectiveKind | None:
    """``all_gather`` / ``reduce_scatter`` / ``all_reduce`` / ``all_to_all`` / ``other`` for a collective start
    (single, ``_coalesced`` and ``into_tensor`` forms alike), ``None`` for anything else."""
    if not is_collective_start(node):
        return None
    name = compat.op_name(compat.unwrap_control_deps(node)[0])
    return next((kind for key, kind in _KINDS if key in name), "other")


def is_compute_node(node: fx.Node) -> bool:
    """An op with a FLOP formula (matmuls, attention, convolutions): what collectives are meant to hide behind."""
    return compat.flop_formula(node.target) is not None


def _is_transparent(node: fx.Node) -> bool:
    """Ops that move a parameter's elements without computing on them: views, dtype casts, copies, and the
    copy-in of torch's merged buckets. The only ops allowed between a parameter and its FSDP all-gather."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem or getattr(target, "is_view", False):
        return True
    return compat.op_name(target) in _TRANSPARENT_OPS


_TRANSPARENT_OPS = frozenset({
    "aten._to_copy", "prims.convert_element_type", "aten.clone", "aten.contiguous", "aten.copy", "aten.copy_",
    "aten.detach", "aten.alias", "aten.lift_fresh_copy", "aten.cat", "aten.reshape", "aten.flatten",
    "aten.split_with_sizes", "aten.split_with_sizes_copy", "aten.split", "aten.empty", "aten.new_empty",
    "aten.empty_strided", "aten.view", "aten.t", "aten.permute", "aten.expand",
    "bucketing._pre_bucket_all_gather", "fsdp.all_gather_copy_in", "aten.foreach_copy", "aten._foreach_copy",
})


def placeholder_sources(start: fx.Node) -> tuple[fx.Node, ...] | None:
    """The placeholders an all-gather reads through transparent ops alone (views, casts, copies, a merged bucket's
    copy-in), in discovery order; ``None`` if any other op lies between (an activation gather: sequence or tensor
    parallel, or a gather of an embedding's *output*).

    One placeholder: an FSDP gather; two or more: a bucket torch's merge helpers (any bucket mode) already merged.
    The walk stops at placeholders and at the first non-transparent op, so it is linear in the copy-in region.
    """
    seen: set[fx.Node] = set()
    stack = list(data_inputs(start))
    found: list[fx.Node] = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            found.append(node)
        elif node.op == "get_attr" or _is_transparent(node):
            stack.extend(data_inputs(node))
        else:
            return None
    return tuple(found)


def parameter_sources(start: fx.Node) -> tuple[str, ...] | None:
    """Names of ``placeholder_sources(start)`` (see there)."""
    found = placeholder_sources(start)
    return None if found is None else tuple(n.name for n in found)


def is_parameter_placeholder(node: fx.Node) -> bool:
    """A graph input that can be a parameter (shard): a floating tensor that is one of the step's own inputs, not a
    saved activation or a tangent.

    aot marks the step's inputs with a ``PlainAOTInput`` descriptor (possibly wrapped for tensor subclasses such
    as DTensor), in forward and, for saved parameters, in backward; saved activations and tangents carry other
    descriptors or none. Graphs without descriptors (inductor's post-grad graph) keep aot's ``primals_N`` names.
    """
    if node.op != "placeholder":
        return False
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and not val.is_floating_point():
        return False  # token ids, masks, sizes: never a parameter
    desc = node.meta.get("desc")
    if desc is not None:
        return compat.is_plain_input_descriptor(desc)
    if SAVED_VIEW_KEY in node.meta.get(META_KEY, {}):
        return True
    return node.name.startswith("primals_")


SAVED_VIEW_KEY = "saved_parameter_view"
"""``node.meta[META_KEY][SAVED_VIEW_KEY]``: on a backward placeholder the forward saved, the aot descriptor of the
parameter input it is a view or cast of (set by ``mark_saved_parameter_views``)."""


def saved_parameter_views(forward: fx.GraphModule) -> dict[str, object]:
    """Forward outputs saved for backward that are a parameter input seen through transparent ops only (the local
    shard of a 2-D DTensor parameter, viewed), by node name -> that input's aot descriptor.

    With reshard-after-forward on an FSDP + TP model, the backward re-gathers such a saved view instead of the
    parameter input itself; the backward graph alone cannot tell it from a saved activation (its placeholder has
    no descriptor), the forward graph can.
    """
    output = next((n for n in forward.graph.nodes if n.op == "output"), None)
    descs = output.meta.get("desc") if output is not None else None
    if output is None or not descs:
        return {}
    found: dict[str, object] = {}
    for node, desc in zip(output.args[0], descs, strict=False):  # type: ignore[arg-type]
        if not isinstance(node, fx.Node) or not compat.is_saved_for_backward_descriptor(desc):
            continue
        if node.op == "placeholder":
            sources: tuple[fx.Node, ...] | None = (node,)
        elif _is_transparent(node):
            sources = placeholder_sources(node)
        else:
            continue
        if sources is not None and len(sources) == 1 and is_parameter_placeholder(sources[0]) \
                and sources[0].meta.get("desc") is not None:
            found[node.name] = sources[0].meta["desc"]
    return found


def mark_saved_parameter_views(backward: fx.GraphModule, views: dict[str, object]) -> int:
    """Stamp ``SAVED_VIEW_KEY`` on the backward placeholders ``saved_parameter_views`` names (same node name, no
    descriptor of their own); returns how many."""
    marked = 0
    for node in backward.graph.nodes:
        if node.op == "placeholder" and node.name in views and node.meta.get("desc") is None:
            node.meta.setdefault(META_KEY, {})[SAVED_VIEW_KEY] = views[node.name]
            marked += 1
    return marked


def is_partial_gradient_scatter(start: fx.Node, waits: tuple[fx.Node, ...] | list[fx.Node]) -> bool:
    """A reduce-scatter of one use's gradient of a parameter used twice (tied embeddings): its wait is summed with
    other reduce-scattered partial gradients, and the sum flows to a graph output through unary ops only.

    torch's ``is_fsdp_reduce_scatter`` wants the wait to flow to the output alone, so it misses these; the
    backend's descriptors see them as the parameter's gradient. Both routes must classify them alike.
    """
    if len(waits) != 1 or len(waits[0].users) != 1:
        return False
    total = next(iter(waits[0].users))
    if compat.op_name(total.target) != "aten.add" or not all(started_by(i) is not None
                                                               for i in total.all_input_nodes):
        return False
    cur = total
    for _ in range(32):
        users = list(cur.users)
        if any(u.op == "output" for u in users):
            return True
        if len(users) != 1 or len(users[0].all_input_nodes) != 1:
            return False
        cur = users[0]
    return False


def is_parameter_gather(start: fx.Node) -> bool:
    """An all-gather of parameter inputs through transparent ops alone (one input: FSDP; several: a merged
    bucket)."""
    sources = placeholder_sources(start)
    return bool(sources) and all(is_parameter_placeholder(s) for s in sources)  # type: ignore[union-attr]


def node_direction(node: fx.Node) -> Direction:
    """Which side of autograd a node is on, from aot_autograd's ``autograd_backward`` tag."""
    return "backward" if node.meta.get("autograd_backward", False) else "forward"


def _params(start: fx.Node, kind: str) -> tuple[str, ...]:
    owner = start.meta.get(META_KEY, {}).get("owner")
    if owner is not None:
        return (owner.param_fqn,)
    if kind != "all_gather":
        return ()
    return parameter_sources(start) or ()


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
    if position is not None and len(args) > position and isinstance(args[position], int):
        return int(args[position])
    return compat.registered_group_size(group_name(start))


def _reached_users(starts: Iterable[fx.Node], follow: Callable[[fx.Node], bool]) -> Iterator[fx.Node]:
    """Every user reachable from ``starts``, depth first, walking on through the users ``follow`` accepts (each
    node once): the one walk the structural tests below share."""
    stack, seen = list(starts), set()
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for user in cur.users:
            yield user
            if follow(user):
                stack.append(user)


def _is_unary(node: fx.Node) -> bool:
    return node.op != "output" and len(node.all_input_nodes) == 1


def _flows_to_outputs(node: fx.Node) -> bool:
    """Every path from ``node`` reaches the graph outputs through single-input ops only (a gradient that is
    returned, perhaps cast or viewed): torch's ``is_fsdp_reduce_scatter`` rule, for any node."""
    return all(user.op == "output" or _is_unary(user) for user in _reached_users([node], _is_unary))


_CHAIN_LIMIT = 16


def _reduce_scatter_fed_by(wait: fx.Node) -> fx.Node | None:
    """AR -> RS: the reduce-scatter start that reads this all-reduce wait through single-user transparent ops,
    or through the copy-in of reduce-scatters another pass already merged (upstream leaves the all-reduces)."""
    cur = wait
    for _ in range(_CHAIN_LIMIT):
        if len(cur.users) != 1:
            return None
        user = next(iter(cur.users))
        if collective_kind(user) == "reduce_scatter" and user.args and (user.args[0] is cur or (
                isinstance(user.args[0], (list, tuple)) and cur in user.args[0])):
            return user
        copy_in = user.target is compat.pre_bucket_reduce_scatter
        if not copy_in and (not _is_transparent(user) or len(user.all_input_nodes) != 1):
            return None
        cur = user
    return None


def _reduce_scatter_read_by(all_reduce: fx.Node) -> fx.Node | None:
    """RS -> AR: the reduce-scatter whose wait this all-reduce reads through single-input transparent ops."""
    cur = all_reduce.args[0] if all_reduce.args else None
    for _ in range(_CHAIN_LIMIT):
        if not isinstance(cur, fx.Node):
            return None
        start = started_by(cur)
        if start is not None:
            return start if collective_kind(start) == "reduce_scatter" and len(cur.users) == 1 else None
        if not _is_transparent(cur) or len(cur.all_input_nodes) != 1 or len(cur.users) != 1:
            return None
        cur = cur.all_input_nodes[0]
    return None


def _hsdp_pairs(waits_of: dict[fx.Node, list[fx.Node]]) -> dict[fx.Node, fx.Node]:
    """All-reduce <-> reduce-scatter pairs that reduce one gradient on two groups (both directions in the map).

    AR -> RS: the all-reduce's one wait feeds the reduce-scatter, whose result is returned. RS -> AR: the
    all-reduce reads the reduce-scatter's one wait and its own result is returned. Anything else (an all-reduce
    of an activation, a loss, a norm) pairs with nothing and stays ``other``.
    """
    pairs: dict[fx.Node, fx.Node] = {}
    for start, waits in waits_of.items():
        if collective_kind(start) != "all_reduce" or len(waits) != 1:
            continue
        rs = _reduce_scatter_fed_by(waits[0])
        if rs is not None and len(waits_of.get(rs, ())) == 1 and _flows_to_outputs(waits_of[rs][0]):
            pairs[start], pairs[rs] = rs, start
            continue
        rs = _reduce_scatter_read_by(start)
        if rs is not None and _flows_to_outputs(waits[0]):
            pairs[start], pairs[rs] = rs, start
    return pairs


def _reduced_again(waits: list[fx.Node]) -> bool:
    """The result goes through another reduce-scatter before the output: this one is the tensor-parallel half of
    a 2-D gradient reduction (FSDP + TP without sequence parallel reduce-scatters a row-parallel weight's gradient
    on the tp group, then on the dp group), and only the last one, nearest the output, is FSDP's. torch's
    ``is_fsdp_reduce_scatter`` accepts both (a reduce-scatter and a wait are single-input ops)."""
    def follow(user: fx.Node) -> bool:  # views and casts, and a merged bucket's copy-in (the dp half, bucketed)
        return user.op != "output" and (len(user.all_input_nodes) == 1 or _is_transparent(user)
                                        or user.target is compat.pre_bucket_reduce_scatter)

    return any(collective_kind(user) == "reduce_scatter" for user in _reached_users(waits, follow))

def _role(start: fx.Node, kind: CollectiveKind, waits: list[fx.Node], partner: fx.Node | None) -> CollectiveRole:
    """Evidence, strongest first: our bucketer merged it, the aot descriptors tied it to a parameter, or (for
    graphs nobody annotated) its structure: an all-gather fed by parameter inputs through transparent ops only, a
    reduce-scatter whose result flows to the graph outputs through unary ops only (directly or through its HSDP
    all-reduce) and through no other reduce-scatter, an all-reduce chained with such a reduce-scatter."""
    ours = start.meta.get(META_KEY, {})
    merged = "bucket" in ours
    if kind == "all_gather":
        return "fsdp_all_gather" if merged or "owner" in ours or is_parameter_gather(start) else "other"
    if kind == "reduce_scatter":
        if not merged and _reduced_again(waits):
            return "other"  # descriptors name the parameter for both halves: structure decides which is FSDP's
        fsdp = (merged or "owner" in ours or partner is not None or compat.is_fsdp_reduce_scatter(start)
                or is_partial_gradient_scatter(start, waits))
        return "fsdp_reduce_scatter" if fsdp else "other"
    # The plain op only: torch's all-reduce merge takes single tensors (a coalesced all-reduce is left alone).
    if start.target is compat.ALL_REDUCE and ((merged and ours.get("kind") == "all_reduce") or partner is not None):
        return "hsdp_all_reduce"
    return "other"


def find_collectives(
    graph: fx.Graph,
    module_fqn_fn: ModuleFqnFn,
    *,
    direction: Direction | None = None,
) -> list[Collective]:
    """Every waited ``_c10d_functional`` collective in graph order, with its role (``CollectiveRole``).

    ``direction`` forces one direction for all (a forward or a backward graph from aot_autograd); ``None`` reads
    it per node (joint graphs). Reduce-scatters and HSDP all-reduces are always backward.
    """
    waits_of: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        start = started_by(node)
        if start is not None:
            waits_of.setdefault(start, []).append(node)
    partners = _hsdp_pairs(waits_of)
    out: list[Collective] = []
    for start, waits in waits_of.items():
        kind = collective_kind(start) or "other"
        partner = partners.get(start)
        role = _role(start, kind, waits, partner)
        fsdp = role != "other"
        if kind == "reduce_scatter":
            source = compat.unwrapped_call(start)[1][0]
            size_node = source if isinstance(source, (fx.Node, list, tuple)) else start
        else:
            size_node = start
        vals = _tensors(start.meta.get("val"))
        if fsdp and not vals:
            # Sizes drive the byte cap and the report: guessing 0 bytes would silently disable the cap.
            raise RuntimeError(f"overlapcfg.apply: FSDP collective {start.name} has no meta['val'] fake tensor; "
                               "run the pass on a traced graph (aot_autograd or inductor post-grad) that has them")
        dtype = vals[0].dtype if vals else torch.float32
        dirn: Direction = "backward" if role in ("fsdp_reduce_scatter", "hsdp_all_reduce") or kind == \
            "reduce_scatter" else (direction or node_direction(start))
        # An HSDP all-reduce belongs to whoever owns the gradient it reduces: its reduce-scatter.
        owner_node = partner if role == "hsdp_all_reduce" and partner is not None else start
        owner_kind = "reduce_scatter" if owner_node is not start else kind
        out.append(Collective(start, tuple(waits), kind, role, dirn, group_name(start), _group_size(start, kind),
                              dtype, _nbytes(size_node), module_fqn_fn(owner_node) if fsdp else None,
                              _params(owner_node, owner_kind) if fsdp else (), partner))
    index = positions(graph)
    out.sort(key=lambda c: index[c.start])
    out = _no_hsdp_on_activation_groups(out)
    out = _one_owner_per_shared_gradient(out)
    owner_of = {c.start: c.module_fqn for c in out if c.role == "fsdp_reduce_scatter"}
    return [dataclasses.replace(c, module_fqn=owner_of.get(c.partner, c.module_fqn))
            if c.role == "hsdp_all_reduce" and c.partner is not None else c for c in out]


def _no_hsdp_on_activation_groups(collectives: list[Collective]) -> list[Collective]:
    """An all-reduce chained with an FSDP reduce-scatter is HSDP's replicate half only on a group that carries
    gradients alone. On a group that also carries activations (a tensor-parallel group: sequence-parallel
    gathers, row-parallel all-reduces), the same chain is tensor parallel's reduction of a replicated weight's
    partial gradient (norm weights), and tensor-parallel collectives are never merged or moved."""
    activation_groups = {c.group for c in collectives if c.role == "other" and feeds_compute(c)}
    demoted = {c.start for c in collectives if c.role == "hsdp_all_reduce" and c.group in activation_groups
               and "bucket" not in c.start.meta.get(META_KEY, {})}
    if not demoted:
        return collectives
    note = (f"{len(demoted)} all-reduce(s) on group(s) "
            f"{', '.join(sorted({repr(c.group) for c in collectives if c.start in demoted}))} are chained with FSDP "
            "reduce-scatters like HSDP's, but their group also carries activation collectives (tensor parallel): "
            "left alone, never bucketed")
    return [dataclasses.replace(c, role="other", module_fqn=None, params=(), partner=None, note=note)
            if c.start in demoted else dataclasses.replace(c, partner=None) if c.partner in demoted else c
            for c in collectives]


def feeds_compute(c: Collective) -> bool:
    """Whether the collective's result is read by compute (through views, casts and splits): an activation
    collective (tensor / sequence parallel, expert all-to-all), on the critical path between the compute that
    makes and the compute that reads it. A gradient's reduction, which flows to the outputs or into another
    collective, is not."""
    def passes(user: fx.Node) -> bool:  # not the output, nor into another collective or its wait
        return user.op != "output" and not is_collective_start(user) and started_by(user) is None

    def computes(user: fx.Node) -> bool:
        return passes(user) and user.op == "call_function" and not _is_transparent(user) \
            and user.target is not compat.pre_bucket_reduce_scatter

    return any(computes(user) for user in _reached_users(c.waits, passes))

def _one_owner_per_shared_gradient(collectives: list[Collective]) -> list[Collective]:
    """Partial gradients of one shared parameter (tied embeddings: one reduce-scatter per use, summed) belong to
    one module, the one that used the parameter first in forward: the partial whose reduce-scatter backward issues
    last. That is also the owner the aot descriptors name (dynamo names a parameter by its first access), so a
    graph with and without descriptors buckets the same way."""
    sums: dict[fx.Node, list[int]] = {}
    for i, c in enumerate(collectives):
        if c.kind == "reduce_scatter" and c.fsdp and len(c.waits) == 1 and len(c.waits[0].users) == 1:
            total = next(iter(c.waits[0].users))
            if compat.op_name(total.target) == "aten.add":
                sums.setdefault(total, []).append(i)
    for members in sums.values():
        owner = collectives[members[-1]].module_fqn  # graph order: the last issued
        if len(members) > 1 and owner is not None:
            for i in members:
                collectives[i] = dataclasses.replace(collectives[i], module_fqn=owner)
    return collectives
