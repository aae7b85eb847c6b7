"""The files a Hydra composition will read, read first by overlapcfg's bounded YAML reader.

Hydra reads each config file whole with OmegaConf's loader (``hydra/_internal/core_plugins/file_config_source.py``:
``FileConfigSource.load_config`` opens the file and calls ``OmegaConf.load``): no size limit, aliases expanded as
a tree once the config is merged, recursion as deep as the file nests. A 300-byte alias bomb as
``hardware/bomb.yaml``, or a 50 MB preset under ``--config-dir``, hangs it for minutes; 3,000-deep nesting or
``a: &a [1, *a]`` ends in a ``RecursionError`` traceback.

So every route that starts Hydra for a user (the ``overlapcfg`` command, ``overlapcfg.hydra_main`` and
``with_hydra_overrides``, and ``hydra_overrides`` inside a compose context) first finds the files the composition
will read and reads each with ``overlapcfg.config.yaml_files.read_yaml``: the library's own limits (size, nesting,
values once aliases are expanded, duplicate keys, UTF-8) and one fault naming the file, line and column. Only
then does Hydra read them.

Which files, in our own reading of Hydra's documented defaults-list grammar: the primary config; each entry of a
defaults list (``group: option``, ``group@package: option``, ``override group: ...``, ``optional group: ...``,
``/absolute/group: ...``, a list of options, a plain config name, ``_self_``), a group's option replaced by the one
the command line chooses (``hardware=x``, ``overlap/policy@trainer.overlap.policy=x``, ``+group=x``, sweeps
``a,b``); the directories ``hydra.searchpath`` adds (literal entries). A group chosen on the command line that no
search-path directory holds is a fault here, with the options closest first. Left to Hydra: its own groups
(``hydra/...``), interpolated names (``${...}``), schema sources (``structured://``), options a default names but
no directory holds (Hydra's own "Could not find" says it).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlapcfg.compat.omegaconf import CommandLineOverride, parse_command_line
from overlapcfg.config.yaml_files import read_yaml
from overlapcfg.errors import Fault, OverlapConfigError, closest_first, did_you_mean, natural_key

__all__ = ["MAX_CONFIG_FILES", "SearchPath", "group_of", "read_composition"]

MAX_CONFIG_FILES = 1000
"""Most config files one composition may read: a recipe with every group of a large project reads tens."""
HEADER = "a config file Hydra would read is refused"
SUFFIX = ".yaml"
"""The one extension Hydra reads since version_base 1.2 (``ConfigSource._normalize_file_name``)."""


@dataclass(frozen=True, slots=True)
class SearchPath:
    """The local config directories of a Hydra search path, in Hydra's order: the first holding a config is the
    one Hydra reads."""

    dirs: tuple[Path, ...]

    @classmethod
    def of(cls, entries: Iterable[str]) -> SearchPath:
        """From Hydra's search-path strings (``file:///x``, ``/x``, ``pkg://mypkg.conf``); Hydra's own package
        (``pkg://hydra.conf``) and schema sources (``structured://``) hold no file of the user's."""
        return cls(()).then(entries)

    def then(self, entries: Iterable[str]) -> SearchPath:
        dirs = list(self.dirs)
        for entry in entries:
            found = _local_dir(entry)
            if found is not None and found not in dirs:
                dirs.append(found)
        return SearchPath(tuple(dirs))

    def find(self, config_path: str) -> Path | None:
        """The file Hydra reads for ``config_path`` (``hardware/h100_nvlink``), or None."""
        name = config_path if config_path.endswith(SUFFIX) else config_path + SUFFIX
        for d in self.dirs:
            if (d / name).is_file():
                return d / name
        return None

    def is_group(self, group: str) -> bool:
        return any((d / group).is_dir() for d in self.dirs)

    def subgroups(self, group: str) -> tuple[str, ...]:
        """The groups right below ``group`` (``overlap/plan``, ``overlap/policy`` below ``overlap``), in natural
        order."""
        names = {p.name for d in self.dirs if (d / group).is_dir() for p in (d / group).iterdir() if p.is_dir()}
        return tuple(f"{group}/{name}" for name in sorted(names, key=natural_key))

    def options(self, group: str) -> tuple[str, ...]:
        """Every option of ``group`` on the search path, in natural order."""
        names = {p.name[: -len(SUFFIX)] for d in self.dirs if (d / group).is_dir()
                 for p in (d / group).iterdir() if p.name.endswith(SUFFIX) and p.is_file()}
        return tuple(sorted(names, key=natural_key))


def _local_dir(entry: str) -> Path | None:
    scheme, sep, rest = entry.partition("://")
    if not sep:
        return Path(entry)
    if scheme == "file":
        return Path(rest)
    if scheme != "pkg" or rest == "hydra.conf" or rest.startswith("hydra.conf."):
        return None
    try:  # what Hydra's package source reads: the package's directory (importing its parent, as Hydra does)
        spec = importlib.util.find_spec(rest.replace("/", "."))
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def group_of(o: CommandLineOverride, search_path: SearchPath) -> str | None:
    """The config group ``o`` chooses an option of (``hardware``, ``overlap/plan``), or None for a value
    override: a key holding ``/`` or naming a directory on the search path, as Hydra decides
    (``defaults_list.py``: ``repo.group_exists``); Hydra's own groups are left to it."""
    if o.prefix in ("~", "++") or o.is_null or o.key == "hydra" or o.key.startswith(("hydra.", "hydra/")):
        return None
    if "/" in o.key or o.package is not None or search_path.is_group(o.key):
        return o.key.lstrip("/")
    return None


def read_composition(search_path: SearchPath, config_name: str | None, overrides: Sequence[CommandLineOverride],
                     *, written: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Read every config file the composition of ``config_name`` with ``overrides`` will read (module docstring),
    each with the bounded reader; ``{config path: file}`` of those read. An ``OverlapConfigError`` lists every
    file refused (and every chosen option that does not exist) at once; ``written`` maps an override to how the
    user wrote it (``overlap/plan=x`` was ``overlap.plan=x``), for the faults."""
    chosen: dict[str, list[tuple[CommandLineOverride, str]]] = {}
    for o in overrides:
        group = group_of(o, search_path)
        if group is not None and o.options is not None:
            chosen.setdefault(group, []).extend((o, option) for option in o.options)
    faults: list[Fault] = []
    walk = _Walk(search_path.then(_searchpath_overrides(overrides)),
                 {group: [option for _, option in pairs] for group, pairs in chosen.items()}, faults)
    if config_name is not None:  # first: its hydra.searchpath may hold the options chosen
        name = config_name.removesuffix(SUFFIX)
        walk.visit(name, name.rpartition("/")[0], primary=True)
    missing = []
    for group, pairs in chosen.items():
        for o, option in pairs:
            if walk.search_path.find(f"{group}/{option}") is None:
                missing.append(missing_option(o, group, option, walk.search_path,
                                              written=(written or {}).get(o.text, o.text)))
            else:
                walk.visit(f"{group}/{option}", group)
    if missing or faults:
        header = "invalid overrides" if not faults else HEADER if not missing else f"invalid overrides; {HEADER}"
        raise OverlapConfigError([*missing, *faults], header=header)
    return walk.read


def missing_option(o: CommandLineOverride, group: str, option: str, search_path: SearchPath, *,
                   written: str | None = None) -> Fault:
    """``hardware=h100: no option 'h100' in group hardware (did you mean 'h100_nvlink'?); options (closest first):
    ...``, saying why where Hydra would read the name as a number or a boolean (``hardware=1``), and which group
    below holds the name where one does (``overlap=aggressive``: ``overlap/policy=aggressive``)."""
    options = search_path.options(group)
    as_written = parse_command_line([written])[0] if written else None
    read_as = o.typed + (as_written.typed if as_written is not None else ())
    typed = (f" (Hydra reads {option} as a {_kind(option)}; an option of that name would be the file "
             f"{group}/{option}.yaml)") if option in read_as else ""
    listing = ", ".join(closest_first(option, options)) or "none"
    below = [sub for sub in search_path.subgroups(group) if option in search_path.options(sub)]
    elsewhere = f"; it is an option of {' and '.join(below)}: {below[0]}={option}" if below else ""
    return Fault("", f"{written or o.text}: no option {option!r} in group {group}{typed}"
                     f"{did_you_mean(option, options)}; "
                     f"options (closest first): {listing}{elsewhere}")


def _kind(text: str) -> str:
    low = text.lower()
    return "boolean" if low in ("true", "false") else "number"


def _searchpath_overrides(overrides: Sequence[CommandLineOverride]) -> list[str]:
    for o in overrides:
        if o.key == "hydra.searchpath" and o.prefix != "~":
            value = o.value()
            return [v for v in value if isinstance(v, str) and "${" not in v] if isinstance(value, list) else []
    return []


class _Walk:
    """The files read so far and what is still to read (``read_composition``)."""

    def __init__(self, search_path: SearchPath, chosen: Mapping[str, list[str]], faults: list[Fault]) -> None:
        self.search_path = search_path
        self.chosen = chosen
        self.faults = faults
        self.read: dict[str, Path] = {}
        self.seen: set[str] = set()

    def visit(self, config_path: str, group: str, *, primary: bool = False) -> None:
        """Read ``config_path`` (a config in ``group``, ``""`` at the top) and everything its defaults name; the
        primary config's ``hydra.searchpath`` extends the search path (literal entries only)."""
        todo = [(config_path, group)]
        while todo:
            path, in_group = todo.pop()
            if path in self.seen:
                continue
            self.seen.add(path)
            if len(self.seen) > MAX_CONFIG_FILES:
                self.faults.append(Fault("", f"the composition reads more than {MAX_CONFIG_FILES} config files; "
                                             "a defaults list that names itself, or a generated tree?"))
                return
            file = self.search_path.find(path)
            if file is None:
                continue  # Hydra says which default it could not find
            try:
                data = read_yaml(file, "", what="Hydra config file")
            except OverlapConfigError as err:
                self.faults.extend(err.faults)
                continue
            self.read[path] = file
            if primary and path == config_path:
                self.search_path = self.search_path.then(_own_searchpath(data))
            todo.extend(self._defaults(data, in_group))

    def _defaults(self, data: Any, group: str) -> Iterator[tuple[str, str]]:
        entries = data.get("defaults") if isinstance(data, Mapping) else None
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, str) and entry != "_self_" and "${" not in entry:
                name = _absolute(entry.partition("@")[0], group)
                yield name, name.rpartition("/")[0]
            elif isinstance(entry, Mapping) and len(entry) == 1:
                ((key, value),) = entry.items()
                target = _absolute(str(key).split()[-1].partition("@")[0], group)
                options = self.chosen.get(target) or (value if isinstance(value, list) else [value])
                for option in options:
                    if isinstance(option, str) and option != "???" and "${" not in option:
                        yield f"{target}/{option}", target


def _absolute(name: str, group: str) -> str:
    """A defaults entry's group or config path from the top of the search path: ``/x`` is absolute, anything else
    relative to the group of the config that lists it."""
    if name.startswith("/"):
        return name.lstrip("/")
    return f"{group}/{name}" if group else name


def _own_searchpath(data: Any) -> list[str]:
    hydra = data.get("hydra") if isinstance(data, Mapping) else None
    entries = hydra.get("searchpath") if isinstance(hydra, Mapping) else None
    return [e for e in entries if isinstance(e, str) and "${" not in e] if isinstance(entries, list) else []
