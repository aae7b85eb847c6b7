"""The ``overlapcfg`` command: a Hydra app around ``overlapcfg.demo.job`` (primary config ``conf/overlapcfg.yaml``).

``overlapcfg`` traces the demo model and reports what the configured strategy did; ``overlapcfg mode=compare``
compares several configs; ``overlapcfg -m overlap.policy.forward_prefetch=0,1,2`` sweeps, one report per job.

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
from omegaconf import DictConfig
from rich.console import Console

from overlapcfg.config.presets import conf_dir
from overlapcfg.errors import OverlapConfigError, OverlapVerificationError, did_you_mean

__all__ = ["ConfigError", "main"]

MODES = ("run", "compare")


class ConfigError(CompactHydraException):
    """A config error, shown by Hydra as its message alone (exit status 1)."""


def _task(cfg: DictConfig) -> None:
    from overlapcfg.demo import job

    console = Console()
    if not console.is_terminal:  # piped or captured: 80 columns would wrap every bucket row
        console = Console(width=160)
    console.quiet = os.environ.get("RANK", "0") != "0"  # under torchrun, rank 0 speaks for all
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    mode = cfg.mode
    try:
        if mode == "run":
            job.run_report(cfg, output_dir, console)
        elif mode == "compare":
            job.run_compare(cfg, output_dir, console)
        else:
            raise OverlapConfigError.single("mode", f"expected one of {', '.join(MODES)}, got {mode!r}"
                                                    f"{did_you_mean(str(mode), MODES)}")
    except (OverlapConfigError, OverlapVerificationError) as err:
        raise ConfigError(str(err)) from None


def main() -> None:
    """Console-script entry point. Hydra parses ``sys.argv`` itself."""
    app = hydra.main(config_path=str(conf_dir()), config_name="overlapcfg", version_base="1.3")(_task)
    app()


if __name__ == "__main__":
    sys.exit(main())
