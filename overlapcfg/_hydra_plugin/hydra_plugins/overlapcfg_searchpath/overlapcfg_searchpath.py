"""Makes overlapcfg's config groups (``overlap``, ``overlap/plan``, ``overlap/policy``, ``hardware``) available to
every Hydra app, so a recipe can write ``defaults: [overlap: default, _self_]`` with no search-path set-up.

Hydra imports this module in *every* Hydra app (``hydra.core.plugins._scan_all_plugins``), so it imports hydra
and the standard library only: no torch, and not overlapcfg itself. The config tree is located from
``importlib.util.find_spec("overlapcfg")``, which finds the package without executing it:

- wheel install: ``<site-packages>/overlapcfg/conf`` (the top-level ``conf/`` force-included by hatch);
- editable install or source checkout: ``<repo>/conf``, next to the package.

It is appended as a ``file://`` path rather than ``pkg://overlapcfg.conf``: Hydra's package source only accepts
a package with an ``__init__.py`` and would import ``overlapcfg`` to read it; a wheel is always unpacked on disk,
so a directory path is exact in both layouts. ``overlapcfg.config.presets.conf_dir`` applies the same rule.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

PROVIDER = "overlapcfg"


def overlapcfg_conf_dir() -> Path | None:
    """The directory holding ``overlap/``, or None when overlapcfg is not importable or its tree is missing."""
    spec = importlib.util.find_spec("overlapcfg")
    if spec is None or spec.origin is None:
        return None
    package = Path(spec.origin).resolve().parent
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "overlap").is_dir():
            return candidate
    return None


class OverlapcfgSearchPathPlugin(SearchPathPlugin):
    """Appends overlapcfg's config tree under provider ``overlapcfg`` (after the app's own configs, so an app's
    ``overlap/`` group of the same name wins)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        conf = overlapcfg_conf_dir()
        if conf is None:
            return
        listed = {_as_dir(element.path) for element in search_path.get_path()}
        if conf not in listed:  # the overlapcfg command itself already has it as its primary config path
            search_path.append(provider=PROVIDER, path=f"file://{conf}")


def _as_dir(path: str | None) -> Path | None:
    """A search-path entry as a directory (``file:///x``, or a bare ``/x`` as Hydra stores the main path)."""
    if not path or ("://" in path and not path.startswith("file://")):
        return None
    return Path(path.removeprefix("file://")).resolve()
