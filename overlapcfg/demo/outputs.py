"""The files the ``overlapcfg`` command writes into a run directory, and clearing the previous run's.

Hydra writes ``.hydra/`` (the composed config and ``overrides.yaml``) at the start of every run into that run's
directory, also when the directory is reused (``hydra.run.dir=out``). From that moment, whatever an earlier run
left there (``tuned.yaml``, ``report.json``) sits next to a config it was not made from. So every mode first
removes every output file of every mode, then writes its own, each atomically (``overlapcfg.files``):
the directory holds the outputs of the run whose config it holds, or none of them (the run was interrupted or
failed). Removing is chosen over writing a marker: a marker has to be checked by every reader, and a person
opening ``tuned.yaml``, or a script loading it, would not.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from overlapcfg.files import TEMP_GLOB

__all__ = ["COMPARE_FILE", "DIAGNOSE_FILE", "DIAGNOSE_TIMELINE", "FRONT_FILE", "MEASURE_FILE", "NODE_COSTS_FILE",
           "OUTPUT_FILES", "PROPOSED_FILE", "REPORT_FILE", "TIMELINE_STEM", "TUNED_FILE", "TUNE_FILE", "clear_outputs"]

log = logging.getLogger(__name__)

REPORT_FILE = "report.json"
COMPARE_FILE = "compare.json"
TIMELINE_STEM = "timeline"
TUNED_FILE = "tuned.yaml"
TUNE_FILE = "tune.json"
FRONT_FILE = "tune_front.png"
MEASURE_FILE = "measure.json"
NODE_COSTS_FILE = "node_costs.json"
DIAGNOSE_FILE = "diagnose.json"
PROPOSED_FILE = "proposed.yaml"
DIAGNOSE_TIMELINE = "diagnose_timeline.png"
OUTPUT_FILES = (REPORT_FILE, COMPARE_FILE, f"{TIMELINE_STEM}.json", f"{TIMELINE_STEM}.png", TUNED_FILE, TUNE_FILE,
                FRONT_FILE, MEASURE_FILE, NODE_COSTS_FILE, DIAGNOSE_FILE, PROPOSED_FILE, DIAGNOSE_TIMELINE)
"""Every file a mode writes (``mode=run``: the report; ``compare``: the comparison and the timeline; ``tune``:
the tuned config, its evidence and the front; ``measure``: the measurement and the node costs; ``diagnose``: the
diagnosis, the proposed config and one step's timeline). ``calibrate``'s
copy of the profile is named after it (``<name>.yaml``) and stays: its name says which run made it."""


def clear_outputs(output_dir: Path) -> list[str]:
    """Remove the outputs of an earlier run (and temporary files a killed write left) from ``output_dir``; the
    names removed, which are logged."""
    removed = []
    for path in [*(output_dir / name for name in OUTPUT_FILES), *output_dir.glob(TEMP_GLOB)]:
        with contextlib.suppress(FileNotFoundError):
            if path.is_file():
                path.unlink()
                removed.append(path.name)
    if removed:
        log.info("removed the outputs of an earlier run in %s: %s", output_dir, ", ".join(removed))
    return removed
