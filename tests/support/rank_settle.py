"""Imported last by the fork servers of gloo ranks (``tests.support.rank_warmup.preloaded``), once everything else
of the preload is: the collector set as the test workers set it (``tests/conftest.py``), for every rank forked after.

Everything imported so far is frozen out of the collector's walks (``gc.freeze``: torch, dynamo and the test modules
live to the end of each rank anyway), and the youngest generation is collected every 10,000 net allocations instead
of 700: dynamo and aot allocate by the hundred thousand while tracing, most of it dead before a collection with the
larger threshold runs. Measured on 2 cores: three captures of the 2-layer demo step in one process, 4.2 CPU s with
Python's defaults, 3.8 with both. When garbage is freed changes, never whether; a rank's numbers are untouched.
"""

from __future__ import annotations

import gc

gc.collect()
gc.freeze()
gc.set_threshold(10_000, 20, 10)
