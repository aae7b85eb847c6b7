"""Pydantic's validation errors in our words: one ``Fault`` per error, its path from where the user mounted the
config (``trainer.overlap.policy.forward_prefetch``), what was expected and what was given, the closest field name.

This is the only place pydantic's ``ValidationError`` is translated (``load.validate_config`` calls it for every
model a user writes: configs, hardware profiles, the demo's settings).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from overlapcfg.errors import Fault, did_you_mean, join_path, show_value

__all__ = ["faults_from_validation_error"]


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
        faults.append(Fault(join_path(root, loc), _message(error, hints or {})))
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
