"""``focus sweep --grid`` (focus_attention.experiments.grid): grid expansion and slugs, errors for
bad grids, a 2-cell sweep end to end on the tiny model, skipping finished cells, resuming
an unfinished one, and parallel cells giving the results of serial ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from focus_attention.experiments import grid as sweep_mod
from focus_attention.experiments.grid import (
    SweepConfig,
    cell_slug,
    expand_grid,
    load_plan,
    run_sweep,
    sweep_points,
)

#: the cells run with FOCUS_NO_EXTENSION=1 (no kernel build), which says so in a warning
pytestmark = pytest.mark.filterwarnings("ignore:.*fused CPU kernel unavailable:RuntimeWarning")

#: the tiny model's settings (tests/tiny_assets.py tiny_config), 2 steps, no validation
TINY_GRID = """
[train]
model = "{model}"
corpus = "{corpus}"
steps = 2
seq_len = 32
batch_size = 2
lr = 1e-2
warmup_steps = 1
eval_every = -1
save_every = 1
threads = 1
progress = false

[train.focus]
num_groups = 4
top_k = 2
window = 8
group_dim = 8
sink_tokens = 1

[eval]
seq_len = 32
max_tokens = 64
top_k = [1, 2]
progress = false

[grid]
sinkhorn_iters = [0, 10]
"""


def test_grid_expands_to_the_cartesian_product_in_key_order():
    cells = expand_grid({"num_groups": [4, 8], "sinkhorn_iters": [0, 10], "gate": "log"})
    assert list(cells) == [
        "num_groups-4_sinkhorn_iters-0_gate-log",
        "num_groups-4_sinkhorn_iters-10_gate-log",
        "num_groups-8_sinkhorn_iters-0_gate-log",
        "num_groups-8_sinkhorn_iters-10_gate-log",
    ]
    assert cells["num_groups-8_sinkhorn_iters-0_gate-log"] == {
        "num_groups": 8, "sinkhorn_iters": 0, "gate": "log"}  # fmt: skip
    # explicit cells come after the product; a duplicate is dropped
    cells = expand_grid({"window": [64]}, [{"window": 32, "temperature": 0.05}, {"window": 64}])
    assert list(cells) == ["window-64", "window-32_temperature-0.05"]


@pytest.mark.parametrize(
    "settings,slug",
    [({}, "base"), ({"prepend_bos": True}, "prepend_bos-on"), ({"max_train_tokens": None},
     "max_train_tokens-none"), ({"betas": [0.9, 0.95]}, "betas-0.9+0.95"),
     ({"objective": "mix", "lr": 3e-2}, "objective-mix_lr-0.03")],
)  # fmt: skip
def test_slugs(settings, slug):
    assert cell_slug(settings) == slug


@pytest.mark.parametrize(
    "grid,cells,match",
    [
        ({"num_grups": [4]}, None, "unknown setting 'num_grups'"),
        ({"out": ["a", "b"]}, None, "unknown setting 'out'"),
        ({"threads": [1, 2]}, None, "unknown setting 'threads'"),
        ({"window": []}, None, "window is an empty list"),
        ({}, None, "no cells"),
        ({}, [{"sinkhorn": 0}], r"\[\[cells\]\] #1: unknown setting 'sinkhorn'"),
        ({}, ["window"], "expected a table"),
    ],
)
def test_bad_grids_raise_clear_errors(grid, cells, match):
    with pytest.raises(ValueError, match=match):
        expand_grid(grid, cells)


def _write_grid(tmp_path, assets, text=TINY_GRID, name="grid.toml"):
    path = tmp_path / name
    path.write_text(text.format(model=assets["model"], corpus=assets["corpus"]))
    return path


@pytest.mark.parametrize(
    "extra,match",
    [
        ("[grid]\nnum_groups = [0]\n", r"cell num_groups-0: .*num_groups"),
        ("[grid]\ntop_k = [8]\n", r"cell top_k-8: .*top_k"),
        ("[sweep]\njobs = 2\n", r"unknown tables \['sweep'\]"),
        ("[grid]\nwindow = [64]\n", r"cell window-64: .*seq_len"),
    ],
)
def test_invalid_cells_fail_before_anything_runs(tmp_path, module_assets, extra, match):
    text = TINY_GRID.replace("[grid]\nsinkhorn_iters = [0, 10]\n", extra)
    with pytest.raises(ValueError, match=match):
        load_plan(_write_grid(tmp_path, module_assets, text))


@pytest.fixture(scope="module")
def serial_sweep(module_assets, tmp_path_factory):
    """The 2-cell tiny sweep (Sinkhorn off and on), run once in this process."""
    root = tmp_path_factory.mktemp("sweep")
    grid = _write_grid(root, module_assets)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOCUS_HOME", str(module_assets["home"]))
        mp.setenv("FOCUS_NO_EXTENSION", "1")  # the portable backends: no kernel build
        cfg = SweepConfig(grid=str(grid), out=str(root / "out"), threads=1, progress=False)
        summary = run_sweep(cfg)
    return cfg, summary


def test_sweep_trains_and_evaluates_every_cell(serial_sweep):
    cfg, summary = serial_sweep
    out = cfg.out_dir()
    slugs = ["sinkhorn_iters-0", "sinkhorn_iters-10"]
    assert [r["slug"] for r in summary["cells"]] == slugs
    for row, iters in zip(summary["cells"], (0, 10), strict=True):
        cell = out / "cells" / row["slug"]
        for name in ("focus_model.safetensors", "log.jsonl", "eval.json", "eval.md", "cell.json"):
            assert (cell / name).is_file(), name
        assert row["settings"] == {"sinkhorn_iters": iters}
        assert row["focus"]["sinkhorn_iters"] == iters and row["focus"]["num_groups"] == 4
        ev = row["evals"]["eval"]
        assert list(ev["ppl"]["focus_topk"]) == ["1", "2"]
        assert 0 < ev["pairs_retained"]["1"] < ev["pairs_retained"]["2"] <= 1
        assert ev["seq_len"] == 32 and ev["eval_config"]["max_tokens"] == 64
        assert 0.25 <= row["train_dominance"]["dominance"] <= 1  # K = 4
        assert row["train_seconds"] > 0
        trained = json.loads((cell / "train_config.json").read_text())
        assert trained["focus"]["sinkhorn_iters"] == iters and trained["steps"] == 2
    # same base model, budget and data: the dense perplexity is the same in every cell
    evs = [r["evals"]["eval"] for r in summary["cells"]]
    assert evs[0]["ppl"]["base"] == evs[1]["ppl"]["base"]
    written = json.loads((out / "sweep.json").read_text())
    assert written["cells"] == summary["cells"] and "torch" in written["versions"]
    table = (out / "sweep.md").read_text()
    assert table.count("\n| sinkhorn_iters-0 | 0 |") == 2  # a row per top_k
    assert table.count("\n| sinkhorn_iters-10 | 10 |") == 2
    for name in ("ppl_vs_pairs.png", "dominance.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerun_skips_finished_cells(serial_sweep, monkeypatch):
    cfg, summary = serial_sweep
    cells = cfg.out_dir() / "cells"
    mtimes = {p: p.stat().st_mtime_ns for p in cells.rglob("*") if p.is_file()}

    def no_training(*args, **kwargs):
        raise AssertionError("a finished cell was trained again")

    monkeypatch.setattr("focus_attention.experiments.grid.train", no_training)
    monkeypatch.setattr("focus_attention.experiments.grid.evaluate", no_training)
    again = run_sweep(cfg)
    assert again["cells"] == summary["cells"]
    assert {p: p.stat().st_mtime_ns for p in cells.rglob("*") if p.is_file()} == mtimes


def test_unfinished_cell_resumes_its_training(serial_sweep, module_assets, monkeypatch):
    cfg, summary = serial_sweep
    cell = cfg.out_dir() / "cells" / "sinkhorn_iters-10"
    # as if stopped after step 1 of 2: the last checkpoint and the results are gone
    shutil.rmtree(cell / "checkpoints" / "checkpoint-2")
    for name in ("cell.json", "eval.json"):
        (cell / name).unlink()
    calls = []
    real_train = sweep_mod.train

    def spy(config, **kwargs):
        result = real_train(config, **kwargs)
        calls.append((config, result))
        return result

    monkeypatch.setattr(sweep_mod, "train", spy)
    monkeypatch.setenv("FOCUS_HOME", str(module_assets["home"]))
    monkeypatch.setenv("FOCUS_NO_EXTENSION", "1")  # as in serial_sweep
    again = run_sweep(cfg)
    assert [c.resume for c, _ in calls] == [True]  # only the unfinished cell, resumed
    config, result = calls[0]
    assert config.out == str(cell) and (result.start_step, result.steps) == (1, 2)
    assert (cell / "checkpoints" / "checkpoint-2").is_dir()
    # resuming continues exactly: the same adapter, the same perplexities
    again_ppl = again["cells"][1]["evals"]["eval"]["ppl"]
    ppl = summary["cells"][1]["evals"]["eval"]["ppl"]
    assert again_ppl["focus_topk"] == pytest.approx(ppl["focus_topk"], rel=1e-6)


@pytest.mark.slow
def test_parallel_cells_equal_serial_ones(serial_sweep, module_assets, tmp_path, monkeypatch,
                                          capsys):  # fmt: skip
    cfg, summary = serial_sweep
    monkeypatch.setenv("FOCUS_HOME", str(module_assets["home"]))
    monkeypatch.setenv("FOCUS_NO_EXTENSION", "1")  # as in serial_sweep
    par = SweepConfig(grid=cfg.grid, out=str(tmp_path / "par"), jobs=2, threads=2)
    assert par.cell_threads() == 1
    result = run_sweep(par)
    lines = sorted(capsys.readouterr().err.splitlines())  # a line per cell as it finishes
    assert [line.split(" (")[0] for line in lines] == [
        "focus sweep: cell sinkhorn_iters-0: done", "focus sweep: cell sinkhorn_iters-10: done"]  # fmt: skip
    for a, b in zip(result["cells"], summary["cells"], strict=True):
        assert a["slug"] == b["slug"]
        ea, eb = a["evals"]["eval"], b["evals"]["eval"]
        for key in ("base", "focus_soft"):
            assert ea["ppl"][key] == pytest.approx(eb["ppl"][key], rel=1e-6)
        assert ea["ppl"]["focus_topk"] == pytest.approx(eb["ppl"]["focus_topk"], rel=1e-6)
        assert ea["pairs_retained"] == eb["pairs_retained"]
        assert a["train_dominance"] == pytest.approx(b["train_dominance"], rel=1e-6)


def test_cli_reports_bad_grids(tmp_path, capsys):
    from focus_attention.cli import main

    with pytest.raises(SystemExit):
        main(["sweep"])
    assert "one of the arguments --grid --study is required" in capsys.readouterr().err
    for path, what in ((tmp_path / "nonexist.toml", "no such file"), (tmp_path, "is a directory")):
        assert main(["sweep", "--grid", str(path)]) == 1
        assert capsys.readouterr().err == (f"focus: error: --grid {path}: {what}; expected a TOML "
                                           "grid file ([train], [eval], [grid], [[cells]], "
                                           "[[evals]] tables)\n")  # fmt: skip
    with pytest.raises(FileNotFoundError, match=f"grid file {tmp_path}: is a directory; expected"):
        load_plan(tmp_path)
    assert main(["sweep", "--grid", "g.toml", "--runs", "r", "--dry-run"]) == 1
    assert "focus: error: --runs, --dry-run: for --study only" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[grid]\nnum_groups = []\n")
    assert main(["sweep", "--grid", str(bad)]) == 1
    assert "num_groups is an empty list" in capsys.readouterr().err
    assert sweep_mod.GRID_KEYS and "sinkhorn_iters" in sweep_mod.GRID_KEYS


ROOT = Path(__file__).resolve().parents[2]
#: the grid files of the studies (experiments/ablations, experiments/quality)
SWEEP_FILES = sorted(
    p for study in ("ablations", "quality") for p in (ROOT / "experiments" / study).glob("*.toml")
    if p.name != "config.toml"
)  # fmt: skip


@pytest.mark.parametrize("path", SWEEP_FILES, ids=[p.stem for p in SWEEP_FILES])
def test_shipped_grid_files_are_valid(path):
    plan = load_plan(path)  # checks every cell's TrainConfig and EvalConfigs
    assert len(plan.cells) >= 2
    if path.stem == "honest":  # the quality runs: their own budgets (below)
        return
    for slug in plan.cells:
        assert plan.train_config(slug, Path("cell")).steps == 80  # the main job's budget


def test_shipped_grid_files_exist():
    assert {p.stem for p in SWEEP_FILES} >= {"smollm2-small", "groups-window", "honest"}


def test_groups_window_grid_chooses_on_the_validation_book():
    """experiments/ablations/groups-window.toml: K at window 128 and window at K = 8, each cell
    evaluated at 1K and 4K tokens on the validation split (it is used to choose settings)."""
    plan = load_plan(ROOT / "experiments/ablations/groups-window.toml")
    got = [(s["num_groups"], s["window"]) for s in plan.cells.values()]
    assert got == [(8, 128), (16, 128), (8, 64)]  # the two denser cells: not run
    for slug in plan.cells:
        evs = [plan.eval_config(slug, Path("c"), e.name) for e in plan.cell_evals(slug)]
        assert [(e.split, e.seq_len) for e in evs] == [("validation", 1024), ("validation", 4096)]
        assert all(e.top_k == (1, 2) for e in evs)


def test_finished_cells_with_other_settings_are_refused(serial_sweep, module_assets, tmp_path):
    cfg, _ = serial_sweep
    text = TINY_GRID.replace("max_tokens = 64", "max_tokens = 96").replace("lr = 1e-2", "lr = 2e-2")
    grid = _write_grid(tmp_path, module_assets, text)
    changed = SweepConfig(grid=str(grid), out=cfg.out, progress=False)
    with pytest.raises(ValueError, match=r"other settings \(lr, eval.max_tokens changed\)"):
        run_sweep(changed)


def test_help_says_one_of_grid_and_study_is_required():
    from focus_attention.cli import build_parser

    parser = build_parser("sweep")
    sub = next(a for a in parser._actions if a.dest == "command").choices["sweep"]
    text = " ".join(sub.format_help().split())
    assert "usage: focus sweep [-h] (--grid FILE | --study DIR)" in text
    assert "[[evals]]); one of --grid / --study is required" in text and "; required" not in text


def test_parallel_cells_are_reported_as_they_finish(capsys):
    """The parent of parallel cells prints one line per finished cell (with progress on),
    in the order they finish, and returns the rows by cell."""
    from concurrent.futures import Future

    futures = {Future(): "a", Future(): "b"}
    for future, slug in reversed(list(futures.items())):
        future.set_result({"slug": slug})
    rows = sweep_mod._gather(futures, progress=True)
    assert rows == {"a": {"slug": "a"}, "b": {"slug": "b"}}
    lines = capsys.readouterr().err.splitlines()
    assert sorted(line.split(": done ")[0] for line in lines) == [
        "focus sweep: cell a", "focus sweep: cell b"]  # fmt: skip
    assert sorted(line.split(": done ")[1] for line in lines) == [
        "(1 of 2 cells)",
        "(2 of 2 cells)",
    ]
    sweep_mod._gather(futures, progress=False)
    assert capsys.readouterr().err == ""


def test_cli_runs_a_finished_sweep(serial_sweep, capsys):
    from focus_attention.cli import main

    cfg, _ = serial_sweep
    assert main(["sweep", "--grid", cfg.grid, "--out", cfg.out, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| cell | sinkhorn_iters | top_k | PPL | dense |" in out and "sweep.json" in out


def test_a_damaged_cell_file_is_one_error_naming_it(serial_sweep, tmp_path, capsys):
    from focus_attention.cli import main

    cfg, _ = serial_sweep
    out = tmp_path / "out"
    shutil.copytree(cfg.out_dir(), out)
    damaged = out / "cells" / "sinkhorn_iters-0" / "cell.json"
    damaged.write_text(damaged.read_text()[:20])  # cut short
    capsys.readouterr()
    assert main(["sweep", "--grid", cfg.grid, "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"focus: error: {damaged}: not valid JSON" in err and "Traceback" not in err


#: TINY_GRID with two named evaluations: every cell at 32 tokens, the Sinkhorn-on cell also
#: at 16 tokens with top_k 1 only
EVALS_GRID = TINY_GRID.replace(
    "[grid]\nsinkhorn_iters = [0, 10]\n",
    """[[cells]]
name = "off"
sinkhorn_iters = 0

[[cells]]
sinkhorn_iters = 10

[[evals]]
name = "long"

[[evals]]
name = "short"
seq_len = 16
max_tokens = 48
top_k = [1]
cells = ["sinkhorn_iters-10"]
""",
)


@pytest.fixture(scope="module")
def evals_sweep(module_assets, tmp_path_factory):
    """The tiny sweep with named cells and two named evaluations, run once."""
    root = tmp_path_factory.mktemp("sweep-evals")
    grid = _write_grid(root, module_assets, EVALS_GRID)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOCUS_HOME", str(module_assets["home"]))
        mp.setenv("FOCUS_NO_EXTENSION", "1")
        cfg = SweepConfig(grid=str(grid), out=str(root / "out"), threads=1, progress=False)
        summary = run_sweep(cfg)
    return cfg, summary


def test_named_evaluations_run_per_cell_into_their_files(evals_sweep):
    cfg, summary = evals_sweep
    off, on = summary["cells"]
    assert (off["slug"], on["slug"]) == ("off", "sinkhorn_iters-10")
    assert off["settings"] == {"sinkhorn_iters": 0}  # the name is not a setting
    assert list(off["evals"]) == ["long"] and list(on["evals"]) == ["long", "short"]
    cells = cfg.out_dir() / "cells"
    for slug, names in (("off", ["long"]), ("sinkhorn_iters-10", ["long", "short"])):
        found = sorted(p.name for p in (cells / slug).glob("eval*"))
        assert found == sorted(f"eval-{n}.{x}" for n in names for x in ("json", "md"))
    long, short = on["evals"]["long"], on["evals"]["short"]
    assert (long["seq_len"], short["seq_len"]) == (32, 16)
    assert list(short["ppl"]["focus_topk"]) == ["1"] and short["eval_config"]["max_tokens"] == 48
    written = json.loads((cells / "sinkhorn_iters-10" / "eval-short.json").read_text())
    assert written["config"]["seq_len"] == 16 and written["ppl"] == short["ppl"]
    # a shorter window keeps a larger share of the causal pairs inside the local window
    assert short["pairs_retained"]["1"] > long["pairs_retained"]["1"]
    assert [len(summary["points"][n]) for n in ("long", "short")] == [4, 1]
    table = (cfg.out_dir() / "sweep.md").read_text()
    assert "### Evaluation `long`: test split" in table and "in 16-token windows" in table
    assert table.count("\n| off | 0 |") == 2 and table.count("\n| sinkhorn_iters-10 | 10 |") == 3


def test_a_missing_evaluation_runs_alone(evals_sweep, monkeypatch):
    """Resumable per evaluation: an evaluation missing from cell.json (interrupted, or
    added to the grid later) runs without training again; the others are reused."""
    cfg, summary = evals_sweep
    path = cfg.out_dir() / "cells" / "sinkhorn_iters-10" / "cell.json"
    row = json.loads(path.read_text())
    del row["evals"]["short"]
    path.write_text(json.dumps(row))

    def no_training(*args, **kwargs):
        raise AssertionError("a trained cell was trained again")

    calls = []
    real = sweep_mod.evaluate
    monkeypatch.setattr("focus_attention.experiments.grid.train", no_training)
    monkeypatch.setattr(sweep_mod, "evaluate", lambda c: calls.append(c) or real(c))
    monkeypatch.setenv("FOCUS_NO_EXTENSION", "1")
    again = run_sweep(cfg)
    assert [(c.seq_len, Path(c.json).name) for c in calls] == [(16, "eval-short.json")]
    short, before = again["cells"][1]["evals"]["short"], summary["cells"][1]["evals"]["short"]
    assert short["ppl"]["focus_topk"] == pytest.approx(before["ppl"]["focus_topk"], rel=1e-6)
    assert again["cells"][0] == summary["cells"][0]


def test_changed_named_evaluation_is_refused(evals_sweep, module_assets, tmp_path):
    cfg, _ = evals_sweep
    text = EVALS_GRID.replace("max_tokens = 48", "max_tokens = 32")
    changed = SweepConfig(grid=str(_write_grid(tmp_path, module_assets, text)), out=cfg.out)
    with pytest.raises(ValueError, match=r"other settings \(short.max_tokens changed\)"):
        run_sweep(changed)


def test_cells_of_the_one_evaluation_layout_are_read(serial_sweep, monkeypatch, tmp_path):
    """A cell.json with the results at the top level (a sweep without [[evals]] written
    before evaluations had names) is reused, not trained or evaluated again."""
    cfg, summary = serial_sweep
    out = tmp_path / "old"
    shutil.copytree(cfg.out_dir() / "cells", out / "cells")
    for row in summary["cells"]:
        ev = row["evals"]["eval"]
        old = {k: v for k, v in row.items() if k != "evals"}
        old.update({k: ev[k] for k in ("ppl", "pairs_retained", "dominance")},
                   eval_tokens=ev["tokens"], eval_config=ev["eval_config"])  # fmt: skip
        (out / "cells" / row["slug"] / "cell.json").write_text(json.dumps(old))

    def no_training(*args, **kwargs):
        raise AssertionError("a finished cell was trained or evaluated again")

    monkeypatch.setattr("focus_attention.experiments.grid.train", no_training)
    monkeypatch.setattr("focus_attention.experiments.grid.evaluate", no_training)
    again = run_sweep(SweepConfig(grid=cfg.grid, out=str(out), progress=False))
    assert [r["evals"] for r in again["cells"]] == [r["evals"] for r in summary["cells"]]


EVAL_TABLES = (
    '[[cells]]\nname = "a"\nsinkhorn_iters = 0\n\n[[cells]]\nname = "b"\nsinkhorn_iters = 10\n\n'
)


@pytest.mark.parametrize(
    "evals,match",
    [
        ("[[evals]]\nseq_len = 16\n", r"\[\[evals\]\] #1: no name"),
        ("[[evals]]\nname = \"a/b\"\n", r"#1: name 'a/b' is not a file name"),
        ("[[evals]]\nname = \"x\"\ncells = [\"c\"]\n", r"unknown cells \['c'\]"),
        ("[[evals]]\nname = \"x\"\ncells = []\n", "cells must be a list of cell names"),
        ("[[evals]]\nname = \"x\"\n\n[[evals]]\nname = \"x\"\ncells = [\"b\"]\n",
         "#2: cell b has two evaluations named 'x'"),
        ("[[evals]]\nname = \"x\"\ncells = [\"a\"]\n", r"cells \['b'\] have no evaluation"),
        ("[[evals]]\nname = \"x\"\nseq_len = 1\n", r"\[\[evals\]\] x: .*seq_len"),
        ("[[evals]]\nname = \"x\"\nsplit = \"dev\"\n", r"\[\[evals\]\] x: .*split"),
        ("evals = 3\n", r"\[\[evals\]\] must be one or more tables"),
    ],
)  # fmt: skip
def test_bad_evaluations_fail_before_anything_runs(tmp_path, module_assets, evals, match):
    text = TINY_GRID.replace("[grid]\nsinkhorn_iters = [0, 10]\n", EVAL_TABLES)
    if evals.startswith("evals ="):  # a key, not a table: before the first table
        text = evals + text
    else:
        text += "\n" + evals
    with pytest.raises(ValueError, match=match):
        load_plan(_write_grid(tmp_path, module_assets, text))


def test_named_cells():
    cells = expand_grid({}, [{"name": "lane-1", "steps": 300}, {"steps": 80}])
    assert cells == {"lane-1": {"steps": 300}, "steps-80": {"steps": 80}}
    with pytest.raises(ValueError, match="two different cells are named 'a'"):
        expand_grid({}, [{"name": "a", "steps": 1}, {"name": "a", "steps": 2}])
    with pytest.raises(ValueError, match=r"#1: name '\.\./x' is not a file name"):
        expand_grid({}, [{"name": "../x", "steps": 1}])
    with pytest.raises(ValueError, match=r"#1: name 3 is not a file name"):
        expand_grid({}, [{"name": 3}])


def _row(slug, ppl, pairs, dense=10.0, name="e"):
    return {"slug": slug, "evals": {name: {
        "ppl": {"base": dense, "focus_topk": {str(k + 1): p for k, p in enumerate(ppl)}},
        "pairs_retained": {str(k + 1): p for k, p in enumerate(pairs)}}}}  # fmt: skip


def test_points_cost_and_pareto_front():
    rows = [_row("a", [11.0, 10.5], [0.4, 0.6]), _row("b", [12.0, 10.2], [0.3, 0.6]),
            _row("c", [10.0], [1.0])]  # fmt: skip
    points = sweep_points(rows)["e"]
    by = {(p["slug"], p["top_k"]): p for p in points}
    a1 = by["a", 1]
    assert a1["ppl_increase"] == pytest.approx(0.1) and a1["pairs_removed"] == pytest.approx(0.6)
    assert a1["cost"] == pytest.approx(0.1 / 0.6) and a1["dense"] == 10.0
    assert by["c", 1]["cost"] is None  # nothing removed: no cost per removed pair
    # a2 (10.5 at 0.6) is dominated by b2 (10.2 at 0.6); every other point is on the front
    assert {k for k, p in by.items() if p["pareto"]} == {("a", 1), ("b", 1), ("b", 2), ("c", 1)}


def test_honest_grid_is_the_quality_runs():
    """experiments/quality/honest.toml: the quality runs, one cell per training and its
    evaluations (the sweep step of experiments/quality/config.toml runs it)."""
    path = ROOT / "experiments" / "quality" / "honest.toml"
    plan = load_plan(path)
    assert list(plan.cells) == ["log-s4", "paper-s4", "default-s0", "default-s4", "random"]
    long = {"steps": 300, "lr": 3e-2, "warmup_steps": 20, "eval_every": 100,
            "eval_tokens": 2048, "save_every": 50}  # fmt: skip
    want = {"log-s4": (long, {"gate": "log", "sink_tokens": 4}),
            "paper-s4": (long, {"gate": "paper", "sink_tokens": 4}),
            "default-s0": ({"steps": 80}, {"sink_tokens": 0}),
            "default-s4": ({"steps": 80}, {"sink_tokens": 4}),
            "random": ({"steps": 0, "eval_every": -1}, {})}  # fmt: skip
    from focus_attention.training.config import TrainConfig

    for slug, (run, focus) in want.items():
        expected = TrainConfig.from_dict({**run, "threads": 1, "progress": False,
                                          "out": "cell", "focus": focus})  # fmt: skip
        assert plan.train_config(slug, Path("cell")) == expected, slug
    evals = {s: [e.name for e in plan.cell_evals(s)] for s in plan.cells}
    assert evals == {"log-s4": ["causal", "sequence", "causal-sinks0"],
                     "paper-s4": ["causal", "sequence"], "default-s0": ["causal"],
                     "default-s4": ["causal"], "random": ["sequence"]}  # fmt: skip
    for slug, names in evals.items():
        for name in names:
            ev = plan.eval_config(slug, Path("cell"), name)
            assert (ev.split, ev.max_tokens, ev.seq_len) == ("test", 12288, 1024)
            assert ev.json == str(Path("cell") / f"eval-{name}.json")
            assert ev.inference_routing == ("sequence" if name == "sequence" else None)
            assert ev.sink_tokens == (0 if name == "causal-sinks0" else None)
            assert ev.top_k == ((1, 2) if slug == "random" else (1, 2, 4))


def test_an_untrained_cell_and_a_removed_evaluation(module_assets, tmp_path, monkeypatch):
    """A 0-step cell (the quality runs' untrained routers) trains nothing and is evaluated;
    an evaluation dropped from the grid file is no longer reported."""
    monkeypatch.setenv("FOCUS_HOME", str(module_assets["home"]))
    monkeypatch.setenv("FOCUS_NO_EXTENSION", "1")
    text = TINY_GRID.replace("[grid]\nsinkhorn_iters = [0, 10]\n", """[[cells]]
name = "random"
steps = 0
eval_every = -1

[[cells]]
name = "one-step"
steps = 1

[[evals]]
name = "a"

[[evals]]
name = "b"
top_k = [1]
""")  # fmt: skip
    grid = _write_grid(tmp_path, module_assets, text)
    cfg = SweepConfig(grid=str(grid), out=str(tmp_path / "out"), progress=False)
    first = run_sweep(cfg)
    random = first["cells"][0]
    assert random["train_config"]["steps"] == 0 and random["train_dominance"] == {}
    assert list(random["evals"]) == ["a", "b"] and random["evals"]["a"]["ppl"]["base"] > 1
    grid.write_text(grid.read_text().replace('[[evals]]\nname = "b"\ntop_k = [1]\n', ""))
    again = run_sweep(cfg)
    assert [list(r["evals"]) for r in again["cells"]] == [["a"], ["a"]]
    assert list(again["points"]) == ["a"]
    assert "### Evaluation `b`" not in (cfg.out_dir() / "sweep.md").read_text()


@pytest.mark.parametrize("damage, why", [
    (lambda row: row.pop("train_config"), "no key 'train_config'"),
    (lambda row: row["evals"]["eval"].pop("eval_config"), "evals.eval: no key 'eval_config'"),
    (lambda row: row.update(evals=[]), "evals is a JSON array, not a JSON object"),
])  # fmt: skip
def test_a_cell_file_without_what_the_sweep_reads_is_named(serial_sweep, tmp_path, capsys, damage, why):  # fmt: skip
    from focus_attention.cli import main

    cfg, _ = serial_sweep
    out = tmp_path / "out"
    shutil.copytree(cfg.out_dir(), out)
    path = out / "cells" / "sinkhorn_iters-0" / "cell.json"
    row = json.loads(path.read_text())
    damage(row)
    path.write_text(json.dumps(row))
    capsys.readouterr()
    assert main(["sweep", "--grid", cfg.grid, "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"focus: error: {path}: {why}; expected the JSON row of a focus sweep cell")  # fmt: skip


HOLD = """
import sys, time
from focus_attention.utils.io import exclusive_lock
with exclusive_lock(sys.argv[1], "focus sweep --grid g --out " + sys.argv[2]):
    print("held", flush=True)
    time.sleep(300)
"""


def test_a_second_sweep_into_a_folder_in_use_refuses_naming_the_first(serial_sweep, tmp_path, monkeypatch):  # fmt: skip
    import os
    import subprocess
    import sys

    from focus_attention.utils.io import FolderInUseError

    cfg, _ = serial_sweep
    out = tmp_path / "out"
    shutil.copytree(cfg.out_dir(), out)
    (out / "sweep.json").unlink()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(out / ".focus-sweep.lock"), str(out)],
                             stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUseError, match=rf"^{out} is in use by process {first.pid} on .*focus sweep --grid g"):  # fmt: skip
            run_sweep(SweepConfig(grid=cfg.grid, out=str(out), progress=False))
        assert not (out / "sweep.json").exists()
    finally:
        first.kill()
        first.wait()
    monkeypatch.setattr(sweep_mod, "train", lambda *a, **k: pytest.fail("a finished cell trained"))
    run_sweep(SweepConfig(grid=cfg.grid, out=str(out), progress=False))
    assert (out / "sweep.json").is_file() and not (out / ".focus-sweep.lock").exists()
