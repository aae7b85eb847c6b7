"""Tests of ``overlapcfg.capture``: from a model to a captured, traced step."""
