"""``overlapcfg mode=tune``: search plans and schedules for the demo step, print the evidence, write tuned.yaml.

Stages, each shown while it runs: validate ``tune`` (torch-free: a typo in ``tune.space`` fails before the trace)
→ trace the demo step → ``overlapcfg.tuning.tune`` with a live progress line (candidates done, best so far,
elapsed) → tables (summary, top candidates, Pareto front, presets, remaining stalls) → ``tuned.yaml``,
``tune.json`` and ``tune_front.png`` in the run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from overlapcfg.config.base import ByteCount, ConfigModel, RankCount
from overlapcfg.config.load import validate_config
from overlapcfg.demo.job import Progress as Stages
from overlapcfg.demo.job import demo_spec, pricing_of, replay_hardware, traced
from overlapcfg.demo.outputs import FRONT_FILE, TUNE_FILE, TUNED_FILE
from overlapcfg.errors import OverlapConfigError
from overlapcfg.files import write_atomic
from overlapcfg.tuning.space import TuneSpace

if TYPE_CHECKING:
    from overlapcfg.cost.node_costs import NodeCosts

__all__ = ["TUNED_FILE", "TuneSettings", "run_tune", "tune_settings"]


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class TuneSettings(ConfigModel):
    """The command's ``tune`` node."""

    memory_budget: ByteCount | None = None
    """Largest peak of all-gathered bytes in flight (as costed: ``dtype``) a candidate may reach; null: none."""
    world_size: RankCount | None = None
    """Ranks the step is predicted at (1 or more); null: the traced world size."""
    dtype: Literal["bf16", "fp16", "fp32"] | None = None
    """Cost floating tensors as this dtype (mixed precision from the fp32 trace); null: as traced."""
    space: TuneSpace = TuneSpace()
    """What is searched: the ``tune/space`` group (``tune/space=quick``) or its fields."""
    node_costs: str | None = None
    """Path of a ``node_costs.json`` (``mode=measure`` writes one): measured node durations priced instead of the
    roofline (profile-guided); null: the roofline."""


def tune_settings(cfg: DictConfig) -> TuneSettings:
    node = cfg.get("tune")
    data: Any = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    return validate_config(TuneSettings, data or {}, root="tune", header="invalid tune settings")


def _node_costs(path: str | None) -> NodeCosts | None:
    """The measured node durations ``tune.node_costs`` names; a file that cannot be read, or holds a duration that
    is not a finite number of seconds (NaN, negative, infinite, absurd), is an error naming it and the entry."""
    if path is None:
        return None
    from overlapcfg.cost.node_costs import NodeCosts

    try:
        return NodeCosts.read(path, root="tune.node_costs")
    except OverlapConfigError as err:
        if err.header is None:  # the file itself: its fault is at tune.node_costs already
            raise
        raise OverlapConfigError(err.faults, header=f"{err.header} (tune.node_costs)") from None


def run_tune(cfg: DictConfig, output_dir: Path, console: Console) -> Path:
    """``mode=tune``: tune the demo step on ``hardware``; returns the path of ``tuned.yaml``."""
    stages = Stages(console)
    with stages.stage("validating config", done="validated config"):
        spec = demo_spec(cfg)
        settings = tune_settings(cfg)
        hardware = replay_hardware(cfg, spec, "tune")
        pricing = pricing_of(cfg)
        if not spec.dims.is_1d:
            raise OverlapConfigError.single("parallel", f"mode=tune models plain FSDP graphs (every collective an "
                                                        f"FSDP all-gather or reduce-scatter); {spec.dims.describe()} "
                                                        "adds HSDP or tensor-parallel traffic: drop parallel.*")
        node_costs = _node_costs(settings.node_costs)  # before tracing: a bad file fails in a second
    # torch and the tuner only now: a fault in the settings above is reported before their import (seconds)
    import torch

    from overlapcfg.report.labels import fmt_seconds
    from overlapcfg.tuning import TuneProgress, tune

    what = f"{spec.model.n_layers}-layer demo model for {spec.world_size} ranks"
    with stages.stage(f"tracing {what}", done=f"traced {what}"):
        step = traced(spec)
    as_dtype = getattr(torch, _DTYPES[settings.dtype]) if settings.dtype else None
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("best {task.fields[best]}"), TimeElapsedColumn(), console=console, transient=True)

    def show(p: TuneProgress) -> None:
        best = fmt_seconds(p.best_seconds) if p.best_seconds is not None else "—"
        bar.update(task, description=f"tune: {p.phase}", completed=p.done, total=max(p.total, 1), best=best)

    with bar:
        task = bar.add_task("tune: profile", total=1, best="—")
        result = tune(step, hardware=hardware, world_size=settings.world_size, memory_budget=settings.memory_budget,
                      space=settings.space, as_dtype=as_dtype, progress=show, config_root="tune",
                      node_costs=node_costs, pricing=pricing, pricing_path="predict")
    stages.console.print(f"[green]✓[/green] tuned: {result.evaluated} candidates in {result.seconds:.1f} s")
    console.print(result)  # the tables; print(result) in Python shows the same
    path = write_atomic(output_dir / TUNED_FILE, result.to_yaml())
    write_atomic(output_dir / TUNE_FILE, result.to_json())
    png = result.plot(output_dir / FRONT_FILE)
    console.print(f"tuned config: {path}; evidence: {output_dir / TUNE_FILE}, {png}  "
                  f"[dim](total {stages.total():.1f} s)[/dim]")
    return path
