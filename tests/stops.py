"""Stopping a command at one of its writes, for the tests that every interruption point of a
command that writes leaves the previous output or the finished one: every rename into place
(``os.replace``) and every flush to disk (``os.fsync``) that a function makes is counted, and
the one asked for raises instead (Ctrl-C's ``KeyboardInterrupt``, a full disk's ``OSError``).
Imported as ``stops`` (``tests/`` is on ``sys.path`` through ``tests/conftest.py``)."""

from __future__ import annotations

import errno
import os
from typing import Any

#: the write operations counted: every rename into place and every flush to disk
WRITES = ("replace", "fsync")
#: the ways a write stops: Ctrl-C, and a full disk
ERRORS = {
    "ctrl-c": KeyboardInterrupt(),
    "disk-full": OSError(errno.ENOSPC, "No space left on device"),
}


def stop_writes(monkeypatch: Any, owner: Any, name: str, at: int | None = None,
                error: BaseException | None = None) -> list[str]:  # fmt: skip
    """Count the writes of ``owner.name`` (a function or method, replaced through
    ``monkeypatch`` for the test) while it runs; with ``at``, raise ``error`` at that write
    (0-based) instead of making it.

    Returns:
        the operations seen (``"replace"`` or ``"fsync"``), filled as the function runs.
    """
    seen: list[str] = []
    inside: list[int] = []
    real = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        inside.append(1)
        try:
            return real(*args, **kwargs)
        finally:
            inside.pop()

    def counted(op: str) -> Any:
        real_op = getattr(os, op)

        def write(*args: Any) -> Any:
            if inside:
                seen.append(op)
                if at is not None and len(seen) - 1 == at:
                    raise error
            return real_op(*args)

        return write

    monkeypatch.setattr(owner, name, wrapped)
    for op in WRITES:
        monkeypatch.setattr(os, op, counted(op))
    return seen


def run_until_stopped(run: Any, error: BaseException) -> bool:
    """Run ``run()``; whether it raised ``error``'s type. Only a failed write may pass
    unnoticed, as a directory's flush does on file systems that refuse it.

    Raises:
        AssertionError: a Ctrl-C that did not stop it.
    """
    try:
        run()
    except type(error):
        return True
    assert isinstance(error, OSError), "the interruption did not stop it"
    return False
