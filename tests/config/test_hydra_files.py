"""Every config file Hydra would read is read first with the library's bounds, on the routes users take: the
``overlapcfg`` command (a hardware profile in the user's profile directory, a preset under ``--config-dir``), a
user's own app in another directory (``overlapcfg.hydra_main``, ``with_hydra_overrides``), the compose API
(``hydra_overrides``) and Python.

Issue 39: an alias bomb or a 50 MB file hung Hydra (killed at 75-90 s); 3,000-deep nesting or ``a: &a [1, *a]``
ended in a ``RecursionError`` traceback; a profile named ``nan`` got "Config group override must be a string or a
list. Got float"; a broken preset chosen by name leaked a raw ``yaml.parser.ParserError`` (``from_hydra``) or a
94-line Hydra traceback (``with_hydra_overrides``); errors in a user's preset named the config path, not the file.
Each child runs with 512 MiB of address space and a timeout (``tests.support.bounded``). The children are forked
from one server per module that has imported Hydra, pydantic and the config layer (``tests/support/warm_cli.py``:
still a process per run, with its own bounds, environment and exit; only the imports before the first line are
shared), not started as fresh interpreters.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from overlapcfg.config.presets import command_conf_dir
from tests.support.bounded import BOUND_BYTES, TIMEOUT_S, bad_yaml_files, script
from tests.support.user_app import user_app
from tests.support.warm_cli import CONFIG_ONLY, WarmCli

BAD = bad_yaml_files()
COMMAND = Path(sys.executable).with_name("overlapcfg")


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmCli]:
    with WarmCli(CONFIG_ONLY) as server:
        yield server


def _bounded(warm: WarmCli, args: list[str], *, cwd: Path,
             env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``tests.support.bounded.run_bounded`` through the warm server: the same bounds, environment and timeout."""
    full = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full.update(env or {})
    return warm.run(args, cwd=cwd, env=full, limit_as=BOUND_BYTES, timeout=TIMEOUT_S)


def _refused(out: subprocess.CompletedProcess[str], file: Path, says: str) -> str:
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert "Traceback" not in text and "RecursionError" not in text and "MemoryError" not in text, text[-3000:]
    assert str(file) in text and says in text, text[-3000:]
    assert len(text.splitlines()) < 25, text  # one screen
    return text


@pytest.mark.slow  # four runs of the command (no torch: a few seconds each)
@pytest.mark.parametrize("kind", list(BAD))
def test_the_command_refuses_a_bad_hardware_profile_and_a_bad_preset_under_config_dir(warm: WarmCli, tmp_path: Path,
                                                                                      kind: str) -> None:
    text, says = BAD[kind]
    home = tmp_path / "home" / "hardware"
    home.mkdir(parents=True)
    (home / "bad.yaml").write_text(text)
    env = {"OVERLAPCFG_HOME": str(tmp_path / "home")}
    out = _bounded(warm, [str(COMMAND), "hardware=bad", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)
    _refused(out, home / "bad.yaml", says)
    extra = tmp_path / "extra" / "overlap" / "policy"
    extra.mkdir(parents=True)
    (extra / "bad.yaml").write_text(text)
    for choice in ("overlap.policy=bad", "overlap/policy=bad"):
        out = _bounded(warm, [str(COMMAND), "--config-dir", str(tmp_path / "extra"), choice,
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
        _refused(out, extra / "bad.yaml", says)


@pytest.mark.slow  # three runs of a user's app (no torch)
@pytest.mark.parametrize("kind", list(BAD))
def test_a_users_app_refuses_a_bad_preset_of_its_own_on_every_route(warm: WarmCli, tmp_path: Path, kind: str) -> None:
    text, says = BAD[kind]
    conf = user_app(tmp_path, {"bad": text})
    for args in (script(tmp_path / "app.py", "main"), script(tmp_path / "app.py", "helper"),
                 script(tmp_path / "compose.py", str(conf))):
        out = _bounded(warm, [*args, "trainer.overlap.policy=bad", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
        _refused(out, conf / "overlap" / "policy" / "bad.yaml", says)


@pytest.mark.slow  # runs of a user's app and the command (no torch)
def test_a_broken_or_invalid_preset_of_a_users_own_is_one_error_naming_the_file(warm: WarmCli, tmp_path: Path) -> None:
    """A YAML syntax error, then a value out of range, in the user's preset, chosen by name: one screen naming the
    file on every decorated route (before: a raw ``ParserError`` from ``from_hydra``, a 94-line traceback with
    ``with_hydra_overrides``, and for a bad value the config path only)."""
    conf = user_app(tmp_path, {"broken": "forward_prefetch: [1\n", "minus": "forward_prefetch: -1\n"})
    broken, minus = conf / "overlap" / "policy" / "broken.yaml", conf / "overlap" / "policy" / "minus.yaml"
    for args in (script(tmp_path / "app.py", "main"), script(tmp_path / "app.py", "helper"),
                 script(tmp_path / "compose.py", str(conf))):
        out = _bounded(warm, [*args, "trainer.overlap.policy=broken", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path)
        _refused(out, broken, "did not find expected ',' or ']' (line 2, column 1)")
    for how in ("main", "helper"):
        out = _bounded(warm, script(tmp_path / "app.py", how, "trainer.overlap.policy=minus",
                                 f"hydra.run.dir={tmp_path / 'run'}"), cwd=tmp_path)
        text = _refused(out, minus, "trainer.overlap.policy.forward_prefetch: expected an integer >= 0, got -1")
        assert f"(trainer.overlap.policy is overlap/policy@trainer.overlap.policy=minus: {minus})" in text
    shutil.copytree(conf / "overlap", tmp_path / "extra" / "overlap")
    out = _bounded(warm, [str(COMMAND), "--config-dir", str(tmp_path / "extra"), "overlap.policy=minus",
                       f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    _refused(out, tmp_path / "extra" / "overlap" / "policy" / "minus.yaml",
             "overlap.policy.forward_prefetch: expected an integer >= 0, got -1")


@pytest.mark.slow  # runs of the command and a user's app (no torch)
def test_a_name_yaml_reads_as_a_number_or_a_boolean_works_or_is_refused_with_the_reason(warm: WarmCli,
                                                                                        tmp_path: Path) -> None:
    """Issue 39: a profile file named ``nan.yaml`` (or ``inf``, ``true``, ``1``) got Hydra's "Config group override
    must be a string or a list. Got float". Such a name is looked up as the option of that name."""
    home = tmp_path / "home" / "hardware"
    home.mkdir(parents=True)
    for name in ("nan", "true"):
        shutil.copy(command_conf_dir() / "hardware" / "h100_nvlink.yaml", home / f"{name}.yaml")
    env = {"OVERLAPCFG_HOME": str(tmp_path / "home")}
    for name in ("nan", "true"):
        out = _bounded(warm, [str(COMMAND), "--cfg", "job", f"hardware={name}"], cwd=tmp_path, env=env)
        assert out.returncode == 0 and "mem_bandwidth: 3350000000000.0" in out.stdout, out.stderr
    out = _bounded(warm, [str(COMMAND), "hardware=1"], cwd=tmp_path, env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "hardware=1: no option '1' in group hardware (Hydra reads 1 as a number; an option of that name would " \
           "be the file hardware/1.yaml)" in out.stderr
    user_app(tmp_path / "app", {"inf": "forward_prefetch: 3\n"})
    out = _bounded(warm, script(tmp_path / "app" / "app.py", "main", "trainer.overlap.policy=inf",
                             f"hydra.run.dir={tmp_path / 'run'}"), cwd=tmp_path / "app")
    assert out.returncode == 0 and "RESULT 3 1" in out.stdout, out.stderr


def test_python_reads_a_bad_profile_with_the_same_bounds(tmp_path: Path) -> None:
    """The library's own loader (bounded before issue 39 too): the same refusals, as ``OverlapConfigError``."""
    from overlapcfg import OverlapConfigError, load_hardware

    for kind, (text, says) in BAD.items():
        path = tmp_path / f"{kind}.yaml"
        path.write_text(text)
        with pytest.raises(OverlapConfigError) as err:
            load_hardware(path)
        assert str(path) in str(err.value) and says in str(err.value), kind


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_files_read_first_are_those_the_composition_reads(tmp_path: Path) -> None:
    """The primary config, its defaults followed (relative and absolute groups, ``override``, packages, a nested
    option's own defaults), an option the command line chooses in place of the default, and a directory the
    primary config's ``hydra.searchpath`` adds; an option nobody chooses is not read."""
    from overlapcfg import OverlapConfigError
    from overlapcfg.compat.omegaconf import parse_command_line
    from overlapcfg.config.hydra_files import SearchPath, read_composition

    bomb = BAD["alias_bomb"][0]
    other = _tree(tmp_path / "other", {"db/remote.yaml": "host: x\n"})
    app = _tree(tmp_path / "app", {
        "train.yaml": f"defaults:\n  - db@store: local\n  - model: small\n  - _self_\nhydra:\n  searchpath: "
                      f"[file://{other}]\n",
        "db/local.yaml": "path: /tmp\n", "db/bomb.yaml": bomb,
        "model/small.yaml": "defaults:\n  - layers: four\n  - /db@cache: local\n", "model/layers/four.yaml": "n: 4\n",
        "model/big.yaml": bomb,
    })
    search = SearchPath.of([f"file://{app}"])

    def read(*overrides: str) -> list[str]:
        return sorted(read_composition(search, "train", [o for o in parse_command_line(overrides) if o]))

    assert read() == ["db/local", "model/layers/four", "model/small", "train"]
    assert read("db@store=remote") == ["db/remote", "model/layers/four", "model/small", "train"]
    with pytest.raises(OverlapConfigError, match="values once aliases are expanded") as err:
        read("model=big")
    assert str(app / "model" / "big.yaml") in str(err.value)
    with pytest.raises(OverlapConfigError, match=r"db=lcoal: no option 'lcoal' in group db \(did you mean 'local'\?\); "
                                        r"options \(closest first\): local, bomb, remote"):
        read("db=lcoal")



def test_from_hydra_on_a_name_hydra_left_as_a_value_is_a_config_error_not_a_yaml_one(tmp_path: Path) -> None:
    """Issue 39: a broken preset of the user's own, chosen by name in an app without the decorators, leaked a raw
    ``yaml.parser.ParserError`` from ``from_hydra`` (which read the file off the running Hydra's search path). The
    node holds a name; ``from_hydra`` reads no file for it and says how to choose the preset."""
    from hydra import compose, initialize_config_dir

    from overlapcfg import OverlapConfigError, from_hydra

    conf = user_app(tmp_path, {"broken": "forward_prefetch: [1\n"})
    with initialize_config_dir(str(conf), version_base="1.3"):
        node = compose("train", overrides=["trainer.overlap.policy=broken"]).trainer.overlap
        with pytest.raises(OverlapConfigError) as err:
            from_hydra(node)
    assert "trainer.overlap.policy: 'broken' is not a shipped policy preset" in str(err.value)
    assert "choose it as overlap/policy@trainer.overlap.policy=broken" in str(err.value)


def test_an_option_of_a_group_below_says_where_it_is(tmp_path: Path) -> None:
    """Found trying the command: ``overlap=aggressive`` said only that ``overlap`` has the option ``default``."""
    from overlapcfg import OverlapConfigError
    from overlapcfg.compat.omegaconf import parse_command_line
    from overlapcfg.config.hydra_files import SearchPath, read_composition

    app = _tree(tmp_path / "app", {"train.yaml": "a: 1\n", "overlap/default.yaml": "x: 1\n",
                                   "overlap/policy/aggressive.yaml": "y: 2\n", "overlap/plan/mine.yaml": "z: 3\n"})
    search = SearchPath.of([f"file://{app}"])
    with pytest.raises(OverlapConfigError) as err:
        read_composition(search, "train", [o for o in parse_command_line(["overlap=aggressive"]) if o])
    assert str(err.value).endswith("options (closest first): default; it is an option of overlap/policy: "
                                   "overlap/policy=aggressive")
    with pytest.raises(OverlapConfigError) as err:
        read_composition(search, "train", [o for o in parse_command_line(["overlap=nothing"]) if o])
    assert str(err.value).endswith("options (closest first): default")
