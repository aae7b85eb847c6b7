"""``step_plans_kept``: a step's pricing plan depends on its graphs and the pricing settings, and on the machine only
through its device kind (which picks the fusion), so a caller pricing the same graphs on many machines may keep it;
nothing is kept outside the block, and other settings or other graphs get their own plan."""

from __future__ import annotations

from overlapcfg.cost.hardware import load_hardware
from overlapcfg.cost.pricing import Pricing
from overlapcfg.cost.pricing_plan import step_plan, step_plans_kept
from tests.support.synthetic import captured_step

NAMES = ("forward", "backward")


def test_a_kept_plan_is_reused_for_the_same_graphs_and_settings_on_a_machine_of_the_same_kind_only() -> None:
    step, other = captured_step([[1], [2]]), captured_step([[1], [2]])
    graphs = [step.forward, step.backward]
    h100, a100, cpu = (load_hardware(name) for name in ("h100_nvlink", "a100_ib", "cpu_gloo"))
    selective, full = Pricing(activation_checkpointing="selective"), Pricing(activation_checkpointing="full")
    store: dict = {}
    with step_plans_kept(store):
        first = step_plan(graphs, NAMES, h100, selective)
        assert step_plan(graphs, NAMES, a100, selective) is first  # another GPU: the same fusion, the same plan
        assert step_plan(graphs, NAMES, cpu, selective) is not first  # a CPU profile fuses nothing (eager)
        assert step_plan(graphs, NAMES, h100, full) is not first
        assert step_plan([other.forward, other.backward], NAMES, h100, selective) is not first
    assert len(store) == 4
    assert step_plan(graphs, NAMES, h100, selective) is not first  # outside the block: made anew, not kept
    assert len(store) == 4
    again = step_plan(graphs, NAMES, h100, selective)
    assert again.recompute_nodes == first.recompute_nodes and again.fused == first.fused
