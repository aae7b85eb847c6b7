"""A captured training step: what ``explain``, ``compare`` and ``tune`` take, and the process groups it needs.

A ``CapturedStep`` is the untransformed forward and backward graphs of one training step plus the model facts
plan resolution needs (module tree, FSDP parameters and their owners, who owns each collective). It is data: every
consumer applies configs to *copies* of its graphs, so one capture serves any number of configs. It is made by
``overlapcfg.capture_step`` (any model), by a compiled backend (``GraphBackend.step()``: what ``overlapcfg.backend``
compiled) and by the demo's tracer (``overlapcfg.demo.tracing.TracedStep``, which adds how the demo was built).

Applying a config needs the process groups the graphs name (torch's merge helpers resolve a group by name and
write this rank into the graph). ``CapturedStep.process_groups()`` provides them: inside a live job the job's own
groups (checked against the step: same world size, every named group registered), otherwise a fake default group
of the captured size (``ensure_process_group``). A fake group is only ever created where none exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist
from torch import fx

from overlapcfg import compat
from overlapcfg.errors import UnsupportedGraphError
from overlapcfg.graph.attribution import CollectiveOwner, ModuleFqnFn, module_fqn
from overlapcfg.graph.ops import group_name
from overlapcfg.kinds import DIRECTIONS, Direction
from overlapcfg.module_paths import ModelFacts

__all__ = ["CapturedStep", "ensure_process_group"]


@contextlib.contextmanager
def ensure_process_group(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """The default process group for the duration: the live one if a job initialized it (it must have
    ``world_size`` ranks), else a fake one of ``world_size`` ranks as rank ``rank``, destroyed on exit.

    The fake group (torch's communication-free ``fake`` backend) lets one CPU process trace and transform graphs
    with real collectives in them: shapes, dtypes and group names are those of a real run, values are not.
    """
    if compat.process_group_initialized():
        live = dist.get_world_size()
        if live != world_size:
            raise UnsupportedGraphError(
                f"this process's default process group has {live} ranks, but {world_size} were asked for; inside a "
                f"job, capture and explain at the job's size, or do it outside the job (a fake group of "
                f"{world_size} ranks is then opened)")
        group = dist.group.WORLD
        if group is None:
            raise AssertionError("ensure_process_group: torch.distributed is initialized but has no default group")
        yield group
        return
    with compat.fake_process_group(world_size, rank) as group:
        yield group


@dataclass(frozen=True, slots=True)
class CapturedStep:
    """The forward and backward graphs of one training step plus the model facts plan resolution needs.

    The graphs are as traced (no pass applied); treat them as read-only (every consumer deep-copies first).
    """

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
    """Ranks of the process group the step was captured in (the whole mesh for HSDP / TP)."""
    rank: int
    module_types: tuple[str, ...] = ()
    """The class name of each module of ``module_fqns`` (same order), where the capture saw the model; empty for a
    step built by hand. ``tune`` finds the repeated blocks of a model by it (a container of same-class blocks)."""
    mesh_groups: tuple[tuple[str, str], ...] = ()
    """``(mesh dimension, process-group name as the graphs state it)`` for each dimension that communicates, e.g.
    ``(("dp_shard", "5"), ("tp", "9"))``, where the step knows its device mesh; reports then name groups by
    dimension. Empty: unknown (groups are named by their process-group names alone)."""

    def graph(self, name: Direction) -> fx.GraphModule:
        return self.forward if name == "forward" else self.backward

    @property
    def facts(self) -> ModelFacts:
        """What plans are resolved against for this step (``overlapcfg.resolve.resolve_config``)."""
        return ModelFacts(self.module_fqns, self.param_owners, self.param_fqns, self.module_types)

    def group_names(self) -> tuple[str, ...]:
        """The process groups the step's FSDP collectives run on, as the graphs name them (first use order)."""
        names: dict[str, None] = {}
        for name in DIRECTIONS:
            starts = {rec.node for rec in self.collectives_in(name)}
            if not starts:
                continue
            for node in self.graph(name).graph.nodes:
                if node.name in starts:
                    names.setdefault(group_name(node))
        return tuple(names)

    @contextlib.contextmanager
    def process_groups(self) -> Iterator[object]:
        """A context in which the process groups the graphs name exist (merging resolves groups by name): the live
        job's groups if a default group is initialized (checked: same world size, every named group registered),
        else a fake default group of the captured size and rank. A step captured on a device mesh names
        sub-groups a fresh fake group does not have: explain it inside the groups it was captured under (the demo's
        ``TracedStep`` rebuilds its own mesh)."""
        with ensure_process_group(self.world_size, self.rank) as group:
            missing = [n for n in self.group_names() if compat.registered_group_size(n) is None]
            if missing:
                raise UnsupportedGraphError(
                    f"this step's FSDP collectives run on process group(s) {', '.join(map(repr, missing))}, which do "
                    "not exist here (a device mesh's sub-groups); transform it inside the process groups it was "
                    "captured under (in the same job, or the same fake_process_group after building the mesh)")
            yield group

    def collectives_in(self, graph: Direction, kind: str | None = None) -> tuple[CollectiveOwner, ...]:
        return tuple(c for c in self.collectives if c.graph == graph and (kind is None or c.kind == kind))

    def module_fqn_fn(self, graph: Direction) -> ModuleFqnFn:
        """Attribution for nodes of ``graph``: the recorded owners for collective starts and waits (by node name,
        so it also works on a copy of the graph), the default evidence order for everything else."""
        by_name: dict[str, str] = {}
        for rec in self.collectives_in(graph):
            by_name[rec.node] = by_name[rec.wait] = rec.module_fqn

        def lookup(node: fx.Node) -> str | None:
            return by_name.get(node.name) or module_fqn(node)

        return lookup

    def __repr__(self) -> str:
        """One line: the graphs are thousands of nodes, and printing them is never what was meant."""
        return (f"{type(self).__name__}({len(self.param_fqns)} FSDP parameters in {len(self.param_owners)} modules, "
                f"{len(self.collectives)} FSDP collectives, {len(self.forward.graph.nodes)} forward / "
                f"{len(self.backward.graph.nodes)} backward nodes, world size {self.world_size}, rank {self.rank})")

