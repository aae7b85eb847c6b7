"""Attention as trainers run it: every ``scaled_dot_product_attention`` call costed as one fused kernel.

A step traced on the meta device (or on a CPU, through the math backend) shows SDPA decomposed: ``bmm`` of q and
k, a causal mask, ``_safe_softmax``, ``bmm`` with v, with the ``s x s`` scores materialized in between and saved
for the backward. Trainers run flash or memory-efficient attention: one kernel that never writes the scores. In the
Llama-3-8B trace at 8192 tokens the decomposed math was a third of the step's compute, all of it memory traffic
of scores a real step never moves. So each call is costed as the fused kernel, whatever the decomposition:

- forward: the two matmuls' FLOPs (``2 B sq sk (d + dv)``, at the matmul rate of the step's dtype) against the
  memory traffic of q, k, v and the output (``B (sq d + sk d + sk dv + sq dv)`` elements);
- backward: twice the forward FLOPs (four matmuls, as torch's FLOP counter counts the fused backward) against
  reading q, k, v, the output and its gradient and writing the three input gradients.

The roofline of that (``max(FLOPs / peak, bytes / bandwidth)``) is charged to the region's last node in graph order
(where the output is ready) and the region's other nodes are folded into it (cost nothing). A call that is already
a fused kernel in the graph (a CUDA trace's ``_scaled_dot_product_flash_attention``) is kept: its own node's
roofline. Either way the nodes count as ``attention`` in the prediction's breakdown of compute
(``Simulation.compute_parts``).

Recognised by the metadata aot leaves on every node, never by names: forward nodes (not ``autograd_backward``) whose
``source_fn_stack`` ends in ``torch.nn.functional.scaled_dot_product_attention``; one call per connected piece of
them (the causal mask, built from constants and shared between layers by CSE, connects nothing and costs nothing:
a fused kernel masks in place); backward nodes (``autograd_backward``, recomputed forward ops included) by the
autograd sequence numbers (``seq_nr``) of their call's forward nodes. A call
whose decomposition is not the two matmuls this reading expects is left as traced. Measured node durations
(``overlapcfg.cost.node_costs``) still win where given: they are what actually ran.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
from torch import fx

from overlapcfg.cost.hardware import HardwareProfile
from overlapcfg.cost.price import matmul_rate, memory_rate, node_flops, node_kind

__all__ = ["EMPTY", "AttentionPlan", "AttentionRole", "FusedAttention", "attention_plan", "fused_seconds",
           "kept_attention"]

_SDPA = torch.nn.functional.scaled_dot_product_attention
_MATMULS = (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)


@dataclass(frozen=True, slots=True)
class FusedAttention:
    """One call's fused kernel in one direction: what the region's carrier node is charged."""

    flops: int
    """As torch's FLOP counter counts them: the full (non-causal) products."""
    elements: int
    """Elements read and written (bytes = elements x the element size of ``dtype``, or of the costed dtype)."""
    dtype: torch.dtype
    seq_len: int = 0
    """Query length (the rate's lookup: ``overlapcfg.cost.achievable.AttentionRates``)."""
    head_dim: int = 0
    causal: bool = False
    """Masked by a mask built from constants (the causal mask trainers build): a fused kernel skips the masked half,
    so it does half the FLOPs."""
    backward: bool = False
    backend: str | None = None
    """The backend the graph already chose (a fused kernel in a CUDA trace); None: the prediction's."""


AttentionRole: TypeAlias = "FusedAttention | Literal['folded', 'kept']"
"""A node's part in an attention region: the carrier of the fused kernel's cost (``FusedAttention``), ``folded``
into it (costs nothing), or ``kept`` (a fused kernel already in the graph: its own roofline)."""


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Per graph (by position in the sequence given to ``attention_plan``): each node of an attention region and
    its role."""

    graphs: tuple[Mapping[fx.Node, AttentionRole], ...]
    calls: int
    """Attention calls found (forward)."""

    def role(self, graph: int, node: fx.Node) -> AttentionRole | None:
        """``node``'s role in graph ``graph`` (its position in the sequence), or None outside attention regions."""
        return self.graphs[graph].get(node) if graph < len(self.graphs) else None


EMPTY = AttentionPlan((), 0)


def _is_sdpa(node: fx.Node) -> bool:
    stack = node.meta.get("source_fn_stack")
    return isinstance(stack, (list, tuple)) and bool(stack) and stack[-1][1] is _SDPA


def _backward(node: fx.Node) -> bool:
    """Whether aot put ``node`` on the backward side (its gradient formulas, and forward ops it recomputes there)."""
    return bool(node.meta.get("autograd_backward"))


def _components(nodes: Sequence[fx.Node], members: set[fx.Node]) -> list[list[fx.Node]]:
    """Connected pieces of ``nodes`` through edges between members, each in graph order, pieces in order of their
    first node."""
    parent = {n: n for n in nodes}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for inp in n.all_input_nodes:
            if inp in members:
                a, b = find(n), find(inp)
                if a is not b:
                    parent[b] = a
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def _shape(node: fx.Node, i: int) -> tuple[int, ...] | None:
    arg = node.args[i] if len(node.args) > i else None
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    return tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else None


def _fused(call: Sequence[fx.Node], causal: bool = False) -> tuple[FusedAttention, FusedAttention] | None:
    """The forward and backward fused kernels of one decomposed call (two matmuls: ``q k^T`` then ``p v``), or
    None where the decomposition is not that; ``causal``: the call reads a mask built from constants."""
    mms = [n for n in call if n.target in _MATMULS]
    if len(mms) != 2:
        return None
    offset = 1 if mms[0].target is torch.ops.aten.baddbmm.default else 0
    q_shape, k_shape = _shape(mms[0], offset), _shape(mms[0], offset + 1)
    offset = 1 if mms[1].target is torch.ops.aten.baddbmm.default else 0
    p_shape, v_shape = _shape(mms[1], offset), _shape(mms[1], offset + 1)
    if q_shape is None or k_shape is None or p_shape is None or v_shape is None \
            or len(q_shape) != 3 or len(k_shape) != 3 or len(v_shape) != 3:
        return None
    batch, sq, d = q_shape
    sk = k_shape[2]
    sk2, dv = v_shape[1], v_shape[2]
    if sk2 != sk:
        return None
    val = mms[0].meta.get("val")
    dtype = val.dtype if isinstance(val, torch.Tensor) else torch.float32
    flops = 2 * batch * sq * sk * (d + dv)
    q, k, v, o = batch * sq * d, batch * sk * d, batch * sk * dv, batch * sq * dv
    facts = {"dtype": dtype, "seq_len": sq, "head_dim": d, "causal": causal}
    return (FusedAttention(flops, q + k + v + o, **facts),  # type: ignore[arg-type]
            FusedAttention(2 * flops, 2 * (q + k + v) + 2 * o, backward=True, **facts))  # type: ignore[arg-type]


def attention_plan(graphs: Sequence[fx.GraphModule]) -> AttentionPlan:
    """The attention regions of a step's graphs (forward first, then backward; see the module docstring)."""
    if not graphs:
        return EMPTY
    tables: list[dict[fx.Node, AttentionRole]] = [{} for _ in graphs]
    backward_of: dict[int, tuple[int, FusedAttention | None]] = {}  # forward seq_nr -> (call, its backward)
    backs: dict[int, FusedAttention | None] = {}
    calls = 0
    for gi, gm in enumerate(graphs):
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and _is_sdpa(n) and not _backward(n)]
        if not nodes:
            continue
        region = set(nodes)
        constant: set[fx.Node] = set()
        for n in nodes:  # graph order: a mask built from constants only (ones, tril, where) belongs to no call
            if all(i in constant for i in n.all_input_nodes):
                constant.add(n)
        table = tables[gi]
        for n in constant:
            table[n] = "folded"
        for call in _components([n for n in nodes if n not in constant], region - constant):
            calls += 1
            masked = any(i in constant for n in call for i in n.all_input_nodes)
            fused = _fused(call, masked)
            if fused is None and not any(n.target in _MATMULS for n in call):  # a fused kernel already
                for n in call:
                    table[n] = "kept"
                back = None
            elif fused is None:  # decomposed some other way: leave it as traced
                continue
            else:
                for n in call:
                    table[n] = "folded"
                table[call[-1]] = fused[0]
                back = fused[1]
            backs[calls] = back
            for n in call:
                seq = n.meta.get("seq_nr")
                if isinstance(seq, int):
                    backward_of[seq] = (calls, back)
    members: dict[int, list[tuple[int, fx.Node]]] = {}  # call -> its backward nodes, (graph, node) in order
    for gi, gm in enumerate(graphs if backward_of else ()):
        for n in gm.graph.nodes:
            seq = n.meta.get("seq_nr")
            if n.op != "call_function" or not _backward(n) or not isinstance(seq, int) or seq not in backward_of \
                    or node_kind(n) not in ("compute", "memory", "free"):
                continue
            members.setdefault(backward_of[seq][0], []).append((gi, n))
    for index, nodes_of in members.items():
        back = backs[index]
        for gi, n in nodes_of:
            tables[gi][n] = "kept" if back is None else "folded"
        if back is not None:  # charged where the backward ends (the partitioner may put a few views in the forward)
            gi, n = nodes_of[-1]
            tables[gi][n] = back
    return AttentionPlan(tuple(tables), calls)


def fused_seconds(fused: FusedAttention, hw: HardwareProfile, as_dtype: torch.dtype | None,
                  backend: str | None = None) -> tuple[float, str, int]:
    """``(seconds, bound, bytes)`` of a fused kernel: its FLOPs (half of them for a causal call) at the profile's
    achievable attention rate for ``backend`` (``overlapcfg.cost.achievable.AttentionRates``; default the
    profile's), else at the matmul rate of its dtype (or ``as_dtype``), against its elements at the memory
    bandwidth, whichever is longer, plus a launch."""
    dtype = as_dtype if as_dtype is not None else fused.dtype
    nbytes = fused.elements * dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    rates = hw.achievable.attention if hw.achievable is not None else None
    launch = 0.0
    if rates is not None:
        chosen = fused.backend if fused.backend in rates.backends else (backend or rates.backend)
        share = rates.share(chosen, fused.seq_len, fused.head_dim, backward=fused.backward, causal=fused.causal)
        work = fused.flops / 2 if fused.causal else fused.flops
        if fused.backward:
            work *= 1.25  # the fused backward recomputes the scores: five matmuls to the counter's four
        t_flops = work / (hw.flops_for(name) * share)
        launch = rates.launch_seconds * (2 if fused.backward else 1)  # the backward's preprocessing kernel
    else:
        t_flops = fused.flops / matmul_rate(hw, name, None)
    t_mem = nbytes / memory_rate(hw)
    return launch + max(t_flops, t_mem), "compute" if t_flops >= t_mem else "memory", nbytes


_CAUSAL_ARGUMENT = "is_causal"


def kept_attention(node: fx.Node) -> FusedAttention | None:
    """A fused SDPA kernel already in the graph (``_scaled_dot_product_flash_attention``, its CPU and memory-
    efficient and cuDNN siblings, and their backwards) as ``FusedAttention``: its FLOPs by torch's counter, its
    query length and head dimension from its first argument (``batch x heads x seq x head_dim``), ``is_causal``
    read by name from the op's schema; None for anything else."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or "scaled_dot_product" not in schema.name:
        return None
    names = [a.name for a in schema.arguments]
    q = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    if _CAUSAL_ARGUMENT not in names or not isinstance(q, torch.Tensor) or q.dim() != 4:
        return None
    i = names.index(_CAUSAL_ARGUMENT)
    causal = node.args[i] if len(node.args) > i else node.kwargs.get(_CAUSAL_ARGUMENT, False)
    flops = node_flops(node)
    backend = next((b for b in ("cudnn", "efficient", "flash") if b in schema.name), None)
    return FusedAttention(flops, 0, q.dtype, seq_len=int(q.shape[2]), head_dim=int(q.shape[3]),
                          causal=bool(causal), backward="backward" in schema.name, backend=backend)
