"""Small FSDP-like FX graphs built directly (no dynamo, no aot): what the fast tier tests passes on.

A graph here looks like what aot_autograd hands a backend for a SimpleFSDP model of ``n`` "layers", each with
one to three parameters, and is built in milliseconds:

- **forward**: for each parameter ``layers.i.w{j}`` (a shard of ``rows`` x ``DIM``), in layer order::

      ag = all_gather_into_tensor(primals_k, world_size, group); w = wait_tensor(ag)
      h = mm(x, t(w)); x = mm(h, w)

  and the graph returns ``x``;
- **backward**: layers in reverse order; per parameter, the gathered weight is either a saved activation
  (``saved_w_k``) or, with ``regather=True`` (reshard-after-forward), all-gathered again from its primal; then::

      grad = t(mm(t(gy), h_k)); gy = mm(h_k, w)
      rs = reduce_scatter_tensor(grad, "sum", world_size, group); g = wait_tensor(rs)

  and the graph returns every reduce-scattered gradient (primal order) and the last ``gy``: each reduce-scatter
  flows to the outputs through its wait only, as ``is_fsdp_reduce_scatter`` wants.

Parameters are graph inputs named ``primals_N`` (aot's names) or, with ``descriptors=True``, ordinary names. A
forward graph carries aot's ``PlainAOTInput(idx)`` descriptors only with ``descriptors=True`` (without them the
structure says which inputs are parameters: every input of a forward graph is the step's own); a backward graph
always carries them on its saved parameters, as aot's does (torch 2.13 keeps them through inductor's post-grad
passes): without them a backward graph cannot tell a saved parameter from a saved activation. Every collective, wait
and compute node has ``meta["custom"]["module_fqn"]`` (torchtitan's ``annotate_module_fqns`` form), so the
default attribution works, and every node has a ``meta["val"]`` fake tensor (``FakeTensorProp``), as the merge
helpers need. Building needs no process group: the group is named ``"0"``, which is what
``overlapcfg.compat.fake_process_group`` gives the default group, so ``apply`` under it merges these graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import fx
from torch._functorch._aot_autograd.descriptors import PlainAOTInput
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

if TYPE_CHECKING:
    from overlapcfg.passes.backend import CapturedStep

__all__ = ["DIM", "GROUP", "PARAM_NAMES", "Synthetic", "backward_graph", "captured_step", "forward_graph",
           "joint_graph", "layer_fqns", "new_capture", "with_fake_values"]

DIM = 4
"""Columns of every parameter; a parameter with ``rows`` shard rows gathers to ``world_size * rows`` x ``DIM``."""
BATCH = 2
GROUP = "0"
"""The default group's name under ``overlapcfg.compat.fake_process_group``."""
PARAM_NAMES = ("wq", "wk", "wv")

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten

Hsdp = Literal["all_reduce_first", "reduce_scatter_first"] | None
Layers = Sequence[Sequence[int]]
"""Per layer, the shard rows of each of its parameters (one to three): ``[[2], [1, 3]]``."""


@dataclass(frozen=True, slots=True)
class Synthetic:
    """A built graph and the facts a test needs to judge a pass over it without asking overlapcfg."""

    gm: fx.GraphModule
    kind: Literal["forward", "backward", "joint"]
    module_fqns: tuple[str, ...]
    """Every module of the model, parents first: ``("", "layers", "layers.0", "layers.0.wq", ...)``."""
    owners: dict[str, str]
    """Original collective start name -> the parameter-owning module (``layers.1.wk``)."""
    layer_bytes: tuple[int, ...]
    """Per layer, the unsharded bytes of its parameters (what one layer's all-gathers produce)."""
    world_size: int


def with_fake_values(gm: fx.GraphModule, inputs: Sequence[tuple[fx.Node, tuple[int, ...]]],
                     fake_mode: FakeTensorMode | None = None) -> fx.GraphModule:
    """``gm`` with ``meta["val"]`` on every node: fake tensors of the inputs' shapes, propagated (what a traced
    graph carries and the pass reads). Each graph gets a fake mode of its own (a capture of its own, as a traced
    step has) unless ``fake_mode`` is given: graphs built on one mode are one capture, whose bucket merges are
    traced once for all of them (``overlapcfg.graph.traces``), as a test drawing many small graphs wants."""
    with (fake_mode or FakeTensorMode()) as mode:
        fakes = [torch.empty(shape) for _, shape in inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    for (node, _), fake in zip(inputs, fakes, strict=True):
        node.meta["val"] = fake
    return gm


def new_capture() -> FakeTensorMode:
    """A fake mode to build several graphs on (``fake_mode=``): they are then one capture (``with_fake_values``)."""
    return FakeTensorMode()


def layer_fqns(layers: Layers) -> tuple[str, ...]:
    """The module tree of ``layers``: root, ``layers``, each ``layers.i`` and its parameter modules."""
    out = ["", "layers"]
    for i, params in enumerate(layers):
        out += [f"layers.{i}", *(f"layers.{i}.{PARAM_NAMES[j]}" for j in range(len(params)))]
    return tuple(out)


def _check(layers: Layers) -> None:
    if not layers or any(not 1 <= len(p) <= len(PARAM_NAMES) or min(p) < 1 for p in layers):
        raise ValueError(f"layers must be non-empty lists of 1-{len(PARAM_NAMES)} positive row counts, got {layers}")


class _Builder:
    def __init__(self, world_size: int, descriptors: bool, *, stamp: bool | None = None,
                 fake_mode: FakeTensorMode | None = None) -> None:
        self.graph = fx.Graph()
        self.fake_mode = fake_mode
        self.world_size = world_size
        self.descriptors = descriptors
        self.stamp = descriptors if stamp is None else stamp
        self.inputs: list[tuple[fx.Node, tuple[int, ...]]] = []
        self.owners: dict[str, str] = {}

    def placeholder(self, name: str, shape: tuple[int, ...], *, parameter: bool) -> fx.Node:
        node = self.graph.placeholder(name)
        if self.stamp and parameter:
            node.meta["desc"] = PlainAOTInput(len(self.inputs))
        if not self.descriptors and parameter and not name.startswith("primals_"):
            raise AssertionError(f"parameter placeholder {name} must be named primals_N without descriptors")
        self.inputs.append((node, shape))
        return node

    def call(self, target: object, args: tuple[object, ...], fqn: str | None, backward: bool) -> fx.Node:
        node = self.graph.call_function(target, args)  # type: ignore[arg-type]
        if fqn is not None:
            node.meta["custom"] = {"module_fqn": fqn}
        if backward:
            node.meta["autograd_backward"] = True
        return node

    def all_gather(self, shard: fx.Node, fqn: str, backward: bool) -> fx.Node:
        start = self.call(_c10d.all_gather_into_tensor.default, (shard, self.world_size, GROUP), fqn, backward)
        self.owners[start.name] = fqn
        return self.call(_c10d.wait_tensor.default, (start,), fqn, backward)

    def reduce_scatter(self, grad: fx.Node, fqn: str) -> fx.Node:
        start = self.call(_c10d.reduce_scatter_tensor.default, (grad, "sum", self.world_size, GROUP), fqn, True)
        self.owners[start.name] = fqn
        return self.call(_c10d.wait_tensor.default, (start,), fqn, True)

    def all_reduce(self, grad: fx.Node, fqn: str) -> fx.Node:
        start = self.call(_c10d.all_reduce.default, (grad, "sum", GROUP), fqn, True)
        self.owners[start.name] = fqn
        return self.call(_c10d.wait_tensor.default, (start,), fqn, True)

    def finish(self, outputs: object, kind: Literal["forward", "backward", "joint"], layers: Layers) -> Synthetic:
        self.graph.output(outputs)
        gm = with_fake_values(fx.GraphModule(torch.nn.Module(), self.graph), self.inputs, self.fake_mode)
        nbytes = tuple(sum(self.world_size * r * DIM * 4 for r in params) for params in layers)
        return Synthetic(gm, kind, layer_fqns(layers), dict(self.owners), nbytes, self.world_size)


def _params(layers: Layers) -> list[tuple[int, str, int]]:
    """``(layer, module fqn, shard rows)`` per parameter, model order."""
    return [(i, f"layers.{i}.{PARAM_NAMES[j]}", rows) for i, ps in enumerate(layers) for j, rows in enumerate(ps)]


def _param_name(k: int, descriptors: bool) -> str:
    return f"param_{k}" if descriptors else f"primals_{k + 1}"


def forward_graph(layers: Layers, *, world_size: int = 2, descriptors: bool = False,
                  fake_mode: FakeTensorMode | None = None) -> Synthetic:
    """The forward graph of ``layers`` (see the module docstring); ``fake_mode``: see ``with_fake_values``."""
    _check(layers)
    b = _Builder(world_size, descriptors, fake_mode=fake_mode)
    params = _params(layers)
    shards = [b.placeholder(_param_name(k, descriptors), (rows, DIM), parameter=True)
              for k, (_, _, rows) in enumerate(params)]
    x = b.placeholder("x" if descriptors else f"primals_{len(params) + 1}", (BATCH, DIM), parameter=False)
    for shard, (_, fqn, _) in zip(shards, params, strict=True):
        w = b.all_gather(shard, fqn, backward=False)
        h = b.call(_aten.mm.default, (x, b.call(_aten.t.default, (w,), fqn, False)), fqn, False)
        x = b.call(_aten.mm.default, (h, w), fqn, False)
    return b.finish(x, "forward", layers)


def backward_graph(layers: Layers, *, world_size: int = 2, descriptors: bool = False,
                   regather: bool = False, hsdp: Hsdp = None, fake_mode: FakeTensorMode | None = None) -> Synthetic:
    """The backward graph of ``layers`` (see the module docstring); ``regather``: all-gather the weights again;
    ``fake_mode``: see ``with_fake_values``.

    ``hsdp``: also all-reduce every gradient (HSDP's replicate half, on the same group here, so one fake process
    group serves): ``"all_reduce_first"`` as torchtitan's DTensor does (``all_reduce -> wait -> reduce_scatter``),
    ``"reduce_scatter_first"`` as FSDP2 does (``reduce_scatter -> wait -> all_reduce -> wait -> output``)."""
    _check(layers)
    b = _Builder(world_size, descriptors, stamp=True, fake_mode=fake_mode)
    params = _params(layers)
    weights: list[fx.Node] = []
    for k, (_, _, rows) in enumerate(params):
        if regather:
            weights.append(b.placeholder(_param_name(k, descriptors), (rows, DIM), parameter=True))
        else:
            weights.append(b.placeholder(f"saved_w_{k}", (world_size * rows, DIM), parameter=False))
    saved = [b.placeholder(f"saved_h_{k}", (BATCH, world_size * rows), parameter=False)
             for k, (_, _, rows) in enumerate(params)]
    gy = b.placeholder("tangents_1", (BATCH, DIM), parameter=False)
    grads: dict[int, fx.Node] = {}
    for k in reversed(range(len(params))):
        fqn = params[k][1]
        w = b.all_gather(weights[k], fqn, backward=True) if regather else weights[k]
        gy_t = b.call(_aten.t.default, (gy,), fqn, True)
        grad = b.call(_aten.t.default, (b.call(_aten.mm.default, (gy_t, saved[k]), fqn, True),), fqn, True)
        gy = b.call(_aten.mm.default, (saved[k], w), fqn, True)
        if hsdp == "all_reduce_first":
            grad = b.all_reduce(grad, fqn)
        grads[k] = b.reduce_scatter(grad, fqn)
        if hsdp == "reduce_scatter_first":
            grads[k] = b.all_reduce(grads[k], fqn)
    return b.finish((*(grads[k] for k in range(len(params))), gy), "backward", layers)


def captured_step(layers: Layers, *, world_size: int = 2, fake_mode: FakeTensorMode | None = None) -> CapturedStep:
    """A two-graph step (forward, and backward re-gathering every weight) built without tracing: what
    ``explain``, ``compare`` and ``tune`` take. Its graphs share one fake mode (``fake_mode``, else a new one): a
    traced step is one capture too."""
    from overlapcfg.passes.backend import CapturedStep

    mode = fake_mode or FakeTensorMode()
    fw = forward_graph(layers, world_size=world_size, fake_mode=mode)
    bw = backward_graph(layers, world_size=world_size, regather=True, fake_mode=mode)
    owners = tuple(dict.fromkeys(fw.owners.values()))
    return CapturedStep(forward=fw.gm, backward=bw.gm, module_fqns=fw.module_fqns,
                        param_fqns=tuple(f"{o}.weight" for o in owners), param_owners=owners, collectives=(),
                        world_size=world_size, rank=0)

def joint_graph(layers: Layers, *, world_size: int = 2, regather: bool = True,
                write_shard: int | None = None) -> Synthetic:
    """A whole-step graph of ``layers`` (forward, then backward tagged ``autograd_backward``), as torchtitan's
    graph trainer traces one: parameters are aot-described inputs; the forward is ``forward_graph``'s; the backward
    reads the forward's activations directly and, with ``regather`` (reshard-after-forward), all-gathers every
    weight again from its shard (the recomputed re-gather), else reads the forward's gathered weight. Returns the
    last activation, the input gradient and every reduce-scattered gradient (parameter order).

    ``write_shard=k``: an in-place ``add_`` on parameter ``k``'s shard between the forward and the backward (what
    a traced optimizer step must never do before the backward's re-gather)."""
    _check(layers)
    b = _Builder(world_size, descriptors=True)
    params = _params(layers)
    shards = [b.placeholder(_param_name(k, True), (rows, DIM), parameter=True) for k, (_, _, rows) in enumerate(params)]
    x = b.placeholder("x", (BATCH, DIM), parameter=False)
    acts: list[tuple[fx.Node, fx.Node]] = []  # (input of the parameter's first mm, gathered weight)
    for shard, (_, fqn, _) in zip(shards, params, strict=True):
        w = b.all_gather(shard, fqn, backward=False)
        acts.append((x, w))
        h = b.call(_aten.mm.default, (x, b.call(_aten.t.default, (w,), fqn, False)), fqn, False)
        x = b.call(_aten.mm.default, (h, w), fqn, False)
    if write_shard is not None:
        b.call(_aten.add_.Tensor, (shards[write_shard], 1.0), params[write_shard][1], True)
    gy = x
    grads: dict[int, fx.Node] = {}
    for k in reversed(range(len(params))):
        fqn = params[k][1]
        inp, w = acts[k]
        if regather:
            w = b.all_gather(shards[k], fqn, backward=True)
        w_t = b.call(_aten.t.default, (w,), fqn, True)
        h = b.call(_aten.mm.default, (inp, w_t), fqn, True)
        grads[k] = b.reduce_scatter(b.call(_aten.mm.default, (b.call(_aten.t.default, (h,), fqn, True), gy), fqn,
                                           True), fqn)
        gy = b.call(_aten.mm.default, (b.call(_aten.mm.default, (gy, w_t), fqn, True), w), fqn, True)
    return b.finish((x, gy, *(grads[k] for k in range(len(params)))), "joint", layers)
