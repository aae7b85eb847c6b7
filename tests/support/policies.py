"""A third party's strategy policy, for the tests that register one (``clean_registry`` puts the catalog back)."""

from __future__ import annotations

from overlapcfg.config.policy import PolicyBase


class LookaheadPolicy(PolicyBase):
    """A third party's own knobs."""

    lookahead: int = 2
    """How far ahead."""
    label: str = "x"
    """Free text."""
