"""What a pass did and what a plan will cost: ``explain`` (per-bucket report), ``simulate`` (cost model and
replay), ``compare`` (several configs on one trace, with a timeline), hardware profiles.

Layout: ``model`` (report data, JSON schema), ``explain`` (building it), ``render`` (rich tables), ``cost``
(per-node FLOPs/bytes, alpha-beta collectives, contention per link), ``attention`` (SDPA as one fused kernel),
``node_costs`` (measured durations and their footing), ``replay`` (the streams, contention included: one
implementation for the simulator and the tuner), ``simulate`` (the replay of a graph), ``hardware`` (profiles),
``compare`` and ``timeline`` (Chrome trace + PNG).
"""

from __future__ import annotations

from overlapcfg.config.hardware import HardwareProfile, PeakFlops, hardware_names, load_hardware
from overlapcfg.report.compare import Comparison, ComparisonRow, compare
from overlapcfg.report.explain import explain
from overlapcfg.report.model import SCHEMA, Event, GraphReport, Report, Simulation
from overlapcfg.report.simulate import GroupPlacement, simulate

__all__ = [
    "SCHEMA",
    "Comparison",
    "ComparisonRow",
    "Event",
    "GraphReport",
    "GroupPlacement",
    "HardwareProfile",
    "PeakFlops",
    "Report",
    "Simulation",
    "compare",
    "explain",
    "hardware_names",
    "load_hardware",
    "simulate",
]
