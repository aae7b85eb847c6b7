"""Turning whatever a user has (a model, a dict, a DictConfig, YAML text or a file) into an ``OverlapConfig``.

This is the only place pydantic's ``ValidationError`` is translated: each error becomes one ``Fault`` whose
path is the dotted config path from where the user mounted the config (``trainer.overlap.policy.…``).
Nothing a user passes escapes as anything but ``OverlapConfigError`` (a wrong Python type is ``TypeError``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from pydantic import BaseModel, TypeAdapter, ValidationError

from overlapcfg.compat.omegaconf import full_key, root_of
from overlapcfg.config.base import TARGET_KEY, TARGET_MESSAGE, collect_unknown_field_hints
from overlapcfg.config.interpolate import (
    KeyPath,
    format_path,
    has_references,
    parse_key_path,
    resolve_references,
)
from overlapcfg.config.overlap import OverlapConfig
from overlapcfg.config.presets import searching_hydra
from overlapcfg.config.safe_yaml import YamlLimitError, dump_yaml, load_yaml, measure
from overlapcfg.errors import Fault, OverlapConfigError, did_you_mean, show_value

__all__ = [
    "MAX_FILE_BYTES",
    "ConfigSource",
    "dump_yaml",
    "faults_from_validation_error",
    "from_hydra",
    "load_config",
    "validate_config",
    "validate_value",
]

M = TypeVar("M", bound=BaseModel)

HEADER = "invalid overlap config"

MAX_FILE_BYTES = 16 * 2**20
"""Largest config file (or YAML text) read, checked before parsing; a plan for the largest models is well under
1 MiB. Parsing is bounded further by ``safe_yaml.MAX_NODES`` values, counted before anything is composed."""

ConfigSource: TypeAlias = OverlapConfig | Mapping[str, Any] | DictConfig | str | os.PathLike[str]
"""Anything ``load_config`` turns into an ``OverlapConfig``."""

def load_config(src: ConfigSource, *, root: str = "overlap") -> OverlapConfig:
    """Validate ``src`` into an ``OverlapConfig``, or raise ``OverlapConfigError`` listing every fault.

    ``root`` is the prefix of every fault path: where the config sits in the user's own config tree.
    A mapping with a single ``overlap`` key is unwrapped, so a recipe's whole config file can be passed.

    What each kind of ``src`` means:

    - ``str`` is always YAML *text*, never a file name (a file name is a valid YAML string, so guessing would
      make ``load_config(user_input)`` read arbitrary files). A file is read only when given as a
      ``pathlib.Path`` (any ``os.PathLike``); errors name the file and give line and column, and never echo
      its contents.
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
        return src if root in ("overlap", src.config_root) else src.mounted_at(root)
    data = _to_container(src, root)
    if not isinstance(data, Mapping):
        raise OverlapConfigError.single(root, f"expected a mapping, got {_describe(data, src)}")
    if targets := list(_target_paths(data, root)):
        raise OverlapConfigError([Fault(p, TARGET_MESSAGE) for p in targets], header=HEADER)
    if surrogates := list(_surrogate_faults(data, root)):
        raise OverlapConfigError(surrogates, header=HEADER)
    return validate_config(OverlapConfig, dict(data), root=root).mounted_at(root)


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

    ``${key}`` references may point anywhere in the composed config; resolvers are refused, including Hydra's
    own ``${hydra:...}`` (the shipped ``overlap`` group never uses one: it only holds at run time).
    """
    if not isinstance(node, DictConfig):
        raise TypeError(f"from_hydra expects an omegaconf DictConfig node, got {type(node).__name__}")
    _refuse_whole_config(node)
    with searching_hydra():  # the user's own overlap/plan/<name>.yaml resolves by name too
        return load_config(node, root=full_key(node) or "overlap")


def _overlap_nodes(node: DictConfig, prefix: str = "", depth: int = 0) -> Iterator[str]:
    """Paths below ``node`` of mappings that look like an overlap config (only its field names, a strategy or a
    plan among them), shallowest first."""
    fields = set(OverlapConfig.model_fields)
    for key in node:
        child = None if OmegaConf.is_missing(node, key) else node.get(key)
        if isinstance(child, DictConfig):
            keys = {str(k) for k in child}
            path = f"{prefix}{key}"
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
    if isinstance(src, (DictConfig, ListConfig)):
        return _from_omegaconf(src, root)
    if isinstance(src, os.PathLike):
        return _from_text(_read_file(Path(src), root), root, Path(src))
    if isinstance(src, str):
        return _from_text(src, root, None)
    if isinstance(src, Mapping):
        _measure_or_fault(src, root, None)
        return _unwrap(src)[0]
    raise TypeError(
        f"load_config expects an OverlapConfig, a mapping, a DictConfig, YAML text or a pathlib.Path; "
        f"got {type(src).__name__}"
    )


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
"""Opening never waits (a FIFO without a writer) and never adopts a terminal; reading never waits either: a file
that has nothing to give now (``/proc/kmsg`` reports a regular file of size 0, then blocks) says so instead."""


def _read_file(path: Path, root: str) -> str:
    """The file's text, read from one open descriptor (what is checked is what is read) and at most
    ``MAX_FILE_BYTES`` + 1 bytes of it, whatever size the file reports."""
    name = show_value(str(path))
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise OverlapConfigError.single(root, f"config file {name} does not exist") from None
    except OSError as err:
        raise OverlapConfigError.single(root, f"config file {name} cannot be read: {err.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OverlapConfigError.single(root, f"config file {name} is not a file")
        data = _read_capped(fd, name, root)
    except BlockingIOError:
        raise OverlapConfigError.single(root, f"config file {name} cannot be read without waiting (a kernel or "
                                              "device file that only looks like a file, such as /proc/kmsg)") from None
    except OSError as err:
        raise OverlapConfigError.single(root, f"config file {name} cannot be read: {err.strerror}") from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise OverlapConfigError.single(
            root, f"config file {name} is not UTF-8 text (byte {err.start} of {len(data):,})") from None


def _read_capped(fd: int, name: str, root: str) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, min(2**20, MAX_FILE_BYTES + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > MAX_FILE_BYTES:
            raise OverlapConfigError.single(
                root, f"config file {name} is more than {MAX_FILE_BYTES:,} bytes; config files are at most that")
    return b"".join(chunks)


def _check_text(text: str, root: str) -> None:
    """YAML text is held to the file limit before it is parsed, and must be valid Unicode: a lone surrogate
    (``'\\udcff'``, what ``surrogateescape`` makes of an undecodable byte) cannot be written back as YAML."""
    if len(text) > MAX_FILE_BYTES:  # every character is at least one byte: no need to encode to know
        raise OverlapConfigError.single(root, f"YAML text of {len(text):,} characters refused; config text is at "
                                              f"most {MAX_FILE_BYTES:,} bytes")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as err:
        line = text.count("\n", 0, err.start) + 1
        column = err.start - (text.rfind("\n", 0, err.start) + 1) + 1
        raise OverlapConfigError.single(root, f"YAML text holds a lone surrogate {text[err.start]!r} (line {line}, "
                                              f"column {column}): not valid Unicode text") from None
    if size > MAX_FILE_BYTES:
        raise OverlapConfigError.single(root, f"YAML text of {size:,} bytes refused; config text is at most "
                                              f"{MAX_FILE_BYTES:,} bytes")


def _from_text(text: str, root: str, path: Path | None) -> Any:
    where = f"YAML file {show_value(str(path))}" if path is not None else "YAML"
    _check_text(text, root)
    try:
        data = load_yaml(text)
    except YamlLimitError as err:
        raise OverlapConfigError.single(root, f"{where} refused: {err}") from None
    except (yaml.YAMLError, ValueError, TypeError, RecursionError) as err:
        raise OverlapConfigError.single(root, f"could not parse {where}: {_yaml_problem(err)}") from None
    inner, at = _unwrap(data)
    if has_references(inner):
        return _resolve(data, at, lambda p: _show_path(root, p[len(at):]), root)
    return inner


def _from_omegaconf(node: DictConfig | ListConfig, root: str) -> Any:
    try:
        data = OmegaConf.to_container(node, resolve=False, throw_on_missing=True)
        _measure_or_fault(data, root, None)
        data, inner = _unwrap(data)
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
        return _show_path(root, p[len(at):]) if p[: len(at)] == at else format_path(p) or "<root>"

    return _resolve(whole, at, show, root)


def _omegaconf_path(err: OmegaConfBaseException, node: DictConfig | ListConfig, root: str) -> str:
    """Where OmegaConf's fault is, from ``root``: its ``full_key`` counts from the top of the composed config,
    so the node's own path comes off first (``trainer.overlap.policy`` under root ``trainer.overlap`` is
    ``policy``; it used to read ``trainer.overlap.trainer.overlap.policy``)."""
    key = str(getattr(err, "full_key", None) or "")
    own = full_key(node)
    if own and (key == own or key.startswith((f"{own}.", f"{own}["))):
        key = key[len(own):].lstrip(".")
    return _show_path(root, parse_key_path(key)) if key else root


def _omegaconf_problem(err: OmegaConfBaseException) -> str:
    """OmegaConf's fault in our words, one line: its message carries ``full_key``/``object_type`` lines (the path
    is already the fault's), and a missing value says how the config came to lack it."""
    if isinstance(err, MissingMandatoryValue):
        return "required value is missing: the config has '???' here (a group option nobody chose, or a value to fill)"
    message = str(getattr(err, "msg", err)).strip().splitlines()
    return f"{type(err).__name__}: {message[0] if message else ''}".rstrip(": ")


def _resolve(whole: Any, at: KeyPath, show: Callable[[KeyPath], str], root: str) -> Any:
    data, faults = resolve_references(whole, at, show)
    if faults:
        raise OverlapConfigError(faults, header=HEADER)
    _measure_or_fault(data, root, "once references are resolved")
    return data


def _measure_or_fault(data: Any, root: str, when: str | None) -> None:
    try:
        measure(data)
    except YamlLimitError as err:
        raise OverlapConfigError.single(root, f"config refused: {err}{f' ({when})' if when else ''}") from None


def _unwrap(data: Any) -> tuple[Any, KeyPath]:
    if isinstance(data, Mapping) and set(data) == {"overlap"} and isinstance(data["overlap"], Mapping):
        return data["overlap"], ("overlap",)
    return data, ()


def _show_path(root: str, path: KeyPath) -> str:
    rel = format_path(path)
    if not rel:
        return root
    if not root:
        return rel
    return f"{root}{rel}" if rel.startswith("[") else f"{root}.{rel}"


def _yaml_problem(err: Exception) -> str:
    """PyYAML's problem and where it is (``... (line 1, column 11)``), on one line; never the offending text."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or (str(err).strip().splitlines() or [type(err).__name__])[0]
    if isinstance(err, RecursionError):
        problem = "nesting too deep"
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


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


def _join(root: str, loc: tuple[int | str, ...]) -> str:
    out = root
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith("<"):  # a union tag (see schema.plan.BucketEntry), not part of the user's path
            continue
        else:
            out = f"{out}.{part}" if out else part
    return out


def _show(value: Any) -> str:
    if isinstance(value, (dict, Mapping)):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return show_value(value)


_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "tuple_type": "a list",
    "list_type": "a list",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "dict_type": "a mapping",
    "none_required": "null (this strategy does not support it)",
}


def _message(error: Mapping[str, Any], hints: Mapping[str, tuple[str, ...]]) -> str:
    kind, ctx, given = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        key = str(error["loc"][-1]) if error["loc"] else ""
        valid = hints.get(key, ())
        listing = f"; valid fields: {', '.join(valid)}" if valid else ""
        return f"unknown field{did_you_mean(key, valid, n=1)}{listing}"
    if kind == "literal_error":
        expected = ctx.get("expected", "")
        options = [o.strip().strip("'") for o in expected.replace(" or ", ", ").split(",")]
        hint = did_you_mean(str(given), options) if isinstance(given, str) else ""
        return f"expected {expected}, got {_show(given)}{hint}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()), "?")
        return f"expected a value {op} {bound}, got {_show(given)}"
    if kind in ("too_short", "too_long"):
        return f"expected {'at least' if kind == 'too_short' else 'at most'} " \
               f"{ctx.get('min_length', ctx.get('max_length'))} item(s), got {ctx.get('actual_length')}"
    if _is_pattern_position(error) and isinstance(given, int) and not isinstance(given, bool):
        if kind == "bucket_entry":
            return f"{error.get('msg', kind)}; {_integer_pattern(given)}"
        return _integer_pattern(given)
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {_show(given)}"
    msg = str(error.get("msg", kind))
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    return msg


def faults_from_validation_error(err: ValidationError, root: str = "",
                                 hints: Mapping[str, tuple[str, ...]] | None = None) -> list[Fault]:
    """One fault per pydantic error, in pydantic's order, with dotted paths and our wording.

    ``hints`` maps unknown keys to the valid field names of their model (``collect_unknown_field_hints``).
    """
    errors = err.errors(include_url=False)
    # pydantic also reports a list whose every item failed as too short ("got 0"): a false extra fault.
    failed_items = {tuple(e["loc"][:-1]) for e in errors if e["loc"] and isinstance(e["loc"][-1], int)}
    faults = []
    for error in errors:
        loc = tuple(error["loc"])
        if error["type"] == "too_short" and loc in failed_items:
            continue
        faults.append(Fault(_join(root, loc), _message(error, hints or {})))
    return list(dict.fromkeys(faults))


def _is_pattern_position(error: Mapping[str, Any]) -> bool:
    """Whether the value sits where a module pattern belongs (plan entries, ``modules``, ``per``, ``match``)."""
    loc = tuple(error["loc"])
    if error["type"] == "bucket_entry":
        return True
    return error["type"] == "string_type" and ("buckets" in loc or (bool(loc) and loc[-1] == "match"))


def _integer_pattern(value: int) -> str:
    """Hydra's override parser and YAML read ``0`` (and YAML 1.1 ``4:8``) as integers; say how to quote them."""
    if value.bit_length() > 100:
        return f"got {show_value(value)}; module names are strings"
    msg = f"got an integer {value}; module names are strings: quote it ('{value}')"
    high, low = divmod(value, 60)
    if value >= 60 and high < 60:
        msg += (f"; if you wrote the range {high}:{low}, YAML 1.1 read it as the base-60 number {value}: "
                f"quote the range '{high}:{low}'")
    return msg
