"""OmegaConf and Hydra internals we rely on (torch-free: the config layer imports this)."""

from __future__ import annotations

from typing import Any

from omegaconf import Container, DictConfig, ListConfig, OmegaConf

__all__ = ["full_key", "hydra_group_option", "hydra_group_options", "root_of"]


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
