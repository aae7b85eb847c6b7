"""The main job behind the ``overlapcfg`` command: trace the demo model, apply the config, report; or compare.

Stages, each timed and shown while it runs: validate the config → check the plan against the demo model's module
tree (built on the meta device: an unmatched pattern fails in a second, before any tracing) → trace one training
step → ``overlapcfg.report.explain`` (or ``compare``) → print the rich table and write JSON into the run directory.
With ``sharding=fsdp2`` the trace is replaced by sharding the demo eagerly with ``overlapcfg.fully_shard``
(``overlapcfg.demo.eager``) and the report is read from the model. ``mode=tune`` and ``mode=calibrate|measure``
live in ``tune_job`` and ``measure_job``, which build on this module's stages (never the other way round).

This module knows the composed config's *layout* (``model``, ``world_size``, ``overlap``, ``hardware``, ...) and
nothing about Hydra itself; ``overlapcfg.demo.cli`` is the Hydra app around it. Every user error is raised as
``OverlapConfigError`` with paths as written on the command line.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from overlapcfg.config import OverlapConfig, from_hydra, load_config
from overlapcfg.config.boundary import user_paths
from overlapcfg.config.contracts import contract_of
from overlapcfg.demo.outputs import COMPARE_FILE, REPORT_FILE, TIMELINE_STEM
from overlapcfg.demo.settings import DemoSettings, demo_settings
from overlapcfg.errors import Fault, OverlapConfigError
from overlapcfg.files import write_atomic

if TYPE_CHECKING:
    from overlapcfg.cost.hardware import HardwareProfile
    from overlapcfg.cost.pricing import Pricing
    from overlapcfg.demo.tracing import TracedStep

__all__ = ["Progress", "check_plan", "compare_configs", "demo_spec", "hardware_of", "pricing_of", "run_compare",
           "run_report", "traced"]

log = logging.getLogger(__name__)



def demo_spec(cfg: DictConfig) -> DemoSettings:
    """``model.*``, ``world_size``, ``parallel.*``, ``reshard_after_forward``, ``batch``, ``seq_len`` of the composed
    config."""
    composed = OmegaConf.to_container(cfg, resolve=True)
    return demo_settings(cast("dict[str, Any]", composed) if isinstance(composed, dict) else {})


def replay_hardware(cfg: DictConfig, spec: DemoSettings, mode: str, eager_hint: str = "") -> HardwareProfile:
    """The profile a mode that predicts by replaying traced graphs needs (compare, tune): a traced sharding and
    a hardware profile, each missing one a config fault at its key."""
    if spec.sharding != "simple_fsdp":
        raise OverlapConfigError.single("sharding", f"mode={mode} predicts step times by replaying traced graphs; "
                                                    f"sharding={spec.sharding} (eager) has none: use "
                                                    f"sharding=simple_fsdp{eager_hint}")
    hardware = hardware_of(cfg)
    if hardware is None:
        raise OverlapConfigError.single("hardware", f"mode={mode} predicts step times: choose a profile, e.g. "
                                                    "hardware=h100_nvlink")
    return hardware


def pricing_of(cfg: DictConfig) -> Pricing:
    """The ``predict`` node as the predictions' ``Pricing`` (faults at ``predict.<field>``); the defaults without
    one."""
    from overlapcfg.config.load import config_data
    from overlapcfg.cost.pricing import pricing_from

    node = cfg.get("predict")
    return pricing_from(None if node is None else config_data(node, "predict"), path="predict")


def hardware_of(cfg: DictConfig) -> HardwareProfile | None:
    """The ``hardware`` node as a profile, or None where the group is unset (``hardware=null``): read as the library
    reads a profile file (``hardware_from``: ``${key}`` references honoured, resolvers refused)."""
    node = cfg.get("hardware")
    if node is None:
        return None
    from overlapcfg.cost.hardware import hardware_from, load_hardware

    if isinstance(node, str):
        return load_hardware(node)
    return hardware_from(node, path="hardware")


def check_plan(overlap: OverlapConfig, spec: DemoSettings) -> None:
    """Resolve the plan against the demo model's module tree without tracing (meta device, no compute).

    The pass resolves it again on the traced graph; doing it here first turns a typo into a one-second error
    with the path as the user wrote it (``overlap.plan.buckets[1]``, ``compare.fast.plan.buckets[1]``: where the
    config was loaded from) instead of one after the trace.
    """
    if overlap.plan is None or not contract_of(overlap.strategy).uses_plan:
        return  # nothing to resolve: the model need not be built
    from overlapcfg.demo.llama import Llama
    from overlapcfg.module_paths import ModelFacts
    from overlapcfg.resolve import resolve_config

    with user_paths(overlap.mount):
        resolve_config(overlap, ModelFacts.of(Llama(spec.llama_config(), device="meta")))


class Progress:
    """Shows each stage while it runs (a rich spinner on a terminal: ``tracing …``) and a done line with its seconds
    after (``✓ traced …``): a spinner never says a stage is done while it runs.

    Done lines also go to the log (Hydra writes it to ``<run dir>/overlapcfg.log``).
    """

    def __init__(self, console: Console) -> None:
        self.console = console
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, doing: str, *, done: str) -> Iterator[None]:
        """``doing`` (``tracing …``) on the spinner while the block runs, ``done`` (``traced …``) once it has."""
        start = time.perf_counter()
        with self.console.status(f"{doing} …"):
            yield
        seconds = time.perf_counter() - start
        self.console.print(f"[green]✓[/green] {done} [dim]({seconds:.1f} s)[/dim]")
        log.info("%s: %.2fs", done, seconds)

    def total(self) -> float:
        return time.perf_counter() - self.started


_TRACES: dict[DemoSettings, TracedStep] = {}


def traced(spec: DemoSettings) -> TracedStep:
    """The traced step for ``spec``, memoized per process: a multirun sweep over ``overlap.*`` traces once."""
    if spec not in _TRACES:
        from overlapcfg.demo.tracing import trace_train_step

        _TRACES[spec] = trace_train_step(spec.llama_config(), parallel=spec.dims, rank=0,
                                         reshard_after_forward=spec.reshard_after_forward, batch=spec.batch,
                                         seq_len=spec.seq_len)
    return _TRACES[spec]


def _trace_stage(progress: Progress, spec: DemoSettings) -> TracedStep:
    cfg = spec.llama_config()
    mesh = "" if spec.dims.is_1d else f" = {spec.dims.describe()}"
    what = (f"{cfg.n_layers}-layer demo model (dim {cfg.dim}) for {spec.world_size} ranks{mesh}, "
            f"reshard_after_forward={spec.reshard_after_forward}")
    if spec in _TRACES:
        progress.console.print(f"[green]✓[/green] traced {what} [dim](cached)[/dim]")
        return _TRACES[spec]
    with progress.stage(f"tracing {what}", done=f"traced {what}"):
        return traced(spec)


def run_report(cfg: DictConfig, output_dir: Path, console: Console) -> Path:
    """``mode=run``: apply ``cfg.overlap`` to the demo step, print the report, write ``report.json``."""
    progress = Progress(console)
    # torch-free: a typo is reported before torch is imported
    with progress.stage("validating config", done="validated config"):
        overlap = from_hydra(cfg.overlap)
        spec = demo_spec(cfg)
        hardware = hardware_of(cfg)
        pricing = pricing_of(cfg)
        check_plan(overlap, spec)
    if spec.sharding == "fsdp2":
        return _run_fsdp2(progress, overlap, spec, hardware, output_dir)
    from overlapcfg.report import explain

    step = _trace_stage(progress, spec)
    with progress.stage(f"applying strategy {overlap.strategy!r} to forward and backward graphs",
                        done=f"applied strategy {overlap.strategy!r} to forward and backward graphs"):
        report = explain(step, overlap, hardware=hardware, pricing=pricing, pricing_path="predict")
    console.print(report)  # with the untransformed step's prediction (report.baseline) as "before"
    path = write_atomic(output_dir / REPORT_FILE, report.to_json())
    console.print(f"report: {path}  [dim](total {progress.total():.1f} s)[/dim]")
    return path


def _run_fsdp2(progress: Progress, overlap: OverlapConfig, spec: DemoSettings, hardware: HardwareProfile | None,
               output_dir: Path) -> Path:
    """``mode=run sharding=fsdp2``: shard the demo with ``overlapcfg.fully_shard``, report what it decided."""
    from overlapcfg.demo.eager import process_group, shard_demo
    from overlapcfg.report import explain

    console = progress.console
    with process_group(cast(int, spec.world_size)) as (rank, world_size, group):  # DemoSettings fills it
        if rank:
            console.quiet = True  # a group someone else made: rank 0 prints and writes the report
        where = "one process, fake process group" if group == "fake" else f"{group} group, rank {rank}"
        what = (f"{spec.model.n_layers}-layer demo model (dim {spec.model.dim}) with FSDP2 for {world_size} "
                f"ranks ({where}), reshard_after_forward={spec.reshard_after_forward}")
        with progress.stage(f"sharding {what}", done=f"sharded {what}"):
            sharded = shard_demo(spec, overlap, rank=rank, world_size=world_size, group=group)
        report = explain(sharded.model, overlap)
    console.print(report)
    if hardware is not None:
        console.print(f"[dim]note: no prediction on {hardware.name} for sharding=fsdp2 (the cost model replays "
                      "traced graphs; eager FSDP2 has none)[/dim]")
    path = output_dir / REPORT_FILE
    if not rank:
        write_atomic(path, report.to_json())
    console.print(f"report: {path}  [dim](total {progress.total():.1f} s)[/dim]")
    return path


def compare_configs(cfg: DictConfig, *, key: str = "compare") -> tuple[list[str], list[OverlapConfig]]:
    """``<key>.<label>`` (``compare``, ``measure.configs``): keys that replace those of ``overlap`` (unset keys come
    from ``overlap``).

    Replacing, not merging, is deliberate: ``{strategy: auto, policy: {}}`` must drop the manual depths.
    """
    base = cast("dict[str, Any]", OmegaConf.to_container(cfg.overlap, resolve=True))
    node = OmegaConf.select(cfg, key)
    entries = cast("Mapping[str, Any] | None", OmegaConf.to_container(node, resolve=True) if node is not None else None)
    if not isinstance(entries, Mapping) or not entries:
        raise OverlapConfigError.single(key, f"mode={cfg.get('mode', 'compare')} needs a mapping of label -> "
                                             "overlap keys")
    names, configs, faults = [], [], []
    for label, entry in entries.items():
        if entry is None:
            continue  # `~compare.<label>` or `compare.<label>=null` drops a row
        if not isinstance(entry, Mapping):
            faults.append(Fault(f"{key}.{label}", "expected a mapping of overlap keys (strategy, plan, policy)"))
            continue
        try:
            configs.append(load_config({**base, **entry}, root=f"{key}.{label}"))
            names.append(str(label))
        except OverlapConfigError as err:
            faults.extend(err.faults)
    if faults:
        raise OverlapConfigError(faults, header=f"invalid {key} entries")
    return names, configs


def shadowed_keys(cfg: DictConfig, overrides: Sequence[str] = ()) -> dict[str, list[str]]:
    """For each ``overlap`` key the user set on the command line (``overrides``, as Hydra lists them), the
    ``compare`` rows that replace it: there the override changes nothing, and the user should be told so. Keys
    nobody overrode are not reported: rows replacing the default ``policy`` is how ``compare`` works."""
    entries = cast("Mapping[str, Any]", OmegaConf.to_container(cfg.get("compare") or {}, resolve=True) or {})
    rows = {str(label): e for label, e in entries.items() if isinstance(e, Mapping)}
    overridden = {key for key in cfg.overlap if any(_sets_overlap_key(o, str(key)) for o in overrides)}
    out = {key: [label for label, e in rows.items() if key in e] for key in cfg.overlap if key in overridden}
    return {key: labels for key, labels in out.items() if labels}


def _sets_overlap_key(override: str, key: str) -> bool:
    """Whether a command-line override (``overlap.policy.x=1``, ``overlap/policy=aggressive``, ``+overlap.plan=..``,
    ``overlap=default``) sets ``overlap.<key>``."""
    target = override.split("=", 1)[0].lstrip("~+").split("@", 1)[0].replace("/", ".")
    return target in ("overlap", f"overlap.{key}") or target.startswith(f"overlap.{key}.")


def run_compare(cfg: DictConfig, output_dir: Path, console: Console, overrides: Sequence[str] = ()) -> Path:
    """``mode=compare``: every ``compare`` entry on one trace; print the table, write JSON and the timeline.
    ``overrides``: the command line's, to say which of them the rows replace."""
    progress = Progress(console)
    with progress.stage("validating config", done="validated config"):
        spec = demo_spec(cfg)
        hardware = replay_hardware(cfg, spec, "compare", ", or mode=run for the FSDP2 report")
        pricing = pricing_of(cfg)
        names, configs = compare_configs(cfg)
        for overlap in configs:
            check_plan(overlap, spec)
    from overlapcfg.report import compare

    step = _trace_stage(progress, spec)
    with progress.stage(f"comparing {len(configs)} configs on {hardware.name}",
                        done=f"compared {len(configs)} configs on {hardware.name}"):
        comparison = compare(step, configs, hardware=hardware, names=names, pricing=pricing, pricing_path="predict")
    console.print(comparison)
    for key, labels in shadowed_keys(cfg, overrides).items():
        note = (f"note: rows {', '.join(labels)} set their own {key!r}, so overlap.{key} does not apply to them "
                f"(change a row with compare.<label>.{key})")
        log.info(note)
        console.print(f"[yellow]{note}[/yellow]")
    path = write_atomic(output_dir / COMPARE_FILE, comparison.to_json())
    with progress.stage("writing timeline", done="wrote timeline"):
        files = [comparison.timeline(output_dir / f"{TIMELINE_STEM}{suffix}") for suffix in (".json", ".png")]
    console.print(f"comparison: {path}; timeline: {', '.join(str(f) for f in files)}")
    return path

