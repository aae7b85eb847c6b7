"""``compare`` applies several configs: a fault says which of them it is in."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

import overlapcfg
from overlapcfg import OverlapConfigError
from tests.support.synthetic import captured_step


def test_a_fault_names_the_config_it_is_in() -> None:
    """Found trying the library: with four configs, ``overlap.plan.buckets[0]: pattern ... matches no module`` did
    not say which one (every mapping was read as if mounted at ``overlap``)."""
    step = captured_step([[1], [1]])
    good = {"plan": {"buckets": ["layers.*"]}}
    with pytest.raises(OverlapConfigError) as err:
        overlapcfg.compare(step, [good, {"plan": {"buckets": ["layer.*"]}}], hardware="h100_nvlink")
    assert [f.path for f in err.value.faults] == ["configs[1].plan.buckets[0]"]
    with pytest.raises(OverlapConfigError) as err:
        overlapcfg.compare(step, [good, {"plan": "llama_layers", "policy": {"forward_prefetch": -1}}],
                           hardware="h100_nvlink")
    assert [f.path for f in err.value.faults] == ["configs[1].policy.forward_prefetch"]
    node = OmegaConf.create({"trainer": {"overlap": {"plan": {"buckets": ["layer.*"]}}}}).trainer.overlap
    with pytest.raises(OverlapConfigError) as err:  # a Hydra node, a loaded config: where they say they are
        overlapcfg.compare(step, [good, node], hardware="h100_nvlink")
    assert [f.path for f in err.value.faults] == ["trainer.overlap.plan.buckets[0]"]
