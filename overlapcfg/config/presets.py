"""Presets shipped in the Hydra config tree (``conf/overlap/<group>/*.yaml``), readable without Hydra.

The tree is the project's top-level ``conf/``; the wheel carries it as ``overlapcfg/conf``. Looking in both
places keeps a source checkout, an editable install and a wheel install equivalent.

Within ``from_hydra`` (``searching_hydra``), a name is also looked up on the composed Hydra search path, so a
user's own ``overlap/plan/mine.yaml`` works as ``overlap.plan=mine`` exactly as it does as ``overlap/plan=mine``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from overlapcfg.compat.omegaconf import hydra_group_option, hydra_group_options
from overlapcfg.errors import natural_key

__all__ = ["conf_dir", "load_preset", "preset_names", "searching_hydra"]

_SEARCH_HYDRA: ContextVar[bool] = ContextVar("_SEARCH_HYDRA", default=False)


@cache
def conf_dir() -> Path:
    """The directory holding the ``overlap/`` config group tree."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "overlap").is_dir():
            return candidate
    raise FileNotFoundError(f"overlapcfg's config tree is missing (looked in {package / 'conf'} and "
                            f"{package.parent / 'conf'}); the installation is broken")


@contextmanager
def searching_hydra() -> Iterator[None]:
    """Within the block, presets are also looked up on the composed Hydra search path (if Hydra is running)."""
    token = _SEARCH_HYDRA.set(True)
    try:
        yield
    finally:
        _SEARCH_HYDRA.reset(token)


def _shipped(group: str) -> tuple[str, ...]:
    folder = conf_dir() / "overlap" / group
    return tuple(p.stem for p in folder.glob("*.yaml"))


def preset_names(group: str) -> tuple[str, ...]:
    """Option names of ``overlap/<group>`` in natural order, e.g. ``preset_names("plan")``."""
    names = set(_shipped(group))
    if _SEARCH_HYDRA.get():
        names.update(hydra_group_options(f"overlap/{group}"))
    return tuple(sorted(names, key=natural_key))


def load_preset(group: str, name: str) -> dict[str, Any]:
    """The raw mapping of one preset. Unknown names raise ``KeyError`` (callers turn it into a config error)."""
    if _SEARCH_HYDRA.get():
        found = hydra_group_option(f"overlap/{group}", name)
        if found is not None:
            return found
    if name not in _shipped(group):
        raise KeyError(name)
    text = (conf_dir() / "overlap" / group / f"{name}.yaml").read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise TypeError(f"preset overlap/{group}/{name}.yaml is not a mapping")
    return data
