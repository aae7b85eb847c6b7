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
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Literal, TypeAlias

from torch import fx

from overlapcfg import compat
from overlapcfg.config import OverlapConfig
from overlapcfg.errors import Fault, OverlapConfigError, OverlapUsageError, UnsupportedGraphError
from overlapcfg.graph.attribution import ModuleFqnFn, module_fqn
from overlapcfg.graph.collectives import (
    Collective,
    find_collectives,
    partial_gradients,
)
from overlapcfg.graph.merge import MergedCollective, attribute, fold_repeated_waits
from overlapcfg.graph.meta import is_merged
from overlapcfg.graph.summary import GraphSummary, summarize
from overlapcfg.graph.verify import verify
from overlapcfg.kinds import Direction
from overlapcfg.module_paths import ModelFacts, with_parents
from overlapcfg.passes.gc_paused import cyclic_gc_paused
from overlapcfg.passes.keep_unsharded import KeepResult, keep_unsharded
from overlapcfg.passes.notes import folded_waits, ignored_settings
from overlapcfg.passes.recorded import build_record
from overlapcfg.resolve import ResolvedPlan, resolve_config
from overlapcfg.strategies import PassContext, get_strategy

__all__ = ["GraphKind", "apply"]

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


def apply(
    gm: fx.GraphModule,
    cfg: OverlapConfig,
    *,
    module_fqn_fn: ModuleFqnFn | None = None,
    module_fqns: Sequence[str] | None = None,
    graph_kind: GraphKind = "auto",
    config_root: str | None = None,
    for_compiler: bool = False,
    strict: bool | None = None,
    state_inputs: Mapping[str, str] | None = None,
    summary: GraphSummary | None = None,
    recompile: bool = True,
) -> fx.GraphModule:
    """Bucket and schedule the FSDP collectives of ``gm`` as ``cfg`` says; returns ``gm`` (modified in place).

    ``cfg``: a validated config (``overlapcfg.load_config`` turns YAML, dicts and Hydra nodes into one).
    ``module_fqn_fn(node)`` names the module a node belongs to; by default the evidence order of
    ``overlapcfg.graph.attribution`` (aot descriptors as annotated by the backend, ``meta["custom"]``, module stacks
    of any dynamo root). ``module_fqns``: the model's module FQNs for pattern matching (default: those seen in the
    graph). ``graph_kind``: ``forward``/``backward`` for aot_autograd's separate graphs; ``joint`` for a whole-step
    graph (forward, loss, backward and perhaps the optimizer in one: torchtitan graph_trainer's ``make_fx`` trace),
    whose direction is read per node from ``autograd_backward`` (recomputed forward ops are the backward's);
    ``auto`` reads each node's metadata likewise. ``config_root``: where the config sits in the user's tree, so plan
    faults read ``trainer.overlap.plan.buckets[1]: ...`` (default: where ``load_config``/``from_hydra`` found it,
    ``cfg.config_root``). ``for_compiler=True``: the graph goes on to a compiler that reads fake-tensor metadata
    (inductor), so every new node gets its own ``meta["val"]``. ``strict``: overrides ``cfg.strict`` (nothing
    reaching a bucket, or an FSDP-shaped all-gather nobody can attribute, is an error instead of a warning).
    ``state_inputs``: ``{placeholder name: parameter FQN}`` for the inputs the tracer fed from the model's state
    (``overlapcfg.graph.parameters.state_input_names``): further evidence; an input it does not name is never a
    parameter, and the record names parameters by these FQNs. ``summary``: ``overlapcfg.graph.summary.summarize(gm,
    direction=...)`` of ``gm`` as given (or of a graph it is a copy of), where the caller already has it:
    verification then compares against it instead of interpreting ``gm`` again (``apply_step`` takes it once per
    captured graph for every config). Ignored with ``verify: false``. ``recompile=False``: leave regenerating
    ``gm``'s Python code to the caller, who must do it before anything runs or reads ``gm.code``. Only for callers
    that regenerate it anyway: inductor's post-grad passes end with ``gm.recompile()``, so its hook
    (``inductor_pass``) would otherwise pay that codegen twice (about a third of a second for a 12k-node backward).
    A graph left as it was (failure, nothing to do) needs no new code either way.
    """
    if not isinstance(cfg, OverlapConfig):
        raise OverlapUsageError(f"apply takes a validated OverlapConfig, got {type(cfg).__name__}; build one with "
                                "overlapcfg.load_config(...) (it reads dicts, YAML text, files and Hydra nodes)")
    started = time.perf_counter()
    config_root = config_root or cfg.config_root
    if strict is not None and strict != cfg.strict:
        cfg = cfg.model_copy(update={"strict": strict})
    fn = module_fqn_fn or module_fqn
    forced = _forced_direction(graph_kind)
    collectives = find_collectives(gm.graph, fn, direction=forced, state_inputs=state_inputs)
    fsdp = [c for c in collectives if c.fsdp]
    strategy = get_strategy(cfg.strategy)
    notes = (*ignored_settings(cfg, strategy, config_root), *_unattributed(collectives),
             *_left_alone_chains(collectives))
    if not fsdp:
        _no_fsdp_collectives(gm, cfg, collectives)
        build_record(gm, cfg, graph_kind, ResolvedPlan(()), collectives, collectives, (), (), (), started,
                     ("no FSDP collectives: nothing to do", *notes), strategy_uses_plan=strategy.uses_plan)
        return gm

    owners = list(dict.fromkeys(c.module_fqn for c in fsdp if c.module_fqn))
    plan = ResolvedPlan(())
    if strategy.uses_plan and cfg.plan is not None:
        fqns = tuple(module_fqns) if module_fqns is not None else _model_fqns(gm.graph, fn, owners)
        plan = resolve_config(cfg, ModelFacts(fqns, tuple(owners)), root=config_root)
        _check_attributed(collectives, cfg, config_root)
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
        _nothing_covered(cfg, fsdp, config_root)
    if strategy.uses_plan and plan.buckets and cfg.strict:
        _refuse_unattributed(collectives, cfg)
    if covered and not compat.process_group_initialized():
        raise UnsupportedGraphError(
            "overlapcfg.apply: merging collectives needs the process group the graph was traced for (torch's merge "
            "helpers write this rank into the graph), and none is initialized. Run the pass where the graph is "
            "compiled (overlapcfg.backend does), inside torch.distributed.init_process_group, or for a graph "
            "inspected offline inside overlapcfg.compat.fake_process_group(world_size)")
    with cyclic_gc_paused():  # the rewrite and its proof; see overlapcfg.passes.gc_paused
        if cfg.verify and summary is None:
            summary = summarize(gm, direction=forced)
        elif not cfg.verify:
            summary = None
        backup = _Backup(gm)
        kept = KeepResult()
        try:
            now, scheduled, left = collectives, covered, uncovered
            if strategy.uses_plan and plan.buckets:
                kept = keep_unsharded(gm, cfg, plan, covered, forced=forced, root=config_root)
            if kept.removed:  # the strategy schedules what is left; the record counts from the original graph
                now = find_collectives(gm.graph, fn, direction=forced, state_inputs=state_inputs)
                scheduled, left = attribute(now, plan)
            folded = [c.start.name for _, c in scheduled if strategy.uses_plan and fold_repeated_waits(gm.graph, c)]
            ctx = PassContext(plan, cfg.policy, tuple(now), tuple(scheduled), tuple(left), forced, fn,
                              fresh_fake_values=for_compiler, config_root=config_root)
            result = strategy.run(gm, ctx)
            if summary is None:
                gm.graph.lint()
            else:  # verification lints first, and reports a lint failure with the rest
                verify(summary, gm, direction=forced, pass_name=f"overlapcfg[{cfg.strategy}]",
                       reused_regathers=kept.removed)
        except BaseException:
            backup.restore(gm)  # nothing half-applied: the caller gets the graph it gave us
            raise
        if recompile:
            gm.recompile()
    after = find_collectives(gm.graph, fn, direction=forced, state_inputs=state_inputs)
    notes = (*notes, *kept.notes, *folded_waits(folded), *result.notes,
             *_held_partials(partials, plan, result.merged),
             *_unbucketed_all_reduces(cfg, covered, result.merged, after))
    record = build_record(gm, cfg, graph_kind, plan, collectives, after, covered, result.merged, result.decisions,
                     started, notes, strategy_uses_plan=strategy.uses_plan, kept=kept)
    logger.info("overlapcfg[%s]: %d -> %d FSDP collectives in %d buckets, %.3fs", cfg.strategy,
                record.before.total_fsdp, record.after.total_fsdp, len(plan.buckets), record.seconds)
    return gm


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


def _left_alone_chains(collectives: Sequence[Collective]) -> tuple[str, ...]:
    """Collectives shaped like data-parallel traffic that classification deliberately left alone, said once."""
    notes = tuple(dict.fromkeys(c.note for c in collectives if c.note))
    for note in notes:
        _warn_once(f"overlapcfg: {note}")
    return notes


_LOOK_LIKE = {"all_gather": ("all-gathers", "FSDP parameter gathers"),
              "reduce_scatter": ("reduce-scatters", "FSDP gradient reductions")}
"""How ``Collective.unattributed`` collectives of each kind are described."""


def _unattributed(collectives: Sequence[Collective]) -> tuple[str, ...]:
    """Collectives shaped like FSDP's that the graph's evidence cannot confirm (``Collective.unattributed``): left
    where they are, counted as uncovered, said loudly with the cause; one note per kind."""
    notes = []
    for kind, (plural, what) in _LOOK_LIKE.items():
        found = [c for c in collectives if c.unattributed and c.kind == kind]
        if not found:
            continue
        names = [c.start.name for c in found]
        shown = ", ".join(names[:4]) + (f" ... ({len(names)} in all)" if len(names) > 4 else "")
        causes = "; ".join(dict.fromkeys(c.unattributed for c in found if c.unattributed))
        message = (f"overlapcfg: {len(found)} {plural} look like {what} ({shown}) but are left unbucketed and "
                   f"counted as uncovered: {causes}")
        _warn_once(message)
        notes.append(message)
    return tuple(notes)


def _refuse_unattributed(collectives: Sequence[Collective], cfg: OverlapConfig) -> None:
    found = _unattributed(collectives)
    if found:
        raise UnsupportedGraphError(f"{found[0]} (overlap.strict is set)")


def _held_partials(gradients: Sequence[tuple[Collective, ...]], plan: ResolvedPlan,
                   merged: Sequence[MergedCollective]) -> tuple[str, ...]:
    """Per gradient summed from several reduce-scattered partials that one merged reduce-scatter now carries, what
    merging them costs: the partials (full size) all stay alive until the bucket's reduce-scatter, where alone each
    was reduce-scattered as soon as it was computed. The sums are as before, bit for bit (each element is reduced
    over the same ranks, and summed after in the traced order)."""
    merged_into = {source: m for m in merged if m.kind == "reduce_scatter" for source in m.sources}
    notes = []
    for partials in gradients:
        into = {id(merged_into[c.start.name]) for c in partials if c.start.name in merged_into}
        if len(into) != 1 or not all(c.start.name in merged_into for c in partials):
            continue  # not merged (an upstream strategy), or not together: nothing held longer than traced
        bucket = merged_into[partials[0].start.name].bucket
        held = sum(c.unsharded_bytes for c in partials)
        owner = partials[-1].module_fqn or "?"
        notes.append(f"bucket {plan.buckets[bucket].name!r}: {len(partials)} reduce-scatters are partial "
                     f"gradients of one parameter of {owner!r} (a shared parameter, or a module run "
                     f"{len(partials)} times a step, such as a chunked loss's head), summed after them as traced; "
                     f"merged, all {len(partials)} unsharded partials ({held:,} bytes) stay alive until the "
                     "bucket's reduce-scatter")
    return tuple(notes)


def _unbucketed_all_reduces(cfg: OverlapConfig, covered: Sequence[tuple[int, Collective]],
                            merged: Sequence[object], after: Sequence[Collective]) -> tuple[str, ...]:
    """A strategy that buckets HSDP all-reduces emits merged all-reduces; one that does not (upstream's before
    torch 2.14) leaves one per parameter on the replicate group's links: say so, loudly, rather than report a
    bucketed step. Strategies that return no merges (upstream's passes) are judged by the graph they left."""
    ars = [c for _, c in covered if c.role == "hsdp_all_reduce"]
    if not ars or any(getattr(m, "kind", None) == "all_reduce" for m in merged):
        return ()
    groups = {c.group for c in ars}
    if sum(1 for c in after if c.kind == "all_reduce" and c.group in groups) < len(ars):
        return ()  # fewer all-reduces on those groups than HSDP gradients: the strategy bucketed them
    shown = ", ".join(sorted(repr(g) for g in groups))
    message = (f"overlapcfg[{cfg.strategy}]: {len(ars)} HSDP gradient all-reduces (group {shown}) left unbucketed "
               "and unscheduled: this strategy does not handle them (upstream manual_overlap_bucketing skips "
               "all-reduces before torch 2.14); strategy 'manual' buckets them per bucket with all_reduce_delay")
    _warn_once(message)
    return (message,)


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


def _check_attributed(collectives: Sequence[Collective], cfg: OverlapConfig, root: str) -> None:
    """With ``require_full_coverage``, a collective nobody can attribute is a coverage fault, not a silent skip:
    an FSDP collective without an owning module, an FSDP-shaped all-gather whose inputs the graph cannot confirm as
    parameters, or a reduce-scatter on an FSDP group whose result ends nowhere overlapcfg recognizes."""
    if cfg.plan is None or not cfg.plan.require_full_coverage:
        return
    faults = []
    unknown = [c.start.name for c in collectives if c.fsdp and c.module_fqn is None]
    if unknown:
        faults.append(Fault(
            f"{root}.plan.require_full_coverage",
            f"{len(unknown)} FSDP collective(s) cannot be attributed to a module ({', '.join(unknown[:6])}"
            f"{' ...' if len(unknown) > 6 else ''}): the graph has no aot descriptors, meta['custom']"
            "['module_fqn'] or module stacks for them; pass module_fqn_fn= to apply"))
    for kind, (plural, what) in _LOOK_LIKE.items():
        undecided = [c for c in collectives if c.unattributed and c.kind == kind]
        if undecided:
            names = [c.start.name for c in undecided]
            faults.append(Fault(
                f"{root}.plan.require_full_coverage",
                f"{len(undecided)} {plural[:-1]}(s) look like {what} ({', '.join(names[:6])}"
                f"{' ...' if len(names) > 6 else ''}) but cannot be attributed: "
                f"{'; '.join(dict.fromkeys(c.unattributed for c in undecided if c.unattributed))}"))
    if faults:
        raise OverlapConfigError(faults, header="the bucket plan does not fit the model")


def _nothing_covered(cfg: OverlapConfig, fsdp: Sequence[Collective], root: str) -> None:
    owners = list(dict.fromkeys(c.module_fqn or "?" for c in fsdp))
    shown = ", ".join(owners[:5]) + (f" ... ({len(owners)} in all)" if len(owners) > 5 else "")
    message = (f"overlapcfg[{cfg.strategy}]: the plan resolved but none of the graph's {len(fsdp)} FSDP collectives "
               f"lands in a bucket (their owners: {shown}); the graph is returned unchanged. Check {root}.plan "
               "against these module names, or pass module_fqn_fn= if the attribution is wrong.")
    if not cfg.plan or not cfg.plan.buckets:
        return  # an empty plan asks for nothing: the record lists every collective as uncovered
    if cfg.strict:
        raise UnsupportedGraphError(message + " (overlap.strict is set)")
    _warn_once(message)
