"""Numbers no measurement or machine can have are refused where they are read, naming the file and the entry:
node durations (``node_costs.json``), hardware profiles, and paths no file can have. Before, NaN and negative
durations were dropped without a word (a predicted step of 2.4e-5 s against 4.0e-3 s for the sane file), an
infinite one made the step infinite, ``mem_bandwidth: .inf`` loaded, and a NUL byte in a config path escaped the
loader as Python's own ``ValueError``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import overlapcfg
from overlapcfg import OverlapConfigError
from overlapcfg.cost.node_costs import MAX_NODE_SECONDS, NODE_COSTS_SCHEMA, NodeCosts

BAD_SECONDS = {"nan": math.nan, "negative": -1.0, "infinite": math.inf, "absurd": 1e300, "text": "fast",
               "huge integer": 10**400}


def _costs(seconds: dict[str, object]) -> dict[str, object]:
    nodes = {name: {"signature": f"aten.mm(float32[4, 4])->float32[4, 4] #{name}", "seconds": s}
             for name, s in seconds.items()}
    return {"schema": NODE_COSTS_SCHEMA, "source": "a test", "graphs": {"forward": nodes}}


def _file(tmp_path: Path, data: dict[str, object]) -> Path:
    path = tmp_path / "node_costs.json"
    path.write_text(json.dumps(data))  # json writes NaN and Infinity as Python reads them back
    return path


@pytest.mark.parametrize("kind", BAD_SECONDS)
def test_a_bad_duration_is_refused_naming_the_file_and_the_entry(tmp_path: Path, kind: str) -> None:
    path = _file(tmp_path, _costs({"mm_1": 1e-4, "mm_2": BAD_SECONDS[kind], "mm_3": 2e-4}))
    with pytest.raises(OverlapConfigError) as err:
        NodeCosts.read(path)
    (fault,) = err.value.faults
    assert fault.path == "graphs.forward.mm_2.seconds"
    assert f"finite number from 0 to {MAX_NODE_SECONDS:g}" in fault.message
    assert str(path) in str(err.value).splitlines()[0]


def test_every_bad_duration_is_named_at_once_and_sane_ones_load(tmp_path: Path) -> None:
    bad = {k: v for k, v in BAD_SECONDS.items() if k != "huge integer"}
    with pytest.raises(OverlapConfigError) as err:
        NodeCosts.from_json(json.dumps(_costs({"ok": 0.0, **bad})))
    assert [f.path for f in err.value.faults] == [f"graphs.forward.{k}.seconds" for k in bad]
    sane = NodeCosts.read(_file(tmp_path, _costs({"zero": 0, "small": 3e-6, "limit": MAX_NODE_SECONDS})))
    assert sane.graphs["forward"]["zero"][1] == 0.0 and len(sane) == 3
    with pytest.raises(OverlapConfigError, match=r"graphs\.forward\.mm\.seconds"):
        NodeCosts(source="in code", graphs={"forward": {"mm": ("sig", math.nan)}})  # built in Python too


@pytest.mark.parametrize("text", ["{", "[]", '{"schema": "other"}', json.dumps({"schema": NODE_COSTS_SCHEMA}),
                                  json.dumps({"schema": NODE_COSTS_SCHEMA, "graphs": {"forward": {"mm": 1.0}}})])
def test_a_file_that_is_not_node_costs_is_a_config_error(text: str) -> None:
    with pytest.raises(OverlapConfigError):
        NodeCosts.from_json(text, where="x.json")


def _profile(**changes: object) -> dict[str, object]:
    return {**overlapcfg.load_hardware("h100_nvlink").model_dump(exclude_none=True), **changes}


@pytest.mark.parametrize(("field", "value"), [
    ("mem_bandwidth", math.inf), ("mem_bandwidth", 1e300), ("mem_bandwidth", math.nan), ("mem_bandwidth", 0.0),
    ("intra_node_bandwidth", -1.0), ("inter_node_bandwidth", "fast"), ("latency", math.inf), ("latency", 10.0),
    ("peak_flops", {"bf16": math.inf, "fp32": 67e12}), ("peak_flops", {"bf16": 989e12, "fp32": 1e30}),
])
def test_a_hardware_profile_with_an_impossible_number_is_refused_with_the_range(field: str, value: object) -> None:
    from overlapcfg.cost.hardware import hardware_from

    with pytest.raises(OverlapConfigError) as err:
        hardware_from(_profile(**{field: value}))
    (fault,) = err.value.faults
    assert fault.path.startswith(f"hardware.{field}") and "a finite number from" in fault.message


def test_a_profile_file_with_an_infinite_bandwidth_is_refused(tmp_path: Path) -> None:
    text = (Path(overlapcfg.__file__).parents[1] / "conf" / "hardware" / "h100_nvlink.yaml").read_text()
    path = tmp_path / "fast.yaml"
    path.write_text(text.replace("mem_bandwidth: 3.35e12", "mem_bandwidth: .inf"))
    assert ".inf" in path.read_text()
    with pytest.raises(OverlapConfigError, match=r"hardware.mem_bandwidth: expected bytes/s, a finite number "
                                                 r"from 1e\+06 to 1e\+15 \(1 MB/s to 1 PB/s\), got inf"):
        overlapcfg.load_hardware(path)


def test_a_calibrated_fit_with_an_impossible_number_is_refused() -> None:
    from pydantic import ValidationError

    from overlapcfg.cost.measured_fits import CollectiveFit

    CollectiveFit(latency=1e-9, bandwidth=5e9, issue_latency=1e-5, issue_bandwidth=None)
    for bad in ({"bandwidth": math.inf}, {"latency": math.nan}, {"issue_bandwidth": 1e300}):
        with pytest.raises(ValidationError):
            CollectiveFit(**{"latency": 1e-5, "bandwidth": 5e9, **bad})


def test_every_shipped_profile_is_within_the_bounds() -> None:
    from overlapcfg.cost.hardware import shipped_hardware_names

    assert all(overlapcfg.load_hardware(name).mem_bandwidth > 0 for name in shipped_hardware_names())


@pytest.mark.parametrize("how", ["load_config", "load_hardware", "load_hardware str", "node costs", "save_hardware"])
def test_a_path_with_a_nul_byte_is_a_config_error(tmp_path: Path, how: str) -> None:
    bad = tmp_path / "a\x00b.yaml"
    call = {"load_config": lambda: overlapcfg.load_config(bad),
            "load_hardware": lambda: overlapcfg.load_hardware(bad),
            "load_hardware str": lambda: overlapcfg.load_hardware(str(bad)),
            "node costs": lambda: NodeCosts.read(bad),
            "save_hardware": lambda: overlapcfg.save_hardware(overlapcfg.load_hardware("cpu_gloo"), bad)}[how]
    with pytest.raises(OverlapConfigError, match="contains a NUL byte"):
        call()


@pytest.mark.slow  # spawns the command, which imports torch (seconds)
def test_the_tune_command_refuses_a_nan_node_cost_before_tracing(tmp_path: Path) -> None:
    path = _file(tmp_path, _costs({"mm_1": 1e-4, "mm_2": math.nan}))
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out = subprocess.run([str(Path(sys.executable).with_name("overlapcfg")), "mode=tune", "hardware=h100_nvlink",
                          f"tune.node_costs={path}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert (f"tune.node_costs: invalid node costs in '{path}': graphs.forward.mm_2.seconds: expected a duration in "
            "seconds") in out.stderr
    assert "traced" not in out.stdout  # refused before the command composed its config, let alone traced


NESTED = '{"schema": "overlapcfg.node_costs/1", "graphs": ' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.parametrize(("text", "says"), [
    (NESTED, "nesting deeper than 64 levels"),
    ('{"schema": "overlapcfg.node_costs/1", "graphs": {}, "graphs": {"forward": {}}}', "duplicate key 'graphs'"),
    ('{"schema": "overlapcfg.node_costs/1", "graphs": {"forward": {"mm": {"signature": "s", "seconds": 1e-3, '
     '"seconds": 5}}}}', "duplicate key 'seconds'"),
    ("[" + "0," * 600_000 + "0]", "more than 500,000 values"),
])
def test_node_costs_json_is_bounded_and_refuses_duplicate_keys_before_json_parses_it(tmp_path: Path, text: str,
                                                                                       says: str) -> None:
    """Issue 39: 100,000-deep JSON ended in ``RecursionError`` (only ``ValueError`` was caught) and a key given
    twice was accepted, the last winning (the YAML loader refuses it). Now both, and a file of too many values,
    are refused naming the file, as YAML is."""
    path = tmp_path / "node_costs.json"
    path.write_text(text)
    with pytest.raises(OverlapConfigError) as err:
        NodeCosts.read(path)
    assert str(path) in str(err.value) and says in str(err.value)


def test_a_hardware_number_written_as_a_string_is_refused_naming_the_file_and_field(tmp_path: Path) -> None:
    """Issue 39: ``mem_bandwidth: '1e12'`` (a string) loaded as a number. Hydra's command line gives numbers
    (``hardware.latency=2e-6``), so only text written as such is refused."""
    from overlapcfg.config.presets import command_conf_dir

    path = tmp_path / "quoted.yaml"
    path.write_text((command_conf_dir() / "hardware" / "h100_nvlink.yaml").read_text()
                    .replace("mem_bandwidth: 3.35e12", "mem_bandwidth: '1e12'")
                    .replace("gpus_per_node: 8", "gpus_per_node: '8'"))
    with pytest.raises(OverlapConfigError) as err:
        overlapcfg.load_hardware(path)
    assert sorted(f.path for f in err.value.faults) == ["hardware.gpus_per_node", "hardware.mem_bandwidth"]
    assert "got the string '1e12' (a quoted number is text: write it without quotes)" in str(err.value)
    assert "hardware.gpus_per_node: expected an integer, got the string '8'" in str(err.value)
    assert str(err.value).startswith(f"invalid hardware profile in '{path}' (2 faults):")


@pytest.mark.slow  # runs the command (no torch before the refusal)
def test_the_command_refuses_a_bad_node_costs_file_before_composing_in_any_mode(tmp_path: Path) -> None:
    """Issue 39: ``tune.node_costs=`` was read only by ``mode=tune`` (``RecursionError`` on a deep file) and ignored
    by the other modes after a minute of tracing. It is read when the command line names it."""
    from tests.support.bounded import run_bounded

    path = tmp_path / "node_costs.json"
    path.write_text(NESTED)
    command = str(Path(sys.executable).with_name("overlapcfg"))
    for mode in ("tune", "run"):
        out = run_bounded([command, f"mode={mode}", "hardware=h100_nvlink", f"tune.node_costs={path}",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert f"tune.node_costs: invalid node costs in '{path}': JSON file '{path}' refused: nesting deeper than " \
               "64 levels" in out.stderr
        assert "traced" not in out.stdout


@pytest.mark.slow  # runs the command (no torch before the refusal)
def test_the_command_names_the_profile_file_holding_a_quoted_number(tmp_path: Path) -> None:
    from overlapcfg.config.presets import command_conf_dir
    from tests.support.bounded import run_bounded

    home = tmp_path / "home" / "hardware"
    home.mkdir(parents=True)
    (home / "quoted.yaml").write_text((command_conf_dir() / "hardware" / "h100_nvlink.yaml").read_text()
                                      .replace("mem_bandwidth: 3.35e12", "mem_bandwidth: '1e12'"))
    out = run_bounded([str(Path(sys.executable).with_name("overlapcfg")), "hardware=quoted", "model.n_layers=1",
                       f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                      env={"OVERLAPCFG_HOME": str(tmp_path / "home")})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "hardware.mem_bandwidth: expected bytes/s" in out.stderr and "got the string '1e12'" in out.stderr
    assert f"(hardware is hardware=quoted: {home / 'quoted.yaml'})" in out.stderr
