"""Starting a Hydra app through overlapcfg's one command-line path: the ``overlapcfg`` command and a user's own.

``@overlapcfg.hydra_main(config_path=..., config_name=..., mounts=[...])`` takes the place of ``@hydra.main``;
``@overlapcfg.with_hydra_overrides(mounts=[...])`` goes above an unchanged ``@hydra.main`` line. Both, and the
command, call ``run_app``, which does what ``@hydra.main`` does with four steps added, and never touches
``sys.argv``:

1. the command line is parsed with Hydra's own argument parser (``compat.hydra_argument_parser``);
2. its overrides go through ``hydra_overrides`` (presets by name become group options, fields on top land,
   typos and ``<mount>.policy=null`` are refused with what to write; ``overlapcfg.config.command_line``);
3. every config file the composition will read is read first by the library's bounded reader
   (``overlapcfg.config.hydra_files.read_composition``: size, nesting, aliases, duplicate keys; a fault names the
   file), over the search path Hydra builds for the app (its config directory, every search-path plugin's
   entries, ``--config-dir``, ``hydra.searchpath``);
4. Hydra runs the app with the rewritten overrides, handed over as data (``compat.run_hydra``, what
   ``@hydra.main`` calls once it has parsed ``sys.argv``).

A fault in steps 2-3 ends the process with status 1 and the message, one screen, as Hydra does for its own
composition errors. Inside the job, an ``OverlapcfgError`` the task raises (``from_hydra`` on a bad preset, a
hardware profile out of range) is shown by Hydra as its message alone (``HydraConfigError``, exit status 1), with
the file each faulty node was composed from (the job's group choices, read where they are: inside the running job).
``HYDRA_FULL_ERROR=1`` still shows Hydra's full traceback.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from hydra.errors import CompactHydraException
from omegaconf import DictConfig

from overlapcfg.compat.omegaconf import (
    app_search_path,
    hydra_argument_parser,
    hydra_main_settings,
    job_choices,
    parse_command_line,
    rerun_config,
    run_hydra,
    set_version_base,
)
from overlapcfg.config.command_line import GROUP, hydra_overrides
from overlapcfg.config.hydra_files import SearchPath, read_composition
from overlapcfg.errors import Fault, OverlapcfgError, OverlapConfigError, OverlapUsageError

__all__ = ["HydraConfigError", "Task", "checked_overrides", "hydra_main", "job_message", "run_app",
           "with_hydra_overrides"]

Task = Callable[[DictConfig], Any]
F = TypeVar("F", bound=Callable[..., Any])
Check = Callable[[list[str], SearchPath], list[Fault]]
"""An app's own check of its overrides before composing (the command: keys it does not read, node-costs files)."""


class HydraConfigError(CompactHydraException):
    """An ``OverlapcfgError`` raised in a job, shown by Hydra as its message alone (exit status 1)."""


def run_app(task: Task, *, config_path: str | None, config_name: str | None, mounts: Sequence[str] = (GROUP,),
            strategy: str | None = None, argv: Sequence[str] | None = None, search: Iterable[str] = (),
            check: Check | None = None) -> None:
    """Run ``task`` as ``@hydra.main(config_path, config_name)`` would, through the steps of the module docstring.
    ``argv``: the arguments (default ``sys.argv[1:]``, read, never written); ``search``: directories to look for
    configs in besides Hydra's search path (the command's profile directory, which its primary config adds);
    ``check``: the app's own faults for the overrides as written."""
    parser = hydra_argument_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.experimental_rerun is not None:  # Hydra's own: a pickled config, overrides ignored
        task(rerun_config(args.experimental_rerun, args.overrides))
        return
    if args.config_path is not None:
        config_path = args.config_path
    if args.config_name is not None:
        config_name = args.config_name
    if not args.shell_completion:
        search_path = SearchPath.of(app_search_path(task, config_path, args.config_dir)).then(search)
        try:
            args.overrides = checked_overrides(args.overrides, mounts=mounts, strategy=strategy,
                                               search_path=search_path, config_name=config_name, check=check)
        except OverlapcfgError as err:
            sys.exit(str(err))
    run_hydra(args, parser, _reporting(task), config_path=config_path, config_name=config_name)


def checked_overrides(overrides: Sequence[str], *, mounts: Sequence[str], strategy: str | None,
                      search_path: SearchPath, config_name: str | None, check: Check | None = None) -> list[str]:
    """Steps 2-3 of the module docstring: the overrides Hydra gets, or an ``OverlapConfigError`` listing every
    fault of the command line (the app's own ``check`` first), else every config file refused."""
    faults = list(check(list(overrides), search_path)) if check is not None else []
    try:
        rewritten = hydra_overrides(overrides, mounts=mounts, strategy=strategy, search_path=search_path)
    except OverlapConfigError as err:
        faults += err.faults
    if faults:
        raise OverlapConfigError(faults, header="invalid overrides")
    written = dict(zip(rewritten, overrides, strict=False))  # a fault names an override as the user wrote it
    read_composition(search_path, config_name, [o for o in parse_command_line(rewritten) if o is not None],
                     written=written)
    return rewritten


def _reporting(task: Task) -> Task:
    """``task``, with an ``OverlapcfgError`` it raises shown as Hydra shows its own errors (``job_message``)."""

    @functools.wraps(task)  # Hydra finds the app's module (relative config paths) through __wrapped__
    def job(cfg: DictConfig) -> Any:
        try:
            return task(cfg)
        except OverlapcfgError as err:
            raise HydraConfigError(job_message(err)) from None

    return job


def job_message(err: OverlapcfgError) -> str:
    """``err``'s message, each faulty node's file said where a group option of the running job composed it and the
    command line did not set the faulty value itself::

        invalid overlap config (1 fault):
          trainer.overlap.policy.forward_prefetch: expected an integer >= 0, got -1
          (trainer.overlap.policy is overlap/policy=mine: /home/me/app/conf/overlap/policy/mine.yaml)
    """
    notes = list(_composed_from(err.faults)) if isinstance(err, OverlapConfigError) else []
    return str(err) + "".join(f"\n  ({note})" for note in notes)


def _composed_from(faults: Sequence[Fault]) -> Iterable[str]:
    """For each node holding a fault, the group option of the running job that composed it (the most specific)
    and its file; faults on a key the command line set as a value are the command line's, not a file's."""
    found = job_choices()
    if found is None:
        return
    choices, sources, keys = found
    search_path = SearchPath.of(sources)
    groups = {key.partition("@")[0] for key in choices}
    values = [key for key in keys if "/" not in key and key not in groups]  # value overrides, not group choices
    packages = {}
    for key, option in choices.items():
        group, _, package = key.partition("@")
        if not group.startswith("hydra/"):
            packages[package or group.replace("/", ".")] = (key, option)
    notes: dict[str, str] = {}
    for fault in faults:
        if not fault.path or any(_under(fault.path, key) for key in values):
            continue
        owners = [p for p in packages if _under(fault.path, p)]
        if owners:
            package = max(owners, key=len)
            key, option = packages[package]
            file = search_path.find(f"{key.partition('@')[0]}/{option}")
            if file is not None:
                notes[package] = f"{package} is {key}={option}: {file}"
    yield from notes.values()


def _under(path: str, node: str) -> bool:
    return path == node or path.startswith((f"{node}.", f"{node}["))


def hydra_main(config_path: str | None = None, config_name: str | None = None, version_base: str | None = None, *,
               mounts: Sequence[str] = (GROUP,)) -> Callable[[Task], Callable[..., Any]]:
    """``@hydra.main`` with overlapcfg's command-line path (module docstring): presets by name with fields on top,
    bounded reading of every config file, faults in the project's words. ``mounts``: where the app's defaults
    mount the ``overlap`` group (``["trainer.overlap"]`` for ``overlap@trainer.overlap: default``)::

        @overlapcfg.hydra_main(config_path="conf", config_name="train", mounts=["trainer.overlap"])
        def main(cfg):
            overlap = overlapcfg.from_hydra(cfg.trainer.overlap)
    """
    set_version_base(version_base)
    mounts = tuple(mounts)

    def decorate(task: Task) -> Callable[..., Any]:
        @functools.wraps(task)
        def main(cfg_passthrough: DictConfig | None = None) -> Any:
            if cfg_passthrough is not None:  # as @hydra.main: a config given is the task's, nothing composes
                return task(cfg_passthrough)
            run_app(task, config_path=config_path, config_name=config_name, mounts=mounts)
            return None

        return main

    return decorate


def with_hydra_overrides(*, mounts: Sequence[str] = (GROUP,)) -> Callable[[F], F]:
    """For an app that keeps its ``@hydra.main`` line: placed right above it, the app runs as with
    ``overlapcfg.hydra_main`` (same settings, read from ``@hydra.main``'s function; ``sys.argv`` is not changed)::

        @overlapcfg.with_hydra_overrides(mounts=["trainer.overlap"])
        @hydra.main(config_path="conf", config_name="train", version_base="1.3")
        def main(cfg): ...
    """
    mounts = tuple(mounts)

    def decorate(main: F) -> F:
        settings = hydra_main_settings(main)
        if settings is None:
            raise OverlapUsageError("with_hydra_overrides goes right above @hydra.main(...), on the function it "
                                    f"returns; got {getattr(main, '__qualname__', main)!r}, which is not one (or "
                                    "this hydra-core keeps its settings elsewhere): use @overlapcfg.hydra_main("
                                    "config_path=..., config_name=...) in place of @hydra.main")
        task, config_path, config_name = settings

        @functools.wraps(main)
        def run(cfg_passthrough: DictConfig | None = None) -> Any:
            if cfg_passthrough is not None:
                return main(cfg_passthrough)
            run_app(task, config_path=config_path, config_name=config_name, mounts=mounts)
            return None

        return run  # type: ignore[return-value]  # the same call signature as main: what it wraps

    return decorate
