"""A user's own Hydra app, outside the repository, that mounts overlapcfg's group at ``trainer.overlap``: the
config tree, an ``@hydra.main`` script (``overlapcfg.hydra_main`` or ``with_hydra_overrides`` around Hydra's own)
and a compose-API script. The Hydra-files tests (tests/config/test_hydra_files.py) and the bad-input benchmark
(benchmarks/bad_inputs.py) run the same app, so what the benchmark times is what the tests check.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

__all__ = ["APP", "COMPOSE", "user_app"]

APP = '''
import sys

import hydra

import overlapcfg


def task(cfg):
    policy = overlapcfg.from_hydra(cfg.trainer.overlap).policy
    print("RESULT", policy.forward_prefetch, policy.backward_prefetch)


how = sys.argv.pop(1)
if how == "main":
    main = overlapcfg.hydra_main(config_path="conf", config_name="train", version_base="1.3",
                                 mounts=["trainer.overlap"])(task)
else:
    main = overlapcfg.with_hydra_overrides(mounts=["trainer.overlap"])(
        hydra.main(config_path="conf", config_name="train", version_base="1.3")(task))
main()
'''
"""``python app.py main|helper [overrides]``: prints ``RESULT <forward_prefetch> <backward_prefetch>`` of the
config mounted at ``trainer.overlap``, through ``hydra_main`` (``main``) or ``with_hydra_overrides`` (``helper``)."""

COMPOSE = '''
import sys

from hydra import compose, initialize_config_dir

import overlapcfg

with initialize_config_dir(sys.argv[1], version_base="1.3"):
    try:
        overrides = overlapcfg.hydra_overrides(sys.argv[2:], mounts=["trainer.overlap"])
    except overlapcfg.OverlapcfgError as err:
        sys.exit(str(err))
    cfg = compose("train", overrides=overrides)
    print("RESULT", overlapcfg.from_hydra(cfg.trainer.overlap).policy.forward_prefetch)
'''
"""``python compose.py <conf dir> [overrides]``: the same config through the compose API and ``hydra_overrides``."""


def user_app(tmp_path: Path, presets: dict[str, str]) -> Path:
    """A user's app in ``tmp_path`` (outside the repository): ``conf/train.yaml`` mounting the group at
    ``trainer.overlap``, policy presets of its own, and ``app.py`` / ``compose.py``."""
    conf = tmp_path / "conf"
    (conf / "overlap" / "policy").mkdir(parents=True)
    (conf / "train.yaml").write_text("defaults:\n  - overlap@trainer.overlap: default\n  - _self_\nlr: 0.1\n")
    for name, text in presets.items():
        (conf / "overlap" / "policy" / f"{name}.yaml").write_text(text)
    (tmp_path / "app.py").write_text(textwrap.dedent(APP))
    (tmp_path / "compose.py").write_text(textwrap.dedent(COMPOSE))
    return conf
