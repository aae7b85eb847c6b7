"""Writing output files whole or not at all (shared by every layer that writes one; no torch, no layer imports).

``write_atomic`` writes into a temporary file beside the target and renames it over the target
(``os.replace``: atomic within one filesystem, on POSIX and Windows). Whoever reads the file, and whatever kills
the writer half-way, sees the previous file or the new one, never a truncated one: a ``tuned.yaml`` cut at the
wrong byte is still valid YAML, only with the overrides missing, and loads as a different config without a word.
The temporary file is named ``.<name>.<pid>.<random>.tmp<suffix>`` (the suffix kept, so ``savefig`` picks the
format), is created with the usual permissions (umask applied, unlike ``mkstemp``'s 0600), and is removed if the
write fails.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path

__all__ = ["TEMP_GLOB", "write_atomic"]

TEMP_GLOB = ".*.tmp*"
"""What a temporary file left by a killed writer looks like (``overlapcfg.demo.outputs`` clears them)."""


def write_atomic(path: str | Path, data: str | bytes | Callable[[Path], object]) -> Path:
    """Write ``data`` (text as UTF-8, bytes, or a function writing the file it is given, such as
    ``fig.savefig``) to ``path`` atomically; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        if callable(data):
            data(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path
