"""Tests of ``overlapcfg.strategies``: the registry and the graph kinds strategies accept."""
