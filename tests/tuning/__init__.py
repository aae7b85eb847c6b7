"""Tests of ``overlapcfg.tuning``: the tuner and what it shows."""
