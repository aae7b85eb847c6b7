"""Imported by the fork servers of gloo ranks, first (``tests.support.rank_warmup.preloaded``): what each rank would
otherwise import on its own after the fork (see that module for the measurements)."""

from __future__ import annotations

import contextlib
import importlib

WARM = ("torch._inductor.pattern_matcher",)
"""Imported always: torch's own, present on every supported release."""
OPTIONAL = ("transformers", "transformers.models.llama.modeling_llama",
            "transformers.models.gpt_neox.modeling_gpt_neox")
"""Imported where they import: Hugging Face's models the ranks build. (Not torchtitan: it imports only behind the
stand-ins ``tests.thirdparty.models`` installs first, and a failed import would leave half a package behind.)"""

for _name in WARM:
    importlib.import_module(_name)
for _name in OPTIONAL:
    with contextlib.suppress(ImportError):  # not installed or not importable on this torch: the rank imports it
        importlib.import_module(_name)
