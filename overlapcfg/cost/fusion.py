"""Memory-bound kernels as a compiled route runs them: fused, not one kernel per decomposed op.

A traced step shows an RMSNorm as ``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``, ``mul``: six nodes, each reading
its inputs from memory and writing its output back. Inductor runs them as one kernel that reads ``x`` and the
weight and writes the normalized output (and what the backward saves). Priced one kernel per node, the 8B step's
memory-bound time is several times what a compiled step spends. So on a compiled route (``Pricing.fusion``
``inductor``) memory-bound nodes are grouped the way inductor fuses them, roughly: every memory-bound node joins
the group of each memory-bound producer it reads, directly or through views (views move nothing and fuse away),
and compute (matmuls, attention) and collectives bound the groups. A group is priced as what it moves:

- the tensors its nodes read from outside the group, each once (charged to the first node reading it);
- the outputs of its nodes that something outside the group reads (or the graph returns), each once;
- one kernel launch per such output (``MemoryRate.launch_seconds``): what leaves a fused kernel is what it
  writes;
- at the reduction rate (``MemoryRate.reduction_efficiency``) if any of its nodes reduces (a norm, a softmax).

Per node the plan gives ``(bytes, kernels, reduces)``; a group's nodes sum to the group's. Nodes in a collective's chain
(the copy into a bucket buffer and out of it, a shard's cast before its all-gather, a gradient's cast before its
reduce-scatter, each chain's views) are left unfused, one kernel each: the bucketing pass creates and moves them,
and pricing them alike whatever the grouping keeps the tuner's quick model (which sums its units' chains) equal to
the full simulation. For that, which of the model's own nodes are in a chain must not depend on the grouping: a
chain follows one parameter's lane (``chain_nodes``), never a node whose value reaches the collective along two.
Deliberately not modelled: inductor's limits on fusing reductions with their consumers, and kernels it splits;
the grouping is an upper bound on fusion, the bytes a lower bound on traffic.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import fx

from overlapcfg.cost.price import is_reduction, iter_tensors, node_kind, tensor_bytes
from overlapcfg.graph.ops import is_collective_start, started_by
from overlapcfg.graph.schedule import exclusive_descendants

__all__ = ["chain_nodes", "fusion_plan"]


def chain_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that belong to a collective's chain, each on one parameter's lane: the memory-bound and view nodes
    that feed only its start along one path (one reader, itself in the chain; the start's own inputs may have
    several, such as a copy-in the all-gather both slices and writes into), and the waits and the nodes that read
    one chain node and nothing else (``overlapcfg.graph.schedule.exclusive_descendants``, one input each).

    One lane, because which of the model's own nodes are in a chain must not depend on the grouping: a gradient
    summed from two uses (an RMSNorm's input gradient, read by its weight's gradient and by the embedding's) feeds
    two units' reduce-scatters in the finest grouping and one when the two units share a bucket. Were it a chain
    node there, it would lose its launch and its fusion in one grouping and not the other, and the tuner's quick
    model (its units' chains summed) would part from the full simulation of the grouping it picked."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    chain: set[fx.Node] = set()
    for start in nodes:
        if not is_collective_start(start):
            continue
        direct = set(start.all_input_nodes)
        feeding = {start}
        stack = list(direct)
        while stack:
            node = stack.pop()
            if node in feeding or node.op != "call_function" or node_kind(node) not in ("memory", "free") \
                    or not all(u in feeding for u in node.users) or (len(node.users) > 1 and node not in direct):
                continue
            feeding.add(node)
            stack.extend(node.all_input_nodes)
        chain |= feeding - {start}
        waits = [u for u in start.users if started_by(u) is start]
        if waits:
            after = set(waits)
            for node in exclusive_descendants(waits, index):  # breadth first: a node's input comes before it
                if node in after or (len(node.all_input_nodes) == 1 and node.all_input_nodes[0] in after):
                    after.add(node)
            chain |= after
    return chain


def _value_bytes(node: fx.Node, as_dtype: torch.dtype | None) -> int:
    return sum(tensor_bytes(t, as_dtype) for t in iter_tensors(node.meta.get("val")))


def fusion_plan(gm: fx.GraphModule, as_dtype: torch.dtype | None = None,
                chain: set[fx.Node] | None = None) -> Mapping[fx.Node, tuple[int, int, bool]]:
    """``(bytes, kernels, reduces)`` of every fusable memory-bound node of ``gm`` (see the module docstring); nodes of
    collective chains (``chain``, default ``chain_nodes(gm)``) and every other kind are absent."""
    chain = chain_nodes(gm) if chain is None else chain
    members = [n for n in gm.graph.nodes if n.op == "call_function" and node_kind(n) == "memory" and n not in chain]
    fusable = set(members)
    parent = {n: n for n in members}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def producer(node: fx.Node) -> fx.Node:
        """The node whose data ``node`` carries: through views and getitem to what wrote it."""
        for _ in range(64):
            if node.op != "call_function" or node_kind(node) != "free" or not node.all_input_nodes:
                break
            node = node.all_input_nodes[0]
        return node

    for n in members:
        for inp in n.all_input_nodes:
            src = producer(inp)
            if src in fusable:
                a, b = find(n), find(src)
                if a is not b:
                    parent[a] = b
    group = {n: find(n) for n in members}
    # what leaves the group: a node whose value (or a view of it) a node outside its group reads, or the output
    readers: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node_kind(node) == "free":
            continue  # a view passes its data on; whoever reads the view is the reader
        for inp in node.all_input_nodes:
            src = producer(inp)
            if src in fusable:
                readers.setdefault(src, []).append(node)
    reducing = {group[n] for n in members if is_reduction(n)}
    out: dict[fx.Node, tuple[int, int, bool]] = {}
    charged: set[tuple[fx.Node, fx.Node]] = set()
    for n in members:
        g = group[n]
        read = 0
        for inp in dict.fromkeys(n.all_input_nodes):
            src = producer(inp)
            if src in fusable and group[src] is g:
                continue
            key = (g, inp)
            if key not in charged:
                charged.add(key)
                read += _value_bytes(inp, as_dtype)
        leaves = any(r.op == "output" or group.get(r) is not g for r in readers.get(n, ())) or not readers.get(n)
        written = _value_bytes(n, as_dtype) if leaves else 0
        out[n] = (read + written, 1 if leaves else 0, g in reducing)
    return out
