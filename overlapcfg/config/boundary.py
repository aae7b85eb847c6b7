"""Where a config came from, and the one place that tells the user: the boundary between what a user wrote and the
code that applies it.

Below the public entry points, everything works on an ``OverlapConfig`` as a value: resolution, the strategies,
the graph pass, the FSDP2 driver. A fault they find names the setting relative to the config node
(``plan.buckets[1]``, ``policy.bucket_mode``) and is raised as a ``RelativeConfigError``; a note they make about a
setting is a ``SettingNote`` with such a path. Where the user put the config (``trainer.overlap``,
``OVERLAPCFG_CONFIG``, ``compare.fast``) and the file it was read from travel on the config itself
(``OverlapConfig.mount``, set once by ``load_config`` / ``from_hydra``), never from function to function. Each public
entry point (``apply``, ``backend``, ``inductor_pass``, ``fully_shard`` and the trainer integrations, ``explain``,
``compare``, ``tune``, the demo job) does its work inside ``user_paths(cfg.mount)``, which raises those faults again
at the user's paths, and words its notes with ``Mount.notes``::

    core:      RelativeConfigError  plan.buckets[1]: pattern 'layer.*' matches no module
    boundary:  OverlapConfigError   trainer.overlap.plan.buckets[1]: pattern 'layer.*' matches no module

Why a small module in the lowest layer, not wrappers above every layer: the entry points live in the layers that do
the work (``apply`` in passes, ``fully_shard`` in fsdp2, ``explain`` in report, ``tune`` in tuning) and call one
another's cores (``explain`` applies through passes, ``tune`` through passes and report), and users import them from
there. Wrappers at the top would need those layers to import upward, or restate every entry point's signature. The
translation is a value and one context manager, so it sits beside the config it describes, every layer may call it,
and the import graph stays acyclic.

What is not translated: an ``OverlapConfigError`` that is not relative (an argument's fault, ``world_size``; a file
read, already at the path the user gave) passes through unchanged, and so does one an inner entry point already
translated (``compare`` applying several configs, each from its own place).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from overlapcfg.errors import Fault, OverlapConfigError

__all__ = ["DEFAULT_MOUNT", "Mount", "RelativeConfigError", "SettingNote", "user_paths"]

DEFAULT_MOUNT = "overlap"
"""Where the shipped Hydra group puts the config, and the path of a config given as a Python value."""


class RelativeConfigError(OverlapConfigError):
    """Faults of a config found below the public entry points, each path relative to the config node
    (``plan.buckets[1]``, ``policy.bucket_mode``; ``""`` is the node itself). ``user_paths`` raises them again as an
    ``OverlapConfigError`` at the user's paths; one that escapes without it (a core function called directly) reads
    relative to the config, which is still true, and is caught as the ``OverlapConfigError`` it is."""


@dataclass(frozen=True, slots=True)
class SettingNote:
    """A note about one setting, made below the boundary: ``path`` relative to the config node, ``text`` what follows
    it (``" is ignored: ..."``, ``": bucket 'layers.0' ..."``). ``Mount.notes`` words it at the user's path."""

    path: str
    text: str


@dataclass(frozen=True, slots=True)
class Mount:
    """Where a user's config sits: its dotted path in their config tree, and the file it was read from (if any)."""

    path: str = DEFAULT_MOUNT
    """``trainer.overlap`` for a Hydra node mounted there; what ``load_config(..., root=...)`` was told."""
    file: str | None = None
    """The file the config was read from (``load_config(pathlib.Path(...))``), named in the errors found later."""

    def show(self, relative: str) -> str:
        """The user's path of a setting given relative to the config node: ``plan.buckets[1]`` ->
        ``trainer.overlap.plan.buckets[1]``; ``""`` is the node itself."""
        if not relative:
            return self.path
        if not self.path:
            return relative
        return f"{self.path}{relative}" if relative.startswith("[") else f"{self.path}.{relative}"

    def notes(self, notes: Iterable[str | SettingNote]) -> tuple[str, ...]:
        """Notes as the user reads them: each ``SettingNote`` at the user's path, other notes as they are."""
        return tuple(f"{self.show(n.path)}{n.text}" if isinstance(n, SettingNote) else n for n in notes)

    def error(self, err: RelativeConfigError) -> OverlapConfigError:
        """``err``'s faults at the user's paths, its header naming the file the config came from."""
        header = err.header
        if self.file is not None:
            header = f"{header} (config file {self.file})" if header else f"config file {self.file}"
        return OverlapConfigError([Fault(self.show(f.path), f.message) for f in err.faults], header=header)


@contextlib.contextmanager
def user_paths(mount: Mount) -> Iterator[None]:
    """Within the block, a ``RelativeConfigError`` is raised again at the user's paths (``Mount.error``), keeping
    its cause; every other error passes unchanged."""
    try:
        yield
    except RelativeConfigError as err:
        raise mount.error(err) from err.__cause__
