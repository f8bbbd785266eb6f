"""Every command with settings reads ``--config`` (its table holds every flag as a key,
and the flags win over it); old flag spellings stay as hidden aliases that warn on stderr;
a list flag takes one or several values as its class says."""

from __future__ import annotations

import dataclasses
import json

import pytest

from focus_attention.bench import registry
from focus_attention.bench import settings as bench
from focus_attention.bench.commands import BENCH_COMMANDS
from focus_attention.cli import build_parser, main
from focus_attention.cli.flags import flag_fields, flag_values
from focus_attention.evaluation.settings import CalibrateConfig, EvalConfig, InspectConfig

#: (command words, settings class, --config table, module and function that runs it; for a
#: benchmark, the registry and the benchmark's name: its row's ``run``)
COMMANDS = [
    (["eval"], EvalConfig, "eval", "focus_attention.evaluation", "evaluate"),
    (
        ["calibrate"],
        CalibrateConfig,
        "calibrate",
        "focus_attention.evaluation.calibration",
        "calibrate_adapter",
    ),  # fmt: skip
    (["inspect"], InspectConfig, "inspect", "focus_attention.evaluation.groups", "inspect_groups"),
    *(
        (["bench", name], row.settings, f"bench.{name}", "focus_attention.bench.registry", name)
        for name, row in BENCH_COMMANDS.items()
        if "threads" in row.settings.__dataclass_fields__  # the tests set --threads
    ),
]


class Ran(Exception):
    """Raised by the patched runner, carrying the settings the command built."""


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


def _table(cls: type, table: str, extra: dict) -> str:
    """Table ``[table]`` with every flag of ``cls`` that has a default, at its default,
    then ``extra``."""
    values = {f.name: getattr(cls(**_required(cls)), f.name) for f in flag_fields(cls)}
    values = {k: v for k, v in values.items() if v is not None} | extra
    head = "[" + ".".join(f'"{p}"' if "-" in p else p for p in table.split(".")) + "]"
    return head + "\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in values.items())


def _required(cls: type) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in {"adapter": "run", "out": "new"}.items() if k in names}


def _run(monkeypatch, module: str, function: str, argv: list[str]):
    """The settings ``focus ARGV`` hands to its runner."""

    def runner(config, *args, **kwargs):
        raise Ran(config)

    if module == registry.__name__:  # a benchmark's row holds its run function
        row = registry.BENCHMARKS[function]
        monkeypatch.setitem(registry.BENCHMARKS, function, dataclasses.replace(row, run=runner))
    else:
        monkeypatch.setattr(f"{module}.{function}", runner)
    with pytest.raises(Ran) as ran:
        main(argv)
    return ran.value.args[0]


@pytest.mark.slow  # imports each command's runner module (torch, transformers, lm-eval)
@pytest.mark.parametrize("words, cls, table, module, function", COMMANDS, ids=lambda v: str(v))
def test_every_command_reads_every_flag_from_config(tmp_path, monkeypatch, words, cls, table, module, function):  # fmt: skip
    path = tmp_path / "settings.toml"
    path.write_text(_table(cls, table, {"threads": 1, **_required(cls)}))
    config = _run(monkeypatch, module, function, [*words, "--config", str(path)])
    assert type(config) is cls and config == cls(threads=1, **_required(cls))
    config = _run(monkeypatch, module, function, [*words, "--config", str(path), "--threads", "2"])  # fmt: skip
    assert config.threads == 2


@pytest.mark.parametrize(
    "command, old, new, values, cls",
    [
        (["eval"], "--top-k-values", "--top-k", (["1,2"], ["1", "2"]), EvalConfig),
        (["inspect"], "--tokens", "--max-tokens", (["2048"], ["2048"]), InspectConfig),
        (
            ["bench", "model"],
            "--windows",
            "--window",
            (["64", "128"], ["64", "128"]),
            bench.ModelBenchConfig,
        ),  # fmt: skip
    ],
)
def test_old_flag_spellings_are_hidden_aliases_that_warn(command, old, new, values, cls, capsys):
    parser = build_parser(command[0])
    given_old = flag_values(parser.parse_args([*command, old, *values[0]]), cls)
    assert f"focus: warning: {old} is deprecated, use {new}" in capsys.readouterr().err
    given_new = flag_values(parser.parse_args([*command, new, *values[1]]), cls)
    assert given_old == given_new and len(given_new) == 1
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--help"])
    text = capsys.readouterr().out
    assert new in text and f"{old} " not in text and f"{old}\n" not in text


def test_old_config_keys_are_renamed_with_a_warning(tmp_path, monkeypatch, capsys):
    path = tmp_path / "eval.toml"
    path.write_text('[eval]\nadapter = "run"\ntop_k_values = [2, 1]\n')
    config = _run(monkeypatch, "focus_attention.evaluation", "evaluate", ["eval", "--config", str(path)])  # fmt: skip
    assert config.top_k == (1, 2)
    assert "[eval] key 'top_k_values' is deprecated, use 'top_k'" in capsys.readouterr().err


def test_one_flag_name_per_setting_across_commands():
    """A setting shared by several commands has one flag, with one help text (but where a
    command gives it its own, bench.settings.command_help)."""
    helps: dict[str, set[str]] = {}
    for _, cls, *_ in COMMANDS:
        for f in flag_fields(cls, exclude=getattr(cls, "COMMAND_HELP", {})):
            helps.setdefault(f.name, set()).add(f.metadata["help"])
    for name in ("top_k", "window", "model", "adapter", "corpus", "split", "threads", "json",
                 "dense_layers", "sink_tokens", "query_top_k", "seed", "lengths"):  # fmt: skip
        assert len(helps[name]) == 1, (name, helps[name])
    assert not {"windows", "top_k_values", "tokens"} & set(helps)


def test_a_single_value_setting_refuses_several(capsys):
    with pytest.raises(SystemExit):
        build_parser("eval").parse_args(["eval", "--window", "64", "128"])
    assert "unrecognized arguments: 128" in capsys.readouterr().err
    args = build_parser("bench").parse_args(["bench", "model", "--window", "64", "128"])
    assert flag_values(args, bench.ModelBenchConfig) == {"window": (64, 128)}


@pytest.mark.parametrize(
    "argv, table, expected",
    [
        (["setup"], '[setup]\nmodel = ["m1", "m2"]\ncorpus = ["c1"]\nforce = true\n',
         [("model", "m1", True), ("model", "m2", True), ("corpus", "c1", True)]),
        (["data", "prepare", "c2"], "[data.prepare]\nforce = true\n", [("corpus", "c2", True)]),
        (["models", "prepare", "m3"], '[models.prepare]\nforce = true\n', [("model", "m3", True)]),
        (["setup", "--no-force"], "[setup]\nforce = true\n",
         [("model", "smollm2-135m", False), ("corpus", "austen", False)]),
    ],
)  # fmt: skip
def test_the_asset_commands_read_config(tmp_path, monkeypatch, argv, table, expected):
    calls = []

    def prepare(kind):
        def run(name, force=False):
            calls.append((kind, name, force))
            return tmp_path

        return run

    for module in ("setup", "data", "models"):
        for kind in ("model", "corpus"):
            if hasattr(cli_module(module), f"prepare_{kind}"):
                monkeypatch.setattr(cli_module(module), f"prepare_{kind}", prepare(kind))
    # the commands import the model's preparation (torch) when they run
    monkeypatch.setattr("focus_attention.assets.models.prepare_model", prepare("model"))
    path = tmp_path / "assets.toml"
    path.write_text(table)
    assert main([*argv, "--config", str(path)]) == 0
    assert calls == expected


def cli_module(name: str):
    import importlib

    return importlib.import_module(f"focus_attention.cli.{name}")


def test_errors_name_the_flag_as_typed_and_a_config_key_as_written(tmp_path, capsys):
    """A bad value on the command line is named by its flag (and the flag its bound depends
    on); the same value from the --config table keeps the table's key."""
    assert main(["inspect", "--adapter", "a", "--out", "o", "--seq-len", "64", "--max-tokens", "32"]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err == "focus: error: --max-tokens: received 32, expected at least --seq-len=64"
    config = tmp_path / "settings.toml"
    config.write_text("[inspect]\nmax_tokens = 32\nseq_len = 64\n")
    assert main(["inspect", "--adapter", "a", "--out", "o", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"{config}: InspectConfig.max_tokens: received 32, expected at least seq_len=64" in err
    assert main(["inspect", "--adapter", "a", "--out", "o", "--config", str(config), "--max-tokens", "48"]) == 1  # fmt: skip
    assert "--max-tokens: received 48, expected at least seq_len=64" in capsys.readouterr().err
