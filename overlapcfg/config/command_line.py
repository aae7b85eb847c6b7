"""A preset by name on a Hydra command line is the group option, fields on top included: the one mechanism.

Hydra reads ``overlap.policy=aggressive`` as a *value*: the policy node becomes the string ``'aggressive'``, a
preset name ``from_hydra`` looks up among the shipped presets. A field set next to it then has nothing to land in::

    overlap/policy=aggressive overlap.policy.forward_prefetch=4    the preset's fields, forward_prefetch 4
    overlap.policy=aggressive overlap.policy.forward_prefetch=4    Hydra: "Key 'forward_prefetch' is not in struct"
    overlap.policy=aggressive +overlap.policy.forward_prefetch=4   (Hydra's hint) policy {forward_prefetch: 4}:
                                                                    the preset is gone, depths fall back to 1
    overlap.policy.forward_prefetch=4 overlap.policy=aggressive    the field is gone, no word either

``hydra_overrides`` turns such a command line into one Hydra composes as the group option, before composing, with
Hydra's own override parser (``overlapcfg.compat.omegaconf.parse_command_line``), wherever the ``overlap`` group is
mounted (``overlap``, ``trainer.overlap``):

- ``<mount>.plan=NAME`` / ``<mount>.policy=NAME`` (a sweep ``NAME,NAME`` too) becomes the group option
  (``overlap/policy=NAME``, or ``overlap/policy@trainer.overlap.policy=NAME`` where the group is mounted
  elsewhere);
- a field set on a plan or a policy (``<mount>.policy.FIELD=V``, ``+<mount>.policy.FIELD=V``) becomes ``++``: it
  lands whether or not the chosen preset lists it (a user's own preset may list a few fields), in any order;
- a name Hydra would read as a number or a boolean (``nan``, ``inf``, ``true``, ``1``) is quoted, so it is looked
  up as the option of that name (Hydra refuses a group option that is not a string: "Config group override must
  be a string or a list. Got float"); with a search path, for any config group (``hardware=nan``);
- a plan option chosen without a ``name:`` of its own (a user's ``overlap/plan/mine.yaml``) is named after the
  option (``++<mount>.plan.name=mine``, shown in reports), unless its buckets or name are set on the command line;
- faults, all at once, before anything composes: a key under a mount the config has no field for, with the
  closest fields (``overlapcfg.config.override_checks``), and ``<mount>.policy=null`` (what to write instead).

Every route uses this function: the ``overlapcfg`` command, a user's app through ``overlapcfg.hydra_main`` or
``with_hydra_overrides`` (``overlapcfg.config.hydra_app``), and the compose API
(``compose("train", overrides=overlapcfg.hydra_overrides(overrides, mounts=["trainer.overlap"]))``). Nothing is
read back after composing: ``from_hydra(node)`` is a function of the node alone.

Only plain names are rewritten (``aggressive``, ``per_block_split``, ``1``, ``a,b``): ``null``, mappings, lists and
sweep functions other than ``choice`` stay values, as Hydra reads them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

from overlapcfg.compat.omegaconf import CommandLineOverride, composing_search_path, parse_command_line
from overlapcfg.config.hydra_files import SearchPath, group_of, read_composition
from overlapcfg.config.override_checks import GROUP, PRESET_GROUPS, below, is_field, override_faults
from overlapcfg.config.yaml_files import read_yaml
from overlapcfg.errors import OverlapConfigError

__all__ = ["GROUP", "PRESET_GROUPS", "as_written", "hydra_overrides"]

_NAME = re.compile(r"[\w.-]+")
"""A preset name as a value (``aggressive``, ``1``, ``nan``): anything else (``4:8``, ``x y``) stays a value."""


def hydra_overrides(args: Iterable[str], *, mounts: Sequence[str] = (GROUP,), strategy: str | None = None,
                    search_path: SearchPath | None = None) -> list[str]:
    """``args`` as the overrides Hydra should compose (module docstring), every other argument unchanged, in
    place; ``OverlapConfigError`` listing every fault first.

    ``strategy``: the one the composed config has unless the command line changes it (the command: ``manual``),
    None in a user's app. ``search_path``: where the app's configs are; default: the search path of the Hydra
    instance in use (inside ``initialize_config_dir``), if any. With one, any config group's option named like a
    number is quoted and a plan option without a name of its own is named; with the one found, the chosen options'
    files are read bounded and one that does not exist is a fault (the closest options first), as ``run_app`` does
    for an app."""
    args = list(args)
    faults = override_faults(args, mounts=mounts, strategy=strategy)
    if faults:
        raise OverlapConfigError(faults, header="invalid overrides")
    entries = composing_search_path() if search_path is None else None
    composing = entries is not None
    if entries is not None:
        search_path = SearchPath.of(entries)
    parsed = parse_command_line(args)
    out = [arg if o is None else _rewritten(o, mounts, search_path) for arg, o in zip(args, parsed, strict=True)]
    if search_path is not None:
        out += _plan_names(parse_command_line(out), mounts, search_path)
    if composing and search_path is not None:  # the compose API: the options chosen, read bounded before Hydra
        read_composition(search_path, None, [o for o in parse_command_line(out) if o is not None],
                         written=dict(zip(out, args, strict=False)))
    return out


def as_written(override: str, args: Iterable[str]) -> str:
    """``override`` (as Hydra recorded it for a job: ``++overlap.policy.forward_prefetch=2``) with the prefix the
    user wrote in ``args`` where ``hydra_overrides`` changed it, for tables that show a sweep's overrides."""
    if not override.startswith("++"):
        return override
    key = override[2:].partition("=")[0]
    for arg in args:
        if arg.lstrip("+").partition("=")[0] == key:
            return arg[: len(arg) - len(arg.lstrip("+"))] + override[2:]
    return override


def _rewritten(o: CommandLineOverride, mounts: Sequence[str], search_path: SearchPath | None) -> str:
    chosen = _by_name(o, mounts)
    if chosen is not None:
        mount, group = chosen
        target = f"{GROUP}/{group}" if mount == GROUP else f"{GROUP}/{group}@{mount}.{group}"
        return f"{target}={_option_text(o)}"
    field = _field_of_group(o, mounts)
    if field is not None and is_field(field[1], field[2]):
        # '+' on a key a composed preset has is "already at"; '++' sets it whether the preset lists it or not
        return f"++{o.text.lstrip('+')}"
    if o.typed and (o.key.startswith(f"{GROUP}/") or (search_path is not None
                                                       and group_of(o, search_path) is not None)):
        prefix = o.text[: len(o.text) - len(o.text.lstrip("+"))]
        package = f"@{o.package}" if o.package else ""
        return f"{prefix}{o.key}{package}={_option_text(o)}"
    return o.text


def _by_name(o: CommandLineOverride, mounts: Sequence[str]) -> tuple[str, str] | None:
    """``(mount, group)`` where ``o`` chooses a preset of ``group`` by name at ``mount``."""
    if o.prefix not in ("", "++") or o.options is None or o.value_text.lstrip().startswith("["):
        return None
    if not all(_NAME.fullmatch(name) for name in o.options):
        return None
    for mount in mounts:
        under = below(o, mount)
        if under is not None and len(under) == 1 and under[0] in PRESET_GROUPS:
            return mount, under[0]
    return None


def _field_of_group(o: CommandLineOverride, mounts: Sequence[str]) -> tuple[str, str, str] | None:
    """``(mount, group, field)`` where ``o`` sets a field of a plan or policy (not a deletion, not ``++``)."""
    if o.prefix not in ("", "+"):
        return None
    for mount in mounts:
        under = below(o, mount)
        if under is not None and len(under) >= 2 and under[0] in PRESET_GROUPS:
            return mount, under[0], under[1]
    return None


def _option_text(o: CommandLineOverride) -> str:
    """The value of a group choice, each name Hydra would read as a number or a boolean quoted (``'nan'``)."""
    if not o.typed:
        return o.value_text
    assert o.options is not None  # typed names are among the options
    return ",".join(f"'{name}'" if name in o.typed else name for name in o.options)


def _plan_names(parsed: Sequence[CommandLineOverride | None], mounts: Sequence[str],
                search_path: SearchPath) -> Iterator[str]:
    """``++<mount>.plan.name=<option>`` for each plan option chosen (one, not a sweep) whose file has no ``name``
    and whose buckets and name the command line leaves alone."""
    overrides = [o for o in parsed if o is not None]
    for mount in mounts:
        package = f"{mount}.plan"
        chosen = [o for o in overrides if o.key == f"{GROUP}/plan" and (o.package or f"{GROUP}.plan") == package
                  and o.prefix == "" and not o.is_sweep and o.options is not None and len(o.options) == 1]
        touched = any(below(o, mount) in (("plan", "buckets"), ("plan", "name")) for o in overrides)
        if not chosen or touched:
            continue
        option = (chosen[-1].options or ("",))[0]  # one option, checked above
        file = search_path.find(f"{GROUP}/plan/{option}")
        data = read_yaml(file, package, what="plan preset") if file is not None else None
        if isinstance(data, Mapping) and "name" not in data:
            yield f"++{package}.name='{option}'"  # quoted: a name such as 1 or true stays a string
