"""Presets shipped in the Hydra config tree (``presets/overlap/<group>/*.yaml``), readable without Hydra.

Two trees, both found the same way (the project's top level in a checkout or an editable install; inside the
package in a wheel, where hatch force-includes them), so every install reads the same files:

- ``presets/`` (wheel: ``overlapcfg/presets``): the ``overlap`` groups user apps compose. The Hydra search-path
  plugin puts this tree, and nothing else, on every Hydra app's search path;
- ``conf/`` (wheel: ``overlapcfg/conf``): the ``overlapcfg`` command's own primary config (``overlapcfg.yaml``)
  and the hardware profiles (``hardware/``, read by ``overlapcfg.cost.hardware``). No user app sees it, so a
  user's own ``hardware`` group or ``overlapcfg.yaml`` never collides with ours.

A name is looked up among the shipped presets only, whatever runs in the process: ``load_config({"plan": "x"})``
and ``from_hydra`` give the same config for the same data. A user's own ``overlap/plan/mine.yaml`` is a Hydra
group option; by name on a command line it is chosen as one (``overlapcfg.config.command_line``).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from overlapcfg.config.yaml_files import read_yaml
from overlapcfg.errors import OverlapLookupError, OverlapStateError, OverlapUsageError, natural_key

__all__ = ["command_conf_dir", "conf_dir", "load_preset", "preset_names"]


def _tree(name: str, marker: str) -> Path:
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / name, package.parent / name):
        if (candidate / marker).exists():
            return candidate
    raise OverlapStateError(f"overlapcfg's config tree {name}/ is missing (looked in {package / name} and "
                            f"{package.parent / name}); the installation is broken")


@cache
def conf_dir() -> Path:
    """The directory holding the ``overlap/`` config group tree (``presets/``): what user apps compose."""
    return _tree("presets", "overlap")


@cache
def command_conf_dir() -> Path:
    """The ``overlapcfg`` command's own config directory (``conf/``: ``overlapcfg.yaml``, ``hardware/``)."""
    return _tree("conf", "overlapcfg.yaml")


def _shipped(group: str) -> tuple[str, ...]:
    folder = conf_dir() / "overlap" / group
    return tuple(p.stem for p in folder.glob("*.yaml"))


def preset_names(group: str) -> tuple[str, ...]:
    """Option names of ``overlap/<group>`` in natural order, e.g. ``preset_names("plan")``."""
    return tuple(sorted(_shipped(group), key=natural_key))


def load_preset(group: str, name: str) -> dict[str, Any]:
    """The raw mapping of one preset. Unknown names raise ``KeyError`` (callers turn it into a config error).

    Shipped presets are read as user files are (``overlapcfg.config.yaml_files``): the same scalars and limits."""
    if name not in _shipped(group):
        raise OverlapLookupError(name)
    data = read_yaml(conf_dir() / "overlap" / group / f"{name}.yaml", "", what="shipped preset") or {}
    if not isinstance(data, dict):
        raise OverlapUsageError(f"preset overlap/{group}/{name}.yaml is not a mapping")
    return data
