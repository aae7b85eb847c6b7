"""OmegaConf internals we rely on (torch-free: the config layer imports this)."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig

__all__ = ["full_key", "root_of"]


def full_key(node: DictConfig) -> str:
    """The dotted path where ``node`` sits in its composed config (``trainer.overlap``), ``""`` at the root.

    OmegaConf has no public API for it; ``_get_full_key(None)`` is what its own error messages use.
    """
    return str(node._get_full_key(None) or "")


def root_of(node: DictConfig | ListConfig) -> DictConfig | ListConfig:
    """The whole composed config a node belongs to (``${key}`` references resolve against it)."""
    return node._get_root()
