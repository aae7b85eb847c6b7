"""Each config file Hydra reads parsed once per process, for test modules that compose the shipped tree dozens of
times (``tests/config/test_hydra.py``, ``tests/config/test_preset_by_name.py``).

Hydra parses every file of a composition again on every ``compose`` (its file cache lives for one composition):
about a quarter of a compose is PyYAML reading the same dozen files (``overlapcfg.yaml``, the ``overlap`` groups,
Hydra's own ``hydra/*`` defaults). Parsing is a function of the text alone, so ``memoized_config_files`` keeps
the parsed data by the file's full text and builds a fresh ``DictConfig`` from a copy of it on each read: Hydra
still opens and reads every file, composes, merges and validates as always, and a file whose text changed is parsed
again (``test_hydra.py::test_a_config_file_changed_between_composes_is_read_again``). Only documents that parse to
a mapping are kept; anything else (an error, an empty file, a list) goes through ``OmegaConf.load`` every time.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Iterator
from typing import IO, Any

import pytest
from omegaconf import DictConfig, OmegaConf

_PARSED: dict[str | bytes, dict[Any, Any]] = {}
"""Full text of a config file -> its plain data (``OmegaConf.to_container``, interpolations unresolved)."""


@contextlib.contextmanager
def memoized_config_files() -> Iterator[None]:
    """``OmegaConf.load`` on an open file (how Hydra's config sources read) parses each distinct text once."""
    load = OmegaConf.load

    def memoized(file_: str | IO[Any]) -> Any:
        if not hasattr(file_, "read"):
            return load(file_)  # a path: not Hydra's route, left alone
        text = file_.read()
        data = _PARSED.get(text)
        if data is None:
            cfg = load(io.BytesIO(text) if isinstance(text, bytes) else io.StringIO(text))
            if not isinstance(cfg, DictConfig) or not cfg:
                return cfg
            data = _PARSED[text] = OmegaConf.to_container(cfg, resolve=False)  # type: ignore[assignment]
        return OmegaConf.create(copy.deepcopy(data))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OmegaConf, "load", staticmethod(memoized))
        yield
