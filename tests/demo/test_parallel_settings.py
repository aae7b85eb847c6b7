"""The demo's mesh settings (``parallel.*`` and ``world_size``): how they resolve, and the faults, at their paths.
Torch-free and fast: nothing is traced."""

from __future__ import annotations

from typing import Any

import pytest

from overlapcfg.demo.dims import ParallelDims, tensor_parallel_faults
from overlapcfg.demo.settings import demo_settings
from overlapcfg.errors import OverlapConfigError


def _faults(settings: dict[str, Any]) -> list[str]:
    with pytest.raises(OverlapConfigError) as info:
        demo_settings(settings)
    return [str(f) for f in info.value.faults]


@pytest.mark.parametrize(("settings", "world_size", "dims"), [
    ({}, 2, (1, 2, 1)),
    ({"world_size": 4}, 4, (1, 4, 1)),  # the 1-D shorthand: plain FSDP over 4 ranks
    ({"parallel": {"dp_replicate": 2, "dp_shard": 2}}, 4, (2, 2, 1)),
    ({"parallel": {"dp_shard": 2, "tp": 2}}, 4, (1, 2, 2)),
    ({"parallel": {"dp_replicate": 2}}, 4, (2, 2, 1)),  # dp_shard keeps the demo's default of 2
    ({"world_size": 8, "parallel": {"tp": 2}}, 8, (1, 4, 2)),  # dp_shard: what is left
    ({"world_size": 8, "parallel": {"dp_replicate": 2, "dp_shard": 2, "tp": 2}}, 8, (2, 2, 2)),
])
def test_world_size_and_parallel_resolve_to_one_mesh(settings: dict[str, Any], world_size: int,
                                                     dims: tuple[int, int, int]) -> None:
    spec = demo_settings(settings)
    assert spec.world_size == world_size == spec.dims.world_size
    assert (spec.dims.dp_replicate, spec.dims.dp_shard, spec.dims.tp) == dims


def test_world_size_contradicting_the_mesh_is_a_fault_at_world_size() -> None:
    assert _faults({"world_size": 2, "parallel": {"dp_replicate": 2, "dp_shard": 2}}) == [
        "world_size: world_size=2 contradicts parallel: dp_replicate 2 x dp_shard 2 x tp 1 = 4 ranks; set "
        "world_size=4 or leave it out (null: the product)"]


def test_world_size_the_other_dimensions_do_not_divide_is_a_fault_at_world_size() -> None:
    (fault,) = _faults({"world_size": 6, "parallel": {"tp": 4}})
    assert fault.startswith("world_size: world_size=6 is not divisible by parallel.dp_replicate x parallel.tp = 4")


def test_tensor_parallel_sizes_the_model_cannot_split_are_named() -> None:
    (fault,) = _faults({"parallel": {"tp": 3}})
    assert fault.startswith("parallel: the tensor-parallel plan cannot split the model: model.n_heads=4 is not "
                            "divisible by parallel.tp=3")
    assert "model.ffn_hidden=128" in fault


def test_sequence_parallel_needs_tensor_parallel_and_a_divisible_sequence() -> None:
    assert _faults({"parallel": {"sequence_parallel": True}}) == [
        "parallel.sequence_parallel: sequence parallel shards activations over the tensor-parallel group: it needs "
        "parallel.tp > 1 (tp is 1)"]
    assert _faults({"parallel": {"tp": 2, "sequence_parallel": True}, "seq_len": 15}) == [
        "seq_len: seq_len=15 is not divisible by parallel.tp=2 (sequence parallel splits the sequence)"]


def test_eager_fsdp2_refuses_a_mesh_with_the_reason() -> None:
    (fault,) = _faults({"sharding": "fsdp2", "parallel": {"dp_replicate": 2}})
    assert fault.startswith("parallel: sharding=fsdp2 shards over one dimension here")


def test_a_misspelt_parallel_key_suggests_the_field() -> None:
    (fault,) = _faults({"parallel": {"dp_replicat": 2}})
    assert fault.startswith("parallel.dp_replicat: unknown field (did you mean 'dp_replicate'?)")


def test_an_unknown_hsdp_reduce_order_lists_both() -> None:
    assert _faults({"parallel": {"hsdp_reduce": "ring"}}) == [
        "parallel.hsdp_reduce: expected 'all_reduce_first' or 'reduce_scatter_first', got 'ring'"]


def test_parallel_dims_checks_itself_and_describes_the_used_dimensions() -> None:
    assert ParallelDims(dp_shard=4).describe() == "4 (dp_shard)"
    assert ParallelDims(2, 2, 2, sequence_parallel=True).describe() == \
        "2 x 2 x 2 (dp_replicate x dp_shard x tp), sequence parallel"
    assert ParallelDims(dp_shard=4).is_1d and not ParallelDims(dp_shard=2, tp=2).is_1d
    with pytest.raises(ValueError, match="dp_shard must be an integer >= 1, got 0"):
        ParallelDims(dp_shard=0)
    with pytest.raises(ValueError, match="sequence_parallel needs tp > 1"):
        ParallelDims(sequence_parallel=True)


def test_tensor_parallel_faults_check_the_vocabulary_and_sequence_only_with_sequence_parallel() -> None:
    sizes = {"n_heads": 4, "kv_heads": 2, "ffn_hidden": 64, "vocab_size": 63, "seq_len": 15}
    assert tensor_parallel_faults(ParallelDims(tp=2), **sizes) == []
    assert [name for name, _ in tensor_parallel_faults(ParallelDims(tp=2, sequence_parallel=True), **sizes)] == \
        ["vocab_size", "seq_len"]
