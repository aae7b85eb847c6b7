"""The ``overlapcfg`` pass pipeline for torchtitan's graph trainer, and the checks its trainer runs first.

torchtitan 0.3 (``experiments/graph_trainer``), ``compile.mode="aot_fx_trace"``: the trainer traces forward + loss
+ backward into one graph, then builds its pass list with the pipeline function registered under
``compile.pass_pipeline`` (``construct_default_graph_passes`` unless another is registered) and runs it with
``apply_graph_passes`` (each pass ``(gm, example_inputs) -> gm``; ``compile.disable_passes`` removes passes by
function name). ``overlapcfg_pipeline`` is that default list with one change::

    eliminate_dead_code_pass, canonicalize_graph_pass, deduplicate_fsdp_unshard_chains_pass,
    tag_with_memory_policy_pass, apply_cpu_offload_pass, selective_activation_remat_pass,
    joint_transformer_block_bucketing_reordering_pass      ->  overlapcfg_bucketing_pass
    [annotate_flex_attention_..., regional_inductor_pass | full_inductor_compilation_pass, cudagraph_pass]

so torchtitan's normalization, memory policy, rematerialization and compilation run as they would, and the
bucketing and scheduling of the FSDP collectives is overlapcfg's (``overlapcfg.apply`` on the joint graph,
verified). The config comes from ``OVERLAPCFG_CONFIG`` (``source``); by default it is torchtitan's own plan at
depth 1. ``--compile.disable_passes overlapcfg_bucketing_pass`` leaves the collectives unbucketed, as disabling
torchtitan's pass does.

Settings under which the pipeline would do nothing or fight another pass are errors before tracing
(``check_trainer``, run by the trainer's post-init hook), not silent no-ops.
"""

from __future__ import annotations

import functools
import io
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import fx

from overlapcfg import compat
from overlapcfg.config import OverlapConfig
from overlapcfg.config.boundary import user_paths
from overlapcfg.errors import Fault, OverlapConfigError, UnsupportedGraphError
from overlapcfg.graph.parameters import state_input_names
from overlapcfg.integrations.torchtitan.source import ENV_VAR, TORCHTITAN_PLAN_NAME, find_config
from overlapcfg.module_paths import ModelFacts
from overlapcfg.passes import PassOptions, PassRecord, apply, pass_record
from overlapcfg.passes.schedule_check import check_graph_schedule
from overlapcfg.resolve import resolve_config
from overlapcfg.strategies import get_strategy

__all__ = ["PASS_NAME", "PIPELINE_NAME", "REPLACED_PASS", "check_trainer", "overlapcfg_bucketing_pass",
           "overlapcfg_pipeline"]

logger = logging.getLogger(__name__)

PIPELINE_NAME = "overlapcfg"
"""The name ``compile.pass_pipeline`` selects."""
PASS_NAME = "overlapcfg_bucketing_pass"
"""The pass's name in torchtitan's pass log and for ``compile.disable_passes``."""
REPLACED_PASS = "joint_transformer_block_bucketing_reordering_pass"
"""torchtitan's joint bucketing pass, the one entry of its default list this pipeline replaces."""

TorchtitanPass: TypeAlias = Callable[..., fx.GraphModule]
"""A pass of torchtitan's graph-trainer pipeline: a graph module (and its bound settings) in, a graph module out;
unlike ``overlapcfg.passes.backend.GraphPass`` it may take more than the graph."""


def overlapcfg_bucketing_pass(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None, *,
                              cfg: OverlapConfig, state_fqns: Sequence[str] = (),
                              flat_counts: Sequence[int] = ()) -> fx.GraphModule:
    """``overlapcfg.apply(gm, cfg, graph_kind="joint")`` with torchtitan's pass signature; logs the per-bucket table
    on rank 0 and leaves the record on ``gm.meta["overlapcfg"]``. ``state_fqns`` / ``flat_counts``: the model
    state the tracer fed in as the graph's first inputs (``TracedResult.state_fqns``, each entry's flat input
    count), evidence of which inputs are parameters and their FQNs. ``for_compiler``: torchtitan's inductor passes
    may follow and read fake-tensor metadata. The schedule is then compared across ranks
    (``overlapcfg.graph.same_schedule``): every rank traces and runs this pipeline, so every rank reaches the
    check, before torchtitan's compilation passes."""
    state = state_input_names(gm.graph, list(state_fqns), list(flat_counts)) if state_fqns else None
    gm = apply(gm, cfg, graph_kind="joint", options=PassOptions(for_compiler=True, state_inputs=state))
    check_graph_schedule(gm, cfg, where="torchtitan graph trainer, overlapcfg pipeline")
    record = pass_record(gm)
    if record is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.info("%s", _rendered(record))
    return gm


def overlapcfg_pipeline(traced_result: Any, config: Any, *, parallel_dims: Any = None) -> list[TorchtitanPass]:
    """torchtitan's default pass list (``construct_default_graph_passes``) with its joint bucketing pass replaced by
    ``overlapcfg_bucketing_pass``, configured from ``OVERLAPCFG_CONFIG``. The signature is the one
    ``GraphTrainer`` calls a registered pipeline with.

    Raises ``OverlapConfigError`` for a bad config, and ``UnsupportedGraphError`` where torchtitan's list has no
    joint bucketing pass to replace (a precompiled artifact, built by ``precompile_main`` with the default passes)."""
    from torchtitan.experiments.graph_trainer.fsdp_passes import joint_transformer_block_bucketing_reordering_pass
    from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes

    passes = list(construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims))
    found = [i for i, p in enumerate(passes) if _function(p) is joint_transformer_block_bucketing_reordering_pass]
    if len(found) != 1:
        names = ", ".join(_function(p).__name__ for p in passes) or "none"
        raise UnsupportedGraphError(
            f"compile.pass_pipeline={PIPELINE_NAME}: torchtitan's pass list holds {len(found)} {REPLACED_PASS} "
            f"(passes: {names}); the pipeline replaces exactly one. A precompiled artifact "
            "(compile.precompile_artifact_dir) was built with torchtitan's default passes and cannot be re-bucketed")
    index = found[0]
    plans = passes[index].keywords["module_bucket_plans"]
    cfg = find_config(plans)
    logger.info("overlapcfg: %s %s; strategy %s, plan %s", ENV_VAR, _source_text(), cfg.strategy,
                cfg.plan.name if cfg.plan is not None and cfg.plan.name else "(unnamed)")
    passes[index] = functools.partial(overlapcfg_bucketing_pass, cfg=cfg, **_state(traced_result))
    return passes


def _state(traced_result: Any) -> dict[str, Any]:
    """``TracedResult``'s model state: its FQNs and how many flat graph inputs each became (a DTensor: two)."""
    fqns = tuple(traced_result.state_fqns)
    layouts = traced_result.input_subclass_layouts
    return {"state_fqns": fqns,
            "flat_counts": tuple(layouts[i].num_tensors if i in layouts else 1 for i in range(len(fqns)))}


def check_trainer(trainer: Any) -> None:
    """Fail before tracing where ``compile.pass_pipeline=overlapcfg`` would not run, or would be undone; load the
    config once so that its faults arrive now, not after minutes of tracing. ``GraphTrainer``'s post-init hook."""
    compile_config = trainer.config.compile
    faults: list[Fault] = []
    if compile_config.mode != "aot_fx_trace":
        faults.append(Fault("compile.mode", f"the overlapcfg pipeline runs on the whole-step graph of "
                                            f"compile.mode=aot_fx_trace; got {compile_config.mode!r}, where no pass "
                                            "pipeline runs"))
    if not compile_config.enable_passes:
        faults.append(Fault("compile.enable_passes", "false skips every pass pipeline, overlapcfg's included"))
    if compile_config.precompile_artifact_dir:
        faults.append(Fault("compile.precompile_artifact_dir", "a precompiled artifact was built with torchtitan's "
                                                               "default passes; overlapcfg cannot re-bucket it"))
    if compile_config.enable_fsdp_dense_region_overlap:
        faults.append(Fault("compile.enable_fsdp_dense_region_overlap", "torchtitan's dense-region scheduler "
                            "re-places the FSDP collectives by its own bucket metadata; it cannot follow "
                            "overlapcfg's buckets: set it false"))
    missing = compat.graph_trainer_missing_apis()
    if missing:
        faults.append(Fault("compile.mode", f"torchtitan's graph trainer traces the step with {' and '.join(missing)}, "
                                            f"which torch {torch.__version__} does not have (torch 2.13 and 2.14 do): "
                                            "install a torch the graph trainer runs on, or train with torchtitan's "
                                            "main trainer (overlapcfg.integrations.torchtitan.fsdp2)"))
    parallel_dims = getattr(trainer, "parallel_dims", None)
    if parallel_dims is not None and getattr(parallel_dims, "pp_enabled", False):
        faults.append(Fault("parallelism.pipeline_parallel_degree", "pipeline parallelism runs the graph trainer's "
                                                                    "per-stage path, not the whole-step graph"))
    if faults:
        raise OverlapConfigError(faults, header=f"compile.pass_pipeline={PIPELINE_NAME} cannot run here")
    cfg = find_config(("tok_embeddings",))  # torchtitan's own plan is known at trace time; a file's is checked now
    parts: Sequence[Any] = getattr(trainer, "model_parts", None) or ()
    if cfg.plan is not None and cfg.plan.name != TORCHTITAN_PLAN_NAME and get_strategy(cfg.strategy).uses_plan \
            and len(parts) == 1:
        _check_plan_fits(cfg, parts[0])


def _check_plan_fits(cfg: OverlapConfig, model: Any) -> None:
    """Resolve a config file's plan against the model's modules now: a pattern that matches nothing, or a
    parameter owner outside every bucket under ``require_full_coverage``, fails before minutes of tracing."""
    with user_paths(cfg.mount):
        resolve_config(cfg, ModelFacts.of(model))


def _function(graph_pass: object) -> Callable[..., Any]:
    # torchtitan's passes are plain functions or partials of them
    return graph_pass.func if isinstance(graph_pass, functools.partial) else graph_pass  # type: ignore[return-value]


def _source_text() -> str:
    value = os.environ.get(ENV_VAR, "").strip()
    return f"= {value!r}" if value else "unset (torchtitan's buckets, default policy)"


def _rendered(record: PassRecord) -> str:
    """The per-bucket table as plain text (what ``overlapcfg.explain`` shows), for torchtitan's log."""
    from rich.console import Console
    from rich.markup import escape

    from overlapcfg.report.bucket_table import bucket_table

    out = io.StringIO()
    console = Console(file=out, width=110, color_system=None, force_terminal=False)
    console.print(bucket_table(escape(f"overlapcfg[{record.strategy}] on the joint graph"), record.buckets,
                               world_size=dist.get_world_size() if dist.is_initialized() else 1))
    before, after = record.before.total_fsdp, record.after.total_fsdp
    notes = "".join(f"\n  note: {n}" for n in record.notes)
    return f"overlapcfg: {before} -> {after} FSDP collectives in {len(record.buckets)} buckets\n" \
           f"{out.getvalue().rstrip()}{notes}"
