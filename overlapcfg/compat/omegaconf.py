"""OmegaConf and Hydra internals we rely on (torch-free: the config layer imports this)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from omegaconf import Container, DictConfig, ListConfig, OmegaConf

__all__ = ["CommandLineOverride", "full_key", "hydra_command_line", "hydra_group_option", "hydra_group_options",
           "parse_command_line", "root_of"]


def full_key(node: DictConfig | ListConfig) -> str:
    """The dotted path where ``node`` sits in its composed config (``trainer.overlap``), ``""`` at the root.

    OmegaConf has no public API for it; ``_get_full_key(None)`` is what its own error messages use.
    """
    return str(node._get_full_key(None) or "")


def root_of(node: DictConfig | ListConfig) -> Container:
    """The whole composed config a node belongs to (``${key}`` references resolve against it)."""
    return node._get_root()


def hydra_group_options(group: str) -> tuple[str, ...]:
    """Options of a config group on the running Hydra app's search path (``()`` when Hydra is not running)."""
    loader = _hydra_loader()
    return tuple(loader.get_group_options(group)) if loader is not None else ()


def hydra_group_option(group: str, name: str) -> dict[Any, Any] | None:
    """The raw mapping of ``group/name`` from the running Hydra app's search path, or None.

    Hydra has no public "load this group option" call; its config repository (``ConfigLoaderImpl.repository``)
    is what the defaults list itself uses, so a name resolves here exactly as ``group=name`` would.
    """
    loader = _hydra_loader()
    if loader is None or name not in loader.get_group_options(group):
        return None
    result = loader.repository.load_config(f"{group}/{name}")
    if result is None:
        return None
    data = OmegaConf.to_container(result.config, resolve=False)
    return data if isinstance(data, dict) else None


def _hydra_loader() -> Any:
    from hydra.core.global_hydra import GlobalHydra

    hydra = GlobalHydra.instance()
    return hydra.config_loader() if hydra.is_initialized() else None


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
        out.append(CommandLineOverride(text=arg, prefix=prefix, key=parsed.key_or_group, package=parsed.package,
                                       value_text=arg.partition("=")[2], is_sweep=parsed.is_sweep_override()))
    return out


def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def hydra_command_line(node: DictConfig) -> tuple[tuple[str, ...], dict[str, str]] | None:
    """The task overrides (as written) and group choices (``{"overlap/plan": "mine", ...}``) of the Hydra run that
    composed ``node``: the composed config's own ``hydra`` node where it kept one (``compose(...,
    return_hydra_config=True)``), else the running job's (``HydraConfig``, set only while a ``@hydra.main`` task
    runs). None outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    root = root_of(node)
    hydra_node = root.get("hydra") if isinstance(root, DictConfig) else None
    if not isinstance(hydra_node, DictConfig) and HydraConfig.initialized():
        hydra_node = HydraConfig.get()
    if not isinstance(hydra_node, DictConfig):
        return None
    task = OmegaConf.select(hydra_node, "overrides.task", default=None)
    choices = OmegaConf.select(hydra_node, "runtime.choices", default=None)
    overrides = tuple(str(o) for o in task) if isinstance(task, ListConfig) else ()
    chosen = {str(k): str(v) for k, v in choices.items() if v is not None} if isinstance(choices, DictConfig) else {}
    return overrides, chosen
