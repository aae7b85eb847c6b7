"""Tests of ``overlapcfg.config``: the schema, patterns, loading, presets, Hydra."""
