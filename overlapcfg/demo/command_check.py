"""The ``overlapcfg`` command's own check of its command line, before Hydra composes anything (torch-free).

Hydra's answers to a typo are its own: ``Key 'modle' is not in struct`` and a suggestion to append
(``+modle.n_layers=2``, which it then accepts and the job ignores). The command starts through the path every Hydra
app of overlapcfg's takes (``overlapcfg.config.hydra_app.run_app``: presets by name, ``overlap.*`` keys, group
options that do not exist, every config file read bounded first); this module adds what only the command knows,
reading each override with Hydra's own parser (``compat.parse_command_line``):

- a top-level key the command does not read (``modle.n_layers=2``, ``+modle.n_layers=2``): rejected, closest key;
- a field no model of its node has (``parallel.dp_shrd=2``): closest field and the valid ones;
- ``tune.node_costs=<file>``: the file read and checked now (bounded JSON, every entry), in a second, instead of
  after torch is imported and the demo traced.

Left to Hydra: deletions (``~``) and Hydra's own keys (``hydra.*``, ``hydra/...``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from overlapcfg.compat.omegaconf import CommandLineOverride, parse_command_line
from overlapcfg.config.hydra_app import checked_overrides
from overlapcfg.config.hydra_files import SearchPath, group_of
from overlapcfg.config.presets import command_conf_dir, conf_dir
from overlapcfg.errors import Fault, OverlapConfigError, did_you_mean

__all__ = ["COMMAND_KEYS", "STRATEGY", "command_faults", "command_search_path", "known_fields", "top_level_keys",
           "unknown_override_keys", "user_profiles"]

COMMAND_KEYS = ("mode", "overlap", "hardware", "predict", "tune", "compare", "calibrate", "measure", "trace",
                "diagnose")
"""Top-level keys of ``conf/overlapcfg.yaml`` besides the demo settings (``overlapcfg.demo.settings``); a test
holds the composed config's keys to exactly these and the settings' fields."""
STRATEGY = "manual"
"""The strategy ``conf/overlapcfg.yaml`` composes unless the command line changes it."""
CONFIG_NAME = "overlapcfg"
SEARCHPATH_ENV = "OVERLAPCFG_SEARCHPATH"
"""Read by ``hydra.searchpath`` in ``conf/overlapcfg.yaml``: the user's profile directory, on the search path."""


def top_level_keys() -> tuple[str, ...]:
    from overlapcfg.demo.settings import DemoSettings

    return (*COMMAND_KEYS, *DemoSettings.model_fields)


def known_fields() -> dict[str, tuple[str, ...]]:
    """Keys under each node the command validates with a pydantic model (``overlap`` has its own check:
    ``overlapcfg.config.override_checks.override_faults``)."""
    from overlapcfg.cost.pricing import Pricing
    from overlapcfg.demo.diagnose_job import DiagnoseSettings
    from overlapcfg.demo.settings import DemoModel, DemoParallel

    return {"": top_level_keys(), "model": tuple(DemoModel.model_fields),
            "parallel": tuple(DemoParallel.model_fields), "predict": tuple(Pricing.model_fields),
            "diagnose": tuple(f for f in DiagnoseSettings.model_fields if f != "trace")}


def command_search_path(extra: Iterable[str] = ()) -> SearchPath:
    """Where the command's configs are, as Hydra searches them: its own ``conf/``, the ``overlap`` groups
    (``presets/``), then ``extra`` (the user's profile directory, ``--config-dir``)."""
    return SearchPath.of([str(command_conf_dir()), str(conf_dir()), *extra])


def command_faults(args: list[str], search_path: SearchPath) -> list[Fault]:
    """One fault per override that sets something the command does not read, and for a node-costs file that
    cannot be used (module docstring)."""
    known = known_fields()
    faults: list[Fault] = []
    for o in parse_command_line(args):
        if o is None or o.prefix == "~" or o.key.startswith("hydra") or group_of(o, search_path) is not None:
            continue
        if o.key == "tune.node_costs":
            faults += _node_costs_faults(o)
            continue
        fault = _field_fault(o, known)
        if fault is not None:
            faults.append(fault)
    return faults


def user_profiles() -> list[str]:
    """The directory the command's primary config adds to its search path (``hydra.searchpath`` reads
    ``$OVERLAPCFG_SEARCHPATH``; the command sets it to the user's overlapcfg directory where that exists)."""
    from overlapcfg.cost.hardware import user_conf_dir

    found = os.environ.get(SEARCHPATH_ENV)
    if found:
        return [found]
    home = user_conf_dir()
    return [f"file://{home}"] if home.is_dir() else []


def unknown_override_keys(args: Iterable[str], extra: Iterable[str] = ()) -> list[str]:
    """Every fault the command finds in ``args`` before composing (its own and the path every app takes), as
    the lines it prints; ``[]`` when every override is known. ``extra``: more config directories."""
    try:
        checked_overrides(list(args), mounts=("overlap",), strategy=STRATEGY, config_name=CONFIG_NAME,
                          search_path=command_search_path([*user_profiles(), *extra]), check=command_faults)
    except OverlapConfigError as err:
        return [str(f) for f in err.faults]
    return []


def _field_fault(o: CommandLineOverride, known: dict[str, tuple[str, ...]]) -> Fault | None:
    """A fault for ``o``'s key, or None: its top-level key first, then its field."""
    appending = o.prefix in ("+", "++")
    top = o.key.split(".", 1)[0]
    if top not in known[""]:
        added = " ('+' adds a key, but nothing reads it)" if appending else ""
        return Fault(o.key, f"unknown top-level key {top!r}{did_you_mean(top, known[''])}{added}; the command "
                            f"reads: {', '.join(sorted(known['']))}")
    parent, _, leaf = o.key.rpartition(".")
    if appending or parent not in known or leaf in known[parent]:
        return None
    return Fault(o.key, f"unknown field{did_you_mean(leaf, known[parent])}; valid fields: "
                        f"{', '.join(sorted(known[parent]))}")


def _node_costs_faults(o: CommandLineOverride) -> Iterator[Fault]:
    value = o.value()
    if value is None:
        return
    if not isinstance(value, str):
        yield Fault(o.key, f"expected the path of a node_costs.json, got {o.value_text!r}")
        return
    from overlapcfg.cost.node_costs_file import read_node_costs

    try:
        read_node_costs(Path(value), root=o.key)
    except OverlapConfigError as err:  # the file itself (its fault is at the key), or what it holds
        for f in err.faults:
            what = f"{f.path}: {f.message}" if f.path and f.path != o.key else f.message
            yield Fault(o.key, f"{err.header}: {what}" if err.header else what)
