"""Collectives at achievable rates, pinned on hand computations: an all-gather at two sizes and two rank counts
(inside a node, and across whole nodes driving every NIC), HSDP's one-rank-per-node replicate ring, NVLink SHARP and
the tree for all-reduce, and a rate above the physical link refused.

Fast tier: no graph at all.
"""

from __future__ import annotations

import math

import pytest

from overlapcfg.cost.hardware import hardware_from
from overlapcfg.cost.price import collective_cost
from overlapcfg.errors import OverlapConfigError

GIB, MIB = 2**30, 2**20
INTRA = {"latency": 2e-6, "bandwidth": 370e9}
INTER = {"latency": 18e-6, "bandwidth": 47e9}
PROFILE = {"name": "hand", "peak_flops": {"bf16": 989e12, "fp32": 67e12}, "mem_bandwidth": 3.35e12,
           "intra_node_bandwidth": 450e9, "inter_node_bandwidth": 50e9, "latency": 2e-6, "gpus_per_node": 8,
           "nics_per_node": 8,
           "collectives": {"intra_node": {"all_gather": INTRA, "reduce_scatter": INTRA,
                                          "all_reduce": {**INTRA, "nvls_bandwidth": 275e9}},
                           "inter_node": {"all_gather": INTER, "reduce_scatter": INTER,
                                          "all_reduce": {**INTER, "tree": True}}}}
HW = hardware_from(PROFILE)


@pytest.mark.parametrize("nbytes, expected", [
    (GIB, 7 * 2e-6 + 7 / 8 * GIB / 370e9),   # 2.553 ms: bandwidth-bound
    (MIB, 7 * 2e-6 + 7 / 8 * MIB / 370e9),   # 16.5 us: latency-bound
])
def test_an_all_gather_inside_a_node(nbytes: int, expected: float) -> None:
    assert collective_cost("all_gather", nbytes, HW, 8).seconds == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("nbytes, expected", [
    # 64 ranks on 8 whole nodes: 8 NICs x 47 GB/s = 376 GB/s, capped by the 370 GB/s its data also crosses inside
    # each node; 63 steps of the inter-node latency.
    (GIB, 63 * 18e-6 + 63 / 64 * GIB / 370e9),
    (MIB, 63 * 18e-6 + 63 / 64 * MIB / 370e9),
])
def test_an_all_gather_across_whole_nodes_drives_every_nic(nbytes: int, expected: float) -> None:
    assert collective_cost("all_gather", nbytes, HW, 64).seconds == pytest.approx(expected, rel=1e-12)


def test_hsdp_replicate_group_has_one_rank_per_node_so_one_nic() -> None:
    cost = collective_cost("all_gather", GIB, HW, 8, inter_node=True)
    assert cost.seconds == pytest.approx(7 * 18e-6 + 7 / 8 * GIB / 47e9, rel=1e-12)


def test_all_reduce_takes_nvls_inside_a_node_and_the_tree_across_nodes() -> None:
    ring_inside = 2 * (7 * 2e-6 + 7 / 8 * GIB / 370e9)
    nvls = 2e-6 + GIB / 275e9
    assert nvls < ring_inside
    assert collective_cost("all_reduce", GIB, HW, 8).seconds == pytest.approx(nvls, rel=1e-12)
    # 512 ranks, one small message: the ring's 2 x 511 latencies against the tree's 2 x ceil(log2 512) = 18
    tree = 2 * math.ceil(math.log2(512)) * 18e-6 + 2 * 511 / 512 * MIB / 370e9
    assert collective_cost("all_reduce", MIB, HW, 512).seconds == pytest.approx(tree, rel=1e-12)


def test_a_rate_above_the_physical_link_is_refused_naming_the_field() -> None:
    bad = {**PROFILE, "collectives": {"intra_node": {"all_gather": {"latency": 2e-6, "bandwidth": 500e9}}}}
    with pytest.raises(OverlapConfigError) as err:
        hardware_from(bad)
    assert "collectives.intra_node.all_gather.bandwidth" in str(err.value)
    assert "intra_node_bandwidth 4.5e+11" in str(err.value)
