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

A pass that raises ``SameScheduleError`` (the ranks would issue different collectives: ``backend(cfg)``'s check,
``overlapcfg.graph.same_schedule``) does not fail the compile: the graph is not lowered, and its first run raises the
error. So every rank raises it as itself, where the step runs, instead of as dynamo's ``BackendCompilerFailed``
(dynamo wraps whatever a backend raises while compiling).

Each compiled graph runs inside a profiler range ``overlapcfg.graph::<id>/<graph>`` and, while a profiler records,
leaves its collectives and buckets in the trace (``overlapcfg.passes.trace_label``), so ``overlapcfg.diagnose``
can attribute them from the trace alone.

``GraphBackend`` keeps what it compiled (``graphs``, after the pass), what it was given (``captured``, before the
pass) and who owns each collective (``collectives``); ``GraphBackend.step()`` is that capture as the
``CapturedStep`` ``explain``, ``compare`` and ``tune`` take (``overlapcfg.capture_step`` is built on it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch.distributed as dist
from torch import fx, nn

from overlapcfg import compat
from overlapcfg.errors import AttributionError, OverlapStateError, OverlapUsageError, SameScheduleError
from overlapcfg.graph.attribution import (
    CollectiveOwner,
    annotate_owners,
    dynamo_parameter_inputs,
    stack_module_fqn,
)
from overlapcfg.graph.parameters import mark_saved_parameter_views, saved_parameter_views
from overlapcfg.kinds import Direction
from overlapcfg.module_paths import ModelFacts, parameter_owner, with_parents
from overlapcfg.passes.step import CapturedStep
from overlapcfg.passes.trace_label import labelled

__all__ = ["CapturedStep", "GraphBackend", "GraphCompiler", "Direction", "GraphPass", "boxed_eager",
           "modules_seen"]
GraphPass: TypeAlias = Callable[[fx.GraphModule], fx.GraphModule]
"""A graph pass as the backend applies it: takes aot's graph module, returns the one to run."""
GraphCompiler: TypeAlias = Callable[[fx.GraphModule, Sequence[object]], Callable[..., object]]


def boxed_eager(gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
    """Run the graph as it is (aot's boxed calling convention)."""
    return compat.make_boxed_func(gm.forward)


def modules_seen(dynamo_gm: fx.GraphModule, parameters: Sequence[str | None]) -> tuple[str, ...]:
    """Module FQNs a dynamo graph shows (parameter owners, module-stack entries, and all their parents): what plan
    patterns are matched against when the model itself is not given (``ModelFacts.of(model)`` when it is)."""
    seen = [parameter_owner(p) for p in parameters if p]
    seen += [m for node in dynamo_gm.graph.nodes if (m := stack_module_fqn(node))]
    return with_parents(seen)


@dataclass(slots=True)
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
    captured: dict[str, fx.GraphModule] = field(default_factory=dict)
    """The forward and backward graphs as aot handed them over, before the pass (copies where a pass runs)."""
    collectives: dict[str, tuple[CollectiveOwner, ...]] = field(default_factory=dict)
    param_inputs: tuple[str | None, ...] = ()
    module_fqns: tuple[str, ...] = ()
    """What the last compiled region's plan patterns are matched against."""
    regions: int = 0
    """Compiled regions so far (dynamo calls the backend once per region: graph breaks and recompiles add some)."""
    world: tuple[int, int] | None = None
    """``(world size, rank)`` of the default process group when the last region was compiled."""

    def __deepcopy__(self, memo: dict[int, object]) -> GraphBackend:
        """The backend itself: it is a handle on the graphs it collects, the model and its process groups, not a value.

        Lightning replaces ``torch.compile`` on import (``lightning.fabric.wrappers``) with a wrapper that deep-copies
        the keyword arguments of every ``torch.compile(module, ...)``; a copy would fail on the model's process groups
        (they do not pickle) and, were it to succeed, would collect graphs nobody reads.
        """
        return self

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., object]:
        self.regions += 1
        self.world = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else None
        self.param_inputs = dynamo_parameter_inputs(gm)
        if self.model is not None:
            facts = ModelFacts.of(self.model)
            params = set(facts.params)
            unknown = [p for p in self.param_inputs if p and p not in params]
            if unknown:
                raise AttributionError(f"overlapcfg backend: dynamo's inputs name parameters the model does not "
                                       f"have ({', '.join(unknown[:4])}); pass module_fqn_fn= or check model=")
            self.module_fqns = facts.modules
        else:
            self.module_fqns = modules_seen(gm, self.param_inputs)
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

    def _partition(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> object:
        if self.capture_joint:
            self.graphs["joint"] = copy.deepcopy(joint)
        return compat.min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def _graph_compiler(self, name: Direction, graph_pass: GraphPass | None, compiler: GraphCompiler,
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
            # A lazy copy: it is read and copied again (``step()``), rarely run, so its code is generated only then.
            self.captured[name] = compat.lazy_graph_module_copy(gm) if graph_pass is not None else gm
            if graph_pass is not None:
                try:
                    gm = graph_pass(gm)
                except SameScheduleError as err:  # see the module docstring
                    self.graphs[name] = gm
                    return _raises(err)
                if not isinstance(gm, fx.GraphModule):
                    raise OverlapUsageError(f"{name} pass returned {type(gm).__name__}, expected a GraphModule")
            self.graphs[name] = gm
            return labelled(compiler(gm, example_inputs), gm, name)

        return compile_graph

    def step(self) -> CapturedStep:
        """What this backend compiled, before any pass, as the ``CapturedStep`` ``explain``, ``compare`` and
        ``tune`` take. Needs exactly one compiled region (``torch.compile(..., fullgraph=True)``, one input shape)
        whose forward and backward both ran."""
        missing = [name for name in ("forward", "backward") if name not in self.captured]
        if self.regions != 1 or missing:
            why = (f"{self.regions} regions were compiled (graph breaks or recompiles); a step is one region: compile "
                   "with fullgraph=True and one input shape" if self.regions > 1 else
                   f"no {' or '.join(missing)} graph was compiled yet: run one forward and backward first")
            raise OverlapStateError(f"GraphBackend.step: {why}")
        if self.world is None:
            raise OverlapStateError(
                "GraphBackend.step: no process group existed when the step was compiled, so it has no "
                "FSDP collectives to bucket")
        collectives = self.collectives["forward"] + self.collectives["backward"]
        attributed = dict.fromkeys(c.param_fqn for c in collectives)
        facts = ModelFacts.of(self.model) if self.model is not None else None
        order = facts.params if facts is not None else tuple(p for p in self.param_inputs if p)
        params = (*(p for p in order if p in attributed), *(p for p in attributed if p not in order))
        types = _types_of(facts, self.module_fqns) if facts is not None else ()
        return CapturedStep(
            forward=self.captured["forward"], backward=self.captured["backward"], module_fqns=self.module_fqns,
            param_fqns=params, param_owners=tuple(dict.fromkeys(parameter_owner(p) for p in params)),
            collectives=collectives, world_size=self.world[0], rank=self.world[1], module_types=types)

    def __repr__(self) -> str:
        """Short, and never touches the model: ``torch.compile`` calls ``str(backend)``, and a model's repr reads
        parametrized (sharded) weights, i.e. runs all-gathers."""
        passes = [n for n, p in (("forward", self.fw_pass), ("backward", self.bw_pass)) if p is not None]
        model = f", model={type(self.model).__name__}" if self.model is not None else ""
        return (f"GraphBackend(passes=[{', '.join(passes)}]{model}, compiled={sorted(self.graphs)}, "
                f"regions={self.regions})")


def _raises(err: BaseException) -> Callable[..., object]:
    """A compiled graph (aot's boxed calling convention) whose every run raises ``err``."""
    def run(*_: object) -> object:
        raise err

    return compat.make_boxed_func(run)


def _types_of(facts: ModelFacts, fqns: Sequence[str]) -> tuple[str, ...]:
    """The class name of each of ``fqns`` (the modules the last region matched plans against), "" where unknown."""
    types = dict(zip(facts.modules, facts.types, strict=True))
    return tuple(types.get(f, "") for f in fqns)
