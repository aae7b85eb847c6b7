"""The graph-only part of a step's pricing plan is kept on the graphs and reused: a simulation that reuses it is
the simulation made without it, field for field, and a changed input (a node edited in place, another dtype, a copy
of the graphs) builds it anew. What depends on the rates (the pricing itself) is never reused.

Fast tier: the hand-built forward and backward of ``test_recompute``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from overlapcfg.cost import pricing_plan
from overlapcfg.cost.pricing import Pricing
from overlapcfg.cost.pricing_plan import step_plan
from overlapcfg.cost.simulator import simulate
from tests.cost.test_recompute import HW, _forward


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the graph-only plan was built (not reused)."""
    made: list[int] = []
    build = pricing_plan._graph_plan

    def counted(*args: object, **kwargs: object) -> pricing_plan.StepPlan:
        made.append(1)
        return build(*args, **kwargs)  # type: ignore[arg-type]  # passed through as called

    monkeypatch.setattr(pricing_plan, "_graph_plan", counted)
    return made


def _simulate(graphs: tuple[torch.fx.GraphModule, ...], **kwargs: object) -> dict[str, object]:
    return simulate(graphs, HW, world_size=2, names=["forward", "backward"], **kwargs).model_dump()  # type: ignore[arg-type]


def test_a_simulation_reusing_the_graph_plan_equals_one_built_afresh(builds: list[int]) -> None:
    graphs = _forward(recompute_in_backward=True)
    fresh = _simulate(copy.deepcopy(graphs), pricing={"fusion": "inductor"})
    first = _simulate(graphs, pricing={"fusion": "inductor"})
    again = _simulate(graphs, pricing={"fusion": "inductor"})
    assert len(builds) == 2  # the copy's and the graphs' first: the third reused the second's
    assert fresh == first == again


def test_a_changed_input_builds_the_graph_plan_anew(builds: list[int]) -> None:
    graphs = _forward()
    _simulate(graphs)
    _simulate(graphs, as_dtype=torch.bfloat16)
    assert len(builds) == 2
    _simulate(copy.deepcopy(graphs))  # a copy's nodes are other objects: it carries no plan
    assert len(builds) == 3
    forward = graphs[0]
    node = next(n for n in forward.graph.nodes if n.name == "mm_k")
    node.args = (node.args[1], node.args[0])  # edited in place: same node objects, other content
    edited = _simulate(graphs)
    assert len(builds) == 4
    assert edited == _simulate(copy.deepcopy(graphs))


def test_the_pricing_is_never_reused() -> None:
    graphs = _forward()
    plain = step_plan(graphs, ["forward", "backward"], HW, Pricing())
    other = step_plan(graphs, ["forward", "backward"], HW, Pricing(optimizer="sgd", tokens=64))
    assert plain.pricing == Pricing() and other.pricing == Pricing(optimizer="sgd", tokens=64)
    assert other.facts.tokens == 64 and plain.facts.tokens != 64
