"""Makes overlapcfg's ``overlap`` config groups (``overlap``, ``overlap/plan``, ``overlap/policy``) available to
every Hydra app, so a recipe can write ``defaults: [overlap: default, _self_]`` with no search-path set-up.

Only the ``presets/`` tree goes on the search path: it holds the ``overlap`` groups and nothing else. The
``overlapcfg`` command's own primary config (``conf/overlapcfg.yaml``) and its ``hardware`` group live in
``conf/``, which only the command reads, so a user app's own ``hardware`` group or ``overlapcfg.yaml`` never
collides with ours and its ``--help`` lists only the ``overlap`` groups. The command gets ``overlap`` from this
plugin like any other app.

Hydra imports this module in *every* Hydra app (``hydra.core.plugins._scan_all_plugins``), so it imports hydra
and the standard library only: no torch, and not overlapcfg itself. The tree is located from
``importlib.util.find_spec("overlapcfg")``, which finds the package without executing it:

- wheel install: ``<site-packages>/overlapcfg/presets`` (the top-level ``presets/`` force-included by hatch);
- editable install or source checkout: ``<repo>/presets``, next to the package.

It is appended as a ``file://`` path rather than ``pkg://``: Hydra's package source only accepts a package with
an ``__init__.py`` and would import ``overlapcfg`` to read it; a wheel is always unpacked on disk, so a directory
path is exact in both layouts. ``overlapcfg.config.presets.conf_dir`` applies the same rule.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

PROVIDER = "overlapcfg"
TREE = "presets"
"""The directory (next to the package, or inside it in a wheel) holding ``overlap/`` and nothing else."""


def overlapcfg_conf_dir() -> Path | None:
    """The directory holding ``overlap/``, or None when overlapcfg is not importable or its tree is missing."""
    spec = importlib.util.find_spec("overlapcfg")
    if spec is None or spec.origin is None:
        return None
    package = Path(spec.origin).resolve().parent
    for candidate in (package / TREE, package.parent / TREE):
        if (candidate / "overlap").is_dir():
            return candidate
    return None


class OverlapcfgSearchPathPlugin(SearchPathPlugin):
    """Appends overlapcfg's ``presets/`` tree under provider ``overlapcfg`` (after the app's own configs, so an
    app's ``overlap/`` group of the same name wins)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        tree = overlapcfg_conf_dir()
        if tree is not None:
            search_path.append(provider=PROVIDER, path=f"file://{tree}")
