"""What gloo ranks forked from a fork server import on their own unless the server imported it first.

``run_on_gloo(preload=...)`` starts one fork server per test process, with the preload of the first call; every
later run forks its ranks from it. Each rank then still imports what nothing in that preload imported, once per
rank. Sampled over the whole suite (py-spy, 2026-12-07), the ranks spent about a minute of CPU on two such
imports:

- inductor's pattern matcher (with its lowerings and decompositions), which aot's min-cut partitioner imports
  lazily on the first compile of every rank (``fx_graph_cse``);
- Hugging Face transformers' package and the model modules the ranks build (Llama, GPT-NeoX).

``preloaded(*modules)`` puts ``tests.support.rank_imports`` first in a preload (it does the importing; this module
imports nothing, so a test module importing ``preloaded`` stays cheap to collect): whichever run starts the server,
the server has imported them. It puts ``tests.support.rank_settle`` last: the collector of every rank set as the
test workers' is (everything preloaded frozen, a larger threshold: about a tenth less CPU in a capture). A model
library that does not import (the compat tier's torch releases, where a test skips it) is left to the rank, which
then fails or skips as it would have without this module: the warm-up is an optimisation, never a condition.
"""

from __future__ import annotations

IMPORTS = "tests.support.rank_imports"
"""The module that imports them, named first in every preload."""
SETTLE = "tests.support.rank_settle"
"""The module that sets the ranks' collector, named last in every preload."""


def preloaded(*modules: str) -> tuple[str, ...]:
    """``modules`` for ``run_on_gloo(preload=...)``, the warm-up first and the collector's settings last."""
    return (IMPORTS, *modules, SETTLE)
