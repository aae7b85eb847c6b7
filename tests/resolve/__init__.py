"""Tests of ``overlapcfg.resolve``: plan resolution against module trees."""
