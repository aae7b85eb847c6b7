"""One YAML reader for everything overlapcfg ships or loads (``overlapcfg.config.yaml_files``).

Shipped presets and hardware profiles used to be read with plain ``yaml.safe_load`` (YAML 1.1: ``4:8`` is the
base-60 integer 248, ``312.0e12`` a string because its exponent has no sign, duplicate keys keep the last); user
configs with ``safe_yaml``. Every shipped file is compared here with what plain ``yaml.safe_load`` made of it: the
values are the same but for numbers plain YAML read as strings, and those validate to the same profile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from overlapcfg.config import load_config, load_preset, preset_names
from overlapcfg.config.presets import command_conf_dir, conf_dir
from overlapcfg.config.yaml_files import read_yaml
from overlapcfg.cost.hardware import HardwareProfile, load_hardware, save_hardware, shipped_hardware_names
from overlapcfg.errors import OverlapConfigError

SHIPPED = sorted([*conf_dir().rglob("*.yaml"), *command_conf_dir().rglob("*.yaml")])


def _differences(old: Any, new: Any, at: str = "") -> list[tuple[str, Any, Any]]:
    """``(path, old, new)`` wherever the two readers' values differ, recursing through equal containers."""
    if isinstance(old, dict) and isinstance(new, dict) and old.keys() == new.keys():
        return [d for k in old for d in _differences(old[k], new[k], f"{at}.{k}")]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (o, n) in enumerate(zip(old, new, strict=True)) for d in _differences(o, n, f"{at}[{i}]")]
    return [] if type(old) is type(new) and old == new else [(at, old, new)]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_yaml_reads_as_plain_yaml_did_but_for_numbers_it_took_for_strings(path: Path) -> None:
    old = yaml.safe_load(path.read_text())
    new = read_yaml(path, "")
    for where, was, now in _differences(old, new):
        # The one kind of difference: YAML 1.1 needs a sign in a float's exponent ('312.0e12' is a string to it).
        assert isinstance(was, str) and isinstance(now, float) and float(was) == now, (where, was, now)


def test_where_the_readers_differ_is_the_hardware_profiles_exponents_and_they_validate_the_same() -> None:
    differing = {}
    for path in SHIPPED:
        found = _differences(yaml.safe_load(path.read_text()), read_yaml(path, ""))
        if found:
            differing[f"{path.parent.name}/{path.name}"] = [where for where, _, _ in found]
    assert set(differing) == {f"hardware/{n}.yaml" for n in shipped_hardware_names()}
    assert all(".mem_bandwidth" in where and ".peak_flops.bf16" in where for where in differing.values())
    for name in shipped_hardware_names():  # plain YAML leaves them text, and a string is not a number (issue 39)
        old = yaml.safe_load((command_conf_dir() / "hardware" / f"{name}.yaml").read_text())
        with pytest.raises(ValueError, match="a quoted number is text"):
            HardwareProfile.model_validate({"name": name, **old})
        assert load_hardware(name).mem_bandwidth == float(old["mem_bandwidth"])


def test_every_shipped_preset_is_the_same_mapping_through_the_reader() -> None:
    for group in ("plan", "policy"):
        for name in preset_names(group):
            assert load_preset(group, name) == yaml.safe_load((conf_dir() / "overlap" / group / f"{name}.yaml")
                                                              .read_text()), (group, name)
    assert load_config({"plan": "llama_layers", "policy": "aggressive"}).policy.forward_prefetch == 2


# --- the user's own profiles ($OVERLAPCFG_HOME/hardware) ----------------------------------------------------------

@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OVERLAPCFG_HOME", str(tmp_path))
    (tmp_path / "hardware").mkdir()
    return tmp_path / "hardware"


def _profile_text(**changes: str) -> str:
    lines = yaml.safe_dump(load_hardware("cpu_gloo").model_dump(mode="json", exclude_none=True), sort_keys=False)
    for key, value in changes.items():
        lines = "".join(f"{key}: {value}\n" if line.startswith(f"{key}:") else line
                        for line in lines.splitlines(keepends=True))
    return lines


def test_a_user_profile_reads_a_range_as_text_and_an_exponent_as_a_number(home: Path) -> None:
    (home / "lab.yaml").write_text(_profile_text(name="lab", description="racks 4:8", mem_bandwidth="2e12"))
    profile = load_hardware("lab")
    assert profile.description == "racks 4:8" and profile.mem_bandwidth == 2e12
    (home / "lab2.yaml").write_text(_profile_text(name="lab2", description="4:8"))
    assert load_hardware("lab2").description == "4:8"  # YAML 1.1: the integer 248, refused as a description


def test_a_user_profile_with_a_key_twice_is_refused_naming_the_line(home: Path) -> None:
    (home / "twice.yaml").write_text(_profile_text(name="twice") + "latency: 1.0e-3\n")
    with pytest.raises(OverlapConfigError, match=r"hardware: YAML file .* refused: duplicate key 'latency' "
                                                 r"\(line \d+, column 1\)"):
        load_hardware("twice")


def test_a_saved_profile_reads_back_whatever_its_strings_look_like(home: Path) -> None:
    for description in ("1e3", "4:8", "yes", "null", "${name}", "0x10"):
        profile = load_hardware("cpu_gloo").model_copy(update={"name": "odd", "description": description})
        save_hardware(profile)
        assert load_hardware("odd").description == description
    assert yaml.safe_load((home / "odd.yaml").read_text())["description"] == "0x10"
