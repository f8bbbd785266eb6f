"""What every ``focus`` command shares: the list of commands with their one-line help (so
that ``focus --help`` lists them without importing them), and the one error wrapper, so that
bad input ends as a one-line message and exit status 1 instead of a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from .flags import in_flag_words

Command = Callable[[argparse.Namespace], int]

#: the sub-commands in the order ``focus --help`` lists them: name, the module whose
#: ``register_cli(subparsers)`` adds it, and its one-line help
COMMANDS = (
    ("data", "focus_attention.cli.data",
     "list and prepare text corpora and benchmark data (offline cache)"),
    ("setup", "focus_attention.cli.setup",
     "prepare the default model and corpus (idempotent; run once, then work offline)"),
    ("models", "focus_attention.cli.models", "list and prepare pretrained models (offline cache)"),
    ("train", "focus_attention.cli.train",
     "train the Focus centroids of a frozen model, or LoRA / fine-tuning baselines"),
    ("pretrain", "focus_attention.cli.pretrain",
     "train a small LLaMA-style model from scratch with Focus or dense attention"),
    ("eval", "focus_attention.cli.eval",
     "perplexity of the base model and a Focus adapter (soft and every top-k) or any focus "
     "train run"),
    ("calibrate", "focus_attention.cli.calibrate",
     "an adapter for long inputs: the routing bias collected at that length, and new window "
     "/ sink tokens / dense layers / top_k"),
    ("export", "focus_attention.cli.export",
     "a model directory any transformers tool loads with Focus (trust_remote_code)"),
    ("inspect", "focus_attention.cli.inspect",
     "what the learned groups hold: shares, tokens, word categories, NMI vs untrained"),
    ("sweep", "focus_attention.cli.sweep",
     "ablation grid (--grid) or study (--study): run every step not yet done"),
    ("bench", "focus_attention.cli.bench", "speed and quality benchmarks (write JSON results)"),
    ("lm-eval", "focus_attention.cli.harness",
     "lm-evaluation-harness's command line with the focus model and the local tasks"),
)  # fmt: skip


def summary(command: str) -> str:
    """The one-line help of ``command`` (:data:`COMMANDS`).

    Raises:
        KeyError: an unknown command.
    """
    return {name: text for name, _, text in COMMANDS}[command]


#: the errors a command reports in one line: bad settings or input, missing files, an
#: output that is already there, failures the code detected and explained (a changed base
#: model, a non-finite loss...) and the system's (a path that is a file, no permission, a
#: full disk)
REPORTED_ERRORS = (ValueError, RuntimeError, OSError)


def run_guarded(func: Command) -> Command:
    """Wrap a command: an error of :data:`REPORTED_ERRORS` becomes ``focus: error: <message>``
    on stderr (in the words of the command line: :func:`~focus_attention.cli.flags.
    in_flag_words`) and exit status 1; anything else propagates with its traceback."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return int(func(args) or 0)
        except REPORTED_ERRORS as err:
            print(f"focus: error: {in_flag_words(str(err), args)}", file=sys.stderr)
            return 1

    wrapper.__name__ = getattr(func, "__name__", "command")
    wrapper.__doc__ = func.__doc__
    return wrapper
