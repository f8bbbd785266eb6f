"""``focus inspect`` (:mod:`focus_attention.evaluation.groups`): the word categories, the
NMI, the counts of a run on a tiny random LLaMA and its 4-step adapter (they sum to the
token totals and agree with ``focus eval``'s group shares), the files and the errors; plus
one run on smollm2-135m (marked ``assets``)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import word_tokenizer
from tiny_assets import use_tiny_assets

from focus_attention.evaluation.categories import (
    CATEGORIES,
    token_categories,
    token_texts,
    word_category,
)
from focus_attention.evaluation.groups import (
    InspectConfig,
    group_category_counts,
    information,
    inspect_groups,
    normalized_mutual_information,
    shuffled_nmi,
    write_outputs,
)

# --------------------------------------------------------------------------------------------
# categories


@pytest.mark.parametrize(
    ("word", "category"),
    [("the", "det"), ("The", "det"), ("every", "det"), ("of", "adp"), ("upon", "adp"),
     ("her", "pron"), ("Himself", "pron"), ("was", "aux"), ("could", "aux"), ("'ll", "aux"),
     ("and", "cconj"), ("because", "sconj"), ("that", "sconj"), ("not", "part"),
     ("n't", "part"), ("\u2019s", "part"), (",", "punct"), ("\u2014", "punct"),
     ('."', "punct"), ("$", "punct"), ("1811", "number"), ("twenty", "number"),
     ("\n\n", "newline"), (" \n", "newline"), ("  ", "space"), ("Elliot", "capitalised"),
     (" Kellynch", "capitalised"), ("walked", "other"), ("amusement", "other")],
)  # fmt: skip
def test_word_category_of_known_words(word, category):
    assert word_category(word) == category


def test_every_closed_class_word_is_in_one_list_only():
    from focus_attention.evaluation.categories import CLOSED_CLASSES, NUMBER_WORDS

    seen: dict[str, str] = {}
    for cat, words in CLOSED_CLASSES.items():
        assert cat in CATEGORIES
        for w in words:
            assert w not in seen and w not in NUMBER_WORDS, (w, cat, seen.get(w))
            seen[w] = cat
            assert word_category(w) == cat


def test_sub_word_tokens_take_the_category_of_their_word():
    texts = ["Sir", " Ell", "iot", ",", " walk", "ing", "'s", " 17", "60", "\n", "<eos>", "the"]
    special = [t == "<eos>" for t in texts]
    cats, cont = token_categories(texts, special)
    assert cats == ["capitalised", "capitalised", "capitalised", "punct", "other", "other",
                    "part", "number", "number", "newline", "special", "det"]  # fmt: skip
    assert cont == [False, False, True, False, False, True, False, False, True, False, False,
                    False]  # fmt: skip
    with pytest.raises(ValueError, match="one per token"):
        token_categories(texts, special[:-1])


def test_token_texts_show_the_spaces_the_decoder_inserts():
    tok = word_tokenizer(["the", "walk", "of", "anne"])
    ids = tok("the walk of anne").input_ids
    texts = token_texts(tok, ids)
    assert texts == ["the", " walk", " of", " anne"]
    assert token_categories(texts)[1] == [False] * 4  # whole words, no continuation


# --------------------------------------------------------------------------------------------
# NMI and counts


def test_nmi_of_a_perfect_grouping_is_one_and_of_independent_ones_near_zero():
    gen = torch.Generator().manual_seed(0)
    cats = torch.randint(0, 6, (4000,), generator=gen)
    relabel = torch.tensor([3, 5, 0, 1, 2, 4])  # the same partition under other names
    groups = torch.nn.functional.one_hot(relabel[cats], 6).float()
    assert normalized_mutual_information(group_category_counts(groups, cats, 6)) == pytest.approx(1.0)  # fmt: skip
    coarse = torch.nn.functional.one_hot(cats // 2, 3).float()  # a coarsening: strictly between
    assert 0.3 < normalized_mutual_information(group_category_counts(coarse, cats, 6)) < 0.99
    independent = torch.nn.functional.one_hot(torch.randint(0, 8, (4000,), generator=gen), 8)
    nmi = normalized_mutual_information(group_category_counts(independent.float(), cats, 6))
    assert 0 <= nmi < 0.01
    chance = shuffled_nmi(groups, cats, 6, 5, seed=0)
    assert chance["mean"] < 0.01 and chance["std"] >= 0
    assert shuffled_nmi(groups, cats, 6, 0, seed=0) is None


def test_nmi_by_hand_and_edge_cases():
    import math

    # two groups, two categories: p = [[.4, .1], [.1, .4]]
    joint = torch.tensor([[4.0, 1.0], [1.0, 4.0]])
    p = [0.4, 0.1, 0.1, 0.4]
    mi = sum(v * math.log(v / 0.25) for v in p)
    assert normalized_mutual_information(joint) == pytest.approx(mi / math.log(2), rel=1e-12)
    info = information(joint)
    assert info["mi"] == pytest.approx(mi, rel=1e-12)
    assert info["h_a"] == pytest.approx(math.log(2)) and info["h_b"] == pytest.approx(math.log(2))
    assert normalized_mutual_information(torch.tensor([[7.0]])) == 1.0  # both constant
    assert normalized_mutual_information(torch.tensor([[3.0, 5.0]])) == 0.0  # one constant
    for bad, match in [(torch.ones(3), "2-D"), (torch.tensor([[1.0, -1.0]]), "non-negative"),
                       (torch.tensor([[float("nan")]]), "non-negative"),
                       (torch.zeros(2, 2), "empty")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            normalized_mutual_information(bad)


def test_group_category_counts_sum_to_the_tokens_and_reject_bad_input():
    m = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    cats = torch.tensor([1, 0, 1])
    counts = group_category_counts(m, cats, 2)
    assert counts.tolist() == [[0.0, 1.5], [0.0, 0.5], [1.0, 0.0]]
    with pytest.raises(ValueError, match=r"\[T\]"):
        group_category_counts(m, cats[:2], 2)
    with pytest.raises(ValueError, match="outside"):
        group_category_counts(m, torch.tensor([0, 1, 2]), 2)


# --------------------------------------------------------------------------------------------
# a run on the tiny model


def _inspect(assets, adapter, **kw):
    kw.setdefault("seq_len", 64)
    kw.setdefault("max_tokens", 192)
    kw.setdefault("shuffles", 3)
    return inspect_groups(model=str(assets["model"]), adapter=str(adapter),
                          corpus=str(assets["corpus"]), threads=1, progress=False, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def result(module_assets, adapter, tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect-out")
    with pytest.MonkeyPatch.context() as mp:
        use_tiny_assets(module_assets, mp)
        res = _inspect(module_assets, adapter, out=str(out))
    return res, out


def test_counts_sum_to_the_token_totals(result):
    res, _ = result
    total = res["tokens"]
    assert total == 192 and res["windows"] == 3
    assert sum(res["categories"]["counts"].values()) == total
    assert res["routings"] == ["trained", "untrained", "untrained_calibrated"]
    assert res["focus_layers"] == [0, 1] and list(res["layers"]) == ["0", "1"]
    for layer in res["layers"].values():
        for name in res["routings"]:
            v = layer[name]
            assert sum(map(sum, v["composition"])) == pytest.approx(total, abs=1e-2)
            per_cat = [sum(col) for col in zip(*v["composition"], strict=True)]
            counts = list(res["categories"]["counts"].values())
            assert per_cat == pytest.approx(counts, abs=1e-2)
            assert sum(v["shares"]) == pytest.approx(1.0, abs=1e-4)
            assert v["dominance"] == pytest.approx(max(v["shares"]))
            assert 0 <= v["nmi"] <= 1 and 0 <= v["category_explained"] <= 1
            assert v["mi"] >= 0
            assert all(0 <= c <= 1 for c in v["continuation_share"])
        assert 0 <= layer["nmi_shuffled"]["mean"] <= 1
    for groups in res["groups"].values():
        assert [g["group"] for g in groups] == [0, 1, 2, 3]
        assert sum(g["share"] for g in groups) == pytest.approx(1.0, abs=1e-4)
        for g in groups:
            assert sum(g["categories"].values()) == pytest.approx(1.0, abs=1e-3) or g["share"] == 0
            for t in g["frequent"] + g["typical"]:
                assert 0 < t["count"] <= t["total"] and t["p_group"] == pytest.approx(
                    t["count"] / t["total"], abs=1e-3
                )
                assert t["count"] <= g["share"] * total + 1e-6
            assert all(t["total"] >= 5 for t in g["typical"])
            ps = [t["p_group"] for t in g["typical"]]
            assert ps == sorted(ps, reverse=True)
            counts = [t["count"] for t in g["frequent"]]
            assert counts == sorted(counts, reverse=True)
            assert len(g["snippets"]) == min(3, len(g["typical"]))
            assert all("⟦" in s and "⟧" in s for s in g["snippets"])


def test_shares_agree_with_focus_eval(assets, adapter, result):
    """The trained top-1 group shares equal those ``focus eval`` records on the same windows
    (another reader of the same routing records)."""
    from focus_attention.evaluation import evaluate

    ev = evaluate(model=str(assets["model"]), adapter=adapter, corpus=str(assets["corpus"]),
                  split="test", seq_len=64, max_tokens=192, top_k=(1,), threads=1,
                  progress=False).to_dict()  # fmt: skip
    res, _ = result
    for layer, shares in ev["group_shares"]["topk"]["1"].items():
        assert res["layers"][layer]["trained"]["shares"] == pytest.approx(shares, abs=1e-4)


def test_top_k_memberships_count_one_over_k(assets, adapter):
    res = _inspect(assets, adapter, top_k=4, baseline=False, layers=(1,), shuffles=0)
    assert res["routings"] == ["trained"] and list(res["groups"]) == ["1"]
    for layer in res["layers"].values():
        # every token in all four groups: a quarter each, nothing to learn from the groups
        assert layer["trained"]["shares"] == pytest.approx([0.25] * 4)
        assert layer["trained"]["nmi"] == pytest.approx(0.0, abs=1e-9)
        assert sum(map(sum, layer["trained"]["composition"])) == pytest.approx(res["tokens"])
        assert layer["nmi_shuffled"] is None


def test_files_are_written_and_readable(result):
    res, out = result
    names = sorted(p.name for p in out.iterdir())
    assert names == ["composition.png", "inspect.json", "inspect.md", "shares.png"]
    assert json.loads((out / "inspect.json").read_text())["summary"] == res["summary"]
    md = (out / "inspect.md").read_text()
    assert "## How far the groups are from random" in md and "### Layer 1" in md
    assert md.count("\n| 0 |") >= 1 and "untrained, bias calibrated" in md
    for png in ("composition.png", "shares.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 400_000
    assert {"torch", "transformers", "python"} <= set(res["versions"])
    assert res["config"]["adapter"] and res["config"]["detail_layers"] == [0, 1]


def test_a_failed_write_leaves_no_partial_file(result, tmp_path, monkeypatch):
    import matplotlib.figure

    res, _ = result
    (tmp_path / "shares.png").write_bytes(b"old")

    def broken(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_outputs(res, tmp_path)
    assert (tmp_path / "shares.png").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inspect.json", "inspect.md", "shares.png"]  # fmt: skip


def test_clear_errors(assets, adapter, tmp_path):
    with pytest.raises(ValueError, match=r"layers \(--layers\) \[2, 7\] are not Focus layers"
                       r".*Focus layers: 0-1, 2 in all; layers that can be inspected: 0-1"):  # fmt: skip
        _inspect(assets, adapter, layers=(7, 2, 1))
    with pytest.raises(FileNotFoundError, match="not a Focus adapter"):
        _inspect(assets, tmp_path)
    with pytest.raises(ValueError, match="adapter directory is required"):
        inspect_groups(model=str(assets["model"]), progress=False)
    with pytest.raises(ValueError, match=r"top_k=5: expected 1..K=4"):
        _inspect(assets, adapter, top_k=5)
    for bad, match in [({"layers": ()}, "layers"), ({"max_tokens": 16, "seq_len": 32}, "max_tokens"),
                       ({"top_k": 0}, "top_k"), ({"split": "dev"}, "split"),
                       ({"layers": (1, "2")}, "layers")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            InspectConfig(**bad)
    with pytest.raises(ValueError, match="unknown keys"):
        InspectConfig.from_dict({"adapterr": "x"})


def test_layers_that_run_dense_attention_are_not_inspected(assets, adapter, tmp_path, monkeypatch):  # fmt: skip
    """A dense layer has no groups: asked for, it is an error that lists the layers that
    can be inspected (before the model loads); by default only the routed layers are
    inspected; an adapter with no routed layer is an error."""
    from focus_attention.evaluation.calibration import CalibrateConfig, calibrate_adapter

    for dense in ((1,), (0, 1)):
        calibrate_adapter(CalibrateConfig(model=str(assets["model"]), adapter=str(adapter),
                                          out=str(tmp_path / str(len(dense))), blocks=0,
                                          dense_layers=dense, progress=False))  # fmt: skip
    res = _inspect(assets, tmp_path / "1", baseline=False, shuffles=0)
    assert res["dense_layers"] == [1] and res["focus_layers"] == [0, 1]
    assert list(res["layers"]) == ["0"] and list(res["groups"]) == ["0"]
    assert res["config"]["detail_layers"] == [0]

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the layers were checked")

    monkeypatch.setattr("focus_attention.evaluation.groups.load_model", no_loading)
    with pytest.raises(ValueError, match=r"layers \(--layers\) \[1\] run dense attention in "
                       r"this adapter \(dense_layers 1\) and have no groups; layers that can be "
                       r"inspected: 0$"):  # fmt: skip
        _inspect(assets, tmp_path / "1", layers=(0, 1))
    for layers in (None, (0,)):
        with pytest.raises(ValueError, match=r"every Focus layer of this adapter runs dense "
                           r"attention \(dense_layers 0-1\): no layer has groups to inspect"):  # fmt: skip
            _inspect(assets, tmp_path / "2", layers=layers)


def test_check_layers_lists_the_layers_in_short_form():
    from focus_attention.evaluation.groups import check_layers

    layers = list(range(30))
    dense = (18, 20, 21, 22, 23)
    assert check_layers(None, layers, dense) == [i for i in layers if i not in dense]
    assert check_layers((0, 19), layers, dense) == [0, 19]
    with pytest.raises(ValueError, match=r"\[20\] run dense attention .*dense_layers 18, 20-23\)"
                       r".*can be inspected: 0-17, 19, 24-29$"):  # fmt: skip
        check_layers((0, 20), layers, dense)


def test_paths_that_cannot_be_an_adapter_or_the_output_are_refused(assets, adapter, tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"out \(--out\): received .*afile', which is a file"):
        _inspect(assets, adapter, out=str(tmp_path / "afile"))
    with pytest.raises(FileNotFoundError, match=r"is a file, not a folder; expected an adapter "
                       r"folder .*: pass .*, the folder that holds it"):  # fmt: skip
        _inspect(assets, adapter / "focus_config.json")
    (tmp_path / "sweep" / "cells" / "a").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"not a Focus adapter; .* output folder of focus "
                       r"sweep: pass one of its 1 cells, such as .*sweep/cells/a"):  # fmt: skip
        _inspect(assets, tmp_path / "sweep")


# --------------------------------------------------------------------------------------------
# real assets


@pytest.mark.assets
@pytest.mark.slow
def test_real_smollm2_inspect(tmp_path):
    """smollm2-135m with a fresh (untrained) adapter on 384 tokens of Persuasion: the
    counts, the categories of real BPE tokens, and the files."""
    from tiny_assets import require_real_assets

    require_real_assets()
    from focus_attention.assets.models import load_model
    from focus_attention.hf import FocusConfig, get_focus_model

    model, _ = load_model("smollm2-135m", quiet=True)
    get_focus_model(model, FocusConfig(num_groups=8)).save_pretrained(tmp_path / "adapter")
    res = inspect_groups(adapter=str(tmp_path / "adapter"), seq_len=128, max_tokens=384,
                         layers=(0, 29), baseline=False, shuffles=2, threads=1,
                         progress=False, out=str(tmp_path / "out"))  # fmt: skip
    assert res["tokens"] == 384 and len(res["layers"]) == 30 and list(res["groups"]) == ["0", "29"]  # fmt: skip
    counts = res["categories"]["counts"]
    assert sum(counts.values()) == 384
    assert counts["det"] > 5 and counts["punct"] > 10 and counts["capitalised"] > 5
    for layer in res["layers"].values():
        assert sum(map(sum, layer["trained"]["composition"])) == pytest.approx(384, abs=1e-2)
    words = {t["token"].strip() for g in res["groups"]["0"] for t in g["frequent"]}
    assert {",", "the"} & words
    assert (tmp_path / "out" / "composition.png").is_file()


def test_cli_writes_the_outputs_and_reports_bad_layers(assets, adapter, tmp_path, capsys):
    from focus_attention.cli import main

    out = tmp_path / "out"
    argv = ["inspect", "--model", str(assets["model"]), "--adapter", str(adapter), "--corpus",
            str(assets["corpus"]), "--seq-len", "64", "--tokens", "128", "--layers", "1",
            "--shuffles", "2", "--threads", "1", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "128 tokens, 2 Focus layers" in printed and "mean NMI shuffled" in printed
    res = json.loads((out / "inspect.json").read_text())
    assert list(res["groups"]) == ["1"] and res["config"]["layers"] == [1]
    assert (out / "inspect.md").is_file() and (out / "composition.png").is_file()
    assert main([*argv[:-1], str(tmp_path / "bad"), "--layers", "5"]) == 1
    assert "layers (--layers) [5] are not Focus layers" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
