"""The command line: flags generated from the settings dataclasses, settings files
(``--config``) layered under the flags, the settings files shipped in ``configs/``, and the
one error wrapper."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from focus_attention.cli import build_parser
from focus_attention.cli.common import run_guarded
from focus_attention.cli.flags import add_flags, flag_name, flag_values, read_config_table
from focus_attention.cli.train import FOCUS_FIELDS_NOT_FLAGS, config_from_args
from focus_attention.evaluation import EvalConfig
from focus_attention.evaluation.settings import InspectConfig
from focus_attention.hf import FocusConfig
from focus_attention.training import TrainConfig
from focus_attention.training.pretrain import PretrainConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        _parse([*argv, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "command, classes",
    [
        (["train"], [TrainConfig, FocusConfig]),
        (["eval"], [EvalConfig]),
        (["inspect"], [InspectConfig]),
    ],
)
def test_every_setting_with_help_is_a_flag_with_its_default(command, classes, capsys):
    text = _help(command, capsys)
    for cls in classes:
        for f in dataclasses.fields(cls):
            if "help" not in f.metadata or f.name in FOCUS_FIELDS_NOT_FLAGS and cls is FocusConfig:
                continue
            assert flag_name(f.name) in text, f.name
    assert "(default 512)" in text if command == ["train"] else "(default 1024)" in text


def test_train_flags_build_the_config_and_only_given_flags_count():
    args = _parse(["train", "--steps", "5", "--top-k", "1", "--no-progress", "--betas", "0.8,0.9"])
    assert flag_values(args, TrainConfig) == {"steps": 5, "progress": False, "betas": (0.8, 0.9)}
    cfg = config_from_args(args)
    assert cfg.steps == 5 and cfg.focus.top_k == 1 and cfg.betas == (0.8, 0.9)
    assert cfg.seq_len == TrainConfig().seq_len  # the dataclass default
    assert cfg.focus.window == FocusConfig().window


def test_settings_file_sits_between_defaults_and_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 7\nlr = 0.5\n[train.focus]\nwindow = 64\ntop_k = 1\n")
    cfg = config_from_args(_parse(["train", "--config", str(path), "--lr", "0.1"]))
    assert (cfg.steps, cfg.lr, cfg.focus.window, cfg.focus.top_k) == (7, 0.1, 64, 1)
    cfg = config_from_args(_parse(["train", "--config", str(path), "--window", "32"]))
    assert cfg.focus.window == 32 and cfg.lr == 0.5


@pytest.mark.parametrize(
    "text, match",
    [
        ("[train]\nbogus = 1\n", r"run.toml: TrainConfig: unknown keys \['bogus'\]"),
        ("[train]\nsteps = -1\n", "run.toml: TrainConfig.steps"),
        ("[train]\n[train.focus]\ntop_k = 99\n", "run.toml: .*top_k"),
        ("[eval]\nsplit = 'test'\n", r"no \[train\] table"),
        ("[train\n", "not a valid TOML"),
    ],
)
def test_bad_settings_files_are_clear_errors(tmp_path, capsys, text, match):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        config_from_args(_parse(["train", "--config", str(path)]))
    # through the command: one line on stderr, exit status 1
    args = _parse(["train", "--config", str(path)])
    assert args.func(args) == 1
    assert capsys.readouterr().err.startswith("focus: error: ")


def test_eval_adapter_comes_from_a_flag_the_file_or_its_default(tmp_path):
    from focus_attention.cli.flags import command_config

    assert command_config(_parse(["eval"]), EvalConfig, "eval").adapter == "runs/austen"
    path = tmp_path / "run.toml"
    path.write_text("[eval]\nadapter = 'runs/x'\n")
    args = _parse(["eval", "--config", str(path)])
    assert command_config(args, EvalConfig, "eval").adapter == "runs/x"
    args = _parse(["eval", "--config", str(path), "--adapter", "runs/y"])
    assert command_config(args, EvalConfig, "eval").adapter == "runs/y"


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: d / "none.toml", r"--config: .*none\.toml not found; expected a TOML settings "
         r"file \(its \[eval\] table is read\)"),
        (lambda d: d, r"--config: .* is a folder; expected a TOML settings file"),
        (lambda d: _write(d, "adapter = 'x'\nseq_len = 8\n"),
         r"has no \[eval\] table \(the file holds keys \['adapter', 'seq_len'\] and no table\)"),
        (lambda d: _write(d, "[train]\nsteps = 1\n[bench.kernel]\n"),
         r"has no \[eval\] table \(the file holds tables \['\[bench\]', '\[train\]'\]\)"),
        (lambda d: _write(d, "eval = 3\n"), r"has no \[eval\] table \(the file holds keys \['eval'\]"),
    ],
)  # fmt: skip
def test_a_bad_config_file_is_named_with_what_it_holds(tmp_path, capsys, make, match):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=match):
        read_config_table(str(path), "eval")
    args = _parse(["eval", "--config", str(path)])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("focus: error: --config: ") and len(err.splitlines()) == 1


def test_a_missing_sub_table_names_the_table_above(tmp_path):
    path = _write(tmp_path, "[bench.model]\nlengths = [8]\n")
    with pytest.raises(ValueError, match=r"no \[bench\.kernel\] table \(\[bench\] holds "
                       r"tables \['\[model\]'\]\)"):  # fmt: skip
        read_config_table(str(path), "bench.kernel")


def _write(directory: Path, text: str) -> Path:
    path = directory / "settings.toml"
    path.write_text(text)
    return path


def test_inspect_needs_an_adapter_and_an_output_directory(tmp_path, capsys):
    args = _parse(["inspect", "--out", str(tmp_path)])
    assert args.func(args) == 1
    assert "--adapter is required" in capsys.readouterr().err
    path = tmp_path / "run.toml"
    path.write_text("[inspect]\nadapter = 'runs/x'\nlayers = [3, 1]\n")
    args = _parse(["inspect", "--config", str(path)])
    assert args.func(args) == 1
    assert "--out is required" in capsys.readouterr().err
    args = _parse(["inspect", "--layers", "4", "2", "--max-tokens", "2048", "--no-baseline"])
    assert flag_values(args, InspectConfig) == {"layers": (4, 2), "max_tokens": 2048, "baseline": False}  # fmt: skip


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.toml")), ids=lambda p: p.name)
def test_shipped_settings_files_are_valid(path):
    found = 0
    tables = (("train", _train_from_table), ("eval", _eval_from_table),
              ("pretrain", PretrainConfig.from_dict))  # fmt: skip
    for table, build in tables:
        try:
            settings = read_config_table(str(path), table)
        except ValueError as err:
            assert "no [" in str(err)
            continue
        build(settings)
        found += 1
    assert found, f"{path} has no [train], [eval] or [pretrain] table"


def _train_from_table(settings: dict) -> None:
    TrainConfig.from_dict(settings)


def _eval_from_table(settings: dict) -> None:
    EvalConfig.from_dict({"adapter": "x", **settings})


def test_a_field_without_a_readable_type_is_refused():
    @dataclasses.dataclass
    class Odd:
        pairs: dict = dataclasses.field(default_factory=dict, metadata={"help": "no flag type"})

    with pytest.raises(TypeError, match="Odd.pairs"):
        add_flags(argparse.ArgumentParser(), Odd)


def test_run_guarded_turns_reported_errors_into_one_line(capsys):
    def fails(args):
        raise FileNotFoundError("no such adapter")

    assert run_guarded(fails)(argparse.Namespace()) == 1
    assert capsys.readouterr().err == "focus: error: no such adapter\n"

    def crashes(args):
        raise KeyError("a bug")

    with pytest.raises(KeyError):  # a bug keeps its traceback
        run_guarded(crashes)(argparse.Namespace())
