"""``python -m overlapcfg.integrations.torchtitan ARGS``: torchtitan's trainer (``torchtitan.train``) with the
``overlapcfg`` pass pipeline registered on every rank. ``ARGS`` are torchtitan's (``--module``, ``--config``,
``--compile.*``, ...); without a ``--compile.pass_pipeline`` of their own, ``--compile.pass_pipeline overlapcfg`` is
added, so the entry point never runs a step without the pipeline it exists for.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

_FLAGS = ("--compile.pass_pipeline", "--compile.pass-pipeline")


def with_pipeline(args: Sequence[str]) -> list[str]:
    """``args`` with ``--compile.pass_pipeline overlapcfg`` appended unless a pipeline is already named."""
    named = any(a in _FLAGS or a.startswith(tuple(f"{f}=" for f in _FLAGS)) for a in args)
    return list(args) if named else [*args, _FLAGS[0], "overlapcfg"]


def main(argv: Sequence[str] | None = None) -> None:
    import overlapcfg.integrations.torchtitan  # noqa: F401  (registers the pipeline)

    args = with_pipeline(sys.argv[1:] if argv is None else argv)
    sys.argv = [sys.argv[0], *args]  # torchtitan's ConfigManager parses sys.argv
    from torchtitan.train import main as train

    train()


if __name__ == "__main__":
    main()
