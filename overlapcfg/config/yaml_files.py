"""Reading YAML: the one reader of every YAML file overlapcfg loads or ships.

User configs (``load_config``), the shipped presets (``presets/overlap/``), the shipped hardware profiles
(``conf/hardware/``) and the user's own (``$OVERLAPCFG_HOME/hardware/``) are all read here, so they all get the
same scalars (``overlapcfg.config.safe_yaml``: ``4:8`` is the string ``'4:8'``, not YAML 1.1's base-60 248;
``1e3`` is the number 1000.0, not a string), the same refusals (duplicate keys, a file over ``MAX_FILE_BYTES``,
a FIFO or a device, text that is not UTF-8, alias bombs) and the same one-line faults naming the file, line and
column, never its contents. What Hydra composes is read by Hydra's own loader (OmegaConf's), not here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from overlapcfg.config.interpolate import KeyPath, resolve_references
from overlapcfg.config.safe_yaml import YamlLimitError, load_yaml, measure
from overlapcfg.errors import OverlapConfigError, join_path

__all__ = ["MAX_FILE_BYTES", "check_path", "check_text", "measure_or_fault", "parse_yaml", "read_text", "read_yaml",
           "with_references_resolved"]

MAX_FILE_BYTES = 16 * 2**20
"""Largest config file (or YAML text) read, checked before parsing; a plan for the largest models is well under
1 MiB. Parsing is bounded further by ``safe_yaml.MAX_NODES`` values, counted before anything is composed."""


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
"""Opening never waits (a FIFO without a writer) and never adopts a terminal; reading never waits either: a file
that has nothing to give now (``/proc/kmsg`` reports a regular file of size 0, then blocks) says so instead."""


def read_text(path: Path, root: str, *, what: str = "config file") -> str:
    """``path``'s text, read from one open descriptor (what is checked is what is read) and at most
    ``MAX_FILE_BYTES`` + 1 bytes of it, whatever size the file reports."""
    name = repr(str(path))  # whole: a shortened path does not find the file
    check_path(path, root, what=what)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise OverlapConfigError.single(root, f"{what} {name} does not exist") from None
    except OSError as err:
        raise OverlapConfigError.single(root, f"{what} {name} cannot be read: {err.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OverlapConfigError.single(root, f"{what} {name} is not a file")
        data = _read_capped(fd, f"{what} {name}", root)
    except BlockingIOError:
        raise OverlapConfigError.single(root, f"{what} {name} cannot be read without waiting (a kernel or "
                                              "device file that only looks like a file, such as /proc/kmsg)") from None
    except OSError as err:
        raise OverlapConfigError.single(root, f"{what} {name} cannot be read: {err.strerror}") from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise OverlapConfigError.single(
            root, f"{what} {name} is not UTF-8 text (byte {err.start} of {len(data):,})") from None


def check_path(path: str | os.PathLike[str], root: str, *, what: str = "config file") -> None:
    """A path no file can have is a config fault here, not the operating system's ``ValueError`` later: a NUL byte
    ends a C string, so ``open`` refuses it (``embedded null byte``) and ``Path.exists`` answers False."""
    text = os.fspath(path)
    if "\x00" in text:
        raise OverlapConfigError.single(root, f"{what} path {text!r} contains a NUL byte (character "
                                              f"{text.index(chr(0))}); no file name can, check how it was built")


def _read_capped(fd: int, named: str, root: str) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, min(2**20, MAX_FILE_BYTES + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > MAX_FILE_BYTES:
            raise OverlapConfigError.single(
                root, f"{named} is more than {MAX_FILE_BYTES:,} bytes; config files are at most that")
    return b"".join(chunks)


def check_text(text: str, root: str) -> None:
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


def parse_yaml(text: str, root: str, *, source: Path | None = None) -> Any:
    """The one YAML document in ``text`` as plain data; every refusal is an ``OverlapConfigError`` under ``root``
    naming ``source`` (the file it came from) and where in it, never the text."""
    # The path whole (an OS path is at most a few KiB): a shortened one does not find the file.
    where = f"YAML file {str(source)!r}" if source is not None else "YAML"
    check_text(text, root)
    try:
        return load_yaml(text)
    except YamlLimitError as err:
        raise OverlapConfigError.single(root, f"{where} refused: {err}") from None
    except (yaml.YAMLError, ValueError, TypeError, RecursionError) as err:
        raise OverlapConfigError.single(root, f"could not parse {where}: {_yaml_problem(err)}") from None


def read_yaml(path: Path, root: str, *, what: str = "config file") -> Any:
    """The YAML file at ``path`` as plain data (``read_text`` then ``parse_yaml``); faults under ``root``."""
    return parse_yaml(read_text(path, root, what=what), root, source=path)


def with_references_resolved(data: Any, root: str, *, at: KeyPath = (), show: Callable[[KeyPath], str] | None = None,
                             header: str | None = None) -> Any:
    """The value at ``at`` inside ``data`` with its ``${key}`` references resolved (``overlapcfg.config.interpolate``:
    resolvers refused), measured again as a tree. Fault paths come from ``show`` (default: ``root`` then the path
    below ``at``)."""
    show = show or (lambda p: join_path(root, p[len(at):]))
    resolved, faults = resolve_references(data, at, show)
    if faults:
        raise OverlapConfigError(faults, header=header)
    measure_or_fault(resolved, root, "once references are resolved")
    return resolved


def measure_or_fault(data: Any, root: str, when: str | None = None) -> None:
    """``safe_yaml.measure`` (nesting depth, values once shared values are counted in full), faults under ``root``."""
    try:
        measure(data)
    except YamlLimitError as err:
        raise OverlapConfigError.single(root, f"config refused: {err}{f' ({when})' if when else ''}") from None


def _yaml_problem(err: Exception) -> str:
    """PyYAML's problem and where it is (``... (line 1, column 11)``), on one line; never the offending text."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or (str(err).strip().splitlines() or [type(err).__name__])[0]
    if isinstance(err, RecursionError):
        problem = "nesting too deep"
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem
