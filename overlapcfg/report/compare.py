"""``compare(step, configs, hardware=...)``: several strategies and policies on the same trace, side by side.

Each config is applied to fresh copies of the traced graphs (``explain``), then replayed by the cost model at the
requested world size. Rows keep their reports and simulations, so the timeline (``timeline.write_timeline``) and
the table (``render.comparison_table``) come from the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from omegaconf import DictConfig

from overlapcfg.config import OverlapConfig, OverlapPolicy, load_config
from overlapcfg.config.base import RankCount
from overlapcfg.config.load import validate_value
from overlapcfg.cost.hardware import HardwareProfile, load_hardware
from overlapcfg.cost.node_costs import NodeCosts
from overlapcfg.cost.pricing import Pricing, pricing_from
from overlapcfg.cost.simulator import GroupPlacement, simulate
from overlapcfg.errors import OverlapUsageError
from overlapcfg.kinds import DIRECTIONS
from overlapcfg.passes.backend import CapturedStep
from overlapcfg.report.explain import explain, node_labels
from overlapcfg.report.labels import fmt_bytes
from overlapcfg.report.model import Comparison, ComparisonRow, Report

__all__ = ["compare", "compare_reports", "default_name"]

def default_name(cfg: OverlapConfig) -> str:
    """``manual fp2 bp2 rs1 cap=1GiB``, ``torch_manual``, ``none``: the knobs that tell rows apart."""
    policy = cfg.policy
    if cfg.strategy != "manual" or not isinstance(policy, OverlapPolicy):
        return cfg.strategy
    text = f"manual fp{policy.forward_prefetch} bp{policy.backward_prefetch} rs{policy.reduce_scatter_delay}"
    if policy.max_inflight_bytes is not None:
        text += f" cap={fmt_bytes(policy.max_inflight_bytes).replace(' ', '')}"
    if cfg.plan is not None and cfg.plan.name and cfg.plan.name != "llama_layers":
        text += f" {cfg.plan.name}"
    return text


def compare(step: CapturedStep, configs: Sequence[OverlapConfig | Mapping[str, Any]], *,
            hardware: HardwareProfile | str, names: Sequence[str] | None = None,
            world_size: int | None = None, as_dtype: torch.dtype | None = None,
            node_costs: NodeCosts | None = None, pricing: Pricing | Mapping[str, Any] | None = None,
            pricing_path: str = "pricing") -> Comparison:
    """One row per config (in the given order): the prediction at ``world_size`` (default: the trace's).

    Include ``{"strategy": "none"}`` and ``{"strategy": "torch_manual", "plan": ...}`` to get the baselines.
    ``as_dtype=torch.bfloat16`` predicts bf16 mixed precision from an fp32 trace (see ``simulate``).
    ``node_costs``: measured node durations instead of the kernel model (``overlapcfg.cost.node_costs``).
    ``pricing``: checkpointing, fusion, optimizer, attention backend, tokens (``overlapcfg.cost.pricing.Pricing``);
    its faults are reported under ``pricing_path``.
    A fault names the config it is in: ``configs[1].plan.buckets[0]`` for one given as a mapping, the place a
    loaded config or a Hydra node says it came from otherwise.
    """
    loaded = [load_config(c) if isinstance(c, (OverlapConfig, DictConfig)) else load_config(c, root=f"configs[{i}]")
              for i, c in enumerate(configs)]
    if world_size is not None:  # before the configs are applied, not after
        validate_value(RankCount, world_size, path="world_size")
    if names is not None and len(names) != len(loaded):
        raise OverlapUsageError(f"compare: {len(names)} names for {len(loaded)} configs")
    labels = list(names) if names is not None else [default_name(c) for c in loaded]
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):  # keep names unique: they key the timeline's processes
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            labels[i] = f"{label} #{seen[label]}"
    reports = [explain(step, cfg) for cfg in loaded]
    return compare_reports(step, reports, hardware=hardware, names=labels, world_size=world_size,
                           as_dtype=as_dtype, node_costs=node_costs, pricing=pricing, pricing_path=pricing_path)


def compare_reports(step: CapturedStep, reports: Sequence[Report], *, hardware: HardwareProfile | str,
                    names: Sequence[str], world_size: int | None = None,
                    as_dtype: torch.dtype | None = None,
                    groups: Mapping[str, GroupPlacement] | None = None,
                    node_costs: NodeCosts | None = None,
                    pricing: Pricing | Mapping[str, Any] | None = None,
                    pricing_path: str = "pricing") -> Comparison:
    """``compare`` for reports already made by ``explain`` (re-predict one set of passes on many machines);
    ``groups`` places the process groups by name (HSDP: the replicate group across nodes)."""
    hw = load_hardware(hardware)
    priced = pricing_from(pricing, path=pricing_path)
    ws = step.world_size if world_size is None else validate_value(RankCount, world_size, path="world_size")
    rows = []
    for name, explained in zip(names, reports, strict=True):
        if explained.forward is None or explained.backward is None:
            raise OverlapUsageError(f"compare: the report of {name!r} holds no graphs to predict (an eager FSDP2 "
                                    "model's report has none)")
        graphs = [explained.forward, explained.backward]
        node_names: dict[str, dict[str, str]] = {g: node_labels(gm, step.module_fqn_fn(g))
                                                 for g, gm in zip(DIRECTIONS, graphs, strict=True)}
        sim = simulate(graphs, hw, world_size=ws, names=DIRECTIONS, labels=node_names,
                       traced_world_size=step.world_size, as_dtype=as_dtype, groups=groups, node_costs=node_costs,
                       pricing=priced, pricing_path=pricing_path)
        report = explained.model_copy(update={"simulation": sim}).attach(*graphs)
        rows.append(ComparisonRow(name, report.strategy, report, sim))
    return Comparison(hw.name, ws, tuple(rows))
