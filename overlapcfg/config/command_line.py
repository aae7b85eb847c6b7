"""A preset by name on a Hydra command line is the same config as the group option, fields on top included.

Hydra reads ``overlap.policy=aggressive`` as a *value*: the policy node becomes the string ``'aggressive'``, a
preset name ``from_hydra`` looks up. A field set next to it then has nothing to land in::

    overlap/policy=aggressive overlap.policy.forward_prefetch=4    the preset's fields, forward_prefetch 4
    overlap.policy=aggressive overlap.policy.forward_prefetch=4    Hydra: "Key 'forward_prefetch' is not in struct"
    overlap.policy=aggressive +overlap.policy.forward_prefetch=4   (Hydra's hint) policy {forward_prefetch: 4}:
                                                                    the preset is gone, depths fall back to 1
    overlap.policy.forward_prefetch=4 overlap.policy=aggressive    the field is gone, no word either

Two mechanisms make the by-name spelling mean what the group option means, wherever the ``overlap`` group is
mounted (``overlap``, ``trainer.overlap``):

- **before Hydra composes** (``preset_overrides``; the ``overlapcfg`` command always, a user's ``@hydra.main`` app
  through the ``with_hydra_overrides`` decorator, the compose API through ``hydra_overrides``):
  ``<mount>.plan=NAME`` / ``<mount>.policy=NAME`` (a sweep ``NAME,NAME`` too) becomes the group option
  (``overlap/policy=NAME``, or ``overlap/policy@trainer.overlap.policy=NAME`` where the group is mounted
  elsewhere), and ``+<mount>.policy.FIELD=V`` becomes ``++`` (the key exists once the preset is composed; in a
  user's app every field of a plan or policy does, since the app's own presets may list only a few). Keys
  under a mount the config has no field for are refused there, with the closest field (``override_faults``):
  Hydra itself only says "not in struct".
- **after Hydra composed** (``with_presets_chosen_by_name``, run by ``from_hydra``): for apps that rewrite
  nothing, the command line Hydra recorded says which node a by-name choice replaced; the node is rebuilt as the
  preset with every field override of the command line on top, whatever their order and prefix. Hydra's own
  answer to the second line above (its ``+`` hint) so gives the group option's config instead of dropping the
  preset. The rebuilt node is logged; the DictConfig itself is Hydra's and stays as composed.

A plan preset records its name (``plan.name``, shown in reports) in both spellings: a preset chosen as a group
option without a ``name`` of its own (a user's ``overlap/plan/mine.yaml``) takes the option's name where its
buckets are the preset's, as the by-name lookup always did.

Only plain names are rewritten (``aggressive``, ``per_block_split``, ``a,b``): ``null``, mappings and sweep
functions (``choice(...)``) stay values, as Hydra reads them. Which strategy's policy fields are valid is known
where the config is (the command: its own YAML; ``strategy=``); in a user's app the YAML may set another
strategy than the command line shows, so a field of any strategy's policy passes and the composed config is
validated by ``from_hydra`` as always.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from overlapcfg.compat.omegaconf import CommandLineOverride, parse_command_line
from overlapcfg.config.contracts import contract_of, strategy_names
from overlapcfg.config.overlap import OverlapConfig
from overlapcfg.config.plan import BucketPlan
from overlapcfg.config.presets import load_preset
from overlapcfg.errors import Fault, OverlapConfigError, did_you_mean

__all__ = ["PRESET_GROUPS", "chosen_by_name", "hydra_overrides", "override_faults", "preset_overrides",
           "with_hydra_overrides", "with_presets_chosen_by_name"]

log = logging.getLogger(__name__)

PRESET_GROUPS = ("plan", "policy")
"""The ``overlap`` groups whose option may also be written by name, as a value."""
GROUP = "overlap"
"""The config group users mount (``defaults: [overlap: default]``, ``overlap@trainer.overlap: default``)."""
_NAMES = re.compile(r"[A-Za-z_][\w-]*(,[A-Za-z_][\w-]*)*")
"""A plain preset name, or a comma list of them (a sweep over presets)."""
_LITERALS = frozenset({"null", "true", "false"})
"""Hydra's grammar reads these (in any case) as null and booleans, not as names."""

F = TypeVar("F", bound=Callable[..., Any])


def preset_overrides(args: Iterable[str], *, mounts: Sequence[str] = (GROUP,), any_preset: bool = False) -> list[str]:
    """``args`` with every by-name preset choice at a mount written as the group option (module docstring); every
    other argument unchanged, in place.

    ``any_preset``: also write a field set on a plan or policy (``<mount>.policy.forward_prefetch=4``) as ``++``, so
    it lands whether or not the chosen preset lists it (Hydra only changes keys that exist). A user's own preset
    may list a few fields; the shipped ones list every field (the command leaves this off, and its sweep
    summaries show the overrides as written)."""
    args = list(args)
    parsed = parse_command_line(args)
    switched = {chosen for o in parsed if o is not None and (chosen := _by_name(o, mounts)) is not None}
    out = []
    for arg, o in zip(args, parsed, strict=True):
        if o is None:
            out.append(arg)
            continue
        chosen = _by_name(o, mounts)
        if chosen is not None:
            mount, group = chosen
            target = f"{GROUP}/{group}" if mount == GROUP else f"{GROUP}/{group}@{mount}.{group}"
            out.append(f"{target}={o.value_text}")
            continue
        field = _field_of_group(o, mounts)
        if field is not None and _is_field(*field[1:]) and (
                (o.prefix == "+" and field[:2] in switched) or (o.prefix == "" and any_preset)):
            # '+' on a key the composed preset has is "already at"; '++' sets it whether the preset lists it or not
            out.append(f"++{o.text.lstrip('+')}")
            continue
        out.append(arg)
    return out


def chosen_by_name(arg: str, *, mounts: Sequence[str] = (GROUP,)) -> tuple[str, str] | None:
    """``(mount, group)`` where ``arg`` chooses a preset by name (``trainer.overlap.plan=mine``), else None."""
    (o,) = parse_command_line([arg])
    return None if o is None else _by_name(o, mounts)


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
            below = _below(o, mount)
            if not below or o.prefix == "~" or (len(below) == 1 and o.prefix in ("", "++")
                                                and below[0] in PRESET_GROUPS):
                continue
            fault = _field_fault(o, below, active)
            if fault is not None:
                faults.append(fault)
    return faults


def hydra_overrides(args: Iterable[str], *, mounts: Sequence[str] = (GROUP,), strategy: str | None = None) -> list[str]:
    """``preset_overrides`` of ``args`` after ``override_faults`` found none; else ``OverlapConfigError`` listing
    them. For Hydra's compose API: ``compose("train", overrides=overlapcfg.hydra_overrides(overrides,
    mounts=["trainer.overlap"]))``."""
    args = list(args)
    faults = override_faults(args, mounts=mounts, strategy=strategy)
    if faults:
        raise OverlapConfigError(faults, header="invalid overrides")
    return preset_overrides(args, mounts=mounts, any_preset=True)


def with_hydra_overrides(*, mounts: Sequence[str] = (GROUP,)) -> Callable[[F], F]:
    """A decorator above ``@hydra.main``: the command line (``sys.argv``) goes through ``hydra_overrides`` before
    Hydra parses it; a fault exits with status 1 and the message, as Hydra does for its own::

        @overlapcfg.with_hydra_overrides(mounts=["trainer.overlap"])   # where defaults mount the overlap group
        @hydra.main(config_path="conf", config_name="train", version_base="1.3")
        def main(cfg): ...
    """
    mounts = tuple(mounts)

    def decorate(main: F) -> F:
        @functools.wraps(main)
        def run(*a: Any, **kw: Any) -> Any:
            try:
                sys.argv[1:] = hydra_overrides(sys.argv[1:], mounts=mounts)
            except OverlapConfigError as err:
                sys.exit(str(err))
            return main(*a, **kw)

        return run  # type: ignore[return-value]  # the same call signature as main: what it wraps

    return decorate


def with_presets_chosen_by_name(data: Mapping[str, Any], *, mount: str,
                                command_line: tuple[Sequence[str], Mapping[str, str]] | None) -> dict[str, Any]:
    """``data`` (a composed overlap node as plain data, mounted at ``mount``) with each node a by-name choice on
    ``command_line`` (Hydra's task overrides and group choices) replaced rebuilt as the preset plus that command
    line's field overrides, and a group-chosen plan named after its option (module docstring)."""
    out = dict(data)
    if command_line is None:
        return out
    overrides, choices = command_line
    parsed = [o for o in parse_command_line(overrides) if o is not None]
    for group in PRESET_GROUPS:
        rebuilt = _rebuilt(out.get(group), parsed, mount, group)
        if rebuilt is not None:
            out[group] = rebuilt
    plan, chosen = out.get("plan"), choices.get(f"{GROUP}/plan" if mount == GROUP else f"{GROUP}/plan@{mount}.plan")
    if isinstance(plan, Mapping) and plan.get("name") is None and chosen and _same_buckets(plan, chosen):
        out["plan"] = {**plan, "name": chosen}
    return out


# --- before composing ----------------------------------------------------------------------------------------------

def _below(o: CommandLineOverride, mount: str) -> tuple[str, ...] | None:
    """The key's parts below ``mount`` (``()`` for the mount itself), or None when it is not under it or is a group
    option (``overlap/plan=...``) rather than a value."""
    if "/" in o.key or o.package is not None:
        return None
    if o.key == mount:
        return ()
    return tuple(o.key[len(mount) + 1:].split(".")) if o.key.startswith(f"{mount}.") else None


def _by_name(o: CommandLineOverride, mounts: Sequence[str]) -> tuple[str, str] | None:
    """``(mount, group)`` where ``o`` chooses a preset of ``group`` by name at ``mount``."""
    if o.prefix not in ("", "++") or not _NAMES.fullmatch(o.value_text):
        return None
    if any(name.lower() in _LITERALS for name in o.value_text.split(",")):
        return None
    for mount in mounts:
        below = _below(o, mount)
        if below is not None and len(below) == 1 and below[0] in PRESET_GROUPS:
            return mount, below[0]
    return None


def _field_of_group(o: CommandLineOverride, mounts: Sequence[str]) -> tuple[str, str, str] | None:
    """``(mount, group, field)`` where ``o`` sets a field of a preset group's node."""
    for mount in mounts:
        below = _below(o, mount)
        if below is not None and len(below) >= 2 and below[0] in PRESET_GROUPS:
            return mount, below[0], below[1]
    return None


def _is_field(group: str, field: str) -> bool:
    """Whether ``field`` is one a plan (``group="plan"``) or some strategy's policy has."""
    return field in (BucketPlan.model_fields if group == "plan" else _all_policy_fields())


def _chosen_policy(o: CommandLineOverride, mount: str) -> str | None:
    """The policy option ``o`` chooses at ``mount``, by name or as the group option."""
    if _below(o, mount) == ("policy",):
        return o.value_text
    if o.key == f"{GROUP}/policy" and (o.package or f"{GROUP}.policy") == f"{mount}.policy":
        return o.value_text
    return None


def _active_strategy(parsed: Sequence[CommandLineOverride], mount: str, default: str | None) -> str | None:
    """The strategy the command line leaves at ``mount``: an explicit ``<mount>.strategy=...``, else the one a
    chosen policy preset names (``auto``), else ``default``."""
    chosen = policy = None
    for o in parsed:
        if _below(o, mount) == ("strategy",):
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


def _field_fault(o: CommandLineOverride, below: tuple[str, ...], strategy: str | None) -> Fault | None:
    """A fault for ``o`` (a key below a mount), or None: the field right below the mount, or right below its
    plan or policy."""
    added = " ('+' adds a key, but the overlap config refuses keys it does not know)" if o.prefix else ""
    if below[0] not in OverlapConfig.model_fields:
        return _unknown(o.key, below[0], tuple(OverlapConfig.model_fields), added)
    if len(below) < 2 or below[0] not in PRESET_GROUPS:
        return None
    leaf = below[1]
    if below[0] == "plan":
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
    from overlapcfg.config.presets import preset_names

    for name in sorted(preset_names("policy"), key=lambda n: n != "default"):
        if load_preset("policy", name).get("strategy", "manual") == strategy:
            return f"overlap/policy={name}"
    return f"overlap.strategy={strategy}"


# --- after composing -----------------------------------------------------------------------------------------------

def _rebuilt(composed: Any, parsed: Sequence[CommandLineOverride], mount: str, group: str) -> dict[str, Any] | None:
    """The node ``group`` at ``mount`` as the group option would have composed it, where the command line chose
    its preset by name; None where it did not, or where the composed node is not what that command line makes
    (then it was not composed from it, and is left alone)."""
    names = [o for o in parsed if _by_name(o, (mount,)) == (mount, group) and not o.is_sweep]
    if not names:
        return None
    name = names[-1].value_text
    fields = {}
    for o in parsed:
        below = _below(o, mount)
        if below is not None and len(below) == 2 and below[0] == group and o.prefix != "~":
            fields[below[1]] = o.value()
    if composed != name and not (isinstance(composed, Mapping) and set(composed) <= set(fields)
                                 and all(composed[k] == fields[k] for k in composed)):
        return None
    try:
        preset = load_preset(group, name)
    except KeyError:
        return None  # an unknown name: validation names it, with the closest presets
    if group == "plan":
        preset.setdefault("name", name)
    if not fields and composed == name:
        return None  # the name alone: validation looks it up, as it always did
    where = f"{mount}.{group}"
    log.info("%s: preset %r chosen by name on the command line, with %s on top (as %s/%s=%s would compose it)",
             where, name, ", ".join(f"{where}.{k}" for k in fields) or "no field", GROUP, group, name)
    return {**preset, **fields}


def _same_buckets(plan: Mapping[str, Any], name: str) -> bool:
    """Whether ``plan``'s entries mean what preset ``name``'s do (how they are written aside)."""
    try:
        shipped = load_preset("plan", name)
        return (BucketPlan.model_validate({"buckets": plan.get("buckets", [])}).buckets
                == BucketPlan.model_validate({"buckets": shipped.get("buckets", [])}).buckets)
    except (KeyError, TypeError, ValueError):
        return False
