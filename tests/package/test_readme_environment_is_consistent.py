"""README's environment holds what its packages declare, so an extra installs over it without a conflict report.

README's set-up installs the third-party test models with ``--no-deps`` (``tests/thirdparty/requirements.txt``).
Whatever they declare and that file left out made ``pip install 'overlapcfg[torchtitan]'`` print ``ERROR: ...
transformers 5.24.0 requires typer, which is not installed`` (pip reports the conflicts of every package that
depends on one it installs). This is ``pip check`` on the running environment, in process; the one exception is
what torchtitan's trainer imports and ``overlapcfg[torchtitan]`` installs (the conformance suite never starts the
trainer). That installing each extra over this environment downgrades nothing is ``.ci/extras_check``'s to prove:
it needs the network and minutes.
"""

from __future__ import annotations

import re
from importlib import metadata

from tests.support.paths import README

REQUIREMENTS = README.parent / "tests" / "thirdparty" / "requirements.txt"
TRAINER_ONLY = {"torchtitan": {"datasets", "einops", "tensorboard", "torch-checkpointing", "wandb"}}
"""What a package declares and README's environment leaves to its extra: torchtitan's trainer's imports."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pinned() -> dict[str, str]:
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("#")[0].strip().split("==")
            pins[_canonical(name)] = version
    return pins


def test_each_pinned_package_finds_what_it_declares_installed_at_a_version_it_accepts() -> None:
    from packaging.requirements import Requirement  # ~0.15 s to import: only here, not in every collecting process

    problems = []
    for name in _pinned():
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # an optional extra's, or another platform's
            wanted = _canonical(req.name)
            if wanted in TRAINER_ONLY.get(name, set()):
                continue
            try:
                have = metadata.version(wanted)
            except metadata.PackageNotFoundError:
                problems.append(f"{name} requires {req}, which is not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} requires {req}, but {wanted} {have} is installed")
    assert problems == []


def test_the_environment_holds_the_pinned_versions() -> None:
    """The check above is about this file only if the environment is the one it pins."""
    def installed(name: str) -> str | None:
        try:
            return metadata.version(name).split("+")[0]
        except metadata.PackageNotFoundError:
            return None

    wrong = {name: (version, installed(name)) for name, version in _pinned().items() if installed(name) != version}
    assert wrong == {}  # pinned -> (wanted, installed): rebuild the environment as README says
