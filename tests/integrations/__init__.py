"""Tests of ``overlapcfg.integrations``: torchtitan's graph-trainer pipeline."""
