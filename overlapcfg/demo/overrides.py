"""The ``overlapcfg`` command's own check of its command line, before Hydra composes anything (torch-free).

Hydra's answers to a typo are its own: ``Key 'modle' is not in struct`` and a suggestion to append
(``+modle.n_layers=2``, which it then accepts and the job ignores), or a list of a group's options with no closest
one (``hardware=h100``). Here every override is held against what the command reads, in the project's words:

- a top-level key the command does not read (``modle.n_layers=2``, ``+modle.n_layers=2``): rejected, closest key;
- a field no model of its node has (``parallel.dp_shrd=2``): closest field and the valid ones;
- a policy field of another strategy than the active one (``overlap.policy.max_in_flight_gb`` with ``manual``):
  the valid fields are the active strategy's, and the strategy the field belongs to is named;
- a group option that does not exist (``hardware=h100``, ``overlap/plan=llama_layer``), also where it is chosen
  by name (``overlap.plan=llama_layer``): closest option first.

The overlap keys (``overlap.*``) are checked as in any Hydra app (``overlapcfg.config.command_line``), with the
command's own strategy (``manual``) known; ``main`` then rewrites presets chosen by name into group options, so
``overlap.policy=aggressive overlap.policy.forward_prefetch=4`` is the config ``overlap/policy=aggressive ...`` is.

Left to Hydra: deletions (``~``), Hydra's own keys and groups (``hydra.*``, ``hydra/...``), sweep expressions
other than a plain comma list, and group options when the search path is extended (``hydra.searchpath``,
``--config-dir``): those can add options this module cannot see.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from overlapcfg.config.command_line import chosen_by_name, override_faults
from overlapcfg.config.presets import command_conf_dir, conf_dir
from overlapcfg.cost.hardware import hardware_names
from overlapcfg.errors import closest_first, did_you_mean

__all__ = ["COMMAND_KEYS", "known_fields", "top_level_keys", "unknown_override_keys"]

COMMAND_KEYS = ("mode", "overlap", "hardware", "predict", "tune", "compare", "calibrate", "measure")
"""Top-level keys of ``conf/overlapcfg.yaml`` besides the demo settings (``overlapcfg.demo.settings``); a test
holds the composed config's keys to exactly these and the settings' fields."""
_GROUPS = {"hardware": ("command", "hardware"), "tune/space": ("command", "tune/space"),
           "overlap": ("presets", "overlap"), "overlap/plan": ("presets", "overlap/plan"),
           "overlap/policy": ("presets", "overlap/policy")}
"""The command's config groups and the tree their options live in."""
_PLAIN_VALUES = re.compile(r"[\w.-]+(,[\w.-]+)*")
_SEARCH_PATH_FLAGS = ("hydra.searchpath", "--config-dir", "-cd", "--config-path", "-cp")


def top_level_keys() -> tuple[str, ...]:
    from overlapcfg.demo.settings import DemoSettings

    return (*COMMAND_KEYS, *DemoSettings.model_fields)


def known_fields() -> dict[str, tuple[str, ...]]:
    """Keys under each node the command validates with a pydantic model (``overlap`` has its own check:
    ``overlapcfg.config.command_line.override_faults``)."""
    from overlapcfg.cost.pricing import Pricing
    from overlapcfg.demo.settings import DemoModel, DemoParallel

    return {"": top_level_keys(), "model": tuple(DemoModel.model_fields),
            "parallel": tuple(DemoParallel.model_fields), "predict": tuple(Pricing.model_fields)}


def _options(group: str) -> tuple[str, ...]:
    if group == "hardware":  # shipped profiles and the user's own (mode=calibrate writes them there)
        return hardware_names()
    tree, path = _GROUPS[group]
    root: Path = command_conf_dir() if tree == "command" else conf_dir()
    return tuple(sorted(p.stem for p in (root / path).glob("*.yaml")))


def _group_fault(key: str, value: str, *, written: str | None = None) -> str | None:
    """A fault for an option of group ``key`` that does not exist; ``written``: the key as the user wrote it
    (``overlap.plan``, a preset by name), when it differs from the group's."""
    options = _options(key)
    if not _PLAIN_VALUES.fullmatch(value):
        return None  # a sweep expression (range(...), glob(...)): Hydra's to expand
    for option in value.split(","):
        if (option in ("null", "None") and key == "hardware") or option in options:
            continue
        listing = ", ".join(closest_first(option, options))
        return (f"{written or key}={value}: no option {option!r} in group {key}{did_you_mean(option, options)}; "
                f"options (closest first): {listing}")
    return None


def _field_fault(key: str, known: dict[str, tuple[str, ...]], *, appending: bool = False) -> str | None:
    """A fault for ``key`` (as written, without ``+``), or None: its top-level key first, then its field."""
    top = key.split(".", 1)[0]
    if top not in known[""]:
        added = " ('+' adds a key, but nothing reads it)" if appending else ""
        return (f"{key}: unknown top-level key {top!r}{did_you_mean(top, known[''])}{added}; the command reads: "
                f"{', '.join(sorted(known['']))}")
    parent, _, leaf = key.rpartition(".")
    if appending or parent not in known or leaf in known[parent]:
        return None
    valid = ", ".join(sorted(known[parent]))
    return f"{key}: unknown field{did_you_mean(leaf, known[parent])}; valid fields: {valid}"


def unknown_override_keys(args: Iterable[str]) -> list[str]:
    """One fault per override that sets something the command does not read, or picks a group option that does
    not exist (see the module docstring); ``[]`` when every override is known."""
    args = list(args)
    known = known_fields()
    groups_visible = not any(a.startswith(_SEARCH_PATH_FLAGS) for a in args)
    faults = []
    for arg in args:
        if "=" not in arg or arg.startswith(("-", "~", "hydra")):
            continue
        key, _, value = arg.partition("=")
        appending = key.startswith("+")
        key, _, package = key.lstrip("+").partition("@")
        if key.startswith("hydra"):
            continue
        by_name = chosen_by_name(arg)
        if by_name is not None:  # a preset by name: checked as the group option the command runs it as
            fault = _group_fault(f"overlap/{by_name[1]}", value, written=key) if groups_visible else None
        elif key.startswith("overlap."):
            fault = None  # override_faults below
        elif "/" in key or (key in _GROUPS and not appending):  # a group option: hardware=..., overlap/plan=...
            fault = _group_fault(key, value) if key in _GROUPS and groups_visible and not package else None
        else:  # appending (+key=...) adds below a node; only its top-level key must be one the command reads
            fault = _field_fault(key, known, appending=appending)
        if fault is not None:
            faults.append(fault)
    faults += [str(f) for f in override_faults(args, mounts=("overlap",), strategy="manual")]
    return faults
