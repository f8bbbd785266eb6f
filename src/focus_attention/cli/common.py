"""What every ``focus`` command shares: the one error wrapper, so that bad input ends as a
one-line message and exit status 1 instead of a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

Command = Callable[[argparse.Namespace], int]

#: the errors a command reports in one line: bad settings or input, missing files, and
#: failures the code detected and explained (a changed base model, a non-finite loss...)
REPORTED_ERRORS = (ValueError, RuntimeError, FileNotFoundError)


def run_guarded(func: Command) -> Command:
    """Wrap a command: an error of :data:`REPORTED_ERRORS` becomes ``focus: error: <message>``
    on stderr and exit status 1; anything else propagates with its traceback."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return int(func(args) or 0)
        except REPORTED_ERRORS as err:
            print(f"focus: error: {err}", file=sys.stderr)
            return 1

    wrapper.__name__ = getattr(func, "__name__", "command")
    wrapper.__doc__ = func.__doc__
    return wrapper
