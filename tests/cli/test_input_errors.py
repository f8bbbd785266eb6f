"""Bad input on the command line of focus eval, inspect and calibrate: a one-line error that
names the flag and says what was expected, given before any work (the command that would
do the work is replaced by one that fails the test if reached)."""

from __future__ import annotations

import os

import pytest

from focus_attention.bench import settings as bench
from focus_attention.cli import build_parser, main
from focus_attention.cli.flags import flag_values
from focus_attention.evaluation.settings import EvalConfig
from focus_attention.utils.io import check_output_folder

#: the function each command runs, replaced in these tests
RUNNERS = {
    "eval": "focus_attention.evaluation.evaluate",
    "inspect": "focus_attention.evaluation.groups.inspect_groups",
    "calibrate": "focus_attention.evaluation.calibration.calibrate_adapter",
}


class Ran(Exception):
    """The command reached its work."""


def _no_work(monkeypatch) -> None:
    for target in RUNNERS.values():
        monkeypatch.setattr(target, lambda *a, **k: (_ for _ in ()).throw(Ran(a, k)))


def _error(capsys, argv: list[str]) -> str:
    """The one line ``focus: error: ...`` of a command that must fail (exit status 1)."""
    assert main(argv) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("focus: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _parse_error(capsys, argv: list[str]) -> str:
    """argparse's message for a flag it refuses (exit status 2)."""
    with pytest.raises(SystemExit) as stop:
        build_parser(argv[0]).parse_args(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_max_tokens_takes_a_count_of_at_least_one_or_all(capsys, value):
    err = _parse_error(capsys, ["eval", "--max-tokens", value])
    assert "argument --max-tokens: expected a number of tokens (an int >= 1) or 'all'" in err
    assert repr(value) in err
    for text, expected in [("all", None), ("ALL", None), ("none", None), ("7", 7)]:
        args = build_parser("eval").parse_args(["eval", "--max-tokens", text])
        assert flag_values(args, EvalConfig) == {"max_tokens": expected}


def test_a_parse_function_error_reads_as_its_own_message(capsys):
    err = _parse_error(capsys, ["eval", "--dense-heads", "abc"])
    assert err.endswith("argument --dense-heads: expected LAYER:HEAD pairs like 18:0,20:1, got 'abc'")  # fmt: skip
    assert "parse_layer_heads" not in err
    # a flag of another command, whose parser names its settings field: the field goes
    err = _parse_error(capsys, ["bench", "tasks", "--batch-size", "0"])
    assert err.endswith("argument --batch-size: received '0', expected an int >= 1 or 'auto'")
    assert "parse_batch_size" not in err and "TasksBenchConfig" not in err
    args = build_parser("bench").parse_args(["bench", "tasks", "--batch-size", "auto:4"])
    assert flag_values(args, bench.TasksBenchConfig) == {"batch_size": "auto:4"}
    assert "invalid int value: 'x'" in _parse_error(capsys, ["eval", "--seq-len", "x"])


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_eval_checks_its_output_files_before_any_work(tmp_path, monkeypatch, capsys, flag):
    _no_work(monkeypatch)
    (tmp_path / "afile").write_text("")
    bad = {str(tmp_path): "a directory", str(tmp_path / "afile" / "r.json"): "is a file"}
    if os.path.isdir("/proc"):
        bad["/proc/x.json"] = "no file can be created in '/proc'"
    for path, why in bad.items():
        err = _error(capsys, ["eval", "--adapter", "runs/austen", flag, path])
        assert err.startswith(f"focus: error: {flag}: received {path!r}") and why in err


@pytest.mark.parametrize("command", ["inspect", "calibrate"])
def test_out_must_be_a_folder_that_can_be_written(tmp_path, monkeypatch, capsys, command):
    _no_work(monkeypatch)
    (tmp_path / "afile").write_text("")
    bad = {str(tmp_path / "afile"): "which is not a folder", "/dev/null": "which is not a folder",
           str(tmp_path / "afile" / "sub"): "is a file, not a folder"}  # fmt: skip
    if os.path.isdir("/proc"):
        bad["/proc/xyz"] = "no file can be created in '/proc'"
    for path, why in bad.items():
        err = _error(capsys, [command, "--adapter", "runs/austen", "--out", path])
        assert err.startswith(f"focus: error: --out: received {path!r}"), err
        assert why in err and "expected a folder" in err
    with pytest.raises(Ran):  # a new folder, and its missing parents, are fine
        main([command, "--adapter", "runs/austen", "--out", str(tmp_path / "new" / "out")])
    assert not (tmp_path / "new").exists()


def test_check_output_folder_accepts_an_existing_or_new_folder(tmp_path):
    assert check_output_folder(tmp_path, "--out") == tmp_path
    assert check_output_folder(str(tmp_path / "a" / "b"), "--out") == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []  # the probe file is gone, nothing created


def test_calibrate_on_the_test_split_warns(monkeypatch, capsys, tmp_path):
    _no_work(monkeypatch)
    argv = ["calibrate", "--adapter", "runs/austen", "--out", str(tmp_path / "o")]
    with pytest.raises(Ran):
        main([*argv, "--split", "test"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["focus: warning: --split test: the test split is meant for evaluation; "
                   "calibrate on the validation split (the default) to keep it held out"]  # fmt: skip
    with pytest.raises(Ran):
        main(argv)
    assert capsys.readouterr().err == ""


def test_eval_without_adapter_takes_the_default_its_help_names(monkeypatch, capsys, tmp_path):
    _no_work(monkeypatch)
    with pytest.raises(Ran) as ran:
        main(["eval"])
    assert ran.value.args[0][0].adapter == "runs/austen"
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "(default runs/austen)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["inspect", "calibrate"])
def test_out_help_says_it_is_required(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--out OUT directory the results are written into (required)" in text
    assert "under runs/" not in text and "Focus adapter or of a focus train run of any --method (required)" in text  # fmt: skip
    assert "--out is required" in _error(capsys, [command, "--adapter", "runs/austen"])
    with pytest.raises(SystemExit):
        main(["train", "--help"])  # where the group's default holds, its help keeps it
    assert "folder under runs/" in " ".join(capsys.readouterr().out.split())


def test_ranking_length_is_refused_below_the_shortest_pass_key_prompt(tmp_path, monkeypatch, capsys):  # fmt: skip
    """--ranking-length below the needle prompts' least length is refused on its flag's
    setting, before any work and before --out exists; the least length itself is taken."""
    _no_work(monkeypatch)
    out = tmp_path / "out"
    argv = ["calibrate", "--adapter", "runs/austen", "--out", str(out), "--head-budget", "0.5"]
    err = _error(capsys, [*argv, "--ranking-length", "63"])
    assert err == "focus: error: --ranking-length: received 63, expected an int >= 64"  # fmt: skip
    assert not out.exists()
    with pytest.raises(Ran):
        main([*argv, "--ranking-length", "64"])
