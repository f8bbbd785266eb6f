"""Every bounded setting of every command is refused just past its bound, on its flag's check,
before any work: the bound minus one (an int) or a hair below it (a float; at an open bound, the
bound itself), and likewise past an upper bound, while the bound itself is taken. The ranges
below are the contract, written down apart from the code that checks them, so a loosened check
fails here; every numeric flag of every command must be listed (a new one without its range
fails :func:`test_every_numeric_flag_has_a_stated_range`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from focus_attention.bench import settings as bench
from focus_attention.cli import build_parser
from focus_attention.cli import pretrain as cli_pretrain
from focus_attention.cli import train as cli_train
from focus_attention.cli.common import run_guarded
from focus_attention.cli.flags import command_config, flag_values
from focus_attention.deploy.settings import ExportConfig
from focus_attention.evaluation.settings import CalibrateConfig, EvalConfig, InspectConfig
from focus_attention.experiments.settings import SweepConfig

#: a float step past a float bound
HAIR = 1e-3


@dataclass(frozen=True)
class Range:
    """The values a flag takes: ``low`` (least; exclusive with ``low_open``) and ``high``
    (greatest; exclusive with ``high_open``), None for no bound; ``extra`` flags the range
    assumes; ``depends``: those of them the bound is set by, which its refusal names too."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    extra: tuple[str, ...] = ()
    depends: tuple[str, ...] = ()


def at_least(low, *extra, high=None, high_open=False, depends=()) -> Range:
    return Range(low, high, False, high_open, extra, depends)


def above(low, *extra, high=None, high_open=False, depends=()) -> Range:
    return Range(low, high, True, high_open, extra, depends)


#: no bound at the settings check (the reason beside each)
FREE = Range()

#: ranges of the flags that mean the same in every command that has them
SHARED = {
    "--seed": at_least(0),
    "--threads": at_least(1),
    "--top-k": at_least(1),
    "--query-top-k": at_least(1),
    "--window": at_least(1),
    "--sink-tokens": at_least(0),
    "--dense-layers": at_least(0),
    "--num-groups": at_least(2),
    "--group-dim": at_least(1),
    "--sinkhorn-iters": at_least(0),
    "--soft-chunk-size": at_least(0),
    "--temperature": above(0),
    "--gate-sharpness": above(0),
    "--bias-momentum": above(0, high=1),
    "--batch-size": at_least(1),
    "--grad-accum": at_least(1),
    "--keep-checkpoints": at_least(1),
    "--max-train-tokens": at_least(1),
    "--warmup-steps": at_least(0),
    "--weight-decay": at_least(0),
    "--max-grad-norm": at_least(0),
    "--lr": above(0),
    "--max-new-tokens": at_least(1),
    "--num-heads": at_least(1, "--num-key-value-heads", "1"),
    "--num-key-value-heads": at_least(1, "--num-heads", "4"),
    "--head-dim": at_least(1),
    "--depths": at_least(0, high=1),
    "--trials": at_least(1),
}

#: ranges of each command's own flags (and of shared flags that differ there)
OWN = {
    ("train",): {
        "--seq-len": at_least(5, "--window", "4", "--sink-tokens", "0", depends=("--window",)),
        "--window": at_least(1, "--seq-len", "16", high=15, depends=("--seq-len",)),
        "--top-k": at_least(1, "--num-groups", "4", high=4, depends=("--num-groups",)),
        "--query-top-k": at_least(1, "--num-groups", "4", high=4, depends=("--num-groups",)),
        "--steps": at_least(0),
        "--eval-tokens": at_least(1),
        "--eval-every": FREE,  # below 0: never validate
        "--save-every": at_least(0),
        "--distill-weight": at_least(0),
        "--coverage-queries": at_least(0),
        "--retrieval-blocks": at_least(0),
        "--question-weight": above(0, "--retrieval-blocks", "2", "--objective", "coverage"),
        "--base-lr": above(0, "--method", "focus+lora"),
        "--lora-alpha": above(0, "--method", "focus+lora"),
        "--lora-dropout": at_least(0, "--method", "focus+lora", high=1, high_open=True),
        "--gate-penalty": at_least(
            0, "--method", "head-gates", "--objective", "distill", "--init-adapter", "adapter"
        ),  # fmt: skip
        "--phase1-steps": at_least(
            0, "--method", "two-phase", "--steps", "10", high=10, depends=("--steps",)
        ),
    },
    ("pretrain",): {
        "--seq-len": at_least(5, "--window", "4", depends=("--window",)),
        "--top-k": at_least(1, "--num-groups", "4", high=4, depends=("--num-groups",)),
        "--steps": at_least(1),
        "--eval-tokens": at_least(
            64, "--seq-len", "64", "--window", "16", depends=("--seq-len",)
        ),  # a block
        "--hidden-size": at_least(
            2, "--num-heads", "1", "--num-kv-heads", "1", depends=("--num-heads",)
        ),
        "--num-layers": at_least(1),
        "--num-heads": at_least(1, "--hidden-size", "64", "--num-kv-heads", "1"),
        "--num-kv-heads": at_least(1, "--num-heads", "4"),
        "--intermediate-size": at_least(1),
        "--vocab-size": at_least(257),  # the 256 bytes and the end-of-text token
        "--eval-every": at_least(1),
        "--log-every": at_least(1),
    },
    ("eval",): {
        "--seq-len": at_least(2),
        "--calibrate-blocks": at_least(0),
        "--coverage-queries": at_least(0),
    },  # fmt: skip
    ("calibrate",): {
        "--seq-len": at_least(2),
        "--blocks": at_least(0),
        "--head-budget": above(0, high=1),
        "--ranking-length": at_least(64),
    },  # fmt: skip
    ("export",): {},
    ("inspect",): {
        "--seq-len": at_least(2),
        "--max-tokens": at_least(16, "--seq-len", "16", depends=("--seq-len",)),  # a block
        "--layers": at_least(0),
        "--top-tokens": at_least(0),
        "--min-count": at_least(0),
        "--snippets": at_least(0),
        "--context": at_least(0),
        "--shuffles": at_least(0),
    },
    ("sweep",): {"--jobs": at_least(1)},
    ("bench", "kernel"): {
        "--lengths": at_least(1),
        "--repeats": at_least(1),
        "--top-k": at_least(1, "--num-groups", "4", high=4, depends=("--num-groups",)),
        "--query-top-k": at_least(1, "--num-groups", "4", high=4, depends=("--num-groups",)),
    },  # fmt: skip
    ("bench", "model"): {
        "--lengths": at_least(1),
        "--repeats": at_least(1),
        "--warmup": at_least(0),
        "--warmup-tokens": at_least(1),
    },  # fmt: skip
    ("bench", "decode"): {
        "--contexts": at_least(1),
        "--steps": at_least(1),
        "--warmup": at_least(0),
    },  # fmt: skip
    ("bench", "needle"): {"--lengths": at_least(64), "--diagnostic-top-k": at_least(1)},
    ("bench", "retrieval-layers"): {
        "--lengths": at_least(64),
        "--count": at_least(1),
        "--heads": at_least(1),
    },  # fmt: skip
    ("bench", "tasks"): {
        "--top-k": at_least(1, "--adapter", "a"),
        "--window": at_least(1, "--adapter", "a"),
        "--limit": at_least(1),
        "--bootstrap-iters": at_least(0),
    },  # fmt: skip
    ("bench", "ruler"): {
        "--top-k": at_least(1, "--adapter", "a"),
        "--window": at_least(1, "--adapter", "a"),
        "--sink-tokens": at_least(0, "--adapter", "a"),
        "--dense-layers": at_least(0, "--adapter", "a"),
        "--query-top-k": at_least(1, "--adapter", "a"),
        "--lengths": at_least(256),
        "--limit": at_least(1),
        "--max-gen-toks": at_least(1),
    },  # fmt: skip
    ("bench", "instructions"): {
        "--top-k": at_least(1, "--adapter", "a"),
        "--window": at_least(1, "--adapter", "a"),
        "--prompts": at_least(1),
        "--limit": at_least(1),
        "--passage-share": at_least(0, high=1),
    },  # fmt: skip
    ("bench", "serve"): {
        "--lengths": at_least(1),
        "--concurrency": at_least(1),
        "--requests": at_least(1),
        "--cell-timeout": above(0),
        "--ready-timeout": above(0),
        "--warmup": at_least(0),
    },  # fmt: skip
}


def _train(args):
    config = cli_train.config_from_args(args)
    config.validate()


def _pretrain(args):
    config = cli_pretrain.config_from_args(args)
    config.validate()


def _settings(cls: type, table: str) -> Callable:
    return lambda args: command_config(args, cls, table)


_BENCH = {"kernel": bench.KernelBenchConfig, "model": bench.ModelBenchConfig,
          "decode": bench.DecodeBenchConfig, "needle": bench.NeedleBenchConfig,
          "retrieval-layers": bench.RetrievalLayersConfig, "tasks": bench.TasksBenchConfig,
          "instructions": bench.InstructionsBenchConfig, "serve": bench.ServeBenchConfig,
          "ruler": bench.RulerBenchConfig}  # fmt: skip

#: how each command builds and checks its settings from its parsed flags (what it does before
#: any work), and the flags it needs besides
BUILD: dict[tuple[str, ...], tuple[Callable, list[str]]] = {
    ("train",): (_train, []),
    ("pretrain",): (_pretrain, []),
    ("sweep",): (lambda args: SweepConfig(**flag_values(args, SweepConfig)), ["--grid", "g.toml"]),
    ("eval",): (_settings(EvalConfig, "eval"), []),
    ("calibrate",): (_settings(CalibrateConfig, "calibrate"), ["--adapter", "a", "--out", "o"]),
    ("inspect",): (_settings(InspectConfig, "inspect"), ["--adapter", "a", "--out", "o"]),
    ("export",): (_settings(ExportConfig, "export"), ["--adapter", "a", "--out", "o"]),
    **{
        ("bench", name): (
            _settings(cls, f"bench.{name}"),
            ["--adapter", "a"] if name == "serve" else [],
        )
        for name, cls in _BENCH.items()
    },  # fmt: skip
}


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*words, name))
    if words:
        yield words, parser


def _numeric_flags() -> dict[tuple[str, ...], dict[str, type]]:
    """``{command words: {flag: int or float}}`` for every command with numeric flags."""
    found = {}
    for words, parser in _commands(build_parser()):
        flags = {a.option_strings[0]: a.type for a in parser._actions
                 if a.option_strings and a.help != argparse.SUPPRESS and a.type in (int, float)}  # fmt: skip
        if flags:
            found[words] = flags
    return found


FLAGS = _numeric_flags()


def _range(words: tuple[str, ...], flag: str) -> Range | None:
    return OWN.get(words, {}).get(flag, SHARED.get(flag))


def test_every_numeric_flag_has_a_stated_range():
    missing = [f"focus {' '.join(w)} {flag}" for w, flags in FLAGS.items() for flag in flags
               if w not in BUILD or _range(w, flag) is None]  # fmt: skip
    assert not missing, "numeric flags without a range in tests/cli/test_bounds.py: " + ", ".join(missing)  # fmt: skip
    stale = [f"{' '.join(w)} {f}" for w, own in OWN.items() for f in own if f not in FLAGS.get(w, {})]  # fmt: skip
    assert not stale, stale


def _refusal(words: tuple[str, ...], argv: list[str]) -> str | None:
    """Why ``focus WORDS ARGV`` is refused before any work, as the user reads it (argparse's
    message, or the settings' error as the command reports it: ``focus: error: ...``), or
    None when it is taken."""
    build, needed = BUILD[words]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = build_parser(words[0]).parse_args([*words, *needed, *argv])
        except SystemExit:
            return err.getvalue().strip().splitlines()[-1]
        status = run_guarded(lambda parsed: build(parsed) and 0)(args)
    return err.getvalue().strip().splitlines()[-1] if status else None


def _depends(bound: Range, value: float) -> tuple[str, ...]:
    """The flags a refusal of ``value`` must name besides its own: those the bound it is
    past is set by (the upper bound's where the range has one, else the lower's)."""
    high = bound.high is not None and value >= bound.high
    return bound.depends if high or bound.high is None else ()


def _names(message: str, flag: str) -> bool:
    """Whether ``message`` names ``flag`` as typed (``--top-k``, not ``top_k`` or
    ``Config.top_k``)."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", message) is not None


def _cases(kind: type, bound: Range) -> list[tuple[float, bool]]:
    """``(value, taken)`` just inside and just past each bound of ``bound``."""
    step = 1 if kind is int else HAIR
    cases = []
    if bound.low is not None:
        low = bound.low
        cases += [(low, False), (low + step, True)] if bound.low_open else [(low - step, False), (low, True)]  # fmt: skip
    if bound.high is not None:
        high = bound.high
        cases += [(high, False), (high - step, True)] if bound.high_open else [(high + step, False), (high, True)]  # fmt: skip
    return cases


@pytest.mark.parametrize("words", sorted(FLAGS), ids=" ".join)
def test_each_bound_is_refused_just_past_it_and_taken_at_it(words):
    failures = []
    for flag, kind in FLAGS[words].items():
        bound = _range(words, flag)
        if bound is None:
            continue  # reported by test_every_numeric_flag_has_a_stated_range
        for value, taken in _cases(kind, bound):
            text = str(kind(value))
            why = _refusal(words, [*bound.extra, flag, text])
            if taken and why is not None:
                failures.append(f"{flag} {text} refused: {why}")
            elif not taken and why is None:
                failures.append(f"{flag} {text} taken (expected refused)")
            elif not taken and not _names(why, flag):
                failures.append(f"{flag} {text} refused without naming it as typed: {why}")
            elif not taken and not all(_names(why, o) for o in _depends(bound, value)):
                failures.append(f"{flag} {text} refused without naming {bound.depends}: {why}")
    assert not failures, f"focus {' '.join(words)}: " + "; ".join(failures)
