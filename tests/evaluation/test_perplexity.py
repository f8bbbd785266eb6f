"""``focus eval`` on a tiny random LLaMA: the window scheme, the JSON contract, top_k = K is
dense, pairs retained, the base-weight SHA-256 guard, overrides and argument errors."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_assets import check_eval_schema, tiny_config

from focus_attention.evaluation import RoutingStats, evaluate, markdown_table, score_windows
from focus_attention.training import train
from focus_attention.utils.env import weights_sha256


def _evaluate(assets, adapter, **kw):
    kw.setdefault("max_tokens", 192)
    kw.setdefault("seq_len", 64)
    return evaluate(model=str(assets["model"]), adapter=adapter, corpus=str(assets["corpus"]),
                    split="test", threads=1, progress=False, **kw).to_dict()  # fmt: skip


def test_score_windows_matches_the_models_own_loss(assets):
    from focus_attention.assets.models import load_model

    model, _ = load_model(assets["model"], quiet=True)
    torch.manual_seed(0)
    blocks = torch.randint(0, model.config.vocab_size, (3, 16))
    nll, n = score_windows(model, blocks)
    assert n == 3 * 15
    with torch.no_grad():
        ref = sum(float(model(input_ids=b[None], labels=b[None]).loss) * 15 for b in blocks)
    assert nll == pytest.approx(ref, rel=1e-5)
    with pytest.raises(ValueError, match="seq_len"):
        score_windows(model, blocks[:, :1])


def test_weights_sha256_sees_every_tensor(assets):
    from focus_attention.assets.models import load_model

    model, _ = load_model(assets["model"], quiet=True)
    before = weights_sha256(model)
    assert before == weights_sha256(model) and len(before) == 64
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-6
    assert weights_sha256(model) != before


def test_evaluate_contract(assets, adapter):
    res = _evaluate(assets, adapter)
    check_eval_schema(res, 4)
    assert "tuned" not in res["ppl"] and "trained" not in res["base_weights_sha256"]
    assert res["config"]["method"] == "focus"
    assert res["config"]["parts"] == {"focus": True, "lora": False, "model": False}
    assert res["windows"] == 3 and res["tokens"] == 3 * 63
    assert res["ppl"]["focus_topk"]["4"] == pytest.approx(res["ppl"]["base"], rel=1e-4)
    pr = [res["pairs_retained"][str(k)] for k in range(1, 5)]
    assert pr == sorted(pr) and pr[-1] == pytest.approx(1.0) and pr[0] < 1
    for k in ("1", "2", "3", "4"):
        layers = res["group_shares"]["topk"][k]
        assert set(layers) == {"0", "1"}
        for shares in layers.values():
            assert len(shares) == 4 and sum(shares) == pytest.approx(1.0, abs=1e-5)
        assert 0.25 <= res["dominance"]["topk"][k] <= res["dominance"]["topk_max"][k] <= 1
    assert 0.25 <= res["dominance"]["soft"] <= 1
    # the adapter's own top_k is what the config reports, not the last evaluated one
    assert res["config"]["focus"]["top_k"] == 2 and res["config"]["trained_top_k"] == 2
    assert res["routing_affected_share"] == pytest.approx((64 - 8) / 63)
    assert res["config"]["train_config"]["steps"] == 4
    assert set(res["seconds"]["topk"]) == {"1", "2", "3", "4"}
    table = markdown_table(res)
    assert table.count("| Focus top-k |") == 4 and "| Focus soft |" in table


def test_top_k_subset_and_overrides(assets, adapter):
    res = _evaluate(assets, adapter, top_k=[1, 3], inference_routing="sequence",
                    sink_tokens=0, max_tokens=64)  # fmt: skip
    assert list(res["ppl"]["focus_topk"]) == ["1", "3"]
    assert res["config"]["focus"]["inference_routing"] == "sequence"
    assert res["config"]["focus"]["sink_tokens"] == 0
    assert all(math.isfinite(v) for v in res["ppl"]["focus_topk"].values())
    res = _evaluate(assets, adapter, top_k=[1], dense_heads=((0, 0),), max_tokens=64)
    assert res["config"]["focus"]["dense_heads"] == [[0, 0]]
    with pytest.raises(ValueError, match=r"--top-k\): received \[5\], expected values in 1..4"):
        _evaluate(assets, adapter, top_k=[5])


def test_window_override_trades_sparsity_for_quality(assets, adapter):
    """A window as long as the evaluation window makes every pair local: top-1 is then
    exactly the dense model; a shorter window keeps fewer pairs."""
    full = _evaluate(assets, adapter, top_k=[1], window=64, max_tokens=128)
    assert full["config"]["focus"]["window"] == 64
    assert full["config"]["overrides"]["window"] == 64
    assert full["pairs_retained"]["1"] == pytest.approx(1.0)
    assert full["ppl"]["focus_topk"]["1"] == pytest.approx(full["ppl"]["base"], rel=1e-5)
    narrow = _evaluate(assets, adapter, top_k=[1], window=4, max_tokens=128)
    assert narrow["pairs_retained"]["1"] < full["pairs_retained"]["1"]
    with pytest.raises(ValueError, match="window"):
        _evaluate(assets, adapter, window=0)


def test_dense_layers_override(assets, adapter):
    """Every Focus layer dense: top-k and soft are the base model and keep every pair; one
    dense layer (the last: the layers before it see the same inputs) counts as keeping its
    pairs, the others as routed."""
    kw = dict(top_k=[1], window=4, max_tokens=128)
    plain = _evaluate(assets, adapter, **kw)
    layers = plain["config"]["focus_layers"]
    assert len(layers) >= 2 and plain["pairs_retained"]["1"] < 0.9
    dense = _evaluate(assets, adapter, dense_layers=layers, **kw)
    assert dense["config"]["overrides"]["dense_layers"] == list(layers)
    assert dense["config"]["focus"]["dense_layers"] == list(layers)
    assert dense["ppl"]["focus_topk"]["1"] == pytest.approx(dense["ppl"]["base"], rel=1e-5)
    assert dense["ppl"]["focus_soft"] == pytest.approx(dense["ppl"]["base"], rel=1e-5)
    assert dense["pairs_retained"]["1"] == 1.0
    assert dense["dominance"]["topk"]["1"] is None  # no layer routes: no groups
    table = markdown_table(dense)  # a dash for the dominance no layer has
    assert "| Focus top-k | 1 |" in table and "| 100.0% | - |" in table.split("Focus top-k")[1]
    assert "| Focus top-1 |" in table  # the position table
    one = _evaluate(assets, adapter, dense_layers=[layers[-1]], **kw)
    by_layer = one["pairs_retained_by_layer"]["1"]
    assert by_layer[str(layers[-1])] == 1.0
    for k in layers[:-1]:
        assert by_layer[str(k)] == pytest.approx(plain["pairs_retained_by_layer"]["1"][str(k)])
    assert one["pairs_retained"]["1"] == pytest.approx(sum(by_layer.values()) / len(layers))
    with pytest.raises(ValueError, match=r"dense_layers.*are not"):
        _evaluate(assets, adapter, dense_layers=[99], **kw)
    with pytest.raises(ValueError, match="no routed Focus layer to measure"):
        _evaluate(assets, adapter, dense_layers=layers, coverage_queries=4, **kw)


@pytest.mark.filterwarnings("ignore::focus_attention.hf.FocusBaseMismatchWarning")
def test_base_weights_changed_during_eval_fail_loudly(assets, adapter, monkeypatch):
    import focus_attention.evaluation.perplexity as ev

    original = ev.score_windows

    def tampering(model, blocks, **kw):
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)  # a base parameter
        return original(model, blocks, **kw)

    monkeypatch.setattr(ev, "score_windows", tampering)
    with pytest.raises(RuntimeError, match="weights changed"):
        _evaluate(assets, adapter, top_k=[1], max_tokens=64)


def test_routing_stats():
    groups = torch.zeros(1, 6, 4, dtype=torch.bool)
    groups[..., 0] = True  # one group per token
    rec = {"layer": 0, "mode": "topk", "query_groups": groups, "key_groups": groups}
    ok = RoutingStats(window=2, num_groups=4)
    ok.add(0, [rec])
    s = ok.summary()
    assert s["pairs_retained"] == 1.0 and s["dominance"] == 1.0  # everything in group 0
    with pytest.raises(RuntimeError, match="no routing"):
        ok.add(1, [])
    # a dense layer records nothing and keeps every pair: the mean over layers
    half = groups.clone()
    half[:, 3:, 0], half[:, 3:, 1] = False, True  # two groups of three tokens
    mixed = RoutingStats(window=1, num_groups=4, dense_layers=(1,))
    mixed.add(0, [{**rec, "query_groups": half, "key_groups": half}])
    mixed.add(1, [])  # a window where only dense layers ran is no error
    s = mixed.summary()
    routed = s["pairs_retained_by_layer"]["0"]
    assert routed == pytest.approx(12 / 21)  # (6 + 3 + 3) of 21 causal pairs
    assert s["pairs_retained_by_layer"]["1"] == 1.0
    assert s["pairs_retained"] == pytest.approx((routed + 1.0) / 2)


def test_routing_stats_pool_the_heads_of_per_head_memberships():
    """Query-key routers record memberships per key-value head ``[B, N, H_kv, K]``: the group
    shares pool the heads, the pairs retained count every head's pairs."""
    groups = torch.zeros(1, 6, 2, 4, dtype=torch.bool)
    groups[:, :, 0, 0] = True  # head 0: every token in group 0
    groups[:, :3, 1, 1], groups[:, 3:, 1, 2] = True, True  # head 1: two groups of three
    stats = RoutingStats(window=1, num_groups=4)
    stats.add(0, [{"layer": 0, "mode": "topk", "query_groups": groups, "key_groups": groups}])
    s = stats.summary()
    assert s["group_shares"]["0"] == [0.5, 0.25, 0.25, 0.0]
    assert s["pairs_retained"] == pytest.approx((21 + 12) / 42)


def test_a_query_key_adapter_evaluates_at_top_k(assets, tmp_path):
    cfg = tiny_config(assets, tmp_path / "qk", objective="coverage", router_input="query_key",
                      steps=1, eval_every=-1, save_every=0, coverage_queries=4)  # fmt: skip
    result = _evaluate(assets, train(cfg).out, top_k=[1], soft=False, window=4)
    assert math.isfinite(result["ppl"]["focus_topk"]["1"]) and 0 < result["pairs_retained"]["1"] < 1


def test_argument_errors(assets, adapter, tmp_path):
    with pytest.raises(ValueError, match="split"):
        evaluate(model=str(assets["model"]), adapter=adapter, corpus=str(assets["corpus"]),
                 split="dev", progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="seq_len"):
        _evaluate(assets, adapter, seq_len=1)
    with pytest.raises(ValueError, match="max_tokens"):
        _evaluate(assets, adapter, max_tokens=0)
    with pytest.raises(FileNotFoundError, match="not a Focus adapter"):
        _evaluate(assets, tmp_path)
    with pytest.raises(ValueError, match="not enough"):
        _evaluate(assets, adapter, max_tokens=32)


def test_query_top_k_override(assets, adapter):
    """Queries in two groups, keys in one: more pairs than top-1, fewer than top-2; recorded
    in the settings and named in the table; outside 1..K refused."""
    kw = dict(window=4, max_tokens=128, soft=False)
    sym = _evaluate(assets, adapter, top_k=[1, 2], **kw)
    wide = _evaluate(assets, adapter, top_k=[1], query_top_k=2, **kw)
    assert wide["config"]["overrides"]["query_top_k"] == 2
    assert wide["config"]["focus"]["query_top_k"] == 2
    assert sym["config"]["focus"]["query_top_k"] is None
    assert sym["pairs_retained"]["1"] < wide["pairs_retained"]["1"] < sym["pairs_retained"]["2"]
    assert wide["ppl"]["base"] == pytest.approx(sym["ppl"]["base"])
    assert "query_top_k=2" in markdown_table(wide) and "query_top_k" not in markdown_table(sym)
    with pytest.raises(ValueError, match="query_top_k"):
        _evaluate(assets, adapter, query_top_k=9, **kw)


def test_bad_top_k_values_fail_before_the_model_loads(tmp_path, monkeypatch):
    from focus_attention.hf import FocusConfig

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("focus_attention.evaluation.perplexity.load_model", no_loading)
    (tmp_path / "focus_config.json").write_text(FocusConfig(num_groups=4).to_json_string())
    with pytest.raises(ValueError, match=r"top_k \(--top-k\): received \[9\], expected values "
                       r"in 1..4, the adapter's number of groups K"):  # fmt: skip
        evaluate(model="any-model", adapter=tmp_path, corpus="any-corpus", top_k=[9],
                 progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"query_top_k \(--query-top-k\): received 5"):
        evaluate(model="any-model", adapter=tmp_path, corpus="any-corpus", query_top_k=5,
                 progress=False)  # fmt: skip


def test_bad_paths_fail_before_the_model_loads(tmp_path, monkeypatch):
    """Output files that cannot be written, an adapter file instead of its folder and a
    sweep's output folder are refused before the model loads, naming what to pass."""
    from focus_attention.hf import FocusConfig

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("focus_attention.evaluation.perplexity.load_model", no_loading)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "focus_config.json").write_text(FocusConfig(num_groups=4).to_json_string())
    kw = dict(model="any-model", corpus="any-corpus", progress=False)
    for name in ("json", "markdown"):
        with pytest.raises(ValueError, match=f"{name}: received .*, a directory"):
            evaluate(adapter=adapter, **{name: str(tmp_path)}, **kw)
        under_a_file = str(adapter / "focus_config.json" / "out.md")
        with pytest.raises(ValueError, match=f"{name}: received .* is a file, not a folder"):
            evaluate(adapter=adapter, **{name: under_a_file}, **kw)
    with pytest.raises(FileNotFoundError, match=r"focus_config\.json is a file, not a folder; "
                       "expected an adapter folder .*: pass .*adapter, the folder that holds it"):  # fmt: skip
        evaluate(adapter=adapter / "focus_config.json", **kw)
    (tmp_path / "sweep" / "cells" / "k8").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"output folder of focus sweep: pass one of its "
                       r"1 cells, such as .*sweep/cells/k8"):  # fmt: skip
        evaluate(adapter=tmp_path / "sweep", **kw)
    with pytest.raises(FileNotFoundError, match=r"adapter folder .*none not found \(--adapter\)"):
        evaluate(adapter=tmp_path / "none", **kw)


def test_perplexity_by_position_pools_back_to_the_total(assets, adapter):
    """Position buckets partition the scored tokens: their token counts add up, the bucket
    perplexities pool back to the overall one, and inside the local window (positions below
    ``window``) every top_k scores exactly as the dense model."""
    res = _evaluate(assets, adapter, position_buckets=(0, 4, 8, 32, 1000))
    by = res["ppl_by_position"]
    assert by["buckets"] == [[0, 4], [4, 8], [8, 32], [32, 64]]  # the last ends at seq_len
    assert by["tokens"] == [3 * 3, 3 * 4, 3 * 24, 3 * 32]
    assert sum(by["tokens"]) == res["tokens"]
    for name, total, values in [
        ("base", res["ppl"]["base"], by["base"]),
        ("soft", res["ppl"]["focus_soft"], by["focus_soft"]),
        *[(k, res["ppl"]["focus_topk"][k], v) for k, v in by["focus_topk"].items()],
    ]:
        nll = sum(n * math.log(p) for n, p in zip(by["tokens"], values, strict=True))
        assert math.exp(nll / res["tokens"]) == pytest.approx(total, rel=1e-6), name
    for values in by["focus_topk"].values():  # window 8: positions 0-7 see every earlier key
        assert values[:2] == pytest.approx(by["base"][:2], rel=1e-5)
    table = markdown_table(res)
    assert "Perplexity by token position" in table and "| 32-63 |" in table


def test_position_buckets_are_checked():
    from focus_attention.evaluation import EvalConfig, PositionNLL, bucket_bounds

    assert bucket_bounds((0, 128, 512), 300) == [(0, 128), (128, 300)]
    for bad in [(), (5, 5), (10, 0), (-1, 4)]:
        with pytest.raises(ValueError, match="position buckets"):
            bucket_bounds(bad, 64)
    with pytest.raises(ValueError, match="position buckets"):
        EvalConfig(position_buckets=(0, 0))
    acc = PositionNLL(5)
    with pytest.raises(ValueError, match=r"expected \[4\]"):
        acc.add(torch.zeros(5))


def test_without_soft_routing(assets, adapter):
    """``soft=False`` skips the soft model: no soft entry anywhere, the same top-k and base
    scores, and tables without a soft row."""
    full = _evaluate(assets, adapter, top_k=[1, 2])
    lean = _evaluate(assets, adapter, top_k=[1, 2], soft=False)
    assert lean["config"]["soft"] is False and full["config"]["soft"] is True
    assert "focus_soft" not in lean["ppl"] and "focus_soft" not in lean["ppl_by_position"]
    assert "soft" not in lean["dominance"] and "soft" not in lean["seconds"]
    assert lean["ppl"]["base"] == full["ppl"]["base"]
    assert lean["ppl"]["focus_topk"] == full["ppl"]["focus_topk"]
    table = markdown_table(lean)
    assert "Focus soft" not in table and table.count("| Focus top-k |") == 2
    assert "dense_layers" not in table
    # the perplexity-by-position table, with the rows there are
    assert "Perplexity by token position" in table
    assert "| Focus top-1 |" in table and "| Focus top-2 |" in table
    lean["ppl_by_position"].pop("focus_topk")  # a result with the base row only
    assert markdown_table(lean).count("| base (dense) |") == 2
    dense = _evaluate(assets, adapter, top_k=[1], soft=False, dense_layers=[1])
    assert "inference_routing=causal, dense_layers=1)" in markdown_table(dense)


def test_calibrating_the_bias_on_validation_blocks(assets, adapter):
    """``calibrate_blocks`` re-collects the causal routing bias from validation blocks before
    scoring: the dense and soft scores stay, the top-k scores use the new bias, the result
    records it, and asking for more blocks than the split has is an error."""
    plain = _evaluate(assets, adapter, top_k=[1])
    calibrated = _evaluate(assets, adapter, top_k=[1], calibrate_blocks=2)
    assert calibrated["config"]["calibrate_blocks"] == 2
    assert calibrated["ppl"]["base"] == plain["ppl"]["base"]
    assert calibrated["ppl"]["focus_soft"] == plain["ppl"]["focus_soft"]
    assert calibrated["ppl"]["focus_topk"]["1"] != plain["ppl"]["focus_topk"]["1"]
    with pytest.raises(ValueError, match="9999 blocks: the validation split"):
        _evaluate(assets, adapter, top_k=[1], calibrate_blocks=9999)


def test_coverage_of_top_k_routing(assets, adapter):
    """``coverage_queries`` adds the share of distant dense attention each top_k keeps: it
    grows with top_k and is everything at top_k = K (every pair is kept); the markdown says
    it; skipped by default."""
    assert _evaluate(assets, adapter, top_k=[1])["coverage"] is None
    r = _evaluate(assets, adapter, top_k=[1, 2, 4], coverage_queries=16)
    cov = r["coverage"]
    assert 0 < cov["distant_share"] < 1
    assert 0 < cov["topk"]["1"] <= cov["topk"]["2"] <= cov["topk"]["4"]
    assert cov["topk"]["4"] == pytest.approx(1.0)
    assert set(cov["by_layer"]["1"]) == {"0", "1"}
    assert "kept by top-k routing" in markdown_table(r)
    with pytest.raises(ValueError, match="coverage_queries"):
        _evaluate(assets, adapter, coverage_queries=-1)


def test_dense_heads_count_as_keeping_their_pairs():
    """A layer with dense heads keeps, besides its routed heads' share, every pair of its
    dense key-value heads (their share of the layer's key-value heads)."""
    from tiny import focus

    from focus_attention.evaluation.perplexity import RoutingStats, dense_head_share

    _, fm = focus("llama")
    first, last = fm.focus_layers[0], fm.focus_layers[-1]
    assert dense_head_share(fm) == {}
    fm.focus_config = fm.focus_config.replace(dense_heads=[(last, 0)])
    kv = fm.base_model.config.num_key_value_heads
    assert dense_head_share(fm) == {last: 1 / kv}
    stats = RoutingStats(8, 4, (), dense_head_share(fm))
    stats.layer_pairs = {first: [1.0, 4.0], last: [2.0, 4.0]}
    stats.kept, stats.pairs = 3.0, 8.0
    by_layer = stats.summary()["pairs_retained_by_layer"]
    assert by_layer[str(first)] == 0.25
    assert by_layer[str(last)] == pytest.approx(1 / kv + (1 - 1 / kv) * 0.5)
