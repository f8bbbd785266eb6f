"""Study files (focus_attention.experiments.study): the form of config.toml, the command
line of a step, clear errors for bad studies, and a data check of every shipped study under
experiments/: it parses, and names only known commands and known settings (checked with the
focus parser, nothing runs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from focus_attention.cli import build_parser
from focus_attention.experiments import check_study, load_study, step_argv

ROOT = Path(__file__).resolve().parents[2]
STUDIES = sorted(p.parent for p in (ROOT / "experiments").glob("*/config.toml"))
#: the studies the project agreed on; each holds config.toml, README.md and results/
EXPECTED = {"main-job", "kernel", "prefill", "decode", "needle", "dense-layers", "dense-heads",
            "long-input-recipe", "query-top-k", "other-k", "quality", "groups", "ablations",
            "zero-shot", "retention", "pretrain", "soft-leak", "serve", "ruler",
            "routing-diagnostic"}  # fmt: skip

HEAD = '[study]\ntitle = "t"\n'


def _study(tmp_path: Path, text: str) -> Path:
    (tmp_path / "config.toml").write_text(text)
    return tmp_path


def test_every_agreed_study_exists_with_its_files():
    assert {p.name for p in STUDIES} == EXPECTED
    for study in STUDIES:
        assert (study / "README.md").is_file(), study
        assert (study / "results").is_dir(), study


@pytest.mark.parametrize("study", STUDIES, ids=[p.name for p in STUDIES])
def test_shipped_studies_name_known_commands_and_settings(study):
    loaded = load_study(study)
    check_study(loaded, build_parser())  # every step's command line parses, scripts exist
    assert loaded.title and loaded.steps
    for step in loaded.steps:
        if step.result is not None:  # results of the study live in its results/ or in runs/
            assert step.result.startswith(("{results}/", "{runs}/")), (step.name, step.result)


def test_a_step_becomes_its_command_line(tmp_path):
    study = load_study(
        _study(
            tmp_path,
            HEAD
            + """
[[steps]]
name = "needle"
command = "bench needle"
[steps.settings]
adapter = "{runs}/austen-4k"
lengths = [2048, 4096]
top_k_values = "1,2"
dense = false
progress = true
json = "{results}/needle.json"
""",
        )
    )
    (step,) = study.steps
    assert step.result == "{results}/needle.json"  # the json setting, placeholders kept
    assert step_argv(step, study.paths("R")) == [
        "bench", "needle", "--adapter", "R/austen-4k", "--lengths", "2048", "4096",
        "--top-k-values", "1,2", "--no-dense", "--progress", "--json",
        str(tmp_path / "results" / "needle.json")]  # fmt: skip


@pytest.mark.parametrize(
    "text,match",
    [
        ("", r"\[study\] needs a title"),
        (HEAD, r"no \[\[steps\]\] tables"),
        (HEAD + "[other]\n", r"unknown tables \['other'\]"),
        (HEAD + '[[steps]]\nname = "a b"\ncommand = "eval"\n', r"name 'a b' is not a file name"),
        (HEAD + '[[steps]]\nname = "a"\n', r"command None: expected a focus sub-command"),
        (HEAD + '[[steps]]\nname = "a"\ncommand = "eval"\n[[steps]]\nname = "a"\n'
         'command = "eval"\n', "two steps are named 'a'"),
        (HEAD + '[[steps]]\nname = "a"\ncommand = "eval"\nresult = "x.md"\n',
         "result 'x.md': expected the path of a JSON file"),
        (HEAD + '[[steps]]\nname = "a"\ncommand = "eval"\nflags = 1\n', r"unknown keys \['flags'\]"),
        (HEAD + '[[steps]]\nname = "a"\ncommand = "eval"\nvariables = 1\n',
         "variables must be a table"),
        (HEAD + '[[steps]]\nname = "a"\ncommand = "eval"\n[steps.variables]\nX = 1\n',
         "variable X = 1: expected a name of letters, digits and '_' set to a string"),
        (HEAD + '[[steps]]\nname = "a"\ncommand = "eval"\n[steps.variables]\n"A-B" = "1"\n',
         "variable A-B"),
    ],
)  # fmt: skip
def test_bad_study_files_raise_clear_errors(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_study(_study(tmp_path, text))


@pytest.mark.parametrize(
    "step,match",
    [
        ('command = "evaluate"', "invalid choice: 'evaluate'"),
        ('command = "eval"\n[steps.settings]\nseq_lenn = 4', "unrecognized arguments: --seq-lenn 4"),
        ('command = "eval"\n[steps.settings]\nseq_len = "long"', "--seq-len: invalid int value"),
        ('command = "eval"\n[steps.settings]\nsplit = "dev"', "--split: invalid choice: 'dev'"),
        ('command = "eval"\n[steps.settings]\ntop_k_values = "1,2"',
         "--top-k-values is not a flag that `focus eval --help` lists"),
        ('command = "bench model"\n[steps.settings]\nwindows = [128]',
         "--windows is not a flag that `focus bench model --help` lists"),
        ('command = "eval"\n[steps.settings]\nlengths = []', "expected a non-empty list"),
        ('command = "report"\n[steps.settings]\ntables = 1', r"unknown settings \['tables'\]"),
        ('command = "script"\n[steps.settings]\npath = "none.py"', "none.py does not exist"),
    ],
)  # fmt: skip
def test_unknown_commands_and_settings_are_refused_before_anything_runs(tmp_path, step, match):
    study = load_study(_study(tmp_path, HEAD + f'[[steps]]\nname = "s"\n{step}\n'))
    with pytest.raises(ValueError, match=f"config.toml: step s .*{match}"):
        check_study(study, build_parser())


def test_a_missing_study_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere: no such directory; expected a study"):
        load_study(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.toml in it; expected a study"):
        load_study(tmp_path)


@pytest.mark.parametrize(
    "lines,where,name",
    [
        ('[steps.settings]\nadapter = "{nope}/x"', "setting adapter '{nope}/x'", "nope"),
        ('[steps.settings]\nargs = ["{runs}/a", "{result}/b"]', "setting args '{result}/b'",
         "result"),
        ('result = "{runs}/{step}.json"', "result '{runs}/{step}.json'", "step"),
    ],
)  # fmt: skip
def test_unknown_placeholders_are_refused_when_the_study_is_read(tmp_path, lines, where, name):
    text = HEAD + f'[[steps]]\nname = "s"\ncommand = "eval"\n{lines}\n'
    with pytest.raises(ValueError, match=(
            rf"config.toml \[\[steps\]\] #1 \(s\): {re.escape(where)}: unknown placeholder "
            rf"\{{{name}\}}; the placeholders are \{{study\}}, \{{results\}}, \{{runs\}}$")):  # fmt: skip
        load_study(_study(tmp_path, text))


@pytest.mark.parametrize("study", STUDIES, ids=[p.name for p in STUDIES])
def test_study_readmes_link_only_to_files_of_the_repository(study):
    """Every relative link and every ``results/...`` path a study's README names exists,
    inside the repository."""
    text = (study / "README.md").read_text()
    targets = [m.group(1) for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)]
    targets += re.findall(r"`((?:\.\./[a-z-]+/)?results/[^`\s*{}]+)`", text)
    assert targets  # at least config.toml
    for target in targets:
        if target.startswith(("http://", "https://")):
            continue
        path = (study / target).resolve()
        assert path.is_relative_to(ROOT), (study.name, target)
        assert path.exists(), (study.name, target)
