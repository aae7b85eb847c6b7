"""Tests of ``overlapcfg.report``: explain, the cost model, simulation, timelines."""
