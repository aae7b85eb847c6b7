"""The ``overlapcfg`` command: a Hydra app around ``overlapcfg.demo.job`` (primary config ``conf/overlapcfg.yaml``).

``overlapcfg`` traces the demo model and reports what the configured strategy did; ``overlapcfg mode=compare``
compares several configs; ``overlapcfg -m overlap.policy.forward_prefetch=0,1,2`` sweeps, one report per job;
``overlapcfg mode=tune hardware=h100_nvlink tune.memory_budget=4GiB`` searches plans and depths (``tuned.yaml``);
under ``torchrun``, ``mode=calibrate`` writes a measured hardware profile and ``mode=measure`` runs real steps
against the prediction (``overlapcfg.demo.measure_job``); ``overlapcfg mode=diagnose trace=<dir>`` reads a job's own
profiler traces and proposes a config (``overlapcfg.demo.diagnose_job``).

The command starts as every Hydra app of overlapcfg's does (``overlapcfg.config.hydra_app.run_app``): its overrides
checked and presets by name written as group options before Hydra composes, every config file Hydra will read
(hardware profiles, presets under ``--config-dir``) read first with the library's bounds, and the overrides handed
to Hydra as data (``sys.argv`` is never rewritten). ``overlapcfg.demo.command_check`` adds its own checks (keys the
command does not read, a ``tune.node_costs`` file).

Errors: a fault before composing exits with status 1 and the message; a user error in the task (a bad value, an
unmatched pattern, a profile out of range), or a rewritten graph failing verification (its message names the
nodes), is shown by Hydra as its message alone, with the file a faulty node came from (``hydra_app.job_message``),
and exits with status 1, no traceback. ``HYDRA_FULL_ERROR=1`` still shows the full traceback. Ctrl-C ends the
command with status 130 and one line; every output is written whole or not at all (``overlapcfg.files``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console

from overlapcfg.compat.omegaconf import set_version_base
from overlapcfg.config.command_line import as_written
from overlapcfg.config.hydra_app import run_app
from overlapcfg.config.presets import command_conf_dir
from overlapcfg.demo.command_check import (
    CONFIG_NAME,
    SEARCHPATH_ENV,
    STRATEGY,
    command_faults,
    unknown_override_keys,
    user_profiles,
)
from overlapcfg.errors import OverlapConfigError, did_you_mean
from overlapcfg.process_exit import INTERRUPTED

__all__ = ["main", "unknown_override_keys"]

MODES = ("run", "compare", "tune", "calibrate", "measure", "diagnose")


def _console() -> Console:
    console = Console()
    if not console.is_terminal:  # piped or captured: the report is laid out for 100 columns, wider is roomier
        console = Console(width=120)
    console.quiet = os.environ.get("RANK", "0") != "0"  # under torchrun, rank 0 speaks for all
    return console


def _task(cfg: DictConfig) -> None:
    from overlapcfg.demo import job
    from overlapcfg.demo.outputs import clear_outputs

    console = _console()
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    clear_outputs(output_dir)  # .hydra/ already holds this run's config: nothing of an earlier run may stay beside it
    mode = cfg.mode
    try:
        if mode == "run":
            _sweep_job(job.run_report(cfg, output_dir, console))
        elif mode == "compare":
            job.run_compare(cfg, output_dir, console, overrides=_task_overrides())
        elif mode == "tune":
            from overlapcfg.demo import tune_job  # above job: it reuses job's trace, stages and hardware checks

            tune_job.run_tune(cfg, output_dir, console)
        elif mode == "diagnose":
            from overlapcfg.demo import diagnose_job  # reads a job's own traces: nothing traced or run here

            diagnose_job.run_diagnose(cfg, output_dir, console)
        elif mode in ("calibrate", "measure"):
            from overlapcfg.demo import measure_job

            (measure_job.run_calibrate if mode == "calibrate" else measure_job.run_measure)(cfg, output_dir, console)
        else:
            raise OverlapConfigError.single("mode", f"expected one of {', '.join(MODES)}, got {mode!r}"
                                                    f"{did_you_mean(str(mode), MODES)}")
    except Exception as err:
        _sweep_failure(err)
        raise  # an OverlapcfgError is shown as Hydra shows its own errors (hydra_app.job_message)


def _task_overrides() -> list[str]:
    """This job's overrides as the user wrote them (``++`` that ``hydra_overrides`` put on a field, taken off)."""
    return [as_written(str(o), sys.argv[1:]) for o in HydraConfig.get().overrides.task]


_SWEEP: list[tuple[int, list[str], Path]] = []
"""``(job number, overrides, report.json)`` of each ``mode=run`` job of a multirun that finished, in order, for the
summary after the last."""
_FAILED: list[tuple[int, list[str], str]] = []
"""``(job number, overrides, what went wrong)`` of each multirun job that raised."""


def _sweep_job(report: Path) -> None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        _SWEEP.append((hydra_cfg.job.num, _task_overrides(), report))


def _sweep_failure(err: Exception) -> None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    if isinstance(err, OverlapConfigError) and err.faults:
        what = str(err.faults[0]) + (f" (and {len(err.faults) - 1} more)" if len(err.faults) > 1 else "")
    else:
        what = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    _FAILED.append((hydra_cfg.job.num, _task_overrides(), what))


def _sweep_summary() -> None:
    """After a multirun: one table across the jobs that finished, and the jobs that failed with why (Hydra then
    exits 1 for them). Jobs run in this process with Hydra's default launcher; a launcher that runs them
    elsewhere leaves nothing here, and each job's report.json is the record."""
    if not _SWEEP and not _FAILED:
        return
    from rich.markup import escape

    console = _console()
    if _SWEEP:
        from overlapcfg.report import Report
        from overlapcfg.report.sweep import sweep_table

        jobs = [(overrides, Report.from_json(path.read_text())) for _, overrides, path in _SWEEP]
        console.print(sweep_table(jobs, numbers=[num for num, _, _ in _SWEEP]))
        console.print(f"reports: {', '.join(str(path) for _, _, path in _SWEEP)}", soft_wrap=True)
    if _FAILED:
        total = len(_SWEEP) + len(_FAILED)
        console.print(f"[red]failed: {len(_FAILED)} of {total} jobs[/red]")
        for num, overrides, what in _FAILED:
            console.print(f"  job {num} ({escape(' '.join(overrides))}): {escape(what)}", soft_wrap=True)
    _SWEEP.clear()
    _FAILED.clear()


def _user_profiles() -> list[str]:
    """Put the user's overlapcfg directory on the command's search path (``hydra.searchpath`` in
    ``conf/overlapcfg.yaml`` reads it), when it exists: ``hardware=<name>`` then finds ``hardware/<name>.yaml``
    there, as calibration writes it. Returns what is added, for the files read before Hydra."""
    from overlapcfg.cost.hardware import user_conf_dir

    home = user_conf_dir()
    if home.is_dir():
        os.environ.setdefault(SEARCHPATH_ENV, f"file://{home}")
    return user_profiles()


def main() -> None:
    """Console-script entry point: Hydra's own arguments (``sys.argv``, read, not rewritten)."""
    set_version_base("1.3")
    try:
        run_app(_task, config_path=str(command_conf_dir()), config_name=CONFIG_NAME, strategy=STRATEGY,
                search=_user_profiles(), check=command_faults)
    except KeyboardInterrupt:
        _SWEEP.clear()
        _FAILED.clear()
        sys.stderr.write("overlapcfg: interrupted (Ctrl-C); every file written so far is whole\n")
        sys.exit(INTERRUPTED)
    finally:  # also when a job failed: Hydra reports the first failure and exits 1 after all jobs ran
        _sweep_summary()


if __name__ == "__main__":
    main()
