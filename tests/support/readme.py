"""README's blocks, read the way its tests and the torchtitan pipeline's tests need them."""

from __future__ import annotations

import re
import shlex

from tests.support.paths import README


def block_after(heading: str, lang: str) -> str:
    """The first ```lang block after the first occurrence of ``heading`` in README."""
    text = README.read_text()
    section = text.split(heading, 1)[1]
    match = re.search(rf"```{lang}\n(.*?)```", section, flags=re.S)
    assert match, f"no ```{lang} block after {heading!r}"
    return match.group(1)


def readme_torchtitan_args() -> list[str]:
    """The torchtitan arguments of README's ``torchrun ... -m overlapcfg.integrations.torchtitan ...`` line."""
    words = shlex.split(block_after("## torchtitan graph trainer", "bash").replace("\\\n", " "))
    return words[words.index("overlapcfg.integrations.torchtitan") + 1:]
