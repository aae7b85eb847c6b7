"""The ``overlapcfg`` command's own check of its command line, before Hydra composes anything (torch-free).

Hydra's answers to a typo are its own: ``Key 'modle' is not in struct`` and a suggestion to append
(``+modle.n_layers=2``, which it then accepts and the job ignores), or a list of a group's options with no closest
one (``hardware=h100``). Here every override is held against what the command reads, in the project's words:

- a top-level key the command does not read (``modle.n_layers=2``, ``+modle.n_layers=2``): rejected, closest key;
- a field no model of its node has (``parallel.dp_shrd=2``): closest field and the valid ones;
- a policy field of another strategy than the active one (``overlap.policy.max_in_flight_gb`` with ``manual``):
  the valid fields are the active strategy's, and the strategy the field belongs to is named;
- a group option that does not exist (``hardware=h100``, ``overlap/plan=llama_layer``): closest option first.

Left to Hydra: deletions (``~``), Hydra's own keys and groups (``hydra.*``, ``hydra/...``), sweep expressions
other than a plain comma list, and group options when the search path is extended (``hydra.searchpath``,
``--config-dir``): those can add options this module cannot see.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from overlapcfg.config.presets import command_conf_dir, conf_dir, load_preset
from overlapcfg.cost.hardware import hardware_names
from overlapcfg.errors import closest_first, did_you_mean

__all__ = ["COMMAND_KEYS", "known_fields", "top_level_keys", "unknown_override_keys"]

COMMAND_KEYS = ("mode", "overlap", "hardware", "tune", "compare", "calibrate", "measure")
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


def known_fields(strategy: str = "manual") -> dict[str, tuple[str, ...]]:
    """Keys under each node the command validates with a pydantic model; ``overlap.policy`` is ``strategy``'s."""
    from overlapcfg.config.overlap import OverlapConfig
    from overlapcfg.demo.settings import DemoModel, DemoParallel

    return {"": top_level_keys(), "model": tuple(DemoModel.model_fields),
            "parallel": tuple(DemoParallel.model_fields), "overlap": tuple(OverlapConfig.model_fields),
            "overlap.policy": tuple(_policy_fields(strategy) or _all_policy_fields())}


def _policy_fields(strategy: str) -> tuple[str, ...]:
    from overlapcfg.config.contracts import contract_of
    from overlapcfg.errors import OverlapConfigError

    try:
        return tuple(contract_of(strategy).policy.model_fields)
    except OverlapConfigError:  # an unknown strategy: its own fault comes from validation
        return ()


def _all_policy_fields() -> tuple[str, ...]:
    from overlapcfg.config.contracts import strategy_names

    return tuple(sorted({f for name in strategy_names() for f in _policy_fields(name)}))


def _active_strategy(args: Sequence[str]) -> str:
    """The strategy the command line leaves active: an explicit ``overlap.strategy=...``, else the one a chosen
    policy belongs to (``overlap/policy=auto`` or ``overlap.policy=auto``), else the default (``manual``)."""
    chosen: str | None = None
    policy: str | None = None
    for arg in args:
        key, _, value = arg.partition("=")
        key = key.lstrip("+")
        if key == "overlap.strategy":
            chosen = value
        elif key in ("overlap/policy", "overlap.policy"):
            policy = value
    if chosen is not None:
        return chosen
    if policy is not None:
        try:
            owner = load_preset("policy", policy).get("strategy")
        except (KeyError, TypeError):
            owner = None
        if isinstance(owner, str):
            return owner
    return "manual"


def _options(group: str) -> tuple[str, ...]:
    if group == "hardware":  # shipped profiles and the user's own (mode=calibrate writes them there)
        return hardware_names()
    tree, path = _GROUPS[group]
    root: Path = command_conf_dir() if tree == "command" else conf_dir()
    return tuple(sorted(p.stem for p in (root / path).glob("*.yaml")))


def _group_fault(key: str, value: str) -> str | None:
    options = _options(key)
    if not _PLAIN_VALUES.fullmatch(value):
        return None  # a sweep expression (range(...), glob(...)): Hydra's to expand
    for option in value.split(","):
        if (option in ("null", "None") and key == "hardware") or option in options:
            continue
        listing = ", ".join(closest_first(option, options))
        return (f"{key}={value}: no option {option!r} in group {key}{did_you_mean(option, options)}; options "
                f"(closest first): {listing}")
    return None


def _field_fault(key: str, known: dict[str, tuple[str, ...]], strategy: str, *, appending: bool = False) -> str | None:
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
    if parent == "overlap.policy":
        from overlapcfg.config.contracts import contract_of, strategy_names

        owners = [name for name in strategy_names()
                  if contract_of(name).reads_policy and leaf in _policy_fields(name)]
        if owners:
            return (f"{key}: not a field of the policy of strategy {strategy!r}; it belongs to strategy "
                    f"{', '.join(map(repr, owners))} ({_selector(owners[0])}); valid fields: {valid}")
        return (f"{key}: unknown field of the policy of strategy {strategy!r}"
                f"{did_you_mean(leaf, known[parent])}; valid fields: {valid}")
    return f"{key}: unknown field{did_you_mean(leaf, known[parent])}; valid fields: {valid}"


def _selector(strategy: str) -> str:
    """How to switch to ``strategy`` with its policy: a policy preset of it (one without a ``strategy`` key
    belongs to the default, ``manual``), ``default`` first; else the strategy alone."""
    presets = sorted(_options("overlap/policy"), key=lambda name: name != "default")
    for name in presets:
        if load_preset("policy", name).get("strategy", "manual") == strategy:
            return f"overlap/policy={name}"
    return f"overlap.strategy={strategy}"


def unknown_override_keys(args: Iterable[str]) -> list[str]:
    """One fault per override that sets something the command does not read, or picks a group option that does
    not exist (see the module docstring); ``[]`` when every override is known."""
    args = list(args)
    strategy = _active_strategy(args)
    known = known_fields(strategy)
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
        if "/" in key or (key in _GROUPS and not appending):  # a group option: hardware=..., overlap/plan=...
            fault = _group_fault(key, value) if key in _GROUPS and groups_visible and not package else None
        else:  # appending (+key=...) adds below a node; only its top-level key must be one the command reads
            fault = _field_fault(key, known, strategy, appending=appending)
        if fault is not None:
            faults.append(fault)
    return faults
