"""OmegaConf and Hydra internals we rely on (torch-free: the config layer imports this).

Everything here that is not Hydra's documented API says which private piece it reads; a hydra-core release that
moves one breaks here, in one place. Read against hydra-core 1.3.x:

- ``hydra._internal.utils``: ``get_args_parser`` (the argument parser ``@hydra.main`` uses), ``_run_hydra`` (what
  ``@hydra.main`` calls with the parsed arguments: it takes the overrides as data, so an app started through
  ``overlapcfg.hydra_main`` hands Hydra its rewritten overrides without touching ``sys.argv``),
  ``create_automatic_config_search_path`` and ``detect_calling_file_or_module_from_task_function`` (the search
  path ``_run_hydra`` builds, search-path plugins included, for the files overlapcfg reads first);
- ``hydra.main``'s closure (``config_path``, ``config_name``, ``task_function``): how ``with_hydra_overrides``,
  stacked on an unchanged ``@hydra.main`` line, runs the same app;
- ``hydra.main._get_rerun_conf``: the config ``--experimental-rerun`` runs with (``rerun_config``);
- ``OmegaConf``'s ``_get_full_key`` / ``_get_root``: where a node sits in its composed config.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from omegaconf import Container, DictConfig, ListConfig

__all__ = ["CommandLineOverride", "app_search_path", "composing_search_path", "full_key", "hydra_argument_parser",
           "hydra_group_options", "hydra_main_settings", "job_choices", "parse_command_line", "rerun_config", "root_of",
           "run_hydra", "set_version_base"]


def full_key(node: DictConfig | ListConfig) -> str:
    """The dotted path where ``node`` sits in its composed config (``trainer.overlap``), ``""`` at the root.

    OmegaConf has no public API for it; ``_get_full_key(None)`` is what its own error messages use.
    """
    return str(node._get_full_key(None) or "")


def root_of(node: DictConfig | ListConfig) -> Container:
    """The whole composed config a node belongs to (``${key}`` references resolve against it)."""
    return node._get_root()


def hydra_group_options(group: str) -> tuple[str, ...]:
    """Options of a config group on the search path of the Hydra instance in use (``()`` when none is): what a
    user app sees, for tests and the wheel check."""
    from hydra.core.global_hydra import GlobalHydra

    hydra = GlobalHydra.instance()
    return tuple(hydra.config_loader().get_group_options(group)) if hydra.is_initialized() else ()


@dataclass(frozen=True, slots=True)
class CommandLineOverride:
    """One Hydra command-line override as Hydra's own grammar reads it (``hydra.core.override_parser``)."""

    text: str
    """As written: ``+overlap.policy.forward_prefetch=4``."""
    prefix: str
    """``""`` (change), ``"+"`` (add), ``"++"`` (add or change) or ``"~"`` (delete)."""
    key: str
    """The key or config group, without prefix and package: ``overlap.policy.forward_prefetch``, ``overlap/plan``."""
    package: str | None
    """``trainer.overlap.plan`` in ``overlap/plan@trainer.overlap.plan=mine``; None without ``@``."""
    value_text: str
    """What follows the first ``=`` (``""`` for a bare deletion)."""
    is_sweep: bool
    """A sweep (``a,b``, ``range(...)``, ``glob(...)``): its value is Hydra's to expand, job by job."""
    options: tuple[str, ...] | None
    """The names the value would select as a config group option, as written (``nan``, ``'x'`` unquoted): one
    for a plain value, each of a list or of a choice sweep (``a,b``, ``choice(a,b)``); None for null, a mapping,
    an interpolation, or a sweep Hydra expands itself (``range``, ``glob``)."""
    typed: tuple[str, ...]
    """The ``options`` Hydra reads as something other than a string (``nan``, ``inf``, ``true``, ``1``): as a
    group option such a value is refused by Hydra ("Config group override must be a string or a list")."""
    is_null: bool
    """The value is ``null``."""

    def value(self) -> Any:
        """The value as Hydra composes it (``4``, ``[1, 2]``, ``'x y'``); sweeps are not expanded here."""
        return _parser().parse_override(self.text).value()


def parse_command_line(args: Iterable[str]) -> list[CommandLineOverride | None]:
    """Each argument as a ``CommandLineOverride``, or None where it is not one (a flag such as ``--cfg``, a value of
    a flag, text Hydra's grammar rejects: Hydra reports those itself)."""
    from hydra.errors import HydraException

    parser = _parser()
    out: list[CommandLineOverride | None] = []
    for arg in args:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            out.append(None)
            continue
        try:
            parsed = parser.parse_override(arg)
        except HydraException:
            out.append(None)
            continue
        prefix = "~" if parsed.is_delete() else "++" if parsed.is_force_add() else "+" if parsed.is_add() else ""
        options, typed = _options(parsed)
        out.append(CommandLineOverride(text=arg, prefix=prefix, key=parsed.key_or_group, package=parsed.package,
                                       value_text=arg.partition("=")[2], is_sweep=parsed.is_sweep_override(),
                                       options=options, typed=typed,
                                       is_null=not parsed.is_sweep_override() and parsed.value() is None
                                       and "=" in arg))
    return out


def _options(parsed: Any) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """``(options, typed)`` of a parsed override (see ``CommandLineOverride``)."""
    from hydra.core.override_parser.types import ChoiceSweep

    if parsed.is_delete() and parsed.value() is None:
        return None, ()
    value = parsed.value()
    if parsed.is_sweep_override():
        if not isinstance(value, ChoiceSweep):
            return None, ()
        items = list(value.list)
        texts = list(parsed.sweep_string_iterator())
    elif isinstance(value, list):
        items = value
        texts = [_text(v) for v in value]
    else:
        items = [value]
        texts = [_element_text(parsed)]
    if any(not isinstance(v, (str, int, float, bool)) for v in items) or any("${" in t for t in texts):
        return None, ()
    names = tuple(_unquoted(t) for t in texts)
    return names, tuple(n for n, v in zip(names, items, strict=True) if not isinstance(v, str))


def _text(value: Any) -> str:
    """A list element as Hydra's grammar writes it (``true``, ``nan``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return str(value)


def _element_text(parsed: Any) -> str:
    """The value of a plain (non-sweep) override as written, without its escapes (``x\\ y`` is ``x y``)."""
    return str(parsed.input_line).partition("=")[2].strip()


def _unquoted(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


# --- starting a Hydra app with overrides given as data --------------------------------------------------------------

def hydra_argument_parser() -> argparse.ArgumentParser:
    """The argument parser ``@hydra.main`` reads ``sys.argv`` with (``hydra._internal.utils.get_args_parser``)."""
    from hydra._internal.utils import get_args_parser

    parser: argparse.ArgumentParser = get_args_parser()
    return parser


def set_version_base(version_base: str | None) -> None:
    """What ``@hydra.main(version_base=...)`` sets before anything else (``hydra.version.setbase``)."""
    from hydra import version

    version.setbase(version_base)


def run_hydra(args: argparse.Namespace, parser: argparse.ArgumentParser, task: Callable[[DictConfig], Any], *,
              config_path: str | None, config_name: str | None) -> None:
    """Run ``task`` as ``@hydra.main`` would with the parsed ``args`` (its overrides included, as given):
    ``hydra._internal.utils._run_hydra``, what ``hydra.main`` calls after parsing ``sys.argv``."""
    from hydra._internal.utils import _run_hydra

    _run_hydra(args=args, args_parser=parser, task_function=task, config_path=config_path, config_name=config_name)


def hydra_main_settings(main: Callable[..., Any]) -> tuple[Callable[[DictConfig], Any], str | None, str | None] | None:
    """``(task function, config_path, config_name)`` of a function ``@hydra.main(...)`` returned, read from its
    closure (``inspect.getclosurevars``; hydra-core 1.3's ``decorated_main``), or None when ``main`` is not one."""
    try:
        found = inspect.getclosurevars(main).nonlocals
    except TypeError:
        return None
    task = found.get("task_function")
    if not callable(task) or not {"config_path", "config_name"} <= set(found):
        return None
    return task, found["config_path"], found["config_name"]


def app_search_path(task: Callable[..., Any], config_path: str | None, config_dir: str | None) -> tuple[str, ...]:
    """The config search path ``_run_hydra`` builds for ``task`` (Hydra's own package, the app's config directory,
    every search-path plugin's entries, ``--config-dir``), in Hydra's order, as ``file://``/``pkg://`` paths;
    ``hydra.searchpath`` is added at composition and is not in it."""
    from hydra._internal.utils import (
        create_automatic_config_search_path,
        detect_calling_file_or_module_from_task_function,
    )
    from hydra.core.config_search_path import SearchPathQuery

    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task)
    search_path = create_automatic_config_search_path(calling_file, calling_module, config_path)
    if config_dir is not None:  # as _run_hydra's add_conf_dir does
        search_path.prepend(provider="command-line", path=f"file://{os.path.abspath(config_dir)}",
                            anchor=SearchPathQuery(provider="schema"))
    return tuple(element.path for element in search_path.get_path())


def composing_search_path() -> tuple[str, ...] | None:
    """The search path of the Hydra instance in use (inside ``initialize_config_dir(...)``, or a running app),
    or None when Hydra is not initialized."""
    from hydra.core.global_hydra import GlobalHydra

    hydra = GlobalHydra.instance()
    if not hydra.is_initialized():
        return None
    return tuple(element.path for element in hydra.config_loader().get_search_path().get_path())


def job_choices() -> tuple[dict[str, str], tuple[str, ...], tuple[str, ...]] | None:
    """The running job's group choices (``{"overlap/policy@trainer.overlap.policy": "mine", ...}``), the search
    path its config was composed from, and the keys its command line set; None outside a running Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    choices = {str(k): str(v) for k, v in hydra.runtime.choices.items() if v is not None}
    sources = tuple(f"{s.schema}://{s.path}" for s in hydra.runtime.config_sources)
    keys = tuple(o.key for o in parse_command_line(str(t) for t in hydra.overrides.task) if o is not None)
    return choices, sources, keys


def rerun_config(path: str, overrides: list[str]) -> DictConfig:
    """The config ``--experimental-rerun <path>`` runs with (``hydra.main._get_rerun_conf``)."""
    from hydra.main import _get_rerun_conf

    config: DictConfig = _get_rerun_conf(path, overrides)
    return config
