"""The ``overlapcfg`` command: a Hydra app around ``overlapcfg.demo.job`` (primary config ``conf/overlapcfg.yaml``).

``overlapcfg`` traces the demo model and reports what the configured strategy did; ``overlapcfg mode=compare``
compares several configs; ``overlapcfg -m overlap.policy.forward_prefetch=0,1,2`` sweeps, one report per job;
``overlapcfg mode=tune hardware=h100_nvlink tune.memory_budget=4GiB`` searches plans and depths (``tuned.yaml``);
under ``torchrun``, ``mode=calibrate`` writes a measured hardware profile and ``mode=measure`` runs real steps
against the prediction (``overlapcfg.demo.measure_job``).

Errors: a user error in the task (a bad value, an unmatched pattern), or a rewritten graph failing verification
(its message names the nodes), is re-raised as ``ConfigError``, a Hydra
``CompactHydraException``: Hydra then prints its message (plus the job's overrides) and exits with status 1, with
no traceback, just as it does for its own composition errors (an unknown group option). ``HYDRA_FULL_ERROR=1``
still shows the full traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console

from overlapcfg.config.presets import command_conf_dir
from overlapcfg.errors import OverlapConfigError, OverlapVerificationError, did_you_mean

__all__ = ["ConfigError", "main"]

MODES = ("run", "compare", "tune", "calibrate", "measure")


class ConfigError(CompactHydraException):
    """A config error, shown by Hydra as its message alone (exit status 1)."""


def _console() -> Console:
    console = Console()
    if not console.is_terminal:  # piped or captured: the report is laid out for 100 columns, wider is roomier
        console = Console(width=120)
    console.quiet = os.environ.get("RANK", "0") != "0"  # under torchrun, rank 0 speaks for all
    return console


def _task(cfg: DictConfig) -> None:
    from overlapcfg.demo import job

    console = _console()
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    mode = cfg.mode
    try:
        if mode == "run":
            _sweep_job(job.run_report(cfg, output_dir, console))
        elif mode == "compare":
            job.run_compare(cfg, output_dir, console, overrides=HydraConfig.get().overrides.task)
        elif mode == "tune":
            job.run_tune(cfg, output_dir, console)
        elif mode in ("calibrate", "measure"):
            from overlapcfg.demo import measure_job

            (measure_job.run_calibrate if mode == "calibrate" else measure_job.run_measure)(cfg, output_dir, console)
        else:
            raise OverlapConfigError.single("mode", f"expected one of {', '.join(MODES)}, got {mode!r}"
                                                    f"{did_you_mean(str(mode), MODES)}")
    except (OverlapConfigError, OverlapVerificationError) as err:
        raise ConfigError(str(err)) from None


_SWEEP: list[tuple[list[str], Path]] = []
"""``(overrides, report.json)`` of each ``mode=run`` job of a multirun, in order, for the summary after the last."""


def _sweep_job(report: Path) -> None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        _SWEEP.append((list(hydra_cfg.overrides.task), report))


def _sweep_summary() -> None:
    """After a multirun: one table across its jobs. Jobs run in this process with Hydra's default launcher;
    a launcher that runs them elsewhere leaves nothing here, and each job's report.json is the record."""
    if not _SWEEP:
        return
    from overlapcfg.report import Report
    from overlapcfg.report.sweep import sweep_table

    console = _console()
    jobs = [(overrides, Report.from_json(path.read_text())) for overrides, path in _SWEEP]
    console.print(sweep_table(jobs))
    console.print(f"reports: {', '.join(str(path) for _, path in _SWEEP)}", soft_wrap=True)
    _SWEEP.clear()


def _known_fields() -> dict[str, tuple[str, ...]]:
    """Keys under each config node the command validates with a pydantic model (torch-free imports)."""
    from overlapcfg.config.overlap import OverlapConfig
    from overlapcfg.config.policy import AutoPolicy, OverlapPolicy, TorchManualPolicy
    from overlapcfg.demo.settings import DemoModel, DemoParallel

    policy = {f for model in (OverlapPolicy, TorchManualPolicy, AutoPolicy) for f in model.model_fields}
    return {"model": tuple(DemoModel.model_fields), "parallel": tuple(DemoParallel.model_fields),
            "overlap": tuple(OverlapConfig.model_fields), "overlap.policy": tuple(sorted(policy))}


def unknown_override_keys(args: list[str]) -> list[str]:
    """Faults for command-line overrides that set a key no model has (``parallel.dp_shrd=2``), in the project's
    words: Hydra would say ``Key 'dp_shrd' is not in struct`` and suggest ``+parallel.dp_shrd=2``, which then
    fails validation anyway. Group selections (``overlap/plan=x``), appends (``+``), deletions (``~``) and Hydra's
    own keys are left to Hydra."""
    known = _known_fields()
    faults = []
    for arg in args:
        key = arg.split("=", 1)[0]
        if "=" not in arg or key.startswith(("-", "+", "~", "hydra")) or "/" in key:
            continue
        parent, _, leaf = key.rpartition(".")
        if parent in known and leaf not in known[parent]:
            valid = ", ".join(sorted(known[parent]))
            faults.append(f"{key}: unknown field{did_you_mean(leaf, known[parent])}; valid fields: {valid}")
    return faults


def _search_user_profiles() -> None:
    """Put the user's overlapcfg directory on the command's search path (``hydra.searchpath`` in
    ``conf/overlapcfg.yaml`` reads it), when it exists: ``hardware=<name>`` then finds ``hardware/<name>.yaml``
    there, as calibration writes it."""
    from overlapcfg.config.hardware import user_conf_dir

    home = user_conf_dir()
    if home.is_dir():
        os.environ.setdefault("OVERLAPCFG_SEARCHPATH", f"file://{home}")


def main() -> None:
    """Console-script entry point. Hydra parses ``sys.argv`` itself."""
    faults = unknown_override_keys(sys.argv[1:])
    if faults:
        sys.exit(f"invalid overrides ({len(faults)} fault{'s' if len(faults) > 1 else ''}):\n  " + "\n  ".join(faults))
    _search_user_profiles()
    app = hydra.main(config_path=str(command_conf_dir()), config_name="overlapcfg", version_base="1.3")(_task)
    app()
    _sweep_summary()


if __name__ == "__main__":
    sys.exit(main())
