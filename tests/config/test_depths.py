"""The depths are declared once (``Depths``); the views of them are computed from that declaration, and one rule
(``settle``) says what an unset depth becomes, wherever depths are layered (policy, plan entry, override)."""

from __future__ import annotations

import pytest

from overlapcfg import load_config
from overlapcfg.config.depths import (
    DEPTH_FIELDS,
    DEPTH_LABELS,
    DEPTH_OF,
    FOLLOWED,
    SEARCHED_DEPTHS,
    DepthChanges,
    DepthGrid,
    Depths,
    settle,
)
from overlapcfg.module_paths import ModelFacts
from overlapcfg.resolve import resolve_config


def test_every_view_lists_the_declared_depths_in_their_order() -> None:
    assert tuple(Depths.model_fields) == DEPTH_FIELDS
    assert tuple(DepthChanges.model_fields) == DEPTH_FIELDS
    assert tuple(DEPTH_OF.values()) == DEPTH_FIELDS and tuple(DEPTH_LABELS) == DEPTH_FIELDS
    assert tuple(DepthGrid.model_fields) == SEARCHED_DEPTHS == ("forward_prefetch", "backward_prefetch",
                                                                 "reduce_scatter_delay")
    assert FOLLOWED == {"all_reduce_delay": "reduce_scatter_delay"}


def test_derived_fields_keep_the_declared_constraint_and_meaning() -> None:
    with pytest.raises(ValueError, match="expected an integer >= 0"):
        DepthChanges(forward_prefetch=-1)
    with pytest.raises(ValueError, match="at least 1 item"):
        DepthGrid(backward_prefetch=())
    assert DepthGrid().reduce_scatter_delay == (1, 2, 3)
    declared = Depths.model_fields["backward_prefetch"].description
    assert declared and declared in str(DepthChanges.model_fields["backward_prefetch"].description)


def test_an_unset_depth_takes_the_value_it_follows_and_says_so() -> None:
    settled = settle({"forward_prefetch": (2, "policy"), "backward_prefetch": (1, "policy"),
                      "reduce_scatter_delay": (3, "plan")})
    assert settled["all_reduce_delay"] == (3, "reduce_scatter_delay")
    assert Depths(reduce_scatter_delay=3).depth("backward", "all_reduce") == 3
    assert Depths(reduce_scatter_delay=3, all_reduce_delay=0).depth("backward", "all_reduce") == 0


def test_an_override_of_the_followed_depth_carries_its_follower_along_but_not_a_set_one() -> None:
    facts = ModelFacts(("", "layers", "layers.0", "layers.1"), ("layers.0", "layers.1"))

    def resolved(cfg: dict[str, object]) -> dict[str, tuple[int, str]]:
        (first, second) = resolve_config(load_config(cfg), facts).buckets
        return {b.name: (b.all_reduce_delay, b.origin("all_reduce_delay")) for b in (first, second)}

    plan = {"buckets": ["layers.*"]}
    following = resolved({"plan": plan, "overrides": [{"match": "layers.1", "reduce_scatter_delay": 3}]})
    assert following == {"layers.0": (1, "reduce_scatter_delay"), "layers.1": (3, "reduce_scatter_delay")}
    set_once = resolved({"plan": plan, "policy": {"all_reduce_delay": 2},
                         "overrides": [{"match": "layers.1", "reduce_scatter_delay": 3}]})
    assert set_once == {"layers.0": (2, "policy"), "layers.1": (2, "policy")}


def test_a_depth_the_tuner_does_not_search_has_no_grid_field() -> None:
    with pytest.raises(ValueError, match="all_reduce_delay"):
        DepthGrid(all_reduce_delay=(1, 2))
