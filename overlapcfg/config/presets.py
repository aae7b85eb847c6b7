"""Presets shipped in the Hydra config tree (``conf/overlap/<group>/*.yaml``), readable without Hydra.

The tree is the project's top-level ``conf/``; the wheel carries it as ``overlapcfg/conf``. Looking in both
places keeps a source checkout, an editable install and a wheel install equivalent.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

from overlapcfg.errors import natural_key

__all__ = ["conf_dir", "load_preset", "preset_names"]


@cache
def conf_dir() -> Path:
    """The directory holding the ``overlap/`` config group tree."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "overlap").is_dir():
            return candidate
    raise FileNotFoundError(f"overlapcfg's config tree is missing (looked in {package / 'conf'} and "
                            f"{package.parent / 'conf'}); the installation is broken")


def preset_names(group: str) -> tuple[str, ...]:
    """Option names of ``overlap/<group>`` in natural order, e.g. ``preset_names("plan")``."""
    folder = conf_dir() / "overlap" / group
    return tuple(sorted((p.stem for p in folder.glob("*.yaml")), key=natural_key))


def load_preset(group: str, name: str) -> dict[str, Any]:
    """The raw mapping of one preset. Unknown names raise ``KeyError`` (callers turn it into a config error)."""
    if name not in preset_names(group):
        raise KeyError(name)
    text = (conf_dir() / "overlap" / group / f"{name}.yaml").read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise TypeError(f"preset overlap/{group}/{name}.yaml is not a mapping")
    return data
