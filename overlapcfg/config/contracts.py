"""What a config may say for each strategy: its policy model, whether it reads a plan and a policy, its own checks.

A strategy is one object (``overlapcfg.strategies.Strategy``): this contract plus the graph call. The contract is
declared here, in the torch-free config layer, because validating a config must not import torch (a typo on the
command line is reported in a fraction of a second). ``overlapcfg.strategies.register_strategy`` declares the
contract and registers the graph call in one step; nothing else declares contracts.

Names come from three places, in this order: the built-ins below, Python registration, and installed entry points
in the ``overlapcfg.strategies`` group (imported lazily, once, the first time an unknown name is looked up).
A config can never name an import path: YAML selects a key of this catalog and nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, TypeAlias

from overlapcfg.config.policy import AutoPolicy, OverlapPolicy, PolicyBase, TorchManualPolicy
from overlapcfg.errors import OverlapConfigError, closest_first, did_you_mean, show_value

if TYPE_CHECKING:
    from overlapcfg.config.overlap import OverlapConfig

__all__ = ["ENTRY_POINT_GROUP", "ConfigCheck", "StrategyContract", "bare_entry_point", "contract_of", "declare",
           "strategy_names"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "overlapcfg.strategies"

ConfigCheck: TypeAlias = Callable[["OverlapConfig"], Sequence[tuple[tuple[str | int, ...], object, str]]]
"""``check(cfg) -> [(location, value, message), ...]``: faults a strategy finds in an otherwise valid config
(locations relative to the overlap node, e.g. ``("plan", "buckets", 1, "forward_prefetch")``)."""


@dataclass(frozen=True, slots=True)
class StrategyContract:
    """The config-facing half of a strategy."""

    name: str
    policy: type[PolicyBase]
    """The model ``policy`` is validated against (a knob the strategy would ignore is then an unknown field)."""
    uses_plan: bool = True
    """Buckets by ``plan``: a plan is required, and ``overrides`` apply."""
    reads_policy: bool = True
    """False for strategies that read no policy (``none``): a non-default policy is reported as ignored."""
    check: ConfigCheck | None = None
    origin: str = "builtin"
    """Who declared it: ``builtin``, a module name, or ``entry point <dist>``."""


_CONTRACTS: dict[str, StrategyContract] = {}
_BARE_ENTRY_POINTS: dict[str, Callable[..., object]] = {}
_entry_points_loaded = False


def declare(contract: StrategyContract) -> None:
    """Add ``contract``; a taken name raises ``ValueError`` naming both registrants."""
    taken = _CONTRACTS.get(contract.name)
    if taken is not None:
        raise ValueError(
            f"strategy {contract.name!r} is already registered (by {taken.origin}); {contract.origin} tried to "
            "register it again. Pick another name."
        )
    _CONTRACTS[contract.name] = contract


def _torch_manual_depths(cfg: OverlapConfig) -> list[tuple[tuple[str | int, ...], object, str]]:
    """torch_manual runs upstream at depth 1: a per-bucket or per-module depth other than 1 would be ignored."""
    from overlapcfg.config.plan import Bucket

    message = ("torch_manual has a fixed depth of 1 (upstream manual_overlap_bucketing), got {got}; use strategy "
               "'manual' for other depths")
    keys = ("forward_prefetch", "backward_prefetch", "reduce_scatter_delay")
    found: list[tuple[tuple[str | int, ...], object, str]] = []
    for i, entry in enumerate(cfg.plan.buckets if cfg.plan is not None else ()):
        if isinstance(entry, Bucket):
            found += [(("plan", "buckets", i, k), v, message.format(got=repr(v)))
                      for k in keys if (v := getattr(entry, k)) not in (None, 1)]
    for i, override in enumerate(cfg.overrides):
        found += [(("overrides", i, k), v, message.format(got=repr(v)))
                  for k in keys if (v := getattr(override, k)) not in (None, 1)]
    # Upstream leaves HSDP all-reduces alone, so a delay for them would be silently ignored.
    no_all_reduce = ("torch_manual does not bucket or schedule HSDP all-reduces (upstream manual_overlap_bucketing "
                     "skips all-reduces), got {got}; use strategy 'manual' for all_reduce_delay")
    entries = [(("plan", "buckets", i), e) for i, e in enumerate(cfg.plan.buckets if cfg.plan is not None else ())
               if isinstance(e, Bucket)] + [(("overrides", i), o) for i, o in enumerate(cfg.overrides)]
    found += [((*where, "all_reduce_delay"), v, no_all_reduce.format(got=repr(v)))
              for where, e in entries if (v := e.all_reduce_delay) is not None]
    return found


declare(StrategyContract("manual", OverlapPolicy))
declare(StrategyContract("torch_manual", TorchManualPolicy, check=_torch_manual_depths))
declare(StrategyContract("auto", AutoPolicy, uses_plan=False))
# `none` accepts the manual policy so that `-m overlap.strategy=none,manual` sweeps need no other change.
declare(StrategyContract("none", OverlapPolicy, uses_plan=False, reads_policy=False))


def _load_entry_points() -> None:
    """Import each installed plugin once; importing it registers its strategies (``register_strategy``)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in _CONTRACTS:
            continue
        try:
            obj = ep.load()
        except Exception:  # a broken plugin must not break every other config
            logger.exception("overlapcfg: could not load strategy entry point %r (%s)", ep.name, ep.value)
            continue
        if ep.name in _CONTRACTS:
            continue
        if not callable(obj):
            logger.error("overlapcfg: entry point %r is neither registered nor a strategy function", ep.name)
            continue
        # A bare strategy function: the manual policy, a plan. Its graph call is handed to the strategies layer
        # (``bare_entry_point``), which wraps it on first use; this layer only declares what configs may say.
        dist = getattr(getattr(ep, "dist", None), "name", "?")
        declare(StrategyContract(ep.name, OverlapPolicy, origin=f"entry point {dist}"))
        _BARE_ENTRY_POINTS[ep.name] = obj


def bare_entry_point(name: str) -> Callable[..., object] | None:
    """The graph call of an entry point that exposed a bare function instead of registering itself."""
    return _BARE_ENTRY_POINTS.get(name)


def strategy_names() -> tuple[str, ...]:
    """Every declared name, sorted (entry points included)."""
    _load_entry_points()
    return tuple(sorted(_CONTRACTS))


def contract_of(name: str) -> StrategyContract:
    """The contract declared under ``name``; an unknown name lists what is available, closest first."""
    if name not in _CONTRACTS:
        _load_entry_points()
    contract = _CONTRACTS.get(name)
    if contract is None:
        names = strategy_names()
        raise OverlapConfigError.single(
            "strategy", f"unknown strategy {show_value(name)}; available (closest first): "
                        f"{', '.join(closest_first(name, names))}{did_you_mean(name, names)}"
        )
    return contract
