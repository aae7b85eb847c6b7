"""What a pass did and what a plan will cost: ``explain`` (per-bucket report), ``simulate`` (cost model and
replay), ``compare`` (several configs on one trace, with a timeline), hardware profiles.

Layout: ``model`` (report data, JSON schema), ``explain`` (building it), ``render`` (rich tables), ``cost``
(per-node FLOPs/bytes, alpha-beta collectives), ``simulate`` (the replay), ``hardware`` (profiles),
``compare`` and ``timeline`` (Chrome trace + PNG).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlapcfg._lazy import lazy_exports

_EXPORTS = {
    "Comparison": "overlapcfg.report.compare",
    "ComparisonRow": "overlapcfg.report.compare",
    "compare": "overlapcfg.report.compare",
    "explain": "overlapcfg.report.explain",
    "HardwareProfile": "overlapcfg.report.hardware",
    "PeakFlops": "overlapcfg.report.hardware",
    "hardware_names": "overlapcfg.report.hardware",
    "load_hardware": "overlapcfg.report.hardware",
    "SCHEMA": "overlapcfg.report.model",
    "Event": "overlapcfg.report.model",
    "GraphReport": "overlapcfg.report.model",
    "Report": "overlapcfg.report.model",
    "Simulation": "overlapcfg.report.model",
    "simulate": "overlapcfg.report.simulate",
}

__all__ = [
    "Comparison",
    "ComparisonRow",
    "Event",
    "GraphReport",
    "HardwareProfile",
    "PeakFlops",
    "Report",
    "SCHEMA",
    "Simulation",
    "compare",
    "explain",
    "hardware_names",
    "load_hardware",
    "simulate",
]

# Lazy: hardware profiles (pydantic, no torch) load without importing torch, so the command reports a bad
# profile name in a fraction of a second.
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)

if TYPE_CHECKING:
    from overlapcfg.report.compare import Comparison, ComparisonRow, compare
    from overlapcfg.report.explain import explain
    from overlapcfg.report.hardware import HardwareProfile, PeakFlops, hardware_names, load_hardware
    from overlapcfg.report.model import SCHEMA, Event, GraphReport, Report, Simulation
    from overlapcfg.report.simulate import simulate
