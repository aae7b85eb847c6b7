"""The test harness's warm command server (``tests/support/warm_cli.py``) reads each reply as it arrives.

The server sends two lines per run, the child's pid once forked and its status once it ended. A run that ended
before the test asked for it has both lines in the pipe at once; they must be read one after the other without
waiting. (Reading them through the text stream's ``readline`` after a ``select`` on it took both lines into the
stream's buffer on the first read, and the second ``select`` waited out its whole timeout: the determinism test,
which asks for its other process's result after tracing its own step, failed now and then with a timeout.)
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from tests.support.warm_cli import WarmCli


def _reading(lines: list[dict[str, int]]) -> tuple[WarmCli, int]:
    """A ``WarmCli`` whose server has written ``lines``, every one, into its pipe and is still running (the write
    end, returned, stays open: a read past them would wait)."""
    read_end, write_end = os.pipe()
    os.write(write_end, "".join(json.dumps(line) + "\n" for line in lines).encode())
    cli = object.__new__(WarmCli)
    cli._proc = SimpleNamespace(stdout=os.fdopen(read_end, "r"), wait=lambda: 0)  # type: ignore[assignment]
    cli._unread = b""
    return cli, write_end


def test_two_replies_already_in_the_pipe_are_read_one_after_the_other_without_waiting() -> None:
    cli, write_end = _reading([{"pid": 41}, {"rc": 0}])
    try:
        assert cli._reply(timeout=5) == {"pid": 41}
        assert cli._reply(timeout=5) == {"rc": 0}  # was: TimeoutError after 5 s
        with pytest.raises(TimeoutError):  # nothing more was sent: a third reply is waited for, up to its timeout
            cli._reply(timeout=0.01)
        os.close(write_end)
        write_end = -1
        with pytest.raises(RuntimeError, match="server died"):  # the server's end closed
            cli._reply(timeout=5)
    finally:
        if write_end >= 0:
            os.close(write_end)
        cli._proc.stdout.close()
