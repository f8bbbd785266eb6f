"""``focus calibrate --head-budget``: the share of key-value heads kept dense, filled with the
top pairs of a head ranking (a file, or ranked on pass-key prompts of the calibration split),
written into the adapter as ``dense_heads`` and recorded in calibration.json."""

from __future__ import annotations

import json

import pytest

from focus_attention import cli
from focus_attention.evaluation.calibration import (
    CALIBRATION_NAME,
    CalibrateConfig,
    calibrate_adapter,
)
from focus_attention.evaluation.head_budget import (
    budget_heads,
    choose_dense_heads,
    read_head_ranking,
)
from focus_attention.hf import FocusConfig

RANKING = [[1, 1], [0, 1], [1, 0], [0, 0]]


def _ranking_file(tmp_path, pairs=RANKING, model=None, name="heads.json"):
    path = tmp_path / name
    data = {"head_ranking": pairs, "by_head": {f"{p}": 1.0 / (i + 1) for i, p in enumerate(pairs)}}
    if model is not None:
        data["config"] = {"model": model}
    path.write_text(json.dumps(data))
    return path


def _calibrate(assets, adapter, out, **kw):
    return calibrate_adapter(CalibrateConfig(model=str(assets["model"]), adapter=str(adapter),
                                             out=str(out), corpus=str(assets["corpus"]), seq_len=64,
                                             blocks=0, progress=False, **kw))  # fmt: skip


@pytest.mark.parametrize("share, total, count", [(0.2, 90, 18), (7 / 90, 90, 7), (0.078, 90, 8),
                                                 (1, 90, 90), (0.01, 4, 1), (0.5, 4, 2)])  # fmt: skip
def test_the_budget_is_the_ceiling_of_share_times_heads(share, total, count):
    assert budget_heads(share, total) == count


@pytest.mark.parametrize("share", [0, -0.1, 1.01, True, "0.5"])
def test_bad_shares_are_refused(share):
    with pytest.raises(ValueError, match="head_budget"):
        budget_heads(share, 90)
    with pytest.raises(ValueError, match="head_budget"):
        CalibrateConfig(adapter="a", out="b", head_budget=share)


def test_the_top_pairs_fill_the_budget_and_dense_layers_count():
    ranking = [tuple(p) for p in RANKING]
    assert choose_dense_heads(ranking, 0.5, [0, 1], 2) == ((0, 1), (1, 1))
    assert choose_dense_heads(ranking, 0.25, [0, 1], 2) == ((1, 1),)
    assert choose_dense_heads(ranking, 0.75, [0, 1], 2, dense_layers=(1,)) == ((0, 1),)
    assert choose_dense_heads(ranking, 0.5, [0, 1], 2, dense_layers=(1,)) == ()
    with pytest.raises(ValueError, match="already keep 2"):
        choose_dense_heads(ranking, 0.25, [0, 1], 2, dense_layers=(1,))
    with pytest.raises(ValueError, match="another model"):
        choose_dense_heads(ranking + [(5, 0)], 0.5, [0, 1], 2)
    with pytest.raises(ValueError, match="another model"):
        choose_dense_heads(ranking, 0.5, [0, 1], 1)
    with pytest.raises(ValueError, match="the ranking has 2 pairs"):
        choose_dense_heads(ranking[:2], 0.75, [0, 1], 2)


def test_bad_ranking_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a file"):
        read_head_ranking(tmp_path / "missing.json")
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_head_ranking(tmp_path / "text.json")
    for i, pairs in enumerate([[], [[1]], [[1, -1]], [[1, 0.5]], "1:0"]):
        with pytest.raises(ValueError, match="no 'head_ranking' list"):
            read_head_ranking(_ranking_file(tmp_path, pairs, name=f"bad{i}.json"))
    with pytest.raises(ValueError, match="twice"):
        read_head_ranking(_ranking_file(tmp_path, [[1, 0], [1, 0]]))
    with pytest.raises(ValueError, match="of model 'other'"):
        read_head_ranking(_ranking_file(tmp_path, model="other"), "smollm2-135m")
    assert read_head_ranking(_ranking_file(tmp_path, model="m"), "m")["head_ranking"][0] == (1, 1)


def test_settings_that_do_not_fit_a_budget_are_refused():
    with pytest.raises(ValueError, match="head_ranking.*--head-budget"):
        CalibrateConfig(adapter="a", out="b", head_ranking="heads.json")
    with pytest.raises(ValueError, match="dense_heads.*chooses them"):
        CalibrateConfig(adapter="a", out="b", head_budget=0.5, dense_heads=((0, 1),))


def test_a_ranking_file_gives_the_adapter_its_dense_heads(assets, adapter, tmp_path):
    out = tmp_path / "budget"
    record = _calibrate(assets, adapter, out, head_budget=0.5,
                        head_ranking=str(_ranking_file(tmp_path, model=str(assets["model"]))))  # fmt: skip
    assert record["focus"]["dense_heads"] == [[0, 1], [1, 1]]
    assert FocusConfig.from_json_file(out / "focus_config.json").dense_heads == ((0, 1), (1, 1))
    saved = json.loads((out / CALIBRATION_NAME).read_text())["head_budget"]
    assert saved["dense_heads"] == [[0, 1], [1, 1]] and saved["kv_heads"] == 4
    assert saved["dense_kv_heads"] == 2 and saved["ranking"]["head_ranking"] == RANKING
    with pytest.raises(ValueError, match="not of"):
        _calibrate(assets, adapter, tmp_path / "other", head_budget=0.5,
                   head_ranking=str(_ranking_file(tmp_path, model="another-model")))  # fmt: skip
    assert not (tmp_path / "other").exists()


def test_without_a_file_the_heads_are_ranked_on_pass_keys(assets, adapter, tmp_path):
    out = tmp_path / "ranked"
    config = CalibrateConfig(model=str(assets["model"]), adapter=str(adapter), out=str(out),
                             corpus=str(assets["corpus"]), seq_len=64, blocks=0, progress=False,
                             head_budget=0.25, ranking_length=64)  # fmt: skip
    record = calibrate_adapter(config)["head_budget"]
    ranked = record["ranking"]
    assert len(ranked["head_ranking"]) == 4 and ranked["source"]["ranked_here"]["prompts"] == 6
    assert ranked["source"]["ranked_here"]["config"]["haystacks"] == ("passkey",)
    assert record["dense_heads"] == [ranked["head_ranking"][0]]
    scores = [ranked["by_head"][f"{a}:{b}"] for a, b in ranked["head_ranking"]]
    assert scores == sorted(scores, reverse=True)


def test_the_command_line(assets, adapter, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = cli.main(["calibrate", "--model", str(assets["model"]), "--adapter", str(adapter),
                   "--out", str(out), "--corpus", str(assets["corpus"]), "--seq-len", "64",
                   "--blocks", "0", "--head-budget", "0.75",
                   "--head-ranking", str(_ranking_file(tmp_path)), "--no-progress"])  # fmt: skip
    assert rc == 0 and "3 of 4 key-value heads dense; dense_heads 0:1,1:0,1:1" in capsys.readouterr().out  # fmt: skip
