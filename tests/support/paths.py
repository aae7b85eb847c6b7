"""Where things are, for tests and the scripts they start: from this file, so a test file may sit in any folder."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
"""The ``tests/`` package."""
REPO = TESTS.parent
"""The repository root (on ``sys.path`` in a test session: ``tests`` is imported from it)."""
README = REPO / "README.md"
DOCS = REPO / "docs"
"""The documentation site's pages (``mkdocs.yml`` at the root builds them)."""
EXAMPLES = REPO / "examples"
