"""Tests of ``overlapcfg.demo``: the demo model, its mesh settings, the CLI job and its outputs."""
