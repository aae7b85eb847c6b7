"""What every public result shares: ``print`` shows the command's tables, ``repr`` is a short summary, and the
pictures and files the command writes are one method call away.

The results: ``explain``'s ``Report``, ``compare``'s ``Comparison``, ``tune``'s ``TuneResult``, ``measure``'s
``Measurement``, ``calibrate``'s ``CalibratedProfile`` (and any later one: subclass ``Result``, name the module that
presents it, register there with ``present``). For each of them:

- ``print(result)`` / ``str(result)``: the tables the ``overlapcfg`` command prints for it, as plain text (no colour
  codes), as wide as the terminal when standard output is one, else ``PIPED_WIDTH`` columns (``plain_text``);
- ``rich.print(result)`` (``__rich__``): the same tables in colour;
- ``repr(result)``: one line naming what it is and its headline numbers (``summary()``), never its data, and never
  longer than ``MAX_REPR`` characters (a notebook cell or a log line showing a result stays readable);
- where the command writes a picture, ``result.plot(path)`` (``tune_front.png``) and ``result.timeline(path)``
  (``timeline.png``, or the Chrome trace ``timeline.json``) write the same file with the same code; where it writes
  data, ``to_json()`` / ``to_yaml()`` return the same text.

Why the drawing is registered rather than imported: a result's data sits below or beside the module that draws it
(the drawing reads the data, so it imports it); an import back would be a cycle, which the layer contracts refuse
(``lint-imports``). So the data names the module that presents it (``presented_by``), that module registers its
drawing and pictures with ``present`` when it is imported, and the first ``print`` imports it. The dependency stays
one way (presenter → data), and ``tests/package/test_results_print_and_plot.py`` checks it for every result: the
named module imports the data's module, lives in the same package or a layer above, and registers the type.

This module is shared by every layer, so it imports none of them (rich only).
"""

from __future__ import annotations

import importlib
import io
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rich.console import Console, RenderableType

from overlapcfg.errors import OverlapStateError, OverlapUsageError

__all__ = ["MAX_REPR", "PIPED_WIDTH", "Presentation", "Result", "counted", "plain_text", "present", "presentation",
           "short_repr"]

MAX_REPR = 2000
"""Longest ``repr`` of a result, in characters (a summary is far shorter; this bounds whatever it grows into)."""

PIPED_WIDTH = 120
"""Columns of text rendered for a pipe or a file (a terminal uses its own width)."""

Draw = Callable[[Any], RenderableType]
Write = Callable[[Any, Path], Path]


@dataclass(frozen=True, slots=True)
class Presentation:
    """How one result type is shown: ``draw`` makes the rich renderable the command prints; ``plot`` and
    ``timeline`` (where the command writes such a picture) write it to a path and return the path."""

    draw: Draw
    plot: Write | None = None
    timeline: Write | None = None


_PRESENTED: dict[type, Presentation] = {}


def present(cls: type, *, draw: Draw, plot: Write | None = None, timeline: Write | None = None) -> None:
    """Register how ``cls`` is shown (called by the module ``cls.presented_by`` names, when it is imported). A second
    registration of other functions for the same type is an error naming both, not a silent replacement."""
    new = Presentation(draw, plot, timeline)
    old = _PRESENTED.get(cls)
    if old is not None and old != new:
        raise OverlapStateError(f"{cls.__qualname__} is already presented by {_origin(old.draw)}; "
                                f"{_origin(draw)} would replace it")
    _PRESENTED[cls] = new


def presentation(result: object) -> Presentation:
    """The registered ``Presentation`` of ``result``'s type (or of the nearest base that has one), importing the
    module its ``presented_by`` names on first use."""
    cls = type(result)
    found = _lookup(cls)
    if found is None:
        module = getattr(cls, "presented_by", None)
        if module:
            importlib.import_module(module)
            found = _lookup(cls)
    if found is None:
        raise AssertionError(f"overlapcfg: nothing presents {cls.__qualname__} (presented_by="
                             f"{getattr(cls, 'presented_by', None)!r} registered no drawing for it)")
    return found


def _lookup(cls: type) -> Presentation | None:
    return next((_PRESENTED[k] for k in cls.__mro__ if k in _PRESENTED), None)


def _origin(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def plain_text(renderable: RenderableType) -> str:
    """``renderable`` as plain text (no colour codes): what ``str(result)`` and ``print(result)`` show. As wide as
    the terminal when standard output is one, else ``PIPED_WIDTH`` columns."""
    width = shutil.get_terminal_size((PIPED_WIDTH, 24)).columns if sys.stdout.isatty() else PIPED_WIDTH
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, force_terminal=False, highlight=False).print(renderable)
    return out.getvalue().rstrip("\n")


def short_repr(text: str, limit: int = MAX_REPR) -> str:
    """``text`` cut to ``limit`` characters (an ellipsis and the closing parenthesis kept where it is cut)."""
    if len(text) <= limit:
        return text
    tail = ")" if text.endswith(")") else ""
    return text[: limit - 1 - len(tail)] + "…" + tail


def counted(n: int, noun: str) -> str:
    """``1 bucket``, ``3 buckets``: a count in a summary."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class Result:
    """The mixin every public result inherits (module docstring). A subclass sets ``presented_by`` and defines
    ``summary``; the presenting module calls ``present(TheClass, draw=..., plot=..., timeline=...)``."""

    __slots__ = ()

    presented_by: ClassVar[str] = ""
    """The module that registers this type's drawing (``present``); imported on first ``print``. A dataclass
    result assigns it without annotation (a ``ClassVar`` would show in ``__dataclass_fields__``); a pydantic one
    annotates it ``ClassVar[str]`` (pydantic refuses unannotated attributes)."""

    def summary(self) -> str:
        """One line: what this is and its headline numbers (``repr`` is ``ClassName(summary)``); every result
        overrides it."""
        return ""

    def __rich__(self) -> RenderableType:
        """``rich.print(result)``: the command's tables, in colour."""
        return presentation(self).draw(self)

    def __str__(self) -> str:
        """``print(result)``: the command's tables as plain text."""
        return plain_text(self.__rich__())

    def __repr__(self) -> str:
        return short_repr(f"{type(self).__name__}({self.summary()})")

    def _write(self, what: str, path: str | Path, suffixes: tuple[str, ...]) -> Path:
        """Write the picture ``what`` (``plot``, ``timeline``) registered for this type to ``path``."""
        writer = getattr(presentation(self), what)
        if writer is None:
            raise OverlapUsageError(f"{type(self).__name__} has no {what}")
        path = Path(path)
        if path.suffix.lower() not in suffixes:
            raise OverlapUsageError(f"{type(self).__name__}.{what}({str(path)!r}): the file name must end in "
                                    f"{' or '.join(suffixes)} (the format is taken from it)")
        written: Path = writer(self, path)
        return written
