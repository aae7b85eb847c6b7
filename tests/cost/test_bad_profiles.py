"""Bad numbers in a hardware profile are refused with the file and the field: an efficiency outside (0, 1], a
latency at or below 0, a collective rate above the physical link, an unknown checkpointing mode.

Fast tier: YAML files in a temporary directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from overlapcfg.cost.hardware import load_hardware
from overlapcfg.cost.pricing import pricing_from
from overlapcfg.errors import OverlapConfigError


def _profile(tmp_path: Path, **changes: object) -> Path:
    data = load_hardware("h100_nvlink").model_dump(mode="json", exclude_none=True)
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("field, value, says", [
    ("achievable__matmul__bf16__efficiency", 0.0, "expected a fraction of the peak in (0, 1], got 0.0"),
    ("achievable__memory__efficiency", 1.2, "expected a fraction of the peak in (0, 1], got 1.2"),
    ("compute_efficiency", -0.5, "expected a fraction of the peak in (0, 1]"),
    ("latency", 0.0, "1e-09 to 1"),
    ("collectives__inter_node__all_gather__latency", 0.0, "1e-09 to 1"),
    ("collectives__intra_node__all_gather__bandwidth", 451e9, "above the physical link"),
])
def test_a_bad_number_names_the_file_and_the_field(tmp_path: Path, field: str, value: float, says: str) -> None:
    path = _profile(tmp_path, **{field: value})
    with pytest.raises(OverlapConfigError) as err:
        load_hardware(path)
    message = str(err.value)
    assert str(path) in message and says in message
    assert field.replace("__", ".") in message or "collectives.intra_node.all_gather.bandwidth" in message


def test_the_shipped_profiles_say_peak_or_achievable_and_cite_a_source_for_every_number() -> None:
    from overlapcfg.cost.hardware import hardware_dir

    for name in ("h100_nvlink", "a100_ib"):
        text = (hardware_dir() / f"{name}.yaml").read_text()
        assert "No end-to-end training" in text and "throughput" in text
        assert text.count("PEAK.") >= 4 and text.count("ACHIEVABLE") >= 8
        profile = load_hardware(name)
        assert profile.achievable is not None and profile.skew is not None and profile.contention is not None
        shares = [profile.achievable.matmul.bf16.efficiency * profile.achievable.matmul.bf16.sustained,
                  profile.achievable.memory.efficiency]
        assert all(0 < s < 1 for s in shares)


def test_an_unknown_checkpointing_mode_names_the_predict_field() -> None:
    with pytest.raises(OverlapConfigError) as err:
        pricing_from({"activation_checkpointing": "offload"}, path="predict")
    assert "predict.activation_checkpointing" in str(err.value) and "'selective'" in str(err.value)
