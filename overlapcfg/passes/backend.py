"""The ``torch.compile`` backend that runs the pass on any model whose FSDP collectives appear in the graph.

Route: dynamo's graph → ``aot_autograd`` with the min-cut partitioner (required: the default partitioner saves
the all-gathered weights for backward, so a reshard-after-forward backward would lose its all-gathers) → for
each of aot's forward and backward graphs: stamp the owner of every collective the aot descriptors tie to a
parameter (``overlapcfg.graph.attribution.annotate_owners``), run the graph pass, hand the result to a compiler
(boxed eager by default, inductor on request).

Nothing here assumes a particular sharder: SimpleFSDP parametrizations, torchtitan's DTensor ``data_parallel``
and Hugging Face models behind decorated ``forward`` methods (dynamo root ``L['args'][0]``) all go through the
same attribution. Collectives that are not FSDP's (tensor-parallel activations, ``all_to_all``, user
all-reduces) are classified and left alone.

``GraphBackend`` keeps what it compiled (``graphs``, ``collectives``), which is also how the demo's tracer
captures a step (``CapturedStep``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from torch import fx, nn

from overlapcfg import compat
from overlapcfg.graph.attribution import (
    AttributionError,
    CollectiveOwner,
    ModuleFqnFn,
    annotate_owners,
    clean_path,
    dynamo_parameter_inputs,
    module_fqn,
    parameter_owner,
    stack_module_fqn,
    with_parents,
)
from overlapcfg.graph.collectives import mark_saved_parameter_views, saved_parameter_views

__all__ = ["CapturedStep", "GraphBackend", "GraphCompiler", "GraphName", "GraphPass", "boxed_eager",
           "module_tree"]

GraphName: TypeAlias = Literal["forward", "backward"]
GraphPass: TypeAlias = Callable[[fx.GraphModule], fx.GraphModule]
"""A graph pass as the backend applies it: takes aot's graph module, returns the one to run."""
GraphCompiler: TypeAlias = Callable[[fx.GraphModule, Sequence[object]], Callable[..., object]]


def boxed_eager(gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
    """Run the graph as it is (aot's boxed calling convention)."""
    return compat.make_boxed_func(gm.forward)


def module_tree(dynamo_gm: fx.GraphModule, parameters: Sequence[str | None]) -> tuple[str, ...]:
    """Module FQNs a dynamo graph shows (parameter owners, module-stack entries, and all their parents): what plan
    patterns are matched against when the model itself is not given."""
    seen = [parameter_owner(p) for p in parameters if p]
    seen += [m for node in dynamo_gm.graph.nodes if (m := stack_module_fqn(node))]
    return with_parents(seen)


def model_facts(model: nn.Module) -> tuple[tuple[str, ...], frozenset[str]]:
    """``(module FQNs, parameter FQNs)`` of a real model, wrappers and parametrization internals removed."""
    modules = dict.fromkeys(f for name, _ in model.named_modules() if (f := clean_path(name) or ""))
    params = frozenset(clean_path(name) or name for name, _ in model.named_parameters(remove_duplicate=False))
    return tuple(modules), params


@dataclass(slots=True, repr=False)
class GraphBackend:
    """A ``torch.compile`` backend: aot_autograd + min-cut partitioner, attribution, an optional pass per graph.

    After the first forward/backward, ``graphs`` holds what each compiler ran (after the pass) and
    ``collectives`` the owners the descriptors gave, before the pass. ``compiler`` turns the final graph into a
    callable (boxed eager by default); ``bw_compiler`` replaces it for the backward (inductor compiles the two
    differently), and ``decompositions`` is handed to aot_autograd (inductor needs its own table at trace time).
    ``model``: when given, every attributed parameter must be one of its parameters (``AttributionError``
    otherwise) and plan patterns are matched against its ``named_modules()``.
    """

    fw_pass: GraphPass | None = None
    bw_pass: GraphPass | None = None
    compiler: GraphCompiler = boxed_eager
    bw_compiler: GraphCompiler | None = None
    decompositions: Mapping[object, Callable[..., object]] | None = None
    capture_joint: bool = False
    """Also keep a copy of aot's joint forward+backward graph (before partitioning) in ``graphs["joint"]``."""
    model: nn.Module | None = None
    graphs: dict[str, fx.GraphModule] = field(default_factory=dict)
    collectives: dict[str, tuple[CollectiveOwner, ...]] = field(default_factory=dict)
    param_inputs: tuple[str | None, ...] = ()
    module_fqns: tuple[str, ...] = ()
    """What the last compiled region's plan patterns are matched against."""

    def __repr__(self) -> str:
        """Names and counts only. ``torch.compile`` calls ``str(backend)`` when it wraps it, and a model's repr
        runs every ``extra_repr``, which reads parametrized parameters: under SimpleFSDP or torchtitan's
        ``data_parallel`` that is one all-gather per read, issued on some ranks (the ones that log) and never
        waited. So nothing here touches the model, its parameters or the captured graphs' tensors."""
        model = type(self.model).__name__ if self.model is not None else None
        graphs = ", ".join(f"{name}: {len(gm.graph.nodes)} nodes" for name, gm in self.graphs.items())
        return (f"GraphBackend(model={model}, compiler={_name(self.compiler)}, "
                f"bw_compiler={_name(self.bw_compiler)}, passes={self.fw_pass is not None}/{self.bw_pass is not None},"
                f" graphs={{{graphs}}})")

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
        self.param_inputs = dynamo_parameter_inputs(gm)
        if self.model is not None:
            modules, params = model_facts(self.model)
            unknown = [p for p in self.param_inputs if p and p not in params]
            if unknown:
                raise AttributionError(f"overlapcfg backend: dynamo's inputs name parameters the model does not "
                                       f"have ({', '.join(unknown[:4])}); pass module_fqn_fn= or check model=")
            self.module_fqns = modules
        else:
            self.module_fqns = module_tree(gm, self.param_inputs)
        extra = {"decompositions": self.decompositions} if self.decompositions is not None else {}
        # Per compiled region: with graph breaks, aot compiles a region's backward lazily, after later regions'
        # forwards, so what a forward saved must travel with its own region.
        saved_views: dict[str, object] = {}
        return compat.aot_autograd(
            fw_compiler=self._graph_compiler("forward", self.fw_pass, self.compiler, saved_views),
            bw_compiler=self._graph_compiler("backward", self.bw_pass, self.bw_compiler or self.compiler,
                                             saved_views),
            partition_fn=self._partition,
            **extra,
        )(gm, example_inputs)

    def _partition(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: object) -> object:
        if self.capture_joint:
            self.graphs["joint"] = copy.deepcopy(joint)
        return compat.min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def _graph_compiler(self, name: GraphName, graph_pass: GraphPass | None, compiler: GraphCompiler,
                        saved_views: dict[str, object]) -> GraphCompiler:
        def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
            # A backward that re-gathers forward-saved views of parameters (FSDP + TP with reshard-after-forward)
            # needs the forward to know they are parameters: aot gives the saved placeholders no descriptor.
            if name == "forward":
                saved_views.clear()
                saved_views.update(saved_parameter_views(gm))
            else:
                mark_saved_parameter_views(gm, saved_views)
            self.collectives[name] = annotate_owners(gm, name, self.param_inputs)
            if graph_pass is not None:
                gm = graph_pass(gm)
                if not isinstance(gm, fx.GraphModule):
                    raise TypeError(f"{name} pass returned {type(gm).__name__}, expected a GraphModule")
            self.graphs[name] = gm
            return compiler(gm, example_inputs)

        return compile_graph


def _name(fn: object) -> str | None:
    return None if fn is None else getattr(fn, "__qualname__", type(fn).__name__)


@dataclass(frozen=True, slots=True)
class CapturedStep:
    """The forward and backward graphs of one training step plus the model facts plan resolution needs."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    module_fqns: tuple[str, ...]
    """Every module FQN in model order (root, wrappers and parametrization internals excluded)."""
    param_fqns: tuple[str, ...]
    """FSDP-sharded parameters, user FQNs, model order."""
    param_owners: tuple[str, ...]
    """Module FQNs that own FSDP parameters, model order."""
    collectives: tuple[CollectiveOwner, ...]
    """Every attributed FSDP collective: forward graph first, then backward, each in graph order."""
    world_size: int
    rank: int

    def graph(self, name: GraphName) -> fx.GraphModule:
        return self.forward if name == "forward" else self.backward

    def process_groups(self) -> AbstractContextManager[object]:
        """A context in which the process groups the graphs name exist (merging resolves groups by name): a fake
        default group of the traced size and rank. A step traced on a device mesh rebuilds its sub-groups too
        (``overlapcfg.demo.tracing.TracedStep``)."""
        return compat.fake_process_group(self.world_size, self.rank)

    def collectives_in(self, graph: GraphName, kind: str | None = None) -> tuple[CollectiveOwner, ...]:
        return tuple(c for c in self.collectives if c.graph == graph and (kind is None or c.kind == kind))

    def module_fqn_fn(self, graph: GraphName) -> ModuleFqnFn:
        """Attribution for nodes of ``graph``: the recorded owners for collective starts and waits (by node name,
        so it also works on a copy of the graph), the default evidence order for everything else."""
        by_name: dict[str, str] = {}
        for rec in self.collectives_in(graph):
            by_name[rec.node] = by_name[rec.wait] = rec.module_fqn

        def lookup(node: fx.Node) -> str | None:
            return by_name.get(node.name) or module_fqn(node)

        return lookup


__all__ += ["model_facts"]
