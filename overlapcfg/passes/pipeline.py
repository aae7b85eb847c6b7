"""``apply(gm, cfg)``: the graph pass. find collectives → attribute to buckets → strategy → verify → recompile.

Guarantees:

- **Nothing half-applied.** Nothing is changed until the plan has resolved against the graph; the strategy then
  runs on the graph with a copy kept aside, and any failure (the strategy's, or verification's) puts the copy
  back before the error propagates.
- **Proof by default.** ``cfg.verify`` (default true) checks the rewritten graph against the original
  (``overlapcfg.graph.verify``).
- **No silent no-ops.** A graph with no FSDP collective, or one whose FSDP collectives land in no bucket, is
  logged at WARNING once per cause with the likely reason and the fix; ``cfg.strict`` makes it an error.
- **No re-bucketing.** A graph whose FSDP collectives were already merged (by this pass or by torch's) is
  refused with ``UnsupportedGraphError``: apply each config to a fresh copy of the traced graph.

The pass records what it did on ``gm.meta["overlapcfg"]`` (``overlapcfg.graph.record.PassRecord``).

Two parts: ``_rewrite`` is the pass on the config as a value (graph, plan, policy and what the caller knows about
the graph in; what it did out), raising a config's faults relative to it (``plan.buckets[1]``) and leaving its notes
to ``overlapcfg.passes.notes``. ``apply`` is the entry point: it runs ``_rewrite`` inside
``overlapcfg.config.boundary.user_paths`` and words the notes, so faults and notes name settings where the user put
the config, then records.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from torch import fx

from overlapcfg import compat
from overlapcfg.config import OverlapConfig
from overlapcfg.config.boundary import RelativeConfigError, user_paths
from overlapcfg.errors import Fault, OverlapUsageError, UnsupportedGraphError
from overlapcfg.graph.attribution import ModuleFqnFn, module_fqn
from overlapcfg.graph.collectives import (
    Collective,
    find_collectives,
    partial_gradients,
)
from overlapcfg.graph.fingerprint import graph_schedule
from overlapcfg.graph.merge import MergedCollective, attribute, fold_repeated_waits
from overlapcfg.graph.meta import is_merged
from overlapcfg.graph.record import DepthDecision, ScheduleFingerprint
from overlapcfg.graph.summary import GraphSummary, summarize
from overlapcfg.graph.verify import verify
from overlapcfg.kinds import Direction
from overlapcfg.module_paths import ModelFacts, with_parents
from overlapcfg.passes.gc_paused import cyclic_gc_paused
from overlapcfg.passes.keep_unsharded import KeepResult, keep_unsharded
from overlapcfg.passes.notes import (
    LOOK_LIKE,
    Note,
    held_partials,
    left_alone_chains,
    pass_notes,
    unattributed,
    unbucketed_all_reduces,
)
from overlapcfg.passes.recorded import build_record
from overlapcfg.resolve import ResolvedPlan, resolve_config
from overlapcfg.strategies import PassContext, get_strategy

__all__ = ["GraphKind", "PassOptions", "apply"]

logger = logging.getLogger(__name__)

GraphKind: TypeAlias = Literal["forward", "backward", "joint", "auto"]

_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("%s", message)


def _model_fqns(graph: fx.Graph, fn: ModuleFqnFn, owners: Sequence[str]) -> tuple[str, ...]:
    """Module FQNs visible in the graph (and all their parents): what patterns match against."""
    return with_parents([*(m for n in graph.nodes if n.op == "call_function" and (m := fn(n))), *owners])


def _forced_direction(kind: GraphKind) -> Direction | None:
    return kind if kind in ("forward", "backward") else None


def _already_merged(fsdp: Sequence[Collective]) -> list[str]:
    return [c.start.name for c in fsdp if is_merged(c.start) or len(c.params) > 1]


@dataclass(frozen=True, slots=True)
class PassOptions:
    """What only some callers of ``apply`` need, kept off its signature: evidence a tracer has, what a compiler
    after the pass needs, and work a caller has already done. The defaults suit a graph you inspect or run as it
    is."""

    state_inputs: Mapping[str, str] | None = None
    """``{placeholder name: parameter FQN}`` for the inputs the tracer fed from the model's state
    (``overlapcfg.graph.parameters.state_input_names``): further evidence; an input it does not name is never a
    parameter, and the record names parameters by these FQNs (torchtitan's graph trainer gives it)."""
    for_compiler: bool = False
    """The graph goes on to a compiler that reads fake-tensor metadata (inductor), so every new node gets its own
    ``meta["val"]`` (``backend(compiler="inductor")`` and ``inductor_pass`` set it)."""
    strict: bool | None = None
    """Overrides ``cfg.strict`` (nothing reaching a bucket, or an FSDP-shaped all-gather nobody can attribute, is
    an error instead of a warning), for code that builds configs elsewhere (``backend(strict=...)``)."""
    summary: GraphSummary | None = None
    """``overlapcfg.graph.summary.summarize(gm, direction=...)`` of ``gm`` as given (or of a graph it is a copy
    of), where the caller already has it: verification then compares against it instead of interpreting ``gm``
    again (``apply_step`` takes it once per captured graph for every config). Ignored with ``verify: false``."""
    recompile: bool = True
    """False: leave regenerating ``gm``'s Python code to the caller, who must do it before anything runs or reads
    ``gm.code``. Only for callers that regenerate it anyway: inductor's post-grad passes end with
    ``gm.recompile()``, so its hook (``inductor_pass``) would otherwise pay that codegen twice (about a third of a
    second for a 12k-node backward). A graph left as it was (failure, nothing to do) needs no new code either way."""


def apply(
    gm: fx.GraphModule,
    cfg: OverlapConfig,
    *,
    graph_kind: GraphKind = "auto",
    module_fqns: Sequence[str] | None = None,
    module_fqn_fn: ModuleFqnFn | None = None,
    options: PassOptions | None = None,
) -> fx.GraphModule:
    """Bucket and schedule the FSDP collectives of ``gm`` as ``cfg`` says; returns ``gm`` (modified in place).

    ``cfg``: a validated config (``overlapcfg.load_config`` turns YAML, dicts and Hydra nodes into one); its faults
    name the paths where the user put it (``trainer.overlap.plan.buckets[1]: ...``: ``cfg.mount``, which
    ``load_config(..., root=...)`` and ``from_hydra`` set). ``graph_kind``: ``forward``/``backward`` for
    aot_autograd's separate graphs; ``joint`` for a whole-step graph (forward, loss, backward and perhaps the
    optimizer in one: torchtitan graph_trainer's ``make_fx`` trace), whose direction is read per node from
    ``autograd_backward`` (recomputed forward ops are the backward's); ``auto`` reads each node's metadata likewise.
    ``module_fqns``: the model's module FQNs for pattern matching (default: those seen in the graph).
    ``module_fqn_fn``: ``fn(node) -> FQN or None``, the module a node belongs to; by default the evidence order of
    ``overlapcfg.graph.attribution`` (aot descriptors as annotated by the backend, ``meta["custom"]``, module stacks
    of any dynamo root). ``options``: what only some callers need (``overlapcfg.passes.PassOptions``: a tracer's
    ``state_inputs``, ``for_compiler``, ``strict``, a ``summary`` taken already, ``recompile``).
    """
    if not isinstance(cfg, OverlapConfig):
        raise OverlapUsageError(f"apply takes a validated OverlapConfig, got {type(cfg).__name__}; build one with "
                                "overlapcfg.load_config(...) (it reads dicts, YAML text, files and Hydra nodes)")
    started = time.perf_counter()
    options = options or PassOptions()
    if options.strict is not None and options.strict != cfg.strict:
        cfg = cfg.model_copy(update={"strict": options.strict})
    with user_paths(cfg.mount):  # the one place this pass's faults learn where the user put the config
        done = _rewrite(gm, cfg, graph_kind, module_fqns, module_fqn_fn or module_fqn, options)
    record = build_record(gm, cfg, graph_kind, done.plan, done.before, done.after, done.covered, done.merged,
                          done.decisions, started, cfg.mount.notes(done.notes),
                          strategy_uses_plan=done.strategy_uses_plan, kept=done.kept, schedule=done.schedule)
    if not done.nothing_to_do:
        logger.info("overlapcfg[%s]: %d -> %d FSDP collectives in %d buckets, %.3fs", cfg.strategy,
                    record.before.total_fsdp, record.after.total_fsdp, len(done.plan.buckets), record.seconds)
    return gm


@dataclass(frozen=True, slots=True)
class _Rewritten:
    """What the pass did to a graph, for its record: the collectives before and after, the plan they were
    attributed to, the merges and decisions of the strategy, and the record's notes (``overlapcfg.passes.notes``)."""

    plan: ResolvedPlan
    before: Sequence[Collective]
    after: Sequence[Collective]
    covered: Sequence[tuple[int, Collective]] = ()
    merged: Sequence[MergedCollective] = ()
    decisions: Sequence[DepthDecision] = ()
    kept: KeepResult = field(default_factory=KeepResult)
    notes: tuple[Note, ...] = ()
    strategy_uses_plan: bool = True
    nothing_to_do: bool = False
    """No FSDP collective in the graph: it was left as it was."""
    schedule: ScheduleFingerprint | None = None
    """The collectives the final graph issues, as the same-schedule check compares them across ranks."""


def _rewrite(gm: fx.GraphModule, cfg: OverlapConfig, graph_kind: GraphKind, module_fqns: Sequence[str] | None,
             fn: ModuleFqnFn, options: PassOptions) -> _Rewritten:
    """The pass on ``gm`` for ``cfg`` as a value: every fault it raises about the config is a
    ``RelativeConfigError`` (paths from the config node); where the user put the config is ``apply``'s to say."""
    forced = _forced_direction(graph_kind)
    collectives = find_collectives(gm.graph, fn, direction=forced, state_inputs=options.state_inputs)
    fsdp = [c for c in collectives if c.fsdp]
    strategy = get_strategy(cfg.strategy)
    _warn_each(unattributed(collectives), (f"overlapcfg: {n}" for n in left_alone_chains(collectives)))
    if not fsdp:
        _no_fsdp_collectives(gm, cfg, collectives)
        return _Rewritten(ResolvedPlan(()), collectives, collectives,
                          notes=pass_notes(cfg, strategy, collectives, nothing_to_do=True),
                          strategy_uses_plan=strategy.uses_plan, nothing_to_do=True,
                          schedule=graph_schedule(_schedule_label(graph_kind, collectives), collectives))

    owners = list(dict.fromkeys(c.module_fqn for c in fsdp if c.module_fqn))
    plan = ResolvedPlan(())
    if strategy.uses_plan and cfg.plan is not None:
        fqns = tuple(module_fqns) if module_fqns is not None else _model_fqns(gm.graph, fn, owners)
        plan = resolve_config(cfg, ModelFacts(fqns, tuple(owners)))
        _check_attributed(collectives, cfg)
        merged_before = _already_merged(fsdp)
        if merged_before and plan.buckets:
            raise UnsupportedGraphError(
                f"overlapcfg.apply: {len(merged_before)} FSDP collectives of this graph are already bucketed "
                f"({', '.join(merged_before[:4])}{' ...' if len(merged_before) > 4 else ''}); re-bucketing merged "
                "collectives is not supported. Apply each config to a fresh copy of the traced graph "
                "(copy.deepcopy before the first apply), or use strategy 'none' to only read it")
    covered, uncovered = attribute(collectives, plan)
    partials = partial_gradients(c for _, c in covered)  # read now: merging erases the sums' original waits
    if strategy.uses_plan and cfg.plan is not None and not covered:
        _nothing_covered(cfg, fsdp)
    if strategy.uses_plan and plan.buckets and cfg.strict:
        _refuse_unattributed(collectives)
    if covered and not compat.process_group_initialized():
        raise UnsupportedGraphError(
            "overlapcfg.apply: merging collectives needs the process group the graph was traced for (torch's merge "
            "helpers write this rank into the graph), and none is initialized. Run the pass where the graph is "
            "compiled (overlapcfg.backend does), inside torch.distributed.init_process_group, or for a graph "
            "inspected offline inside overlapcfg.compat.fake_process_group(world_size)")
    with cyclic_gc_paused():  # the rewrite and its proof; see overlapcfg.passes.gc_paused
        summary = None
        if cfg.verify:
            summary = options.summary if options.summary is not None else summarize(gm, direction=forced)
        backup = _Backup(gm)
        kept = KeepResult()
        try:
            now, scheduled, left = collectives, covered, uncovered
            if strategy.uses_plan and plan.buckets:
                kept = keep_unsharded(gm, cfg, plan, covered, forced=forced)
            if kept.removed:  # the strategy schedules what is left; the record counts from the original graph
                now = find_collectives(gm.graph, fn, direction=forced, state_inputs=options.state_inputs)
                scheduled, left = attribute(now, plan)
            folded = [c.start.name for _, c in scheduled if strategy.uses_plan and fold_repeated_waits(gm.graph, c)]
            ctx = PassContext(plan, cfg.policy, tuple(now), tuple(scheduled), tuple(left), forced, fn,
                              fresh_fake_values=options.for_compiler)
            result = strategy.run(gm, ctx)
            if summary is None:
                gm.graph.lint()
            else:  # verification lints first, and reports a lint failure with the rest
                verify(summary, gm, direction=forced, pass_name=f"overlapcfg[{cfg.strategy}]",
                       reused_regathers=kept.removed)
        except BaseException:
            backup.restore(gm)  # nothing half-applied: the caller gets the graph it gave us
            raise
        if options.recompile:
            gm.recompile()
    after = find_collectives(gm.graph, fn, direction=forced, state_inputs=options.state_inputs)
    all_reduces = unbucketed_all_reduces(cfg, covered, result.merged, after)
    _warn_each(all_reduces)
    notes = pass_notes(cfg, strategy, collectives, unkept=kept.unkept, folded=folded, strategy_notes=result.notes,
                       held=held_partials(partials, plan, result.merged), all_reduces=all_reduces)
    schedule = graph_schedule(_schedule_label(graph_kind, collectives), after,
                              buckets=[b.name for b in plan.buckets],
                              sources={c.start.name: c for _, c in (*covered, *scheduled)})
    return _Rewritten(plan, collectives, after, covered, result.merged, result.decisions, kept, notes,
                      strategy.uses_plan, schedule=schedule)


def _schedule_label(kind: GraphKind, collectives: Sequence[Collective]) -> str:
    """What the schedule fingerprint calls the graph: its kind where the caller said, else (inductor's hook) the
    direction of its collectives: ``forward``, ``backward``, ``joint`` for both, ``graph`` for none."""
    if kind != "auto":
        return kind
    directions = tuple(dict.fromkeys(c.direction for c in collectives))
    if len(directions) == 1:
        return directions[0]
    return "joint" if directions else "graph"


class _Backup:
    """What a strategy may change on a ``GraphModule`` besides its nodes, kept to put back if it fails: the graph
    (a snapshot, rebuilt as a copy only on failure, output node metadata included), the submodules and buffers it
    registers (``insert_overlap_deps`` adds ``subgraph_*`` modules) and ``gm.meta``.

    Why a snapshot and not a copy: copying a 12k-node graph up front cost as much as verifying it, on every
    successful pass, to serve only the failing ones."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.graph = compat.GraphSnapshot(gm.graph)
        self.children = {name for name, _ in gm.named_children()}
        self.buffers = {name for name, _ in gm.named_buffers(recurse=False)}
        self.parameters = {name for name, _ in gm.named_parameters(recurse=False)}
        self.meta = dict(gm.meta)

    def restore(self, gm: fx.GraphModule) -> None:
        added = [name for name, _ in gm.named_children() if name not in self.children]
        added += [name for name, _ in gm.named_buffers(recurse=False) if name not in self.buffers]
        added += [name for name, _ in gm.named_parameters(recurse=False) if name not in self.parameters]
        for name in added:
            delattr(gm, name)
        gm.graph = self.graph.rebuild()
        gm.meta.clear()
        gm.meta.update(self.meta)
        gm.recompile()


def _warn_each(*messages: Iterable[str]) -> None:
    for group in messages:
        for message in group:
            _warn_once(message)


def _refuse_unattributed(collectives: Sequence[Collective]) -> None:
    found = unattributed(collectives)
    if found:
        raise UnsupportedGraphError(f"{found[0]} (overlap.strict is set)")


def _no_fsdp_collectives(gm: fx.GraphModule, cfg: OverlapConfig, collectives: Sequence[Collective]) -> None:
    others = Counter(c.kind for c in collectives)
    seen = ", ".join(f"{n} {k}" for k, n in sorted(others.items())) or "no collectives at all"
    message = (f"overlapcfg[{cfg.strategy}]: no FSDP parameter all-gather or gradient reduce-scatter in this graph "
               f"({len(gm.graph.nodes)} nodes; {seen}); the graph is returned unchanged. If the model is sharded "
               "with FSDP2 (fully_shard), its collectives run eagerly in FSDP2's hooks, outside the compiled "
               "graph: this pass cannot reach them; overlapcfg.fully_shard(model, cfg) applies the same config through "
               "FSDP2 instead. SimpleFSDP-style sharding (parametrizations with functional collectives, e.g. "
               "torchtitan's simple_fsdp) puts them in the graph.")
    if cfg.strict and cfg.strategy != "none":
        raise UnsupportedGraphError(message + " (overlap.strict is set)")
    if cfg.strategy != "none":
        _warn_once(message)


def _check_attributed(collectives: Sequence[Collective], cfg: OverlapConfig) -> None:
    """With ``require_full_coverage``, a collective nobody can attribute is a coverage fault, not a silent skip:
    an FSDP collective without an owning module, an FSDP-shaped all-gather whose inputs the graph cannot confirm as
    parameters, or a reduce-scatter on an FSDP group whose result ends nowhere overlapcfg recognizes."""
    if cfg.plan is None or not cfg.plan.require_full_coverage:
        return
    faults = []
    unknown = [c.start.name for c in collectives if c.fsdp and c.module_fqn is None]
    if unknown:
        faults.append(Fault(
            "plan.require_full_coverage",
            f"{len(unknown)} FSDP collective(s) cannot be attributed to a module ({', '.join(unknown[:6])}"
            f"{' ...' if len(unknown) > 6 else ''}): the graph has no aot descriptors, meta['custom']"
            "['module_fqn'] or module stacks for them; pass module_fqn_fn= to apply"))
    for kind, (plural, what) in LOOK_LIKE.items():
        undecided = [c for c in collectives if c.unattributed and c.kind == kind]
        if undecided:
            names = [c.start.name for c in undecided]
            faults.append(Fault(
                "plan.require_full_coverage",
                f"{len(undecided)} {plural[:-1]}(s) look like {what} ({', '.join(names[:6])}"
                f"{' ...' if len(names) > 6 else ''}) but cannot be attributed: "
                f"{'; '.join(dict.fromkeys(c.unattributed for c in undecided if c.unattributed))}"))
    if faults:
        raise RelativeConfigError(faults, header="the bucket plan does not fit the model")


def _nothing_covered(cfg: OverlapConfig, fsdp: Sequence[Collective]) -> None:
    owners = list(dict.fromkeys(c.module_fqn or "?" for c in fsdp))
    shown = ", ".join(owners[:5]) + (f" ... ({len(owners)} in all)" if len(owners) > 5 else "")
    message = (f"overlapcfg[{cfg.strategy}]: the plan resolved but none of the graph's {len(fsdp)} FSDP collectives "
               f"lands in a bucket (their owners: {shown}); the graph is returned unchanged. Check the plan's "
               "patterns against these module names, or pass module_fqn_fn= if the attribution is wrong.")
    if not cfg.plan or not cfg.plan.buckets:
        return  # an empty plan asks for nothing: the record lists every collective as uncovered
    if cfg.strict:
        raise UnsupportedGraphError(message + " (overlap.strict is set)")
    _warn_once(message)
