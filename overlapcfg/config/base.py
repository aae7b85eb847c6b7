"""The one base model every schema class inherits, and the constrained scalar types shared by them.

Every model is frozen (hashable, safe to share between ranks and passes) and rejects unknown keys with the
closest valid field name, which pydantic's own ``extra_forbidden`` error does not offer.
"""

from __future__ import annotations

import math
import re
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    PlainValidator,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from overlapcfg.errors import did_you_mean, show_value

__all__ = ["MAX_BYTES", "MAX_RANKS", "TARGET_KEY", "ByteCount", "ConfigModel", "Depth", "RankCount",
           "collect_unknown_field_hints", "measured", "quoted_number"]

TARGET_KEY = "_target_"
TARGET_MESSAGE = (
    "'_target_' is not allowed: configs select registered names only (strategies by `strategy: <name>`, "
    "plans by preset name); nothing is instantiated or imported from a config"
)


_unknown_field_hints: ContextVar[dict[str, tuple[str, ...]] | None] = ContextVar("_unknown_field_hints", default=None)


class ConfigModel(BaseModel):
    """Base of all user-facing config models: frozen, no unknown keys, attribute docstrings as descriptions."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _note_unknown_keys(cls, data: Any) -> Any:
        # Through ``validate_config`` (``load_config``), unknown keys are left to ``extra="forbid"`` so they are
        # reported next to every other fault of the same model, with the valid names remembered for the
        # suggestion. ``_target_`` is refused outright: nothing else about such a config should be looked at.
        if not isinstance(data, dict):
            return data
        if TARGET_KEY in data:
            raise PydanticCustomError("target_forbidden", TARGET_MESSAGE)
        fields = cls.model_fields  # a computed class property in pydantic 2.11+: read once, not once per key
        unknown = [k for k in data if k not in fields]
        if not unknown:
            return data
        valid = tuple(sorted(fields))
        hints = _unknown_field_hints.get()
        if hints is None:  # a direct model_validate: say it here, with the suggestion pydantic would not give
            parts = [f"{show_value(k)}{did_you_mean(str(k), valid, n=1)}" for k in unknown]
            raise PydanticCustomError("unknown_field", "unknown field {fields}; valid fields: {valid}",
                                      {"fields": ", ".join(parts), "valid": ", ".join(valid)})
        for key in unknown:
            hints[str(key)] = valid
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _strings_are_not_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads '1e12' as 1e12 and '8' as 8. A config file's quoted number is a mistake the
        # file should own (a YAML ``'1e12'`` is a string); Hydra's command line gives ints and floats for
        # ``overlap.policy.forward_prefetch=2``, so nothing typed at the command line is refused. Text that is no
        # number at all (``'far'``) is left to the field's own error.
        if isinstance(value, str) and info.field_name in _number_fields(cls) and _numeric(value):
            raise quoted_number(value, "an integer" if info.field_name in _integer_fields(cls) else "a number")
        return value


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return len(text) <= 64


def quoted_number(value: str, expected: str = "a number") -> PydanticCustomError:
    """The error for a number written as a string (``'1e12'``, ``"8"``) where a number is expected."""
    return PydanticCustomError("number_type", "expected {expected}, got the string {got} (a quoted number is text: "
                                              "write it without quotes)", {"expected": expected, "got": _show(value)})


_NUMBERS: dict[type, frozenset[str]] = {}


def _number_fields(model: type[BaseModel]) -> frozenset[str]:
    """Fields of ``model`` typed as a plain number (``int``, ``float``, optional or not) whose checks are pydantic's
    own: those with a validator of ours (``ByteCount`` takes ``'4GiB'``; ``Depth``, ``measured``) say it themselves."""
    found = _NUMBERS.get(model)
    if found is None:
        found = _NUMBERS[model] = frozenset(name for name, f in model.model_fields.items() if _plain_number(f))
    return found


def _integer_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name in _number_fields(model) if float not in _kinds(model.model_fields[name]))


def _kinds(field: FieldInfo) -> tuple[Any, ...]:
    union = typing.get_origin(field.annotation) in (typing.Union, types.UnionType)
    kinds = typing.get_args(field.annotation) if union else (field.annotation,)
    return tuple(k for k in kinds if k is not type(None))


def _plain_number(field: FieldInfo) -> bool:
    if any(isinstance(m, (BeforeValidator, PlainValidator, WrapValidator)) for m in field.metadata):
        return False
    kinds = _kinds(field)
    return bool(kinds) and all(k in (int, float) for k in kinds)


@contextmanager
def collect_unknown_field_hints() -> Iterator[dict[str, tuple[str, ...]]]:
    """Within the block, unknown keys met during validation map to the valid field names of their model."""
    hints: dict[str, tuple[str, ...]] = {}
    token = _unknown_field_hints.set(hints)
    try:
        yield hints
    finally:
        _unknown_field_hints.reset(token)


def _check_depth(value: Any) -> int:
    # bool is an int subclass; `forward_prefetch: true` is a mistake, not a depth of 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PydanticCustomError("depth", "expected an integer >= 0, got {got}", {"got": _show(value)})
    if value > MAX_DEPTH_VALUE:
        raise PydanticCustomError("depth", "expected an integer from 0 to 2**31-1, got {got}", {"got": _show(value)})
    return value


MAX_DEPTH_VALUE = 2**31 - 1
"""Largest depth or delay: any depth past the last bucket means "all of them", and a bounded one dumps and costs
like any other integer (a 5,000-digit one cannot even be printed)."""

Depth = Annotated[int, BeforeValidator(_check_depth)]
"""A prefetch depth or delay: how many buckets ahead. 0 disables overlap for that direction."""

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


MAX_BYTES = 2**63 - 1
"""Largest byte count: torch sizes tensors in int64, and cost arithmetic in floats must not overflow."""


def _check_bytes(value: Any) -> int:
    """Accept ``1073741824``, ``1e9`` (whole floats, as Hydra parses them) or ``"1GiB"`` / ``"512 MB"``."""
    if isinstance(value, bool):
        raise _bytes_error(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if not 1 <= value <= MAX_BYTES:
            raise _bytes_error(value)
        return value
    if isinstance(value, str) and len(value) <= 64 and (m := _SIZE.match(value)) and m.group(2).lower() in _UNITS:
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if 1 <= n <= MAX_BYTES and float(n).is_integer():
            return int(n)
    raise _bytes_error(value)


def _bytes_error(value: Any) -> PydanticCustomError:
    return PydanticCustomError(
        "byte_count",
        "expected a positive byte count of at most 2**63-1 (an integer, or a string such as '2GiB' or '512MB'), "
        "got {got}",
        {"got": _show(value)},
    )


ByteCount = Annotated[int, BeforeValidator(_check_bytes), PlainSerializer(int)]
"""A positive number of bytes; strings with units (``"4GiB"``) are converted on load and dumped as integers."""


MAX_RANKS = 2**31 - 1
"""Largest world size: c10d numbers ranks with 32-bit integers."""


def _check_ranks(value: Any) -> int:
    # bool is an int subclass, and a whole float is not a rank count anyone meant (2.0 from 4 / 2, 2.5 a typo).
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        raise PydanticCustomError("rank_count", "expected a number of ranks: an integer from 1 to 2**31-1, got {got}",
                                  {"got": _show(value)})
    return value


RankCount = Annotated[int, BeforeValidator(_check_ranks)]
"""A world size: how many ranks a prediction or a search is made for."""


def _show(value: Any) -> str:
    return show_value(value) if not isinstance(value, (dict, list, tuple)) else type(value).__name__


def measured(unit: str, low: float, high: float, *, example: str = "") -> BeforeValidator:
    """The check of a measured quantity in ``unit`` (``"bytes/s"``, ``"seconds"``): a finite number in
    ``[low, high]``, as ``Annotated[float, measured(...)]`` (a type alias a type checker reads as ``float``).
    Infinity, NaN and values no hardware has (a bandwidth of 1e300 bytes/s) are refused with the range expected,
    instead of making every prediction zero or infinite; ``example`` names the range in words
    (``"1 MB/s to 1 PB/s"``)."""
    span = f"{low:g} to {high:g}" + (f" ({example})" if example else "")
    expected = f"{unit}, a finite number from {span}"

    def check(value: Any) -> float:
        number = math.nan
        if isinstance(value, str) and _numeric(value):  # '2e12' quoted in a file: pydantic's float took it, we do not
            raise quoted_number(value, expected)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if not isinstance(value, int) or value.bit_length() < 1000 else math.inf
        if not (math.isfinite(number) and low <= number <= high):
            raise PydanticCustomError("measured", "expected {expected}, got {got}",
                                      {"expected": expected, "got": _show(value)})
        return number

    return BeforeValidator(check)
