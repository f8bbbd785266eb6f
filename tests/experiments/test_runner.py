"""``focus sweep --study`` (focus_attention.experiments.runner) on the tiny model: a two-step
study (two evaluations of a tiny adapter) and its report run and record their settings; a
rerun skips both; a changed setting or another runs folder reruns only its step; a missing
runs folder stops the run before the step, naming it; a result without a settings record is
kept until ``--rerun`` names it; an interrupted run resumes at the step that did not finish;
the report is rebuilt from the results alone; a dry run runs nothing and says why each step
would run; ``--study`` refuses the flags of ``--grid``; a step runs in a subprocess of the
same interpreter; an interrupted training step resumes from its newest checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from focus_attention.cli import build_parser, main
from focus_attention.evaluation.perplexity import markdown_table
from focus_attention.experiments import StudyConfig, load_study, run_study, step_status
from focus_attention.experiments.runner import STARTED_NAME, resumed, step_plan

#: the runs use the portable backends (no kernel build), which say so in a warning
pytestmark = pytest.mark.filterwarnings("ignore:.*fused CPU kernel unavailable:RuntimeWarning")

STUDY = """
[study]
title = "Tiny study"
question = "Does the tiny adapter keep its perplexity at 16 tokens?"

[[steps]]
name = "eval-32"
command = "eval"
[steps.settings]
model = "{model}"
corpus = "{corpus}"
adapter = "{runs}/adapter"
seq_len = 32
max_tokens = 64
top_k = [1, 2]
soft = false
threads = 1
progress = false
json = "{{results}}/eval-32.json"

[[steps]]
name = "eval-16"
command = "eval"
[steps.settings]
model = "{model}"
corpus = "{corpus}"
adapter = "{runs}/adapter"
seq_len = 16
max_tokens = 64
top_k = [1]
soft = false
threads = 1
progress = false
json = "{{results}}/eval-16.json"

[[steps]]
name = "report"
command = "report"
"""


class Counting:
    """``focus_attention.cli.main`` that records the command lines it runs and can stop
    (KeyboardInterrupt, as Ctrl-C would) at a step."""

    def __init__(self, stop_at: str | None = None):
        self.argvs: list[list[str]] = []
        self.stop_at = stop_at

    def __call__(self, argv: list[str]) -> int:
        if self.stop_at is not None and any(a.endswith(self.stop_at) for a in argv):
            raise KeyboardInterrupt
        self.argvs.append(argv)
        return main(argv)


def _make_study(root: Path, assets: dict, adapter: Path) -> tuple[Path, Path]:
    """A study directory with STUDY and a runs directory holding the tiny adapter."""
    runs = root / "runs"
    shutil.copytree(adapter, runs / "adapter")
    study = root / "tiny"
    study.mkdir()
    text = STUDY.replace("{runs}", "{{runs}}")
    (study / "config.toml").write_text(text.format(model=assets["model"], corpus=assets["corpus"]))
    return study, runs


def _run(study: Path, runs: Path, main_fn=main, **kw) -> dict[str, str]:
    cfg = StudyConfig(study=str(study), runs=str(runs), isolate=False, **kw)
    return run_study(cfg, build_parser(), main_fn)


def _result(study: Path, name: str) -> dict:
    return json.loads((study / "results" / f"eval-{name}.json").read_text())


def _copy_of(study: Path, tmp_path: Path, assets: dict, monkeypatch) -> Path:
    """A copy of the finished ``study`` to change, with the tiny assets' environment set."""
    monkeypatch.setenv("FOCUS_HOME", str(assets["home"]))
    monkeypatch.setenv("FOCUS_NO_EXTENSION", "1")
    copy = tmp_path / "tiny"
    shutil.copytree(study, copy)
    return copy


@pytest.fixture(scope="module")
def finished(module_assets, adapter, tmp_path_factory):
    """The tiny study run once to the end."""
    study, runs = _make_study(tmp_path_factory.mktemp("study"), module_assets, adapter)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOCUS_HOME", str(module_assets["home"]))
        mp.setenv("FOCUS_NO_EXTENSION", "1")
        counting = Counting()
        plan = _run(study, runs, counting)
    return study, runs, plan, counting


def test_a_two_step_study_runs_and_records_its_settings(finished):
    study, runs, plan, counting = finished
    assert plan == {"eval-32": "run", "eval-16": "run", "report": "always"}
    assert [a[a.index("--seq-len") + 1] for a in counting.argvs] == ["32", "16"]
    for name, seq_len in (("32", 32), ("16", 16)):
        result = _result(study, name)
        assert result["config"]["seq_len"] == seq_len  # the command's own result
        record = result["experiment"]
        assert record["study"] == "tiny" and record["step"] == f"eval-{name}"
        assert record["command"] == "eval" and record["settings"]["seq_len"] == seq_len
        assert record["settings"]["adapter"] == "{runs}/adapter"  # as written in config.toml
        assert record["runs"] == str(runs.resolve())  # what {runs} was
        assert record["argv"][record["argv"].index("--adapter") + 1] == str(runs / "adapter")
        assert record["versions"]["torch"] and record["environment"]["cpu_count"] >= 1
        assert "git_commit" in record["environment"]
    report = (study / "results" / "report.md").read_text()
    assert report.startswith("# Tiny study\n\nDoes the tiny adapter keep")
    assert "## eval-32: `focus eval`" in report and "## eval-16: `focus eval`" in report
    assert markdown_table(_result(study, "16")) in report


def test_a_rerun_skips_the_recorded_steps(finished, module_assets, monkeypatch):
    study, runs, _, _ = finished
    monkeypatch.setenv("FOCUS_HOME", str(module_assets["home"]))
    before = {n: (study / "results" / f"eval-{n}.json").read_text() for n in ("32", "16")}
    counting = Counting()
    assert _run(study, runs, counting) == {"eval-32": "done", "eval-16": "done", "report": "always"}
    assert counting.argvs == []
    assert {n: (study / "results" / f"eval-{n}.json").read_text() for n in before} == before


def test_a_changed_setting_reruns_only_its_step(finished, module_assets, tmp_path, monkeypatch):
    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    config = copy / "config.toml"
    config.write_text(config.read_text().replace("max_tokens = 64\ntop_k = [1]",
                                                 "max_tokens = 48\ntop_k = [1]"))  # fmt: skip
    counting = Counting()
    assert _run(copy, runs, counting) == {"eval-32": "done", "eval-16": "rerun", "report": "always"}
    assert len(counting.argvs) == 1 and counting.argvs[0][counting.argvs[0].index("--max-tokens") + 1] == "48"  # fmt: skip
    assert _result(copy, "16")["experiment"]["settings"]["max_tokens"] == 48
    assert _result(copy, "16")["config"]["max_tokens"] == 48
    assert _result(copy, "32") == _result(study, "32")  # untouched


def test_an_interrupted_run_resumes_at_the_unfinished_step(module_assets, adapter, tmp_path,
                                                           monkeypatch):  # fmt: skip
    monkeypatch.setenv("FOCUS_HOME", str(module_assets["home"]))
    monkeypatch.setenv("FOCUS_NO_EXTENSION", "1")
    study, runs = _make_study(tmp_path, module_assets, adapter)
    with pytest.raises(KeyboardInterrupt):
        _run(study, runs, Counting(stop_at="eval-16.json"))
    assert (study / "results" / "eval-32.json").is_file()
    assert not (study / "results" / "eval-16.json").exists()
    assert not (study / "results" / "report.md").exists()
    counting = Counting()
    assert _run(study, runs, counting) == {"eval-32": "done", "eval-16": "run", "report": "always"}
    assert [a[a.index("--seq-len") + 1] for a in counting.argvs] == ["16"]
    assert "## eval-16: `focus eval`" in (study / "results" / "report.md").read_text()


def test_the_report_is_rebuilt_from_the_results_alone(finished, tmp_path):
    """Without the adapter, the models or the runs directory, and with a result measured
    before the runner (no experiment record), the report step rebuilds the tables."""
    study, _, _, _ = finished
    copy = tmp_path / "tiny"
    shutil.copytree(study, copy)
    (copy / "results" / "report.md").unlink()
    legacy = _result(copy, "16")
    del legacy["experiment"]
    (copy / "results" / "eval-16.json").write_text(json.dumps(legacy))

    def refuse(argv):
        raise AssertionError(f"the report ran a command: {argv}")

    plan = _run(copy, tmp_path / "no-runs", refuse, only=("report",))
    assert plan == {"report": "always"}
    report = (copy / "results" / "report.md").read_text()
    assert markdown_table(_result(copy, "32")) in report and markdown_table(legacy) in report
    assert report.count("carries no `experiment` record") == 1  # eval-16, marked as such
    loaded = load_study(copy)
    assert step_status(loaded, loaded.step("eval-16"), str(tmp_path)) == "kept"


def test_a_dry_run_checks_and_runs_nothing(module_assets, adapter, tmp_path, capsys):
    study, runs = _make_study(tmp_path, module_assets, adapter)
    assert main(["sweep", "--study", str(study), "--runs", str(runs), "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "eval-32: run\neval-16: run\nreport: always" in captured.out
    assert "tiny: eval-32 (eval): would run" in captured.err
    assert not (study / "results").exists()
    (study / "config.toml").write_text(
        (study / "config.toml").read_text() + "[steps.settings]\nwindow = 0\n"
    )
    assert main(["sweep", "--study", str(study), "--dry-run"]) == 1
    assert "step report (report): unknown settings ['window']" in capsys.readouterr().err


def test_cli_refuses_a_grid_and_a_study_together(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--grid", "g.toml", "--study", str(tmp_path)])
    assert "argument --study: not allowed with argument --grid" in capsys.readouterr().err


def test_another_runs_folder_reruns_the_step(finished, module_assets, tmp_path, monkeypatch,
                                             capsys):  # fmt: skip
    """A result made from the adapters of one runs folder is not done for another: the
    settings are compared with {runs} filled in; the same folder under another spelling
    (relative, through a symbolic link) is the same."""
    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    other = tmp_path / "other-runs"
    shutil.copytree(runs, other)
    (tmp_path / "link").symlink_to(runs)
    loaded = load_study(copy)
    step = loaded.step("eval-16")
    assert step_plan(loaded, step, str(tmp_path / "link")) == ("done", "recorded with these settings")  # fmt: skip
    monkeypatch.chdir(runs.parent)
    assert step_status(loaded, step, "runs") == "done"
    status, why = step_plan(loaded, step, str(other))
    assert status == "rerun"
    assert why == f"settings changed: adapter (runs folder {runs.resolve()} -> {other.resolve()})"
    counting = Counting()
    assert _run(copy, other, counting, only=("eval-16",)) == {"eval-16": "rerun"}
    assert counting.argvs[0][counting.argvs[0].index("--adapter") + 1] == str(other / "adapter")
    assert _result(copy, "16")["experiment"]["runs"] == str(other.resolve())
    assert (
        "eval-16 (eval): rerun: settings changed: adapter (runs folder" in capsys.readouterr().err
    )
    assert step_status(loaded, step, str(runs)) == "rerun"  # and back
    _run(copy, runs, Counting(), only=("report",))  # the report says which adapters it read
    report = (copy / "results" / "report.md").read_text()
    assert report.count(f"other settings than config.toml now: adapter (runs folder {other.resolve()} -> {runs.resolve()})") == 1  # fmt: skip


def test_a_missing_runs_folder_stops_the_run_before_the_step(finished, module_assets, tmp_path,
                                                             monkeypatch):  # fmt: skip
    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    nowhere = tmp_path / "nowhere"
    assert _run(copy, nowhere, Counting(), dry_run=True) == {
        "eval-32": "rerun", "eval-16": "rerun", "report": "always"}  # fmt: skip
    counting = Counting()
    with pytest.raises(FileNotFoundError, match=(
            rf"tiny: step eval-32 needs adapter {nowhere}/adapter, not found under the runs "
            rf"folder --runs {nowhere} \(that folder does not exist\): give --runs")):  # fmt: skip
        _run(copy, nowhere, counting)
    assert counting.argvs == [] and _result(copy, "32") == _result(study, "32")
    nowhere.mkdir()
    with pytest.raises(FileNotFoundError, match=r"needs adapter .*/adapter, not found .*nowhere: "):
        _run(copy, nowhere, counting)


def _unrecorded(copy: Path, name: str) -> str:
    """Remove the experiment record of result ``name``; returns the file's text."""
    data = _result(copy, name)
    del data["experiment"]
    (copy / "results" / f"eval-{name}.json").write_text(json.dumps(data))
    return (copy / "results" / f"eval-{name}.json").read_text()


def test_a_result_without_a_record_is_kept_until_rerun_names_it(finished, module_assets, tmp_path,
                                                                monkeypatch, capsys):  # fmt: skip
    """A result without the settings record (measured before the runner) is never
    overwritten by a plain run, also with other settings in config.toml; --rerun recomputes
    it and records it."""
    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    text = _unrecorded(copy, "16")
    config = copy / "config.toml"
    config.write_text(config.read_text().replace("max_tokens = 64\ntop_k = [1]",
                                                 "max_tokens = 48\ntop_k = [1]"))  # fmt: skip
    counting = Counting()
    assert _run(copy, runs, counting) == {"eval-32": "done", "eval-16": "kept", "report": "always"}
    assert counting.argvs == [] and (copy / "results" / "eval-16.json").read_text() == text
    assert ("tiny: eval-16 (eval): kept: result has no settings record; --rerun eval-16 to "
            "recompute it") in capsys.readouterr().err  # fmt: skip
    assert _run(copy, runs, counting, rerun=("eval-16",)) == {
        "eval-32": "done", "eval-16": "rerun", "report": "always"}  # fmt: skip
    assert len(counting.argvs) == 1 and _result(copy, "16")["experiment"]["settings"]["max_tokens"] == 48  # fmt: skip
    assert "eval-16 (eval): rerun: forced by --rerun" in capsys.readouterr().err
    assert _run(copy, runs, counting, rerun=("eval-32",), dry_run=True)["eval-32"] == "rerun"


def test_a_record_without_the_runs_folder_is_kept(finished, module_assets, tmp_path, monkeypatch):
    """A record made before results recorded the runs folder cannot tell which adapters its
    {runs} settings read: kept, not rerun."""
    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    data = _result(copy, "32")
    del data["experiment"]["runs"]
    (copy / "results" / "eval-32.json").write_text(json.dumps(data))
    loaded = load_study(copy)
    status, why = step_plan(loaded, loaded.step("eval-32"), str(runs))
    assert (status, why) == ("kept", "result records no runs folder for its {runs} settings; "
                                     "--rerun eval-32 to recompute it")  # fmt: skip


def test_a_dry_run_says_why_each_step_would_run(finished, module_assets, tmp_path, monkeypatch,
                                                capsys):  # fmt: skip
    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    config = copy / "config.toml"
    config.write_text(config.read_text().replace("seq_len = 16\nmax_tokens = 64",
                                                 "seq_len = 8\nmax_tokens = 48"))  # fmt: skip
    (copy / "results" / "eval-32.json").unlink()
    assert main(["sweep", "--study", str(copy), "--runs", str(runs), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert f"tiny: eval-32 (eval): would run: no result yet ({copy}/results/eval-32.json)" in err
    assert "tiny: eval-16 (eval): would rerun: settings changed: seq_len, max_tokens" in err
    assert "tiny: report (report): would run: rebuilt from the results on every run" in err
    assert main(["sweep", "--study", str(copy), "--runs", str(runs), "--dry-run", "--only",
                 "eval-16", "--rerun", "eval-32"]) == 1  # fmt: skip
    assert (
        "--rerun eval-32: not among the steps --only selects (eval-16)" in capsys.readouterr().err
    )
    assert main(["sweep", "--study", str(copy), "--dry-run", "--rerun", "eval-8"]) == 1
    assert "no step 'eval-8'; the steps are" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--out", "x"], "--out: for --grid only; a study writes its results where"),
        (["--jobs", "2", "--no-progress"], "--jobs, --progress: for --grid only"),
    ],
)
def test_a_study_refuses_the_flags_of_a_grid(tmp_path, capsys, argv, message):
    assert main(["sweep", "--study", str(tmp_path), *argv]) == 1
    assert f"focus: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sub,what", [("nowhere", "no such directory"), ("", "no config.toml in it")]
)
def test_a_missing_study_is_named_with_its_flag(tmp_path, capsys, sub, what):
    assert main(["sweep", "--study", str(tmp_path / sub)]) == 1
    assert f"focus: error: --study {tmp_path / sub}: {what}; expected a study directory" in (
        capsys.readouterr().err)  # fmt: skip


@pytest.mark.slow
def test_a_step_runs_in_a_subprocess(finished, module_assets, tmp_path, monkeypatch):
    """--isolate (the default): the step runs as ``python -m focus_attention.cli`` of this
    interpreter and gives the result of the in-process run."""
    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    (copy / "results" / "eval-16.json").unlink()
    plan = run_study(StudyConfig(study=str(copy), runs=str(runs), only=("eval-16",)),
                     build_parser(), Counting(stop_at=""))  # fmt: skip
    assert plan == {"eval-16": "run"}
    assert _result(copy, "16")["ppl"] == _result(study, "16")["ppl"]


def test_a_step_with_variables_runs_in_a_process_that_has_them(finished, module_assets, tmp_path, monkeypatch):  # fmt: skip
    """``[steps.variables]``: the step runs in a subprocess with them, also under
    --no-isolate (the in-process runner is never called); the result records them, a rerun
    skips the step, and another value reruns it."""
    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    config = copy / "config.toml"
    text = config.read_text()
    marked = text.replace('json = "{results}/eval-16.json"',
                          'json = "{results}/eval-16.json"\n[steps.variables]\nFOCUS_TEST_MARK = "7"')  # fmt: skip
    assert marked != text
    config.write_text(marked)
    assert _run(copy, runs, Counting(stop_at=""), only=("eval-16",)) == {"eval-16": "rerun"}
    result = _result(copy, "16")
    assert result["experiment"]["variables"] == {"FOCUS_TEST_MARK": "7"}
    assert result["environment"]["focus_variables"]["FOCUS_TEST_MARK"] == "7"
    assert _run(copy, runs, Counting(stop_at=""), only=("eval-16",)) == {"eval-16": "done"}
    config.write_text(marked.replace('FOCUS_TEST_MARK = "7"', 'FOCUS_TEST_MARK = "8"'))
    assert _run(copy, runs, Counting(stop_at=""), only=("eval-16",), dry_run=True) == {"eval-16": "rerun"}  # fmt: skip


#: a study that trains the tiny adapter (tests/tiny_assets.py tiny_config: K = 4, top_k 2,
#: window 8, 1 sink token), 4 steps with a checkpoint after each
TRAIN_STUDY = """
[study]
title = "Tiny training"

[[steps]]
name = "train"
command = "train"
result = "{{runs}}/tiny/train_result.json"
[steps.settings]
model = "{model}"
corpus = "{corpus}"
out = "{{runs}}/tiny"
steps = 4
seq_len = 32
batch_size = 2
lr = 1e-2
warmup_steps = 1
eval_every = -1
save_every = 1
num_groups = 4
top_k = 2
window = 8
group_dim = 8
sink_tokens = 1
threads = 1
progress = false
overwrite = true
"""


@pytest.mark.slow
def test_an_interrupted_training_step_resumes_from_its_checkpoint(module_assets, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    """A train step whose result is missing but whose out holds checkpoints runs with
    --resume instead of --overwrite, and its result records the settings of config.toml."""
    monkeypatch.setenv("FOCUS_HOME", str(module_assets["home"]))
    monkeypatch.setenv("FOCUS_NO_EXTENSION", "1")
    study = tmp_path / "train"
    study.mkdir()
    text = TRAIN_STUDY.format(model=module_assets["model"], corpus=module_assets["corpus"])
    (study / "config.toml").write_text(text)
    runs = tmp_path / "runs"
    first = Counting()
    assert _run(study, runs, first) == {"train": "run"}
    assert "--overwrite" in first.argvs[0] and "--resume" not in first.argvs[0]
    done = json.loads((runs / "tiny" / "train_result.json").read_text())
    assert (runs / "tiny" / "checkpoints").is_dir()
    # as if stopped during the last step: its checkpoint and the result are not written
    shutil.rmtree(sorted((runs / "tiny" / "checkpoints").iterdir())[-1])
    (runs / "tiny" / "train_result.json").unlink()
    loaded = load_study(study)
    step = loaded.step("train")
    assert resumed(loaded, step, str(runs)).settings["resume"] is True
    assert "overwrite" not in resumed(loaded, step, str(runs)).settings
    again = Counting()
    assert _run(study, runs, again) == {"train": "run"}
    assert "--resume" in again.argvs[0] and "--overwrite" not in again.argvs[0]
    result = json.loads((runs / "tiny" / "train_result.json").read_text())
    assert result["experiment"]["settings"] == step.settings  # recorded as written
    assert result["start_step"] == 3 and result["steps"] == done["steps"] == 4
    assert result["final_loss"] == pytest.approx(done["final_loss"], rel=1e-6)
    assert _run(study, runs, Counting()) == {"train": "done"}


def _ctrl_c_at(stop: int):
    """A step hook that sends a real SIGINT (as from the terminal) after step ``stop``."""

    def hook(step, entry):
        if step == stop:
            os.kill(os.getpid(), signal.SIGINT)

    return hook


def _train_study(tmp_path: Path, assets: dict, monkeypatch) -> tuple[Path, Path]:
    monkeypatch.setenv("FOCUS_HOME", str(assets["home"]))
    monkeypatch.setenv("FOCUS_NO_EXTENSION", "1")
    study = tmp_path / "train"
    study.mkdir()
    text = TRAIN_STUDY.format(model=assets["model"], corpus=assets["corpus"])
    (study / "config.toml").write_text(text)
    return study, tmp_path / "runs"


def test_an_interrupted_training_step_resumes_and_is_never_kept(module_assets, tmp_path, monkeypatch, capsys):  # fmt: skip
    """Ctrl-C stops the training step after step 2 (focus train writes its interrupted
    output, the runner records nothing): the rerun and its dry run say it resumes, it
    continues from its checkpoint with --resume, and its result is the finished run's."""
    import focus_attention.training as training

    study, runs = _train_study(tmp_path, module_assets, monkeypatch)
    real = training.train
    with monkeypatch.context() as m:
        m.setattr(training, "train", lambda config, **kw: real(config, callback=_ctrl_c_at(2)))
        with pytest.raises(RuntimeError, match="exited with status 130"):
            _run(study, runs, Counting())
    stopped = json.loads((runs / "tiny" / "train_result.json").read_text())
    assert stopped["extra"]["interrupted"] and stopped["steps"] == 2 and "experiment" not in stopped
    loaded = load_study(study)
    status, why = step_plan(loaded, loaded.step("train"), str(runs))
    assert status == "resume"
    assert why == ("its result records a training interrupted at step 2 of 4; it continues "
                   "from its newest checkpoint")  # fmt: skip
    capsys.readouterr()
    assert _run(study, runs, Counting(), dry_run=True) == {"train": "resume"}
    assert f"train (train): would resume: {why}" in capsys.readouterr().err
    again = Counting()
    assert _run(study, runs, again) == {"train": "resume"}
    assert "--resume" in again.argvs[0] and "--overwrite" not in again.argvs[0]
    result = json.loads((runs / "tiny" / "train_result.json").read_text())
    assert result["steps"] == 4 and result["start_step"] == 2
    assert result["extra"]["interrupted"] is False and "experiment" in result
    assert _run(study, runs, Counting()) == {"train": "done"}
    assert json.loads((study / "results" / STARTED_NAME).read_text()) == {}


def test_a_step_that_failed_after_writing_its_result_runs_again(finished, module_assets, tmp_path, monkeypatch, capsys):  # fmt: skip
    """A step whose command wrote its result and then failed (or whose runner was killed
    before it recorded the result) is not kept: it runs again."""
    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    (copy / "results" / "eval-16.json").unlink()

    def fails_after_writing(argv):
        main(argv)
        return 1

    with pytest.raises(RuntimeError, match="exited with status 1"):
        _run(copy, runs, fails_after_writing)
    assert "experiment" not in _result(copy, "16")  # written by focus eval, not recorded
    loaded = load_study(copy)
    assert step_plan(loaded, loaded.step("eval-16"), str(runs)) == (
        "resume",
        "its last run stopped before its result was recorded; it runs again",
    )
    counting = Counting()
    assert _run(copy, runs, counting) == {"eval-32": "done", "eval-16": "resume", "report": "always"}  # fmt: skip
    assert len(counting.argvs) == 1 and "experiment" in _result(copy, "16")
    assert _run(copy, runs, Counting())["eval-16"] == "done"


@pytest.mark.parametrize(
    "unfinished, why",
    [({"complete": False}, "its result is incomplete (its run stopped before the last cell)"),
     ({"extra": {"interrupted": True}, "steps": 3, "config": {"steps": 9}},
      "its result records a training interrupted at step 3 of 9")],
)  # fmt: skip
def test_a_result_that_records_an_unfinished_run_is_never_kept_or_done(finished, module_assets, tmp_path, monkeypatch, unfinished, why):  # fmt: skip
    """Whether the result has no settings record (kept otherwise) or records these settings
    (done otherwise), an unfinished one runs again."""
    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    loaded = load_study(copy)
    recorded = _result(copy, "32")
    for data in ({**recorded, **unfinished}, {k: v for k, v in {**recorded, **unfinished}.items() if k != "experiment"}):  # fmt: skip
        (copy / "results" / "eval-32.json").write_text(json.dumps(data))
        assert step_plan(loaded, loaded.step("eval-32"), str(runs)) == ("resume", why + "; it runs again")  # fmt: skip


@pytest.mark.parametrize("result, status, why", [
    ({"steps": 13, "config": {"steps": 30}, "trainable_parameters": 576, "train_seconds": 1.0,
      "extra": {}}, "resume",
     "its result is not a finished training (train_result.json records 13 steps, the run has 4; "
     "train_result.json: extra: no key 'interrupted' (an older release's result, or a damaged one)"),
    ({"steps": 4, "config": {"steps": 4}, "trainable_parameters": 576, "train_seconds": 1.0,
      "extra": {}}, "resume", "its result is not a finished training (train_result.json: extra: no key 'interrupted'"),  # fmt: skip
    ({"steps": 4, "config": {"steps": 4}, "trainable_parameters": 576, "train_seconds": 1.0,
      "extra": {"interrupted": False}}, "kept", "result has no settings record"),
])  # fmt: skip
def test_an_older_releases_training_result_is_resumed_not_kept(tmp_path, monkeypatch, module_assets, result, status, why):  # fmt: skip
    """A train step's result without a settings record is kept only when it says it
    finished every step of the step's settings; an older release's (no interrupted flag,
    13 of 30 steps) resumes, with --resume where its folder holds a checkpoint."""
    study, runs = _train_study(tmp_path, module_assets, monkeypatch)
    out = runs / "tiny"
    checkpoint = out / "checkpoints" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (checkpoint / "focus_run.json").write_text(json.dumps({"world_size": 1}))
    (out / "train_result.json").write_text(json.dumps(result))
    loaded = load_study(study)
    step = loaded.step("train")
    got = step_plan(loaded, step, str(runs))
    assert got[0] == status and got[1].startswith(why), got
    assert ("resume" in resumed(loaded, step, str(runs)).settings) == (status == "resume")


@pytest.mark.parametrize("text, why", [
    ('{"ppl": {', "not valid JSON"),
    ("", "empty file"),
])  # fmt: skip
def test_a_damaged_result_runs_again_naming_the_file(finished, module_assets, tmp_path, monkeypatch, text, why):  # fmt: skip
    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    path = copy / "results" / "eval-32.json"
    path.write_text(text)
    loaded = load_study(copy)
    status, reason = step_plan(loaded, loaded.step("eval-32"), str(runs))
    assert status == "rerun"
    assert reason.startswith(f"{path}: {why}") and reason.endswith(
        "expected the JSON result of step 'eval-32': it runs again"
    )


HOLD = """
import sys, time
from focus_attention.utils.io import exclusive_lock
with exclusive_lock(sys.argv[1], "focus sweep --study " + sys.argv[2]):
    print("held", flush=True)
    time.sleep(300)
"""


def _held(lock: Path, what: str):
    """A process that holds ``lock`` until killed."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), what], stdout=subprocess.PIPE,
                              text=True, env=env)  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_run_of_a_study_in_progress_refuses_naming_the_first(finished, module_assets, tmp_path, monkeypatch, capsys):  # fmt: skip
    from focus_attention.utils.io import FolderInUseError

    study, runs, _, _ = finished
    copy = _copy_of(study, tmp_path, module_assets, monkeypatch)
    (copy / "results" / "eval-16.json").unlink()
    first = _held(copy / "results" / ".focus-sweep.lock", str(copy))
    try:
        with pytest.raises(FolderInUseError) as err:
            _run(copy, runs, Counting())
        assert str(err.value).startswith(f"{copy / 'results'} is in use by process {first.pid} on ")  # fmt: skip
        assert f"(focus sweep --study {copy}, since " in str(err.value)
        assert not (copy / "results" / "eval-16.json").exists()
        capsys.readouterr()
        argv = ["sweep", "--study", str(copy), "--runs", str(runs), "--no-isolate"]
        assert main(argv) == 1
        assert capsys.readouterr().err.startswith(f"focus: error: {copy / 'results'} is in use")
        assert (
            _run(copy, runs, Counting(), dry_run=True)["eval-16"] == "run"
        )  # a dry run reads only
    finally:
        first.kill()
        first.wait()
    assert _run(copy, runs, Counting())["eval-16"] == "run"
    assert not (copy / "results" / ".focus-sweep.lock").exists()
