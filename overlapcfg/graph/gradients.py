"""Which reduce-scatters and all-reduces reduce a parameter's gradient, read from where their results go.

A gradient ends in one of two places, and nowhere else: at the graph outputs (returned, perhaps cast or viewed:
aot's backward graph, graph_trainer's whole step), or in an update of the step's state (an optimizer traced into a
whole-step graph writes the parameters and its moments in place: ``_foreach_lerp_(exp_avgs, grads, ...)``). An
activation's reduction (tensor or sequence parallel) instead feeds more compute on its way to the loss's gradient.

A parameter used by several modules (T5 and BART share one embedding between encoder, decoder and the tied head;
tied embeddings) gets one partial gradient per use, each reduce-scattered, summed before it ends:
``add(add(rs_a, rs_b), rs_c)``. So does a module called several times in one step: torchtitan's chunked loss runs
``lm_head`` once per sequence chunk, and a whole-step trace of it reduce-scatters the weight's gradient once per
chunk and accumulates the partials in place, ``add_(add_(rs_0, rs_1), rs_2) ...``. Every partial is FSDP's, and
all belong to one module (``one_owner_per_shared_gradient`` in ``overlapcfg.graph.collectives``).

Node-level structure over the op vocabulary (``overlapcfg.graph.ops``); ``overlapcfg.graph.collectives`` builds the
roles of whole collectives on it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx

from overlapcfg import compat
from overlapcfg.graph.ops import (
    collective_kind,
    is_collective_start,
    is_compute_node,
    is_transparent,
    may_alias_input,
    reached_users,
    started_by,
    written_inputs,
)

__all__ = [
    "ends_as_gradient",
    "flows_to_outputs",
    "hsdp_pairs",
    "is_partial_gradient_scatter",
    "partial_sum_root",
    "reduced_again",
]

_CHAIN_LIMIT = 16
_SUM_OPS = frozenset({"aten.add", "aten.add_"})
"""A sum of partial gradients: out of place (uses of a shared parameter), or accumulated in place into the first
partial's buffer (a module called once per chunk). ``alpha`` other than 1 scales: not a plain sum."""


def _is_unary(node: fx.Node) -> bool:
    return node.op != "output" and len(node.all_input_nodes) == 1


def flows_to_outputs(node: fx.Node) -> bool:
    """Every path from ``node`` reaches the graph outputs through single-input ops only (a gradient that is
    returned, perhaps cast or viewed): the rule torch's ``is_fsdp_reduce_scatter`` applies to a reduce-scatter, for
    any node."""
    return all(user.op == "output" or _is_unary(user) for user in reached_users([node], _is_unary))


def _storage_root(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` shares (through views and in-place ops returning their input)."""
    for _ in range(_CHAIN_LIMIT):
        if node.op != "call_function" or not may_alias_input(node) or not node.args \
                or not isinstance(node.args[0], fx.Node):
            return node
        node = node.args[0]
    return node


def _updates_state(node: fx.Node) -> bool:
    """Every path from ``node`` ends in an in-place write into a graph input (an optimizer step traced into the
    graph: the parameters, its moments) or at the outputs, meeting no compute (matmuls, attention), no collective
    and no dead end on the way: a gradient consumed by the step's own update."""
    def writes_state(user: fx.Node) -> bool:  # reads the value into an update of a graph input: the path ends
        written = [_storage_root(w) for w in written_inputs(user)]
        return bool(written) and all(w.op == "placeholder" for w in written)

    def follow(user: fx.Node) -> bool:
        return user.op != "output" and not writes_state(user)

    updated = False
    for user in reached_users([node], follow):
        if user.op == "output":
            continue
        if is_collective_start(user) or started_by(user) is not None or is_compute_node(user):
            return False
        if writes_state(user):
            updated = True
        elif not user.users:
            return False  # a dead end: not a gradient's
    return updated


def ends_as_gradient(node: fx.Node) -> bool:
    """Where a gradient ends (module docstring): the outputs through single-input ops, or the step's state."""
    return flows_to_outputs(node) or _updates_state(node)


def _is_sum(node: fx.Node) -> bool:
    """``add`` / ``add_`` of two nodes, unscaled."""
    alpha = node.kwargs.get("alpha", 1)
    return bool(compat.op_name(node.target) in _SUM_OPS and len(node.args) == 2 and alpha == 1 and
                all(isinstance(a, fx.Node) for a in node.args))


def partial_sum_root(wait: fx.Node) -> fx.Node | None:
    """If ``wait`` (a collective's wait) is summed with other collective waits in a tree of ``add`` / ``add_`` ops
    (and with nothing else), the root of that tree; else None. ``add(add(w_a, w_b), w_c)`` -> the outer add, for
    each w; the same for ``add_(add_(w_0, w_1), w_2)``. Every node on the way has one user, so no one else reads a
    buffer an ``add_`` overwrites."""
    if len(wait.users) != 1:
        return None
    cur, root = wait, None
    for _ in range(_CHAIN_LIMIT * 4):  # an in-place accumulation is a chain as long as the module's calls
        if len(cur.users) != 1:
            break
        user = next(iter(cur.users))
        if not _is_sum(user) or not all(started_by(i) is not None or _is_partial_sum(i)
                                        for i in user.all_input_nodes):
            break
        cur = root = user
    return root


def _is_partial_sum(node: fx.Node) -> bool:
    """An ``add`` / ``add_`` whose inputs are all collective waits or such sums (the inner nodes of a partial-sum
    tree)."""
    for _ in range(_CHAIN_LIMIT * 4):
        if not _is_sum(node):
            return False
        inner = [i for i in node.all_input_nodes if started_by(i) is None]
        if not inner:
            return True
        if len(inner) != 1:
            return all(_is_partial_sum(i) for i in inner)
        node = inner[0]
    return False


def is_partial_gradient_scatter(start: fx.Node, waits: Sequence[fx.Node]) -> bool:
    """A reduce-scatter of one use's gradient of a parameter used by N >= 2 modules: its wait is summed with the
    other uses' reduce-scattered partials (``partial_sum_root``) and the sum ends as a gradient.

    torch's ``is_fsdp_reduce_scatter`` wants the wait to flow to the output alone, so it misses these; the
    backend's descriptors see them as the parameter's gradient. Both routes must classify them alike.
    """
    if len(waits) != 1:
        return False
    root = partial_sum_root(waits[0])
    return root is not None and ends_as_gradient(root)


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
        if not copy_in and (not is_transparent(user) or len(user.all_input_nodes) != 1):
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
        if not is_transparent(cur) or len(cur.all_input_nodes) != 1 or len(cur.users) != 1:
            return None
        cur = cur.all_input_nodes[0]
    return None


def hsdp_pairs(waits_of: dict[fx.Node, list[fx.Node]]) -> dict[fx.Node, fx.Node]:
    """All-reduce <-> reduce-scatter pairs that reduce one gradient on two groups (both directions in the map).

    AR -> RS: the all-reduce's one wait feeds the reduce-scatter, whose result ends as a gradient. RS -> AR: the
    all-reduce reads the reduce-scatter's one wait and its own result ends as one. Anything else (an all-reduce of
    an activation, a loss, a norm) pairs with nothing and stays ``other``.
    """
    pairs: dict[fx.Node, fx.Node] = {}
    for start, waits in waits_of.items():
        if collective_kind(start) != "all_reduce" or len(waits) != 1:
            continue
        rs = _reduce_scatter_fed_by(waits[0])
        if rs is not None and len(waits_of.get(rs, ())) == 1 and ends_as_gradient(waits_of[rs][0]):
            pairs[start], pairs[rs] = rs, start
            continue
        rs = _reduce_scatter_read_by(start)
        if rs is not None and ends_as_gradient(waits[0]):
            pairs[start], pairs[rs] = rs, start
    return pairs


def reduced_again(waits: Sequence[fx.Node]) -> bool:
    """The result goes through another reduce-scatter before the output: this one is the tensor-parallel half of
    a 2-D gradient reduction (FSDP + TP without sequence parallel reduce-scatters a row-parallel weight's gradient
    on the tp group, then on the dp group), and only the last one, nearest the output, is FSDP's. torch's
    ``is_fsdp_reduce_scatter`` accepts both (a reduce-scatter and a wait are single-input ops)."""
    def follow(user: fx.Node) -> bool:  # views and casts, and a merged bucket's copy-in (the dp half, bucketed)
        return user.op != "output" and (len(user.all_input_nodes) == 1 or is_transparent(user)
                                        or user.target is compat.pre_bucket_reduce_scatter)

    return any(collective_kind(user) == "reduce_scatter" for user in reached_users(waits, follow))
