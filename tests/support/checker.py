"""An independent measure of what a scheduled graph achieves, and what a config asks for.

Written without ``overlapcfg.graph.schedule`` or the pass record: it reads only the final FX graph, the tags
``merge.py`` puts on merged collectives (``node.meta["overlapcfg"]``: part, kind, direction, sources) and the
tracing records of the *original* graph (which module owns each original collective). Bucket membership is
derived here from the sources' owners with a plan written out by hand (``llama_layers``), not from the
resolver, so a resolver or scheduler bug cannot hide behind a shared assumption.

Expected depths (FSDP2 ``set_modules_to_forward_prefetch`` semantics: what is in flight while a bucket computes):

- All-gathers of one direction, buckets ``0..n-1`` in compute order, bucket ``i`` asking for ``k_i``. While
  bucket ``i`` computes, buckets ``i+1..i+k_i`` must have been issued, so by the time bucket ``j`` waits every
  bucket up to ``reach_j = max_{i <= j} min(i + k_i, n - 1)`` has been issued: issue is monotone, a bucket
  issued early for an earlier bucket's sake cannot be un-issued. The achieved depth of ``j`` (other buckets
  issued but not yet waited at ``j``'s wait) is ``reach_j - j``. So an earlier bucket's larger ``k`` can make a
  later bucket's depth larger than its own ``k`` (``k = (2, 0, ...)`` gives bucket 1 a depth of 1), and the last
  buckets are clipped by the end of the graph. With uniform ``k``: ``min(k, n - 1 - j)``.
  The first bucket has no earlier bucket to issue it; where it is issued does not change these counts.
- A ``max_inflight_bytes`` cap ``C`` limits the unsharded bytes issued but not waited at ``j``'s wait,
  ``sum(size[j..reach_j])``: ``reach_j`` is the largest ``r <= min(j + k_j, n - 1)`` within the cap, but never
  below ``max(reach_{j-1}, j)`` (monotone issue; a bucket alone above the cap still runs, at depth 0).
- Reduce-scatters, buckets ``0..n-1`` in issue order, bucket ``i`` asking for ``d_i``: its wait comes after the
  starts of buckets ``i+1..i+d_i``; waits can be delayed independently, so achieved = ``min(d_i, n - 1 - i)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from overlapcfg.demo.tracing import TracedStep
from overlapcfg.kinds import Direction
from tests.thirdparty.conformance import custom_module, summed_partials
from tests.thirdparty.conformance import direction as side

__all__ = [
    "Merged",
    "joint_merged",
    "joint_order",
    "torchtitan_bucket",
    "achieved_delays",
    "achieved_prefetch",
    "bucket_sizes",
    "expected_delays",
    "expected_prefetch",
    "inflight_bytes",
    "llama_layers_bucket",
    "merged_collectives",
    "original_order",
    "two_layers_bucket",
]

_c10d = torch.ops._c10d_functional
_WAIT = _c10d.wait_tensor.default
_KIND = {_c10d.all_gather_into_tensor.default: "all_gather", _c10d.reduce_scatter_tensor.default: "reduce_scatter"}

BucketOf = Callable[[str], str]


def _block_bucket(module_fqn: str, tail: tuple[str, str]) -> str:
    """Embedding, one bucket per ``layers.N`` block, the two ``tail`` modules together (named in this order)."""
    parts = module_fqn.split(".")
    if parts[0] == "layers":
        return f"layers.{parts[1]}"
    if parts[0] in tail:
        return "+".join(tail)
    return parts[0]


def llama_layers_bucket(module_fqn: str) -> str:
    """The ``llama_layers`` plan written out: embedding, one bucket per block, ``[norm, output]``."""
    return _block_bucket(module_fqn, ("norm", "output"))


@dataclass(frozen=True, slots=True)
class Merged:
    """One merged collective of the final graph and the bucket its sources belong to."""

    bucket: str
    kind: str
    direction: str
    start: fx.Node
    wait: fx.Node
    sources: tuple[str, ...]


def _owners(step: TracedStep, graph: Direction) -> dict[str, str]:
    return {c.node: c.module_fqn for c in step.collectives_in(graph)}


def merged_collectives(gm: fx.GraphModule, step: TracedStep, graph: Direction,
                       bucket_of: BucketOf = llama_layers_bucket) -> list[Merged]:
    """Every tagged merged collective start in final graph order, its wait, and its bucket (from its sources)."""
    owners = _owners(step, graph)
    out: list[Merged] = []
    for node in gm.graph.nodes:
        tag = node.meta.get("overlapcfg")
        if not isinstance(tag, dict) or tag.get("part") != "start":
            continue
        buckets = {bucket_of(owners[s]) for s in tag["sources"]}
        if len(buckets) != 1:
            raise AssertionError(f"{node.name} merges collectives of several buckets: {sorted(buckets)}")
        waits = [u for u in node.users if u.target is _WAIT]
        if len(waits) != 1:
            raise AssertionError(f"{node.name} has {len(waits)} waits")
        out.append(Merged(buckets.pop(), tag["kind"], tag["direction"], node, waits[0], tuple(tag["sources"])))
    return out


def torchtitan_bucket(module_fqn: str) -> str:
    """torchtitan's graph-trainer plan written out: ``tok_embeddings``, one bucket per block, ``[norm, lm_head]``."""
    return _block_bucket(module_fqn, ("lm_head", "norm"))


# --- whole-step (joint) graphs ------------------------------------------------------------------------------------
# Owners and directions come from the ORIGINAL graph's own annotations (torchtitan writes the owning module into
# ``meta["custom"]["module_fqn"]`` of every collective, backward copies included, and marks backward nodes
# ``meta["autograd_backward"]``), never from overlapcfg's attribution; a tied weight's summed partial gradients go
# to its first user in forward, the documented rule, found here from the graph's add trees.

_AG_OUT = _c10d.all_gather_into_tensor_out.default


def _joint_kind(node: fx.Node) -> str | None:
    return "all_gather" if node.target is _AG_OUT else _KIND.get(node.target)  # type: ignore[arg-type]


def _shared_gradient_owners(original: fx.GraphModule) -> dict[str, str]:
    """Reduce-scatters whose waits are summed with other reduce-scatters' waits (a tied weight's partial
    gradients, ``add`` trees): the documented rule gives the sum to the module that used the parameter first in
    forward, whose partial the backward reduce-scatters last. Start name -> that owner."""
    index = {n: i for i, n in enumerate(original.graph.nodes)}
    trees: dict[fx.Node, list[fx.Node]] = {}
    for node in original.graph.nodes:
        if node.op != "call_function" or _joint_kind(node) != "reduce_scatter":
            continue
        waits = [u for u in node.users if u.target is _WAIT]
        root = summed_partials(waits[0]) if len(waits) == 1 else None
        if root is not None:
            trees.setdefault(root, []).append(node)
    owners: dict[str, str] = {}
    for starts in trees.values():
        if len(starts) > 1:
            owner = custom_module(max(starts, key=index.__getitem__))
            owners.update((s.name, owner) for s in starts)
    return owners


def joint_order(original: fx.GraphModule, kind: str, direction: str,
                bucket_of: BucketOf = torchtitan_bucket) -> dict[str, list[str]]:
    """The original graph's collectives of one kind and direction: bucket -> start names, buckets in compute order:
    all-gathers by first wait (when the bucket is first needed), reduce-scatters by last start (when the bucket's
    last gradient is ready, so the earliest its merged reduce-scatter can be issued: a tied weight's summed partial
    gradients make a bucket whose first partial comes long before its last)."""
    index = {n: i for i, n in enumerate(original.graph.nodes)}
    shared = _shared_gradient_owners(original)
    found: dict[str, list[str]] = {}
    first: dict[str, int] = {}
    for node in original.graph.nodes:
        if node.op != "call_function" or _joint_kind(node) != kind or side(node) != direction:
            continue
        bucket = bucket_of(shared.get(node.name) or custom_module(node))
        found.setdefault(bucket, []).append(node.name)
        if kind == "all_gather":
            waits = [u for u in node.users if u.target is _WAIT]
            at = index[waits[0]] if waits else index[node]
            first[bucket] = min(first.get(bucket, at), at)
        else:
            first[bucket] = max(first.get(bucket, index[node]), index[node])
    return {b: found[b] for b in sorted(found, key=first.__getitem__)}


def joint_merged(gm: fx.GraphModule, original: fx.GraphModule,
                 bucket_of: BucketOf = torchtitan_bucket) -> list[Merged]:
    """Every merged collective of a transformed whole-step graph, graph order, with the bucket, kind and direction
    its sources have in ``original``; a merge across buckets, kinds or directions is an error."""
    by_name = {n.name: n for n in original.graph.nodes}
    shared = _shared_gradient_owners(original)
    out: list[Merged] = []
    for node in gm.graph.nodes:
        tag = node.meta.get("overlapcfg")
        if not isinstance(tag, dict) or tag.get("part") != "start":
            continue
        sources = [by_name[s] for s in tag["sources"]]
        found = {(bucket_of(shared.get(s.name) or custom_module(s)), _joint_kind(s), side(s))
                 for s in sources}
        if len(found) != 1:
            raise AssertionError(f"{node.name} merges collectives of several buckets/kinds/directions: {found}")
        waits = [u for u in node.users if u.target is _WAIT]
        if len(waits) != 1:
            raise AssertionError(f"{node.name} has {len(waits)} waits")
        bucket, kind, direction = found.pop()
        out.append(Merged(bucket, str(kind), direction, node, waits[0], tuple(tag["sources"])))
    return out


def two_layers_bucket(module_fqn: str) -> str:
    """The ``two_layers_per_bucket`` plan written out: blocks in pairs (``layers.0-1``, ``layers.2-3``...)."""
    parts = module_fqn.split(".")
    if parts[0] == "layers":
        first = int(parts[1]) // 2 * 2
        return f"layers.{first}-{first + 1}"
    return llama_layers_bucket(module_fqn)


def original_order(step: TracedStep, graph: Direction, kind: str,
                   bucket_of: BucketOf = llama_layers_bucket, *, by: str | None = None) -> list[str]:
    """Buckets in the order the *original* graph uses them: by default all-gathers by first wait (compute
    order) and reduce-scatters by first start (issue order); ``by="start"`` / ``"wait"`` forces one."""
    gm = step.graph(graph)
    index = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    by = by or ("wait" if kind == "all_gather" else "start")
    first: dict[str, int] = {}
    for c in step.collectives_in(graph, kind):  # type: ignore[arg-type]
        at = index[c.wait] if by == "wait" else index[c.node]
        b = bucket_of(c.module_fqn)
        first[b] = min(first.get(b, at), at)
    return sorted(first, key=first.__getitem__)


def bucket_sizes(step: TracedStep, graph: Direction, kind: str,
                 bucket_of: BucketOf = llama_layers_bucket) -> dict[str, int]:
    """Unsharded bytes per bucket, summed over the original collectives' full-size tensors."""
    gm = step.graph(graph)
    by_name = {n.name: n for n in gm.graph.nodes}
    sizes: dict[str, int] = {}
    for c in step.collectives_in(graph, kind):  # type: ignore[arg-type]
        node = by_name[c.node]
        val = (node if kind == "all_gather" else node.args[0]).meta["val"]
        sizes[bucket_of(c.module_fqn)] = sizes.get(bucket_of(c.module_fqn), 0) + val.numel() * val.element_size()
    return sizes


def _positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def achieved_prefetch(gm: fx.GraphModule, merged: Sequence[Merged], direction: str) -> dict[str, int]:
    """Per bucket: all-gathers of *other* buckets (same direction) issued but not yet waited at its wait."""
    pos = _positions(gm)
    ags = [m for m in merged if m.kind == "all_gather" and m.direction == direction]
    return {m.bucket: sum(1 for o in ags if o is not m and pos[o.start] < pos[m.wait] < pos[o.wait]) for m in ags}


def inflight_bytes(gm: fx.GraphModule, merged: Sequence[Merged], direction: str,
                   sizes: Mapping[str, int]) -> dict[str, int]:
    """Per bucket: unsharded bytes of all-gathers issued and not yet waited just before its wait (itself too)."""
    pos = _positions(gm)
    ags = [m for m in merged if m.kind == "all_gather" and m.direction == direction]
    return {m.bucket: sum(sizes[o.bucket] for o in ags if pos[o.start] < pos[m.wait] <= pos[o.wait])
            for m in ags}


def achieved_delays(gm: fx.GraphModule, merged: Sequence[Merged]) -> dict[str, int]:
    """Per bucket: reduce-scatter starts of buckets issued *after* it that precede its wait."""
    pos = _positions(gm)
    rss = sorted((m for m in merged if m.kind == "reduce_scatter"), key=lambda m: pos[m.start])
    return {m.bucket: sum(1 for later in rss[i + 1:] if pos[later.start] < pos[m.wait]) for i, m in enumerate(rss)}


def expected_prefetch(ks: Sequence[int], sizes: Sequence[int] | None = None, cap: int | None = None) -> list[int]:
    """Achieved depth per bucket (compute order) for requested depths ``ks``, from the spec by brute force.

    Not a re-run of the scheduler's loop: enumerate every reach sequence ``r`` (``r[j]`` = last bucket issued when
    bucket j waits) that is allowed, and take the lexicographically largest one, i.e. "as deep as asked, as
    early as possible". Allowed: ``j <= r[j] <= last``, monotone (nothing is un-issued), never deeper than some
    bucket asked (``r[j] <= max over i <= j of i + k_i``), and within the cap (unsharded bytes of buckets
    ``j..r[j]`` <= cap) unless ``r[j]`` is forced (``r[j] == max(r[j-1], j)``: already issued, or itself).
    """
    last = len(ks) - 1
    best: list[int] | None = None

    def allowed(j: int, r: int, prev: int) -> bool:
        forced = max(prev, j)
        if r < forced or r > max(forced, min(max(i + k for i, k in enumerate(ks[:j + 1])), last)):
            return False
        within_cap = cap is None or sizes is None or sum(sizes[j:r + 1]) <= cap
        return within_cap or r == forced

    def search(j: int, prev: int, seq: list[int]) -> None:
        nonlocal best
        if j > last:
            if best is None or seq > best:
                best = list(seq)
            return
        for r in range(last, -1, -1):  # largest first: the first complete sequence found is the answer
            if allowed(j, r, prev):
                seq.append(r)
                search(j + 1, r, seq)
                seq.pop()
                if best is not None:
                    return

    search(0, -1, [])
    assert best is not None
    return [r - j for j, r in enumerate(best)]


def expected_delays(ds: Sequence[int]) -> list[int]:
    last = len(ds) - 1
    return [min(d, last - i) for i, d in enumerate(ds)]


def collective_starts(gm: fx.GraphModule) -> list[tuple[str, fx.Node]]:
    """Every FSDP-kind collective start (all-gather / reduce-scatter, merged or not) with its kind."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        kind = _KIND.get(n.target)
        if kind is None and n.target is _c10d.all_gather_into_tensor_out.default:
            kind = "all_gather"
        if kind is not None:
            out.append((kind, n))
    return out
