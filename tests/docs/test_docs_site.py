"""README stays a front page and the site stays whole: README is short and opens with the set-up, every page is in
the navigation, every public name has an API reference entry, and every link from README into the site lands.

Fast checks of the files; the build itself (``mkdocs build --strict``: links, anchors, docstrings) is a step of
``.ci/run``."""

from __future__ import annotations

import re

import tomllib
import yaml

import overlapcfg
from tests.support.paths import DOCS, README, REPO

README_MAX_LINES = 300


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def _mkdocs() -> dict:
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


def test_readme_is_a_front_page_that_opens_with_the_two_setup_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README grew past a front page: move the detail into docs/"
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S)
    assert first and text.index("```") == first.start(), "the first block of README must be the set-up commands"
    commands = first.group(1).strip().splitlines()
    assert len(commands) == 2
    assert "torch==2.13.0" in commands[0] and "-e '.[dev]'" in commands[0]
    assert commands[0].rstrip().endswith(".venv/bin/overlapcfg")
    assert commands[1].startswith(".venv/bin/python -m pytest")


def test_the_setup_installs_the_documentation_tools_pinned() -> None:
    """The first set-up command installs the ``dev`` extra; the site builds with what it pins, exactly."""
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    pins = dict(re.fullmatch(r"([\w.-]+)==([\w.]+)", req).groups() for req in dev if "==" in req)  # type: ignore[union-attr]
    assert {"mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python", "griffe"} <= set(pins), pins


def test_every_page_is_in_the_navigation_and_every_entry_is_a_page() -> None:
    nav = _nav_pages(_mkdocs()["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == pages, (set(pages) - set(nav), set(nav) - set(pages))
    assert len(nav) == len(set(nav)), "a page is in the navigation twice"


def test_every_public_name_has_an_api_reference_entry() -> None:
    """Each name ``overlapcfg`` exports has a ``::: overlapcfg.<module>.<name>`` entry: from the module that defines
    it, since griffe reads the source and does not follow the lazy package's ``__getattr__``."""
    directives = {line[4:].strip() for page in (DOCS / "reference").glob("*.md")
                  for line in page.read_text().splitlines() if line.startswith("::: ")}
    missing = []
    for name in overlapcfg._EXPORTS:
        if not any(d.startswith("overlapcfg.") and d.endswith("." + name) for d in directives):
            missing.append(name)
    assert not missing, "no '::: overlapcfg.<module>.<name>' in docs/reference/ for: " + ", ".join(missing)


def test_readme_links_into_the_site_land_and_its_snippets_exist() -> None:
    text = README.read_text()
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", text)
    assert links and all((REPO / link).is_file() for link in links), [x for x in links if not (REPO / x).is_file()]
    for page in DOCS.rglob("*.md"):
        for name in re.findall(r'^--8<-- "README\.md:([\w-]+)"$', page.read_text(), flags=re.M):
            assert f"--8<-- [start:{name}]" in text and f"--8<-- [end:{name}]" in text, (page.name, name)
