"""Tuning: search bucket plans and depths with the cost model, under a memory budget (``overlapcfg.tune.tune``)."""
