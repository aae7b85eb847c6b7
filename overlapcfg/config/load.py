"""Turning whatever a user has (a model, a dict, a DictConfig, YAML text or a file) into an ``OverlapConfig``.

This is the only place pydantic's ``ValidationError`` is translated: each error becomes one ``Fault`` whose
path is the dotted config path from where the user mounted the config (``trainer.overlap.policy.…``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from overlapcfg.errors import Fault, OverlapConfigError, did_you_mean
from overlapcfg.config.base import TARGET_KEY, TARGET_MESSAGE, collect_unknown_field_hints
from overlapcfg.config.overlap import OverlapConfig

__all__ = ["ConfigSource", "faults_from_validation_error", "from_hydra", "load_config", "validate_config"]

M = TypeVar("M", bound=BaseModel)

HEADER = "invalid overlap config"

ConfigSource: TypeAlias = OverlapConfig | Mapping[str, Any] | DictConfig | str | os.PathLike[str]
"""Anything ``load_config`` turns into an ``OverlapConfig``."""


def load_config(src: ConfigSource, *, root: str = "overlap") -> OverlapConfig:
    """Validate ``src`` into an ``OverlapConfig``, or raise ``OverlapConfigError`` listing every fault.

    ``root`` is the prefix of every fault path: where the config sits in the user's own config tree.
    A mapping with a single ``overlap`` key is unwrapped, so a recipe's whole config file can be passed.
    """
    if isinstance(src, OverlapConfig):
        return src
    data = _to_container(src, root)
    if isinstance(data, Mapping) and set(data) == {"overlap"} and isinstance(data["overlap"], Mapping):
        data = data["overlap"]
    if not isinstance(data, Mapping):
        raise OverlapConfigError.single(root, f"expected a mapping, got {type(data).__name__}")
    if targets := list(_target_paths(data, root)):
        raise OverlapConfigError([Fault(p, TARGET_MESSAGE) for p in targets], header=HEADER)
    return validate_config(OverlapConfig, dict(data), root=root)


def validate_config(model: type[M], data: Any, *, root: str, header: str = HEADER) -> M:
    """``model.model_validate(data)``, every fault translated into one ``OverlapConfigError`` under ``root``."""
    with collect_unknown_field_hints() as hints:
        try:
            return model.model_validate(data)
        except ValidationError as err:
            faults = faults_from_validation_error(err, root, hints)
    raise OverlapConfigError(faults, header=header)


def from_hydra(node: DictConfig) -> OverlapConfig:
    """``load_config`` for a node of a composed Hydra config; fault paths start where the node is mounted."""
    if not isinstance(node, DictConfig):
        raise TypeError(f"from_hydra expects an omegaconf DictConfig node, got {type(node).__name__}")
    return load_config(node, root=node._get_full_key(None) or "overlap")


def _to_container(src: Any, root: str) -> Any:
    try:
        if isinstance(src, DictConfig):
            return OmegaConf.to_container(src, resolve=True, throw_on_missing=True)
        if isinstance(src, os.PathLike) or (isinstance(src, str) and _looks_like_path(src)):
            path = Path(src)
            if not path.is_file():
                raise OverlapConfigError.single(root, f"config file {str(path)!r} does not exist")
            return OmegaConf.to_container(OmegaConf.load(path), resolve=True, throw_on_missing=True)
        if isinstance(src, str):
            return OmegaConf.to_container(OmegaConf.create(src), resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        where = f"{root}.{key}" if key else root
        raise OverlapConfigError.single(where, f"{type(err).__name__}: {getattr(err, 'msg', err)}") from None
    except OverlapConfigError:
        raise
    except (yaml.YAMLError, ValueError, TypeError) as err:  # OmegaConf.create lets PyYAML's errors through
        raise OverlapConfigError.single(root, f"could not parse YAML: {_yaml_problem(err)}") from None
    if isinstance(src, Mapping):
        return src
    raise TypeError(
        f"load_config expects an OverlapConfig, a mapping, a DictConfig, YAML text or a path; "
        f"got {type(src).__name__}"
    )


def _yaml_problem(err: Exception) -> str:
    """PyYAML's problem and where it is (``... (line 1, column 11)``), on one line."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or (str(err).strip().splitlines() or [type(err).__name__])[0]
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def _looks_like_path(text: str) -> bool:
    if "\n" in text:
        return False
    return text.endswith((".yaml", ".yml")) or os.path.isfile(text)


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
    return repr(value)


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
    faults = []
    for error in err.errors(include_url=False):
        faults.append(Fault(_join(root, tuple(error["loc"])), _message(error, hints or {})))
    return list(dict.fromkeys(faults))
