"""Capture the forward and backward FX graphs of one SimpleFSDP training step, and say who owns each collective.

Route: ``torch.compile(model, backend=StepBackend(...), fullgraph=True)`` where ``StepBackend`` is dynamo's
``aot_autograd`` with the min-cut partitioner; one forward + backward triggers both compilers. With the fake
process group (``overlapcfg.compat.fake_process_group``) this runs on one CPU; on ``device="meta"`` it computes
nothing at all.
The same backend, given passes, is what executes transformed graphs on real ranks (``compile_with_pass``), so
traced graphs and executed graphs come from one construction.

Attribution does not trust node names or module stacks. It follows aot's descriptors:
- a forward/backward all-gather reads a primal placeholder whose ``meta["desc"]`` is ``PlainAOTInput(idx)``;
- a reduce-scatter's wait flows into the backward output whose ``meta["desc"][i]`` is
  ``GradAOTOutput(grad_of=PlainAOTInput(idx))``;
- ``idx`` indexes the dynamo graph's placeholders, whose dynamo source names the parameter
  (``L['self']._modules['norm']._modules['parametrizations']._modules['weight']._parameters['original']``).
Each collective start and its wait get the record under ``node.meta["overlapcfg"]["owner"]``.

Graphs are rank-specific in general (torch's merge helpers write the rank into them), and the fake group's name
is "0" in every trace.
"""

from __future__ import annotations

import copy
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import torch
from torch import fx, nn

from overlapcfg import compat
from overlapcfg.graph.meta import META_KEY, OWNER_KEY
from overlapcfg.demo.llama import Llama, LlamaConfig, cross_entropy_loss
from overlapcfg.demo.simple_fsdp import AllGatherShard, is_sharded, shard_module, sharded_parameters, user_fqn

__all__ = [
    "META_NAMESPACE",
    "OWNER_META_KEY",
    "CollectiveOwner",
    "GraphName",
    "GraphPass",
    "StepBackend",
    "TracedStep",
    "annotate_collectives",
    "compile_with_pass",
    "default_module_fqn",
    "demo_batch",
    "module_fqn",
    "trace_train_step",
    "train_step",
]

log = logging.getLogger(__name__)

GraphName: TypeAlias = Literal["forward", "backward"]
CollectiveKind: TypeAlias = Literal["all_gather", "reduce_scatter"]
GraphPass: TypeAlias = Callable[[fx.GraphModule], fx.GraphModule]
"""A graph pass as ``compile_with_pass`` applies it: takes the aot graph module, returns the one to run."""
LossFn: TypeAlias = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

META_NAMESPACE = META_KEY
OWNER_META_KEY = OWNER_KEY
"""``node.meta["overlapcfg"]["owner"]`` holds the ``CollectiveOwner`` of an FSDP collective start and its wait."""

_c10d = torch.ops._c10d_functional
_KIND_OF_TARGET: dict[object, CollectiveKind] = {
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
}


@dataclass(frozen=True, slots=True)
class CollectiveOwner:
    """Which parameter (and so which module) an FSDP collective belongs to."""

    graph: GraphName
    node: str
    """Name of the collective start node (``all_gather_into_tensor_3``); unique within its graph only."""
    kind: CollectiveKind
    module_fqn: str
    """The module owning the parameter, as the user names it: ``layers.0.attention.wq``."""
    param_fqn: str
    """``layers.0.attention.wq.weight``."""
    wait: str
    """Name of the ``wait_tensor`` node consuming the start."""


@dataclass(frozen=True, slots=True)
class TracedStep:
    """The two graphs of one training step plus the model facts plan resolution needs."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    module_fqns: tuple[str, ...]
    """Every module FQN in model order (root, wrappers and parametrization internals excluded)."""
    param_fqns: tuple[str, ...]
    """FSDP-sharded parameters, user FQNs, model order."""
    param_owners: tuple[str, ...]
    """Module FQNs that own FSDP parameters, model order."""
    collectives: tuple[CollectiveOwner, ...]
    """Every FSDP collective: forward graph first, then backward, each in graph order."""
    config: LlamaConfig | None
    world_size: int
    rank: int
    reshard_after_forward: bool
    trace_seconds: float
    param_dtype: torch.dtype | None = None
    """Dtype the shards were cast to before their all-gathers (``shard_module``'s option; ``None``: no cast)."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients were reduce-scattered in (``None``: the gathered dtype, ``param_dtype`` if set)."""

    def graph(self, name: GraphName) -> fx.GraphModule:
        return self.forward if name == "forward" else self.backward

    def collectives_in(self, graph: GraphName, kind: CollectiveKind | None = None) -> tuple[CollectiveOwner, ...]:
        return tuple(c for c in self.collectives if c.graph == graph and (kind is None or c.kind == kind))

    def module_fqn_fn(self, graph: GraphName) -> Callable[[fx.Node], str | None]:
        """Attribution for nodes of ``graph``: our records for collective starts and waits (by node name, so it
        also works on a copy of the graph), the default module-stack reading for everything else."""
        by_name: dict[str, str] = {}
        for rec in self.collectives_in(graph):
            by_name[rec.node] = by_name[rec.wait] = rec.module_fqn

        def lookup(node: fx.Node) -> str | None:
            return by_name.get(node.name) or module_fqn(node)

        return lookup


# --- attribution ---------------------------------------------------------------------------------------------

_ROOT_RE = re.compile(r"^[LG]\['[^']*'\]")
_TOKEN_RE = re.compile(r"\.(\w+)|\['([^']*)'\]|\[(\d+)\]")
_CONTAINER_SEGMENTS = frozenset({"_modules", "_parameters", "_buffers"})


def _clean_path(path: str) -> str:
    """Dynamo source / module-stack path to a dotted FQN, like torch's ``_clean_stack_name`` but also accepting
    attribute and index forms: ``L['self']._modules['layers']['0'].attention`` -> ``layers.0.attention``."""
    rest = _ROOT_RE.sub("", path)
    parts = [next(g for g in m.groups() if g is not None) for m in _TOKEN_RE.finditer(rest)]
    return ".".join(p for p in parts if p not in _CONTAINER_SEGMENTS)


def default_module_fqn(node: fx.Node) -> str | None:
    """The innermost user module on a node's module stack, ``None`` when there is none (or it is the root).

    Reads ``meta["nn_module_stack"]`` (forward nodes, and backward nodes recomputed from forward) or
    ``meta["fwd_nn_module_stack"]`` (backward nodes created by autograd). Parametrization and wrapper segments are
    removed, so a SimpleFSDP all-gather (innermost ``wq.parametrizations.weight.0``) maps to ``wq``.
    """
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    innermost = next(reversed(stack.values()))[0]
    return user_fqn(_clean_path(innermost)) or None


def module_fqn(node: fx.Node) -> str | None:
    """The recorded owner of an annotated FSDP collective (or its wait), else ``default_module_fqn(node)``."""
    owner = node.meta.get(META_NAMESPACE, {}).get(OWNER_META_KEY)
    return owner.module_fqn if owner is not None else default_module_fqn(node)


def _dynamo_param_inputs(gm: fx.GraphModule) -> tuple[str | None, ...]:
    """User parameter FQN for each dynamo-graph placeholder (``None`` for non-parameters such as the tokens)."""
    out: list[str | None] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        source = compat.dynamo_input_source(node)
        out.append(user_fqn(_clean_path(source)) if source and "_parameters[" in source else None)
    return tuple(out)


def _producer_placeholder(node: fx.Node) -> fx.Node | None:
    """Walk first inputs back to a placeholder (dtype casts or views may sit between a primal and its gather)."""
    cur: object = node.args[0]
    while isinstance(cur, fx.Node) and cur.op != "placeholder":
        cur = cur.args[0] if cur.args else None
    return cur if isinstance(cur, fx.Node) else None


def _grad_output_index(wait: fx.Node) -> int | None:
    """Flat input index whose gradient ``wait`` (or a single-user chain after it) is returned as."""
    cur = wait
    while True:
        users = list(cur.users)
        outputs = [u for u in users if u.op == "output"]
        if outputs:
            position = list(outputs[0].args[0]).index(cur)
            desc = outputs[0].meta.get("desc")
            if desc is not None and isinstance(desc[position], compat.GradAOTOutput):
                grad_of = desc[position].grad_of
                return grad_of.idx if isinstance(grad_of, compat.PlainAOTInput) else None
            return position  # backward outputs are one per flat input, in order
        if len(users) != 1:
            return None
        cur = users[0]


def _input_index(placeholder: fx.Node) -> int | None:
    desc = placeholder.meta.get("desc")
    if isinstance(desc, compat.PlainAOTInput):
        return desc.idx
    match = re.fullmatch(r"primals_(\d+)", placeholder.name)
    return int(match.group(1)) - 1 if match else None


def _wait_of(start: fx.Node) -> fx.Node:
    waits = [u for u in start.users if u.target == _c10d.wait_tensor.default]
    if len(waits) != 1:
        raise AssertionError(f"tracing: collective {start.name} has {len(waits)} wait_tensor users, expected 1")
    return waits[0]


def annotate_collectives(gm: fx.GraphModule, graph: GraphName,
                         param_inputs: Sequence[str | None]) -> tuple[CollectiveOwner, ...]:
    """Record the owner of every FSDP collective in ``gm`` (graph order) on the nodes and return the records.

    Raises ``AssertionError`` naming the node when a collective cannot be traced back to a parameter: such a
    graph is not a SimpleFSDP graph and silently mis-attributing it would corrupt every plan applied to it.
    """
    records: list[CollectiveOwner] = []
    for node in gm.graph.nodes:
        kind = _KIND_OF_TARGET.get(node.target) if node.op == "call_function" else None
        if kind is None:
            continue
        wait = _wait_of(node)
        if kind == "all_gather":
            placeholder = _producer_placeholder(node)
            index = _input_index(placeholder) if placeholder is not None else None
        else:
            index = _grad_output_index(wait)
        param = param_inputs[index] if index is not None and index < len(param_inputs) else None
        if param is None:
            raise AssertionError(f"tracing: cannot attribute {graph} {kind} {node.name} to a parameter")
        owner = CollectiveOwner(graph, node.name, kind, param.rpartition(".")[0], param, wait.name)
        for n in (node, wait):
            n.meta.setdefault(META_NAMESPACE, {})[OWNER_META_KEY] = owner
        records.append(owner)
    return tuple(records)


# --- the backend ---------------------------------------------------------------------------------------------

GraphCompiler: TypeAlias = Callable[[fx.GraphModule, Sequence[object]], Callable[..., object]]


def _boxed_eager(gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
    return compat.make_boxed_func(gm.forward)


@dataclass(slots=True)
class StepBackend:
    """A ``torch.compile`` backend: aot_autograd + min-cut partitioner, annotate collectives, apply a pass, run.

    After the first forward/backward, ``graphs`` holds what each compiler ran (after the pass) and ``collectives``
    the records taken before the pass. ``compiler`` turns the final graph into a callable (boxed eager by default);
    ``bw_compiler`` replaces it for the backward (inductor compiles the two differently), and ``decompositions``
    is handed to aot_autograd (inductor needs its own table at trace time).
    """

    fw_pass: GraphPass | None = None
    bw_pass: GraphPass | None = None
    compiler: GraphCompiler = _boxed_eager
    bw_compiler: GraphCompiler | None = None
    decompositions: Mapping[object, Callable[..., object]] | None = None
    capture_joint: bool = False
    """Also keep a copy of aot's joint forward+backward graph (before partitioning) in ``graphs["joint"]``."""
    graphs: dict[str, fx.GraphModule] = field(default_factory=dict)
    collectives: dict[str, tuple[CollectiveOwner, ...]] = field(default_factory=dict)
    param_inputs: tuple[str | None, ...] = ()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
        self.param_inputs = _dynamo_param_inputs(gm)
        extra = {"decompositions": self.decompositions} if self.decompositions is not None else {}
        return compat.aot_autograd(
            fw_compiler=self._graph_compiler("forward", self.fw_pass, self.compiler),
            bw_compiler=self._graph_compiler("backward", self.bw_pass, self.bw_compiler or self.compiler),
            partition_fn=self._partition,
            **extra,
        )(gm, example_inputs)

    def _partition(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: object) -> object:
        if self.capture_joint:
            self.graphs["joint"] = copy.deepcopy(joint)
        return compat.min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def _graph_compiler(self, name: GraphName, graph_pass: GraphPass | None,
                        compiler: GraphCompiler) -> GraphCompiler:
        def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
            self.collectives[name] = annotate_collectives(gm, name, self.param_inputs)
            if graph_pass is not None:
                gm = graph_pass(gm)
                if not isinstance(gm, fx.GraphModule):
                    raise TypeError(f"{name} pass returned {type(gm).__name__}, expected a GraphModule")
            self.graphs[name] = gm
            return compiler(gm, example_inputs)

        return compile_graph


def compile_with_pass(model: nn.Module, fw_pass: GraphPass | None = None, bw_pass: GraphPass | None = None, *,
                      backend: StepBackend | None = None) -> nn.Module:
    """``torch.compile`` ``model`` so its forward/backward aot graphs go through the passes, then run eagerly.

    Resets dynamo first: the demo models share one ``forward`` code object, and stale cache entries compiled with
    another backend would otherwise be reused or hit the recompile limit. Pass ``backend`` to inspect the graphs.
    """
    if backend is not None and (fw_pass is not None or bw_pass is not None):
        raise TypeError("compile_with_pass: give the passes or a backend that holds them, not both")
    compat.dynamo_reset()
    backend = backend if backend is not None else StepBackend(fw_pass, bw_pass)
    return torch.compile(model, backend=backend, fullgraph=True)


def demo_batch(vocab_size: int, *, batch: int = 2, seq_len: int = 16, seed: int = 0,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded ``(tokens, targets)`` of shape ``(batch, seq_len)``; targets are tokens shifted by one."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=gen)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def train_step(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, *,
               loss_fn: LossFn = cross_entropy_loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward (no optimizer step). Returns the detached loss and each parameter's local gradient
    (the shard's, for a sharded model), cloned and keyed by user FQN. The loss is computed outside the model so
    the compiled region is the model alone and its module stacks are rooted at ``L['self']``."""
    for param in model.parameters():
        param.grad = None
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    grads = {fqn: p.grad.detach().clone() for fqn, p in sharded_parameters(model) if p.grad is not None}
    return loss.detach(), grads


# --- tracing ---------------------------------------------------------------------------------------------------

def _user_module_fqns(model: nn.Module) -> tuple[str, ...]:
    names = (user_fqn(name) for name, _ in model.named_modules())
    return tuple(dict.fromkeys(n for n in names if n))


def trace_train_step(model_or_config: nn.Module | LlamaConfig | None = None, *, world_size: int = 2, rank: int = 0,
                     reshard_after_forward: bool = False, batch: int = 2, seq_len: int = 16,
                     device: torch.device | str = "cpu", seed: int = 0,
                     inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
                     loss_fn: LossFn = cross_entropy_loss, param_dtype: torch.dtype | None = None,
                     reduce_dtype: torch.dtype | None = None) -> TracedStep:
    """Trace one training step of a SimpleFSDP-sharded model under a fake process group of ``world_size``.

    ``model_or_config``: a ``LlamaConfig`` (built with ``seed`` on ``device``), an unsharded module (deep-copied,
    then sharded; the caller's module is untouched) or an already sharded one (used as is). ``inputs`` default
    to ``demo_batch`` for models with ``config.vocab_size``. Use ``device="meta"`` for big shapes: nothing is
    computed. ``param_dtype`` / ``reduce_dtype`` are handed to ``shard_module`` (mixed precision: casts before
    the all-gathers and the reduce-scatters, see ``overlapcfg.demo.simple_fsdp``); an already sharded model
    keeps its own, and passing them with one raises ``TypeError``.
    Must not be called while a default process group exists (it opens its own fake one), and resets dynamo.
    """
    if isinstance(model_or_config, nn.Module):
        model = model_or_config if is_sharded(model_or_config) else copy.deepcopy(model_or_config)
    else:
        model = Llama(model_or_config, device=device, seed=seed)
    config: LlamaConfig | None = model.config if isinstance(model, Llama) else None
    if not is_sharded(model):
        shard_module(model, world_size=world_size, rank=rank, reshard_after_forward=reshard_after_forward,
                     param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    elif param_dtype is not None or reduce_dtype is not None:
        raise TypeError("trace_train_step: the model is already sharded; give param_dtype/reduce_dtype to "
                        "shard_module instead")
    if inputs is None:
        if config is None:
            raise TypeError("trace_train_step: pass inputs=(tokens, targets) for a model that is not a Llama")
        inputs = demo_batch(config.vocab_size, batch=batch, seq_len=seq_len, seed=seed, device=device)
    backend = StepBackend()
    start = time.perf_counter()
    with compat.fake_process_group(world_size, rank):
        train_step(compile_with_pass(model, backend=backend), *inputs, loss_fn=loss_fn)
    seconds = time.perf_counter() - start
    compat.dynamo_reset()
    return _traced_step(model, backend, config=config, world_size=world_size, rank=rank,
                        reshard_after_forward=reshard_after_forward, seconds=seconds)


def _mixed_precision(model: nn.Module) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` the model was sharded with (``shard_module`` sets one pair for all)."""
    gather = next((m for m in model.modules() if isinstance(m, AllGatherShard)), None)
    return (gather.param_dtype, gather.reduce_dtype) if gather is not None else (None, None)


def _traced_step(model: nn.Module, backend: StepBackend, *, config: LlamaConfig | None, world_size: int, rank: int,
                 reshard_after_forward: bool, seconds: float) -> TracedStep:
    if set(backend.graphs) != {"forward", "backward"}:
        raise AssertionError(f"tracing: expected forward and backward graphs, captured {sorted(backend.graphs)}")
    param_fqns = tuple(fqn for fqn, _ in sharded_parameters(model))
    owners = tuple(dict.fromkeys(p.rpartition(".")[0] for p in param_fqns))
    param_dtype, reduce_dtype = _mixed_precision(model)
    step = TracedStep(
        forward=backend.graphs["forward"],
        backward=backend.graphs["backward"],
        module_fqns=_user_module_fqns(model),
        param_fqns=param_fqns,
        param_owners=owners,
        collectives=backend.collectives["forward"] + backend.collectives["backward"],
        config=config,
        world_size=world_size,
        rank=rank,
        reshard_after_forward=reshard_after_forward,
        trace_seconds=seconds,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
    )
    log.info("traced %d-parameter step in %.2fs: %d forward / %d backward nodes, %d FSDP collectives",
             len(param_fqns), seconds, len(step.forward.graph.nodes), len(step.backward.graph.nodes),
             len(step.collectives))
    return step
