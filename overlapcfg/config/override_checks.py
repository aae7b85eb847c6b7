"""Overrides under an ``overlap`` mount checked against the schema before Hydra composes (torch-free).

Hydra answers a key no config has with its bare ``Key 'forwad_prefetch' is not in struct`` (and, for a ``+``
override, adds it without a word). Here every override below a mount where the ``overlap`` group sits
(``overlap``, ``trainer.overlap``) is held against the fields the config has, in the project's words, with the
closest fields: a field right below the mount, or right below its plan or policy. Which strategy's policy fields
are valid is known where the config is (the command: ``manual`` unless the command line changes it); in a user's
app the YAML may set another strategy than the command line shows, so a field of any strategy's policy passes and
``from_hydra`` holds the composed config to its strategy's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from overlapcfg.compat.omegaconf import CommandLineOverride, parse_command_line
from overlapcfg.config.contracts import contract_of, strategy_names
from overlapcfg.config.overlap import OverlapConfig
from overlapcfg.config.plan import BucketPlan
from overlapcfg.config.presets import load_preset, preset_names
from overlapcfg.errors import Fault, OverlapConfigError, did_you_mean

__all__ = ["GROUP", "PRESET_GROUPS", "below", "is_field", "null_policy_fault", "override_faults"]

PRESET_GROUPS = ("plan", "policy")
"""The ``overlap`` groups whose option may also be written by name, as a value."""
GROUP = "overlap"
"""The config group users mount (``defaults: [overlap: default]``, ``overlap@trainer.overlap: default``)."""


def override_faults(args: Iterable[str], *, mounts: Sequence[str] = (GROUP,),
                    strategy: str | None = None) -> list[Fault]:
    """One fault per override that sets a key under a mount which the config has no field for, with the closest
    fields. ``strategy``: the one the composed config has unless the command line changes it (``"manual"`` for the
    command); None where it is unknown before composing (a user's app): then a field of any strategy's policy
    passes, and ``from_hydra`` holds the composed config to its strategy's."""
    parsed = [o for o in parse_command_line(args) if o is not None]
    faults = []
    for mount in mounts:
        active = _active_strategy(parsed, mount, strategy)
        for o in parsed:
            under = below(o, mount)
            if under == ("policy",) and o.is_null and o.prefix != "~":
                faults.append(null_policy_fault(mount))
                continue
            if not under or o.prefix == "~" or (len(under) == 1 and o.prefix in ("", "++")
                                                and under[0] in PRESET_GROUPS):
                continue
            fault = _field_fault(o, under, active)
            if fault is not None:
                faults.append(fault)
    return faults


def null_policy_fault(mount: str) -> Fault:
    """``<mount>.policy=null``: Hydra composes a policy of None, which would run the strategy's defaults without a
    word; say what to write instead. The one wording, before composing (``override_faults``) and in a node Hydra
    composed alone (``from_hydra``)."""
    option = f"{GROUP}/policy" if mount == GROUP else f"{GROUP}/policy@{mount}.policy"
    return Fault(f"{mount}.policy", f"null: a policy cannot be unset (it would run the strategy's defaults without a "
                                    f"word); for the default policy write {option}=default or leave {mount}.policy "
                                    f"out; to leave the graph alone write {mount}.strategy=none")


def below(o: CommandLineOverride, mount: str) -> tuple[str, ...] | None:
    """The key's parts below ``mount`` (``()`` for the mount itself), or None when it is not under it or is a group
    option (``overlap/plan=...``) rather than a value."""
    if "/" in o.key or o.package is not None:
        return None
    if o.key == mount:
        return ()
    return tuple(o.key[len(mount) + 1:].split(".")) if o.key.startswith(f"{mount}.") else None


def is_field(group: str, field: str) -> bool:
    """Whether ``field`` is one a plan (``group="plan"``) or some strategy's policy has."""
    return field in (BucketPlan.model_fields if group == "plan" else _all_policy_fields())


def _chosen_policy(o: CommandLineOverride, mount: str) -> str | None:
    """The policy option ``o`` chooses at ``mount``, by name or as the group option."""
    if below(o, mount) == ("policy",):
        return o.value_text
    if o.key == f"{GROUP}/policy" and (o.package or f"{GROUP}.policy") == f"{mount}.policy":
        return o.value_text
    return None


def _active_strategy(parsed: Sequence[CommandLineOverride], mount: str, default: str | None) -> str | None:
    """The strategy the command line leaves at ``mount``: an explicit ``<mount>.strategy=...``, else the one a
    chosen policy preset names (``auto``), else ``default``."""
    chosen = policy = None
    for o in parsed:
        if below(o, mount) == ("strategy",):
            chosen = o.value_text
        elif (name := _chosen_policy(o, mount)) is not None:
            policy = name
    if chosen is not None:
        return chosen
    if policy is not None and "," not in policy:
        try:
            owner = load_preset("policy", policy).get("strategy")
        except (KeyError, TypeError):
            owner = None
        if isinstance(owner, str):
            return owner
        if default is None:
            return None  # a preset of the app's own, or one without a strategy: composing says
    return default


def _policy_fields(strategy: str) -> tuple[str, ...]:
    try:
        return tuple(contract_of(strategy).policy.model_fields)
    except OverlapConfigError:  # an unknown strategy: its own fault comes from validation
        return ()


def _all_policy_fields() -> tuple[str, ...]:
    return tuple(sorted({f for name in strategy_names() for f in _policy_fields(name)}))


def _fields_by_strategy() -> str:
    """``auto: a, b; manual, torch_manual: c, d``: each policy's fields once, with the strategies that read it."""
    owners: dict[tuple[str, ...], list[str]] = {}
    for name in strategy_names():
        if contract_of(name).reads_policy:
            owners.setdefault(tuple(sorted(_policy_fields(name))), []).append(name)
    return "; ".join(f"{', '.join(names)}: {', '.join(fields)}" for fields, names in owners.items())


def _field_fault(o: CommandLineOverride, under: tuple[str, ...], strategy: str | None) -> Fault | None:
    """A fault for ``o`` (a key below a mount), or None: the field right below the mount, or right below its
    plan or policy."""
    added = " ('+' adds a key, but the overlap config refuses keys it does not know)" if o.prefix else ""
    if under[0] not in OverlapConfig.model_fields:
        return _unknown(o.key, under[0], tuple(OverlapConfig.model_fields), added)
    if len(under) < 2 or under[0] not in PRESET_GROUPS:
        return None
    leaf = under[1]
    if under[0] == "plan":
        return None if leaf in BucketPlan.model_fields else _unknown(o.key, leaf, tuple(BucketPlan.model_fields),
                                                                     added)
    own = _policy_fields(strategy) if strategy is not None else ()
    if not own:
        every = _all_policy_fields()
        if leaf in every:
            return None
        return Fault(o.key, f"unknown field of any strategy's policy{did_you_mean(leaf, every)}{added}; valid "
                            f"fields, by strategy: {_fields_by_strategy()}")
    if leaf in own:
        return None
    valid = ", ".join(sorted(own))
    owners = [name for name in strategy_names() if contract_of(name).reads_policy and leaf in _policy_fields(name)]
    if owners:
        return Fault(o.key, f"not a field of the policy of strategy {strategy!r}; it belongs to strategy "
                            f"{', '.join(map(repr, owners))} ({_selector(owners[0])}); valid fields: {valid}")
    return Fault(o.key, f"unknown field of the policy of strategy {strategy!r}{did_you_mean(leaf, own)}{added}; "
                        f"valid fields: {valid}")


def _unknown(key: str, leaf: str, valid: tuple[str, ...], added: str, what: str = "") -> Fault:
    return Fault(key, f"unknown field{what}{did_you_mean(leaf, valid)}{added}; valid fields: "
                      f"{', '.join(sorted(valid))}")


def _selector(strategy: str) -> str:
    """How to switch to ``strategy`` with its policy: a shipped policy preset of it (one without a ``strategy`` key
    belongs to the default, ``manual``), ``default`` first; else the strategy alone."""
    for name in sorted(preset_names("policy"), key=lambda n: n != "default"):
        if load_preset("policy", name).get("strategy", "manual") == strategy:
            return f"overlap/policy={name}"
    return f"overlap.strategy={strategy}"
