"""The cost model: what a step will cost on given hardware, one floor below ``report``, ``tuning`` and ``measuring``
(which present, search with and check it) and above the graph layer (which it reads).

``hardware`` (profiles: shipped, the user's, calibrated; ``load_hardware``), ``measured_fits`` (the measured fits a
calibrated profile holds), ``price`` (what one node or collective costs: roofline, alpha-beta, fitted),
``node_costs`` (measured per-node durations, priced instead of the roofline), ``replay`` (the streams' event
semantics, shared with the tuner's quick model), ``simulator`` (``simulate``: a scheduled graph replayed node by
node) and ``prediction`` (its result: ``Simulation``, ``Event``). Names are exported lazily: reading a hardware profile
imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overlapcfg._lazy import lazy_exports

_EXPORTS = {
    "HardwareProfile": "overlapcfg.cost.hardware",
    "PeakFlops": "overlapcfg.cost.hardware",
    "hardware_names": "overlapcfg.cost.hardware",
    "load_hardware": "overlapcfg.cost.hardware",
    "save_hardware": "overlapcfg.cost.hardware",
    "NodeCosts": "overlapcfg.cost.node_costs",
    "CostSource": "overlapcfg.cost.prediction",
    "Event": "overlapcfg.cost.prediction",
    "Simulation": "overlapcfg.cost.prediction",
    "GroupPlacement": "overlapcfg.cost.simulator",
    "simulate": "overlapcfg.cost.simulator",
}

__all__ = ["CostSource", "Event", "GroupPlacement", "HardwareProfile", "NodeCosts", "PeakFlops", "Simulation",
           "hardware_names", "load_hardware", "save_hardware", "simulate"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)

if TYPE_CHECKING:
    from overlapcfg.cost.hardware import HardwareProfile, PeakFlops, hardware_names, load_hardware, save_hardware
    from overlapcfg.cost.node_costs import NodeCosts
    from overlapcfg.cost.prediction import CostSource, Event, Simulation
    from overlapcfg.cost.simulator import GroupPlacement, simulate
