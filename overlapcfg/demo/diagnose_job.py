"""``overlapcfg mode=diagnose trace=<dir or file>``: diagnose a job from its own profiler traces, print the tables,
write ``diagnose.json``, the proposed config (``proposed.yaml``, when there is a change to make) and the timeline
of one step (``diagnose_timeline.png``) into the run directory.

Nothing is traced or run here: the traces are the job's, read as they are (``overlapcfg.diagnose``). ``trace`` is
the one required key; ``diagnose.config`` names the overlap config file the job ran with (the proposal is then that
config with one change), ``diagnose.memory_budget`` the most bytes a change may add.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from overlapcfg.config.base import ByteCount, ConfigModel
from overlapcfg.config.load import validate_config
from overlapcfg.demo.job import Progress
from overlapcfg.demo.outputs import DIAGNOSE_FILE, DIAGNOSE_TIMELINE, PROPOSED_FILE
from overlapcfg.errors import OverlapConfigError
from overlapcfg.files import write_atomic

__all__ = ["DiagnoseSettings", "run_diagnose"]


class DiagnoseSettings(ConfigModel):
    """The command's ``trace`` key and ``diagnose`` node."""

    trace: str
    """A directory of one Chrome trace per rank (``*.json``, ``*.json.gz``), or one trace file."""
    config: str | None = None
    """The overlap config file (YAML) the job ran with; null: the proposal is written over the buckets the trace
    shows."""
    memory_budget: ByteCount | None = None
    """The most bytes a proposed change may add (``4GiB``); null: no limit."""


def diagnose_settings(cfg: DictConfig) -> DiagnoseSettings:
    node = cfg.get("diagnose")
    data: Any = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    trace = cfg.get("trace")
    if trace is None:
        raise OverlapConfigError.single("trace", "mode=diagnose reads a job's profiler traces: give their directory, "
                                                 "e.g. trace=./traces (one Chrome trace per rank)")
    return validate_config(DiagnoseSettings, {**(data or {}), "trace": str(trace)}, root="diagnose",
                           header="invalid diagnose settings")


def run_diagnose(cfg: DictConfig, output_dir: Path, console: Console) -> Path:
    progress = Progress(console)
    settings = diagnose_settings(cfg)
    from overlapcfg.diagnosis import diagnose

    job_config = Path(settings.config) if settings.config is not None else None
    with progress.stage(f"diagnosing {settings.trace}", done=f"diagnosed {settings.trace}"):
        result = diagnose(settings.trace, job_config, memory_budget=settings.memory_budget)
    console.print(result)
    written = [write_atomic(output_dir / DIAGNOSE_FILE, result.to_json())]
    if result.config is not None:
        written.append(write_atomic(output_dir / PROPOSED_FILE, result.to_yaml()))
    written.append(result.timeline(output_dir / DIAGNOSE_TIMELINE))
    console.print(f"wrote {', '.join(str(p) for p in written)}  [dim](total {progress.total():.1f} s)[/dim]")
    return written[0]
