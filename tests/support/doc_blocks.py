"""The code blocks of README.md and of the documentation site (``docs/``), read the way their tests need them.

Blocks are found with markdown-it (the CommonMark parser rich already brings), so a fence inside a list, a ``~~~``
fence or an indented one is found exactly as a Markdown renderer finds it. A block that is not run says why in an
HTML comment on the lines right above it, ``<!-- not run: <reason> -->`` (other comments, such as the snippet
markers ``<!-- --8<-- [start:name] -->``, may stand between them). A shell block of independent commands, each an
example of its own, may say ``<!-- run: each command on its own -->`` there instead: its commands are then run as
separate tests (spread over the workers, and a failure names the command).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from markdown_it import MarkdownIt

from tests.support.paths import DOCS, README, REPO

RUN_LANGS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
"""Fence languages whose blocks are run: Python, and shell commands (run with bash)."""
SHOWN_LANGS = frozenset({"yaml", "diff", "text", "json", "toml", ""})
"""Fence languages that are shown, not run: configs, diffs and plain text (a directory tree). Any other language
is an error, so a block cannot escape the runner by being spelled ``console`` or ``zsh``."""

NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>.*?)\s*-->", re.S)
EACH_COMMAND = re.compile(r"<!--\s*run: each command on its own\s*-->")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class DocBlock:
    """One fenced code block: where it is, its language, its text, and why it is not run (None: it is run)."""

    path: str
    """Relative to the repository root (``README.md``, ``docs/tuning.md``)."""
    line: int
    """1-based line of the opening fence."""
    heading: str
    """The heading of the section it sits in (the page's title when above every section)."""
    lang: str
    code: str
    not_run: str | None
    each_command: bool = False
    """The block's commands are independent examples, run one by one (``commands``)."""

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def commands(self) -> list[str]:
        """The block's shell commands: a line continued with ``\\`` joined to the next, blank and comment lines
        left out."""
        joined = self.code.replace("\\\n", " ")
        return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]

    @property
    def runner(self) -> str | None:
        """``"python"`` or ``"bash"`` for a block of a language that is run; None for one that is shown."""
        return RUN_LANGS.get(self.lang)


def doc_files() -> list[Path]:
    """README and every page of the site, in a fixed order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def _blocks_of(path: Path) -> list[DocBlock]:
    text = path.read_text()
    tokens = MarkdownIt("commonmark").parse(text)
    out: list[DocBlock] = []
    heading = ""
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            heading = tokens[i + 1].content
        if token.type != "fence":
            continue
        reason, each = None, False
        j = i - 1
        while j >= 0 and tokens[j].type == "html_block":  # the comments right above the fence
            match = NOT_RUN.search(tokens[j].content)
            reason = match.group("reason") if match else reason
            each = each or bool(EACH_COMMAND.search(tokens[j].content))
            j -= 1
        assert token.map is not None
        out.append(DocBlock(path=path.relative_to(REPO).as_posix(), line=token.map[0] + 1, heading=heading,
                            lang=token.info.strip().split(" ")[0].lower(), code=token.content, not_run=reason,
                            each_command=each))
    return out


@cache
def all_blocks() -> tuple[DocBlock, ...]:
    return tuple(block for path in doc_files() for block in _blocks_of(path))


def block_after(heading: str, lang: str) -> str:
    """The first ```lang block after the one occurrence of ``heading`` (a heading's text or any other text) in
    README and the pages together."""
    hits = [(path, text) for path in doc_files() if heading in (text := path.read_text())]
    assert len(hits) == 1, f"{heading!r} is in {[p.name for p, _ in hits] or 'no file'}, expected one"
    path, text = hits[0]
    line = text[:text.index(heading)].count("\n") + 1
    for block in _blocks_of(path):
        if block.lang == lang and block.line >= line:
            return block.code
    raise AssertionError(f"no ```{lang} block after {heading!r} in {path.name}")


def torchtitan_command_args() -> list[str]:
    """The torchtitan arguments of the graph trainer page's ``torchrun ... -m overlapcfg.integrations.torchtitan
    ...`` line."""
    words = shlex.split(block_after("# torchtitan graph trainer", "bash").replace("\\\n", " "))
    return words[words.index("overlapcfg.integrations.torchtitan") + 1:]
