"""Turning whatever a user has (a model, a dict, a DictConfig, YAML text or a file) into an ``OverlapConfig``.

Each pydantic error becomes one ``Fault`` whose path is the dotted config path from where the user mounted the
config (``trainer.overlap.policy.…``; the wording lives in ``faults.py``, the YAML reader in ``yaml_files.py``).
Nothing a user passes escapes as anything but ``OverlapConfigError`` (a wrong Python type is ``TypeError``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from pydantic import BaseModel, TypeAdapter, ValidationError

from overlapcfg.compat.omegaconf import full_key, root_of
from overlapcfg.config.base import TARGET_KEY, TARGET_MESSAGE, collect_unknown_field_hints
from overlapcfg.config.boundary import DEFAULT_MOUNT
from overlapcfg.config.faults import faults_from_validation_error
from overlapcfg.config.interpolate import (
    KeyPath,
    format_path,
    has_references,
    parse_key_path,
)
from overlapcfg.config.overlap import OverlapConfig
from overlapcfg.config.override_checks import null_policy_fault
from overlapcfg.config.presets import preset_names
from overlapcfg.config.safe_yaml import dump_yaml
from overlapcfg.config.yaml_files import (
    MAX_FILE_BYTES,
    measure_or_fault,
    parse_yaml,
    read_text,
    with_references_resolved,
)
from overlapcfg.errors import (
    Fault,
    OverlapConfigError,
    OverlapUsageError,
    closest_first,
    did_you_mean,
    join_path,
    show_value,
)

__all__ = [
    "MAX_FILE_BYTES",
    "ConfigSource",
    "config_data",
    "dump_yaml",
    "from_hydra",
    "load_config",
    "validate_config",
    "validate_value",
]

M = TypeVar("M", bound=BaseModel)

HEADER = "invalid overlap config"

ConfigSource: TypeAlias = OverlapConfig | Mapping[str, Any] | DictConfig | str | os.PathLike[str]
"""Anything ``load_config`` turns into an ``OverlapConfig``."""

def load_config(src: ConfigSource, *, root: str = DEFAULT_MOUNT) -> OverlapConfig:
    """Validate ``src`` into an ``OverlapConfig``, or raise ``OverlapConfigError`` listing every fault.

    ``root`` is the prefix of every fault path: where the config sits in the user's own config tree. A Hydra node
    left at the default says it itself (``cfg.trainer.overlap`` gives ``trainer.overlap``, as ``from_hydra``), and
    a loaded ``OverlapConfig`` keeps where it was loaded from. A mapping with a single ``overlap`` key is
    unwrapped, so a recipe's whole config file can be passed.

    What each kind of ``src`` means:

    - ``str`` is always YAML *text*, never a file name (a file name is a valid YAML string, so guessing would
      make ``load_config(user_input)`` read arbitrary files). A file is read only when given as a
      ``pathlib.Path`` (any ``os.PathLike``); errors name the file (and, for YAML, line and column), and never
      echo its contents.
    - A plain ``Mapping`` is taken as it is: its strings are literal, ``${...}`` included.
    - YAML text, a file and a ``DictConfig`` may use ``${key}`` references to other keys (``${depth}``,
      ``${..x}``), resolved as OmegaConf would. Resolvers are refused with a fault naming the value
      (``${oc.env:SECRET}``, ``${oc.decode:...}``, any ``${name:...}``), also when reached through a reference:
      a config must not read the environment or run registered code.
    - YAML is read with bounded work: nesting deeper than ``MAX_DEPTH``, more than ``MAX_NODES`` values once
      aliases are expanded, and duplicate keys are faults (see ``overlapcfg.config.safe_yaml``). ``4:8`` is
      the string ``'4:8'`` (YAML 1.1 would read the integer 248).
    """
    if isinstance(src, OverlapConfig):
        return src if root in (DEFAULT_MOUNT, src.config_root) else src.mounted_at(root, file=src.mount.file)
    if isinstance(src, DictConfig) and root == DEFAULT_MOUNT:
        root = full_key(src) or DEFAULT_MOUNT
    data = _to_container(src, root)
    if not isinstance(data, Mapping):
        raise OverlapConfigError.single(root, f"expected a mapping, got {_describe(data, src)}")
    header = f"{HEADER} in {os.fspath(src)!r}" if isinstance(src, os.PathLike) else HEADER  # the file, whole
    if targets := list(_target_paths(data, root)):
        raise OverlapConfigError([Fault(p, TARGET_MESSAGE) for p in targets], header=header)
    if surrogates := list(_surrogate_faults(data, root)):
        raise OverlapConfigError(surrogates, header=header)
    file = os.fspath(src) if isinstance(src, os.PathLike) else None  # named in the faults found later
    return validate_config(OverlapConfig, dict(data), root=root, header=header).mounted_at(root, file=file)


def validate_config(model: type[M], data: Any, *, root: str, header: str = HEADER) -> M:
    """``model.model_validate(data)``, every fault translated into one ``OverlapConfigError`` under ``root``."""
    with collect_unknown_field_hints() as hints:
        try:
            return model.model_validate(data)
        except ValidationError as err:
            faults = faults_from_validation_error(err, root, hints)
    raise OverlapConfigError(faults, header=header)


def validate_value(kind: Any, value: Any, *, path: str, header: str | None = None) -> Any:
    """One value that is not part of a config model (a function's argument such as ``world_size=``) validated as
    the ``Annotated`` type ``kind`` (``RankCount``, ``ByteCount``), its fault under ``path``."""
    try:
        return TypeAdapter(kind).validate_python(value)
    except ValidationError as err:
        raise OverlapConfigError(faults_from_validation_error(err, path), header=header) from None


def from_hydra(node: DictConfig) -> OverlapConfig:
    """``load_config`` for a node of a composed Hydra config; fault paths start where the node is mounted.

    A function of the node alone: nothing the process ran before (a Hydra job's recorded command line, the search
    path of a Hydra instance) changes the config it gives. A plan or policy the node holds as a name
    (``overlap.policy=aggressive`` on the command line) is that shipped preset; a name that is none of them is
    refused, saying how to choose an app's own preset (as the group option ``overlap/policy=mine``, or by name
    through ``overlapcfg.hydra_main`` / ``hydra_overrides``, which compose it as one). A policy of null
    (``overlap.policy=null``) is refused with what to write instead.

    ``${key}`` references may point anywhere in the composed config; resolvers are refused, including Hydra's
    own ``${hydra:...}`` (the shipped ``overlap`` group never uses one: it only holds at run time).
    """
    if not isinstance(node, DictConfig):
        raise OverlapUsageError(f"from_hydra expects an omegaconf DictConfig node, got {type(node).__name__}")
    _refuse_whole_config(node)
    root = full_key(node) or "overlap"
    data = _to_container(node, root)
    if isinstance(data, Mapping):
        faults = list(_hydra_node_faults(data, root))
        if faults:
            raise OverlapConfigError(faults, header=HEADER)
        return load_config(data, root=root)
    return load_config(node, root=root)


def _hydra_node_faults(data: Mapping[str, Any], root: str) -> Iterator[Fault]:
    """What a Hydra command line leaves in a node that no YAML of ours would: a policy of null, a plan or policy
    named after a preset that is not shipped (an app's own, which only the group option composes)."""
    option = "overlap/{group}" if root == "overlap" else f"overlap/{{group}}@{root}.{{group}}"
    if "policy" in data and data["policy"] is None:
        yield null_policy_fault(root)
    for group in ("plan", "policy"):
        name = data.get(group)
        if isinstance(name, str) and name not in preset_names(group):
            known = preset_names(group)
            hint, listed = did_you_mean(name, known), closest_first(name, known)
            more = f" ... ({len(listed)} in all)" if len(listed) > 5 else ""
            yield Fault(f"{root}.{group}", f"{show_value(name)} is not a shipped {group} preset{hint} (shipped, "
                                           f"closest first: {', '.join(listed[:5])}{more}); "
                                           f"a preset of your app's own (overlap/{group}/{name}.yaml) is a config "
                                           f"group option: choose it as {option.format(group=group)}={name}, or "
                                           "by name through overlapcfg.hydra_main / overlapcfg.hydra_overrides, "
                                           "which compose it as that option")


def _overlap_nodes(node: DictConfig, prefix: str = "", depth: int = 0) -> Iterator[str]:
    """Paths below ``node`` of mappings that look like an overlap config (only its field names, a strategy or a
    plan among them), shallowest first."""
    fields = set(OverlapConfig.model_fields)
    for key in node:
        child = None if OmegaConf.is_missing(node, key) else node.get(key)
        if isinstance(child, DictConfig):
            keys = {str(k) for k in child}
            path = f"{prefix}{key!s}"
            if keys and keys <= fields and keys & {"strategy", "plan"}:
                yield path
            elif depth < 4:
                yield from _overlap_nodes(child, f"{path}.", depth + 1)


def _refuse_whole_config(node: DictConfig) -> None:
    """``from_hydra(cfg)`` with the whole composed config instead of its overlap node would report every other
    key as an unknown field; say what happened instead."""
    keys = {str(k) for k in node}
    if keys & set(OverlapConfig.model_fields) or keys == {"overlap"}:
        return
    found = list(_overlap_nodes(node))
    if found:
        where = full_key(node) or "the root config"
        raise OverlapConfigError.single(
            full_key(node) or "", f"from_hydra got {where}, not an overlap node; pass the node where the overlap "
            f"config is mounted: from_hydra(cfg.{found[0]})"
            + (f" (other candidates: {', '.join(found[1:4])})" if len(found) > 1 else ""))


def _to_container(src: Any, root: str) -> Any:
    """Plain data for ``src``, unwrapped from a single ``overlap`` key, measured and with references resolved."""
    return config_data(src, root, unwrap=_unwrap)


def config_data(src: Any, root: str, *, what: str = "config file", header: str = HEADER,
                unwrap: Callable[[Any], tuple[Any, KeyPath]] | None = None) -> Any:
    """Plain data for any config source, read one way whatever it describes (an ``OverlapConfig``, a hardware
    profile): a Hydra node (``DictConfig`` / ``ListConfig``: ``${key}`` references resolved against the composed
    config), a ``pathlib.Path`` (a YAML file, ``what`` naming it in faults), YAML text or a mapping; measured
    against the reader's limits, ``${key}`` references resolved and resolvers (``${oc.env:...}``) refused, faults
    under ``root`` (``header`` above those of references). ``unwrap``: where the data sits inside what was read
    (``load_config`` accepts an ``overlap:`` key around a config); default: the whole of it."""
    unwrap = unwrap or _whole
    if isinstance(src, (DictConfig, ListConfig)):
        return _from_omegaconf(src, root, unwrap, header)
    if isinstance(src, os.PathLike):
        return _from_text(read_text(Path(src), root, what=what), root, Path(src), unwrap, header)
    if isinstance(src, str):
        return _from_text(src, root, None, unwrap, header)
    if isinstance(src, Mapping):
        measure_or_fault(src, root, None)
        return unwrap(src)[0]
    raise OverlapUsageError(
        f"load_config expects an OverlapConfig, a mapping, a DictConfig, YAML text or a pathlib.Path; "
        f"got {type(src).__name__}"
    )


def _from_text(text: str, root: str, path: Path | None, unwrap: Callable[[Any], tuple[Any, KeyPath]],
               header: str) -> Any:
    data = parse_yaml(text, root, source=path)
    inner, at = unwrap(data)
    if has_references(inner):
        return with_references_resolved(data, root, at=at, header=header)
    return inner


def _from_omegaconf(node: DictConfig | ListConfig, root: str, unwrap: Callable[[Any], tuple[Any, KeyPath]],
                    header: str) -> Any:
    try:
        data = OmegaConf.to_container(node, resolve=False, throw_on_missing=True)
        measure_or_fault(data, root, None)
        data, inner = unwrap(data)
        if not has_references(data):
            return data
        top = root_of(node)
        at = (*parse_key_path(full_key(node)), *inner)
        whole = OmegaConf.to_container(top, resolve=False, throw_on_missing=False)
    except OmegaConfBaseException as err:
        raise OverlapConfigError.single(_omegaconf_path(err, node, root), _omegaconf_problem(err)) from None
    except RecursionError:
        raise OverlapConfigError.single(root, "the config nests too deeply to read") from None

    def show(p: KeyPath) -> str:
        # Inside the node: the user's path from ``root``; elsewhere in the composed config: its own path.
        return join_path(root, p[len(at):]) if p[: len(at)] == at else format_path(p) or "<root>"

    return with_references_resolved(whole, root, at=at, show=show, header=header)


def _omegaconf_path(err: OmegaConfBaseException, node: DictConfig | ListConfig, root: str) -> str:
    """Where OmegaConf's fault is, from ``root``: its ``full_key`` counts from the top of the composed config,
    so the node's own path comes off first (``trainer.overlap.policy`` under root ``trainer.overlap`` is
    ``policy``; it used to read ``trainer.overlap.trainer.overlap.policy``)."""
    key = str(getattr(err, "full_key", None) or "")
    own = full_key(node)
    if own and (key == own or key.startswith((f"{own}.", f"{own}["))):
        key = key[len(own):].lstrip(".")
    return join_path(root, parse_key_path(key)) if key else root


def _omegaconf_problem(err: OmegaConfBaseException) -> str:
    """OmegaConf's fault in our words, one line: its message carries ``full_key``/``object_type`` lines (the path
    is already the fault's), and a missing value says how the config came to lack it."""
    if isinstance(err, MissingMandatoryValue):
        return "required value is missing: the config has '???' here (a group option nobody chose, or a value to fill)"
    message = str(getattr(err, "msg", err)).strip().splitlines()
    return f"{type(err).__name__}: {message[0] if message else ''}".rstrip(": ")


def _whole(data: Any) -> tuple[Any, KeyPath]:
    return data, ()


def _unwrap(data: Any) -> tuple[Any, KeyPath]:
    if isinstance(data, Mapping) and set(data) == {"overlap"} and isinstance(data["overlap"], Mapping):
        return data["overlap"], ("overlap",)
    return data, ()


def _describe(data: Any, src: Any) -> str:
    """What was found instead of a mapping, without echoing a file's text."""
    if isinstance(src, str) and isinstance(data, str) and _looks_like_path(src):
        exists = "" if os.path.isfile(src.strip()) else " (no such file either)"
        return (f"the string {src.strip()!r}: a str is read as YAML text, not as a file name; to load a file "
                f"pass pathlib.Path({src.strip()!r}){exists}")
    if isinstance(src, os.PathLike):
        kind = _kind(data)
        return f"{kind} (the whole file {str(src)!r} is one value, not a mapping of config keys)"
    return _kind(data)


def _kind(data: Any) -> str:
    if data is None:
        return "an empty document (null)"
    if isinstance(data, bool):
        return "a boolean"
    if isinstance(data, int):
        return "an integer"
    if isinstance(data, float):
        return "a number"
    if isinstance(data, str):
        return f"a string ({len(data):,} characters)"
    if isinstance(data, (list, tuple, ListConfig)):
        return f"a list ({len(data):,} items)"
    return type(data).__name__


def _looks_like_path(text: str) -> bool:
    text = text.strip()
    if "\n" in text or not text:
        return False
    return text.endswith((".yaml", ".yml")) or os.sep in text or os.path.isfile(text)


def _target_paths(data: Any, path: str) -> Iterator[str]:
    if isinstance(data, Mapping):
        for key, value in data.items():
            sub = f"{path}.{key}" if path else str(key)
            if key == TARGET_KEY:
                yield sub
            else:
                yield from _target_paths(value, sub)
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            yield from _target_paths(value, f"{path}[{i}]")


def _surrogate_faults(data: Any, path: str) -> Iterator[Fault]:
    """Strings (keys included) holding a lone surrogate: Python strings may, Unicode text may not. Such a name
    matches no module, cannot be written to YAML or JSON, and crashes whoever prints it to a UTF-8 stream."""
    if isinstance(data, str):
        if not data.isascii():
            try:
                data.encode("utf-8")
            except UnicodeEncodeError as err:
                yield Fault(path, f"{show_value(data)} holds a lone surrogate {data[err.start]!r} at character "
                                  f"{err.start}: not valid Unicode text")
    elif isinstance(data, Mapping):
        for key, value in data.items():
            sub = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not key.isascii():
                yield from _surrogate_faults(key, f"{path} (a key)" if path else "(a key)")
            yield from _surrogate_faults(value, sub)
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            yield from _surrogate_faults(value, f"{path}[{i}]")
