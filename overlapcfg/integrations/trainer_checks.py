"""What every trainer integration checks before it shards anything: the trainer's version, and the faults found in
the trainer's own settings, raised together in the trainer's own terms.

An integration reaches into a trainer at one point (a parallelize hook, a plugin's preparation step), and what it
relies on there (a function's signature, an early return on an already-sharded model) is a fact of the releases it
was tested with, not a promise of the trainer's. So each integration names the release it was tested with, and a
release outside that minor series is a fault, not a hope: one line naming the installed and the tested version and
the extra that installs the tested one.

Faults use the house ``Fault(path, message)`` shape, where ``path`` is the trainer's own name for the setting
(``FullyShardedDataParallelPlugin.auto_wrap_policy``, ``parallelism.pipeline_parallel_degree``), so the message
reads in the trainer's vocabulary; they are raised as one ``OverlapConfigError`` (every fault at once, nothing
sharded). Torch-free: importing this module imports no trainer.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence

from overlapcfg.errors import Fault, OverlapConfigError

__all__ = ["raise_faults", "release_series", "version_fault"]


def release_series(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a release string (``"2.6.6"`` -> ``(2, 6)``, ``"1.15.0.dev3"`` -> ``(1, 15)``);
    None where it does not start with two integers."""
    parts = version.split(".")
    if len(parts) < 2:
        return None
    minor = "".join(c for c in parts[1] if c.isdigit()) if parts[1][:1].isdigit() else ""
    if not parts[0].isdigit() or not minor:
        return None
    return int(parts[0]), int(minor)


def version_fault(distribution: str, tested: str, *, extra: str, installed: str | None = None) -> Fault | None:
    """A fault if ``distribution`` is installed at a release outside ``tested``'s minor series (``2.6.x`` for
    ``2.6.6``); None if it is in the series, or not installed (nothing of it runs then). ``installed``: the
    version to judge (default: the installed distribution's, from its metadata)."""
    if installed is None:
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None
    series = release_series(tested)
    if series is None:
        raise AssertionError(f"tested version {tested!r} of {distribution} has no major.minor")
    if release_series(installed) == series:
        return None
    return Fault(distribution, f"version {installed} is not supported: this integration is tested with {tested} and "
                               f"accepts {series[0]}.{series[1]}.x only (it relies on that release's internals); "
                               f"pip install 'overlapcfg[{extra}]' installs {tested}")


def raise_faults(faults: Sequence[Fault | None], header: str) -> None:
    """Raise one ``OverlapConfigError`` with every fault (None entries are skipped); nothing if there is none."""
    found = [f for f in faults if f is not None]
    if found:
        raise OverlapConfigError(list(dict.fromkeys(found)), header=header)
