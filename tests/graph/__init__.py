"""Tests of ``overlapcfg.graph``: recognition, attribution, scheduling, verification."""
