"""Tests of ``overlapcfg.measuring``: calibration and measured steps."""
