"""The GPU benchmarks' plumbing on the CPU (no timing assertions): random-weight presets, the
bytes a decoding step reads, the crossover, batches over static caches, the CUDA-graph path's
decisions, merged results and their plots."""

from __future__ import annotations

import json

import pytest
import torch
from tolerances import tolerance

from focus_attention import cli
from focus_attention.assets.presets import PRESETS, is_random_model, preset_named
from focus_attention.assets.random_models import build_random_model, random_token_ids
from focus_attention.bench import accounting, graphs
from focus_attention.bench.settings import DecodeBenchConfig, ModelBenchConfig
from focus_attention.ops.sparse.triton_support import triton_reason


def small(name: str) -> dict[str, int]:
    """A small model of a preset's kind: its head counts, head_dim and vocabulary, one layer
    of width one per query head."""
    return dict(num_hidden_layers=1, hidden_size=PRESETS[name].num_attention_heads,
                intermediate_size=48)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# presets and their settings
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_its_shape_with_seeded_random_weights(name):
    preset = PRESETS[name]
    model = build_random_model(f"random:{name}", overrides=small(name), seed=3)
    d = preset.num_attention_heads
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (
        preset.num_attention_heads, preset.num_key_value_heads, preset.head_dim, preset.vocab_size
    )  # fmt: skip
    assert cfg.rope_parameters["rope_theta"] == preset.rope_theta
    assert cfg.tie_word_embeddings == preset.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == preset.tie_word_embeddings
    assert cfg.num_hidden_layers == 1 and cfg._attn_implementation == "sdpa"
    assert not model.training and cfg.name_or_path == f"random:{name}"
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.shape == (preset.num_attention_heads * preset.head_dim, d)
    assert abs(float(q.std()) - cfg.initializer_range) < 0.01  # LLaMA's N(0, 0.02)
    assert torch.equal(model.model.norm.weight, torch.ones(d))
    again = build_random_model(name, overrides=small(name), seed=3)
    other = build_random_model(name, overrides=small(name), seed=4)
    assert torch.equal(again.model.layers[0].self_attn.q_proj.weight, q)
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.weight, q)


def test_the_full_presets_have_the_published_shapes():
    one, eight = PRESETS["llama-3.2-1b"], PRESETS["llama-3-8b"]
    assert (one.hidden_size, one.num_hidden_layers, one.num_attention_heads,
            one.num_key_value_heads, one.head_dim, one.intermediate_size, one.vocab_size,
            one.rope_theta) == (2048, 16, 32, 8, 64, 8192, 128256, 500000.0)  # fmt: skip
    assert (eight.hidden_size, eight.num_hidden_layers, eight.num_attention_heads,
            eight.num_key_value_heads, eight.head_dim, eight.intermediate_size,
            eight.vocab_size) == (4096, 32, 32, 8, 128, 14336, 128256)  # fmt: skip


def test_preset_names_and_random_ids():
    assert is_random_model("random:llama-3-8b") and not is_random_model("smollm2-135m")
    assert preset_named("llama-tiny") is preset_named("random:llama-tiny")
    with pytest.raises(ValueError, match="random:llama-3.2-1b, random:llama-3-8b"):
        preset_named("random:llama-70b")
    with pytest.raises(ValueError, match=r"unknown overrides \['heads'\]"):
        build_random_model("llama-tiny", overrides={"heads": 2})
    ids = random_token_ids(512, 3, 40, seed=1)
    assert ids.shape == (3, 40) and ids.dtype == torch.int64 and ids.min() >= 0 and ids.max() < 512
    assert torch.equal(ids, random_token_ids(512, 3, 40, seed=1))
    assert not torch.equal(ids[0], ids[1])


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(model="random:llama-70b"), r"model: .* one of the presets random:llama-3.2-1b"),
        (dict(model="random:llama-tiny", adapter="runs/austen"), "adapter: .* random-weight"),
        (dict(batch_size=(0,)), "batch_size: received 0"),
        (dict(batch_size=()), "batch_size"),
        (dict(kv_cache="paged"), "kv_cache: received 'paged'"),
        (dict(cuda_graphs=True, device="cpu"), "cuda_graphs: received True, expected a CUDA device"),
    ],
)  # fmt: skip
def test_decode_settings_refuse(changes, match):
    with pytest.raises(ValueError, match=match):
        DecodeBenchConfig(**changes)


def test_graphs_on_the_model_level_need_the_static_cache(monkeypatch):
    """On a (pretend) CUDA device --cuda-graphs is accepted with the static cache, refused with
    a dynamic one at the model level, and accepted at the op level alone."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert DecodeBenchConfig(cuda_graphs=True, kv_cache="static").resolved_device == "cuda"
    with pytest.raises(ValueError, match="kv_cache: received 'dynamic', expected static"):
        DecodeBenchConfig(cuda_graphs=True)
    assert DecodeBenchConfig(cuda_graphs=True, levels=("op",)).cuda_graphs


def test_model_settings_take_presets_device_dtype_and_warmup():
    cfg = ModelBenchConfig(model="random:llama-3-8b", device="cpu", dtype="bfloat16", warmup=1)
    assert (cfg.model, cfg.dtype, cfg.warmup) == ("random:llama-3-8b", "bfloat16", 1)
    for changes, match in [(dict(warmup=-1), "warmup"), (dict(model="random:x"), "presets"),
                           (dict(dtype="int8"), "dtype")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            ModelBenchConfig(**changes)


def test_the_command_line_refuses_graphs_on_the_cpu_and_names_the_presets(capsys):
    assert cli.main(["bench", "decode", "--cuda-graphs", "--device", "cpu", "--levels", "op",
                     "--num-heads", "2", "--num-key-value-heads", "1", "--head-dim", "8"]) != 0  # fmt: skip
    assert "--cuda-graphs: received True, expected a CUDA device" in capsys.readouterr().err
    assert cli.main(["bench", "model", "--model", "random:nope"]) != 0
    assert "random:llama-3-8b" in capsys.readouterr().err
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "decode", "--batch-size", "1", "16", "--kv-cache",
                              "static", "--cuda-graphs", "--model", "random:llama-3-8b"])  # fmt: skip
    assert (args.batch_size, args.kv_cache, args.cuda_graphs) == ([1, 16], "static", True)


# ---------------------------------------------------------------------------------------------
# bytes a step reads, crossover
# ---------------------------------------------------------------------------------------------


def test_weights_bytes_count_what_a_step_reads():
    """Untied: every matrix but the input embedding; tied: the embedding once, as the output
    projection (hand count of the parameters)."""
    for name, tied in (("llama-3-8b", False), ("llama-3.2-1b", True)):
        model = build_random_model(name, overrides=small(name))
        preset, d = PRESETS[name], 32
        attn = d * preset.head_dim * (2 * preset.num_attention_heads + 2 * preset.num_key_value_heads)  # fmt: skip
        layer = attn + 3 * d * 48 + 2 * d
        params = layer + d + preset.vocab_size * d  # final norm, lm_head (or the tied embedding)
        assert not tied or model.lm_head.weight is model.model.embed_tokens.weight
        assert accounting.weights_bytes(model) == 4 * params


def test_visible_keys_and_bucket_entries_by_hand():
    """Eight keys, K = 3, window 2; the query (the last key) is in groups 0 and 2."""
    keys = torch.tensor(
        [[1, 0, 0], [0, 1, 0], [1, 0, 1], [0, 0, 1], [0, 1, 0], [0, 1, 1], [0, 1, 0], [1, 0, 1]],
        dtype=torch.bool,
    )
    query = keys[-1]
    # before the window (keys 0..5): 0 (g0), 2 (g0, g2), 3 (g2), 5 (g2) seen; 6 and 7 the window
    assert accounting.visible_keys(query, keys, 2) == 6
    # entries: group 0 lists keys 0 and 2, group 2 keys 2, 3 and 5; group 2 is the later one
    assert accounting.bucket_entries(query, keys, 2) == (5, 3)
    assert accounting.visible_keys(query, keys, 8) == 8 and accounting.bucket_entries(query, keys, 8) == (0, 0)  # fmt: skip


def test_visible_keys_and_bucket_entries_per_key_value_head():
    """Per key-value head memberships (query-key routing): keys seen are the mean over the
    heads of each head's count, bucket entries the sum; with every head routed alike they are
    the shared memberships' numbers, and a head whose query shares no group sees the window."""
    keys = torch.tensor(
        [[1, 0, 0], [0, 1, 0], [1, 0, 1], [0, 0, 1], [0, 1, 0], [0, 1, 1], [0, 1, 0], [1, 0, 1]],
        dtype=torch.bool,
    )
    query = keys[-1]
    alike_keys, alike_query = keys[:, None].expand(8, 2, 3), query[None].expand(2, 3)
    assert accounting.visible_keys(alike_query, alike_keys, 2) == 6
    assert accounting.bucket_entries(alike_query, alike_keys, 2) == (10, 6)
    lonely = torch.stack([query, torch.tensor([False, True, False])])  # head 1: group 1 only
    other = torch.stack([keys, torch.zeros_like(keys)], dim=1)  # head 1's keys in no group
    assert accounting.visible_keys(lonely, other, 2) == (6 + 2) / 2
    assert accounting.bucket_entries(lonely, other, 2) == (5, 3)


def test_step_bytes_by_hand():
    got = accounting.step_bytes(weights=1000, batch=2, kv_heads=3, head_dim=4, itemsize=2,
                                keys_per_layer=[10, 5.5], entries_per_layer=[(7, 2)])  # fmt: skip
    kv = 2 * 2 * 3 * 4 * 2 * (10 + 5.5)  # keys and values, rows, heads, D, bytes
    index = 2 * (7 * 4 + 2 * 8)  # per row: int32 entries, int64 codes of the later group
    assert got == {"weights_bytes": 1000, "kv_bytes": kv, "index_bytes": index,
                   "bytes_read": 1000 + kv + index}  # fmt: skip


def test_routed_reads_average_records_and_count_dense_heads():
    keys = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 1], [1, 0]], dtype=torch.bool)
    record = {"layer": 3, "query_groups": keys[None, -1:], "key_groups": keys[None], "num_keys": 5}
    got = accounting.routed_reads([record, record], window=1, dense_share={})
    assert got == {3: {"keys": 3.0, "cached": 5.0, "entries": 2.0, "later": 0.0, "share": 0.6}}
    half = accounting.routed_reads([record], window=1, dense_share={3: 0.5})[3]
    assert half["keys"] == 0.5 * 5 + 0.5 * 3 and half["entries"] == 1.0


def _row(level, n, top_k, seconds, reference, batch=1):
    return {"level": level, "N": n, "batch_size": batch, "method": "focus", "top_k": top_k,
            "seconds": seconds, "reference_seconds": reference}  # fmt: skip


def test_crossover_is_the_shortest_context_from_which_focus_stays_as_fast():
    rows = [
        _row("model", 1024, 1, 2.0, 1.0), _row("model", 4096, 1, 1.0, 1.0),
        _row("model", 16384, 1, 0.5, 1.0), _row("model", 1024, 2, 0.9, 1.0),
        _row("model", 4096, 2, 1.1, 1.0), _row("model", 16384, 2, 0.9, 1.0),
        _row("op", 1024, 1, 2.0, 1.0), _row("op", 4096, 1, 3.0, 1.0),
        _row("model", 4096, 1, 0.5, 1.0, batch=16),
        {"level": "model", "N": 4096, "batch_size": 1, "method": "dense", "top_k": None,
         "seconds": 1.0, "reference_seconds": 1.0},
    ]  # fmt: skip
    got = {(c["level"], c["batch_size"], c["top_k"]): c for c in accounting.crossovers(rows, "GPU X")}  # fmt: skip
    assert got[("model", 1, 1)]["crossover_N"] == 4096  # equal speed counts
    assert got[("model", 1, 2)]["crossover_N"] == 16384  # faster at 1K, slower at 4K
    assert got[("op", 1, 1)]["crossover_N"] is None
    assert got[("model", 16, 1)] == {"level": "model", "batch_size": 16, "top_k": 1,
                                     "crossover_N": 4096, "contexts": [4096], "device": "GPU X"}  # fmt: skip
    assert len(got) == 4


def test_copy_bandwidth_is_bytes_moved_over_seconds():
    got = accounting.copy_bandwidth("cpu", nbytes=2**20, repeats=2)
    assert got["copy_bytes"] == 2**20
    assert got["bytes_per_second"] == pytest.approx(2 * 2**20 / got["seconds"])


# ---------------------------------------------------------------------------------------------
# CUDA graphs: what is captured (the capture itself needs a GPU)
# ---------------------------------------------------------------------------------------------


def test_timed_steps_capture_only_what_can_be_captured(monkeypatch):
    """A call that reads back, one refused by its caller and one whose capture fails stay
    eager, with their reasons; the others are timed as their replays."""
    captured = []

    def fake_graph(call, warmup, context=None):
        if call is failing:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        captured.append(call)
        return lambda: replays.append(call)

    replays: list = []
    monkeypatch.setattr(graphs, "graph_step", fake_graph)
    clean = lambda: torch.ones(2) + 1  # noqa: E731
    syncing = lambda: torch.ones(2).nonzero()  # noqa: E731
    failing = lambda: torch.ones(2) * 2  # noqa: E731
    refused = lambda: torch.ones(2) - 1  # noqa: E731
    calls = {"clean": clean, "syncing": syncing, "failing": failing, "refused": refused}
    timed, counts, notes = graphs.timed_steps(calls, {}, steps=3, warmup=1, graphs=True,
                                              refusals={"refused": "a dynamic cache"})  # fmt: skip
    assert captured == [clean]
    assert notes["clean"] is None and notes["refused"] == "a dynamic cache"
    assert notes["syncing"] == "not captured: the step reads back to the host 1 times"
    assert notes["failing"] == "capture failed: operation not permitted when stream is capturing"
    assert replays == [clean] * 4  # warm-up and timed rounds replay the graph
    assert counts["syncing"]["host_syncs"] == 1 and set(timed) == set(calls)
    _, _, off = graphs.timed_steps(calls, {}, steps=1, warmup=0, graphs=False)
    assert set(off.values()) == {None}


# ---------------------------------------------------------------------------------------------
# decoding over static caches, batches, on the CPU (eager)
# ---------------------------------------------------------------------------------------------


def _decode(**kw) -> dict:
    from focus_attention.bench.decode import run_decode_benchmark

    cfg = dict(model="random:llama-tiny", contexts=(40,), top_k=(1, 2), window=8, sink_tokens=2,
               steps=2, warmup=1, threads=1, progress=False, levels=("model",))  # fmt: skip
    return run_decode_benchmark(DecodeBenchConfig(**{**cfg, **kw}))


def test_static_cache_rows_of_dense_and_focus_run_eagerly_with_batches():
    from focus_attention.bench.decode import decode_table

    result = _decode(kv_cache="static", batch_size=(1, 3))
    rows = result["rows"]
    assert sorted((r["batch_size"], r["method"], r["top_k"] or 0) for r in rows) == sorted(
        (b, m, k) for b in (1, 3) for m, k in (("dense", 0), ("focus", 1), ("focus", 2))
    )
    for r in rows:
        assert r["cache"] == "static" and r["cuda_graph"] is False and r["graph_note"] is None
        assert r["seconds"] > 0 and r["tokens_per_second"] == pytest.approx(r["batch_size"] / r["seconds"])  # fmt: skip
        assert r["bytes_read"] == pytest.approx(r["weights_bytes"] + r["kv_bytes"] + r["index_bytes"])  # fmt: skip
        assert r["floor_seconds"] == pytest.approx(r["bytes_read"] / result["bandwidth"]["bytes_per_second"])  # fmt: skip
        assert r["efficiency_from_bytes"] == pytest.approx(r["reference_seconds"] / r["seconds"] / r["ideal_speedup_from_bytes"])  # fmt: skip
    dense = {r["batch_size"]: r for r in rows if r["method"] == "dense"}
    assert dense[1]["host_syncs"] == 0  # a static step reads nothing back
    assert dense[3]["kv_bytes"] == pytest.approx(3 * dense[1]["kv_bytes"])
    for r in rows:
        if r["method"] == "focus":
            assert r["reference_seconds"] == dense[r["batch_size"]]["seconds"]
            assert r["kv_bytes"] < dense[r["batch_size"]]["kv_bytes"] and r["index_bytes"] > 0
            assert r["ideal_speedup_from_bytes"] > 1 and 0 < r["share"] < 1
    assert {(c["batch_size"], c["top_k"]) for c in result["crossover"]} == {(b, k) for b in (1, 3) for k in (1, 2)}  # fmt: skip
    assert result["config"]["weights"] == "random" and result["config"]["batch_sizes"] == [1, 3]
    assert result["skipped"] == [] and "| model | 40 | 3 | focus top_k=1 | static |" in decode_table(result)  # fmt: skip


def test_dense_static_bytes_by_hand():
    """Dense over a static cache reads the weights and every slot of the cache in every layer
    (its mask spans the whole buffer)."""
    result = _decode(kv_cache="static", batch_size=(2,), top_k=(1,))
    dense = next(r for r in result["rows"] if r["method"] == "dense")
    preset = PRESETS["llama-tiny"]
    model = build_random_model("random:llama-tiny")
    from focus_attention.bench.decode_model import steps_per_row

    slots = 40 + steps_per_row(DecodeBenchConfig(steps=2, warmup=1)) + 8
    kv = preset.num_hidden_layers * 2 * 2 * preset.num_key_value_heads * slots * preset.head_dim * 4  # fmt: skip
    assert dense["kv_bytes"] == kv and dense["weights_bytes"] == accounting.weights_bytes(model)


def test_repeat_cache_gives_every_request_the_prefilled_one():
    """A static Focus cache of one prompt repeated three times decodes the next token of each
    request as the single one does."""
    from transformers import StaticCache

    from focus_attention.bench.decode_model import repeat_cache
    from focus_attention.hf import FocusConfig, get_focus_model
    from focus_attention.hf.compat import cache_kwargs

    model = build_random_model("random:llama-tiny")
    fm = get_focus_model(model, FocusConfig(num_groups=4, top_k=1, window=4, sink_tokens=1)).eval()
    ids = random_token_ids(512, 1, 30, seed=2)
    with torch.inference_mode():
        one = StaticCache(config=model.config, max_cache_len=40)
        fm(input_ids=ids[:, :29], **cache_kwargs(one), use_cache=True)
        three = repeat_cache(one, 3)
        batch = fm(input_ids=ids[:, 29:].expand(3, 1), **cache_kwargs(three), use_cache=True).logits  # fmt: skip
        single = fm(input_ids=ids[:, 29:], **cache_kwargs(one), use_cache=True).logits
    assert torch.allclose(batch, single.expand(3, -1, -1), **tolerance("oracle"))


def test_a_cell_that_does_not_fit_is_skipped_with_its_reason(monkeypatch):
    from focus_attention.bench import decode, decode_model

    monkeypatch.setattr(decode_model, "available_bytes", lambda device: 2**29)
    monkeypatch.setattr(decode, "available_bytes", lambda device: 2**29)
    result = _decode(kv_cache="static", batch_size=(1,), top_k=(1,), levels=("op", "model"),
                     contexts=(2**18,), steps=1, warmup=0)  # fmt: skip
    assert result["rows"] == [] and [c["level"] for c in result["skipped"]] == ["op", "model"]
    assert "GiB is free on cpu" in result["skipped"][1]["reason"]


def test_op_level_with_the_static_cache_times_the_bucket_decoding_op():
    result = _decode(kv_cache="static", levels=("op",), contexts=(64,), batch_size=(2,),
                     top_k=(1,))  # fmt: skip
    focus = next(r for r in result["rows"] if r["method"] == "focus")
    # what "auto" decodes over the buckets with: the Triton kernel on CUDA, else masked's form
    on_cuda = result["config"]["device"].startswith("cuda")
    expected = "triton" if on_cuda and not triton_reason(torch.device("cuda")) else "masked"
    assert focus["backend"] == expected
    assert focus["batch_size"] == 2 and 0 < focus["share"] < 1 and focus["index_bytes"] > 0


# ---------------------------------------------------------------------------------------------
# prefill with a preset; merged results and plots
# ---------------------------------------------------------------------------------------------


def test_prefill_of_a_preset_reports_the_share_of_the_floor_speed_up(tmp_path):
    out = tmp_path / "model.json"
    assert cli.main(["bench", "model", "--model", "random:llama-tiny", "--lengths", "64", "--top-k", "1",
                     "--window", "16", "--sink-tokens", "2", "--warmup-tokens", "8", "--warmup", "1",
                     "--device", "cpu", "--no-progress", "--json", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    rows = {r["method"]: r for r in result["rows"]}
    floor = rows["none"]["speedup_vs_sdpa"]
    assert rows["focus"]["share_of_floor_speedup"] == pytest.approx(rows["focus"]["speedup_vs_sdpa"] / floor)  # fmt: skip
    assert rows["sdpa"]["share_of_floor_speedup"] == pytest.approx(1 / floor)
    assert (result["config"]["weights"], result["config"]["preset"]) == ("random", "llama-tiny")
    assert result["config"]["device"] == "cpu" and result["environment"]["git_commit"] is not None
    assert (tmp_path / "model.png").stat().st_size > 0


def test_merge_and_plot_result_files(tmp_path, capsys):
    from focus_attention.bench.results import merge_results

    paths = []
    for n in (32, 48):
        paths.append(tmp_path / f"decode-{n}.json")
        assert cli.main(["bench", "decode", "--model", "random:llama-tiny", "--contexts", str(n),
                         "--top-k", "1", "--window", "8", "--steps", "1", "--warmup", "0",
                         "--kv-cache", "static", "--batch-size", "1", "2", "--no-progress",
                         "--json", str(paths[-1])]) == 0  # fmt: skip
    merged = tmp_path / "decode.json"
    assert cli.main(["bench", "merge", "--results", *map(str, paths), "--json", str(merged)]) == 0
    data = json.loads(merged.read_text())
    assert data["merged"] and data["benchmark"] == "decode" and len(data["parts"]) == 2
    assert data["environment"] == data["parts"][0]["environment"]
    assert cli.main(["bench", "plot", "--results", str(merged), "--out", str(tmp_path / "png")]) == 0  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["decode-1.png", "decode-2.png"]
    with pytest.raises(ValueError, match="one benchmark's"):
        merge_results([data, {"benchmark": "kernel"}])
    capsys.readouterr()
    assert cli.main(["bench", "merge", "--results", str(merged)]) != 0
    assert "--json is required" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# on a GPU: the captures themselves
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_captured_static_decoding_step_replays_the_eager_one():
    """A Focus step over a static cache captured after one warm-up step, replayed with the
    next token, gives the logits the same two steps give eagerly."""
    from transformers import StaticCache

    from focus_attention.bench.decode_model import repeat_cache
    from focus_attention.hf import FocusConfig, get_focus_model
    from focus_attention.hf.compat import cache_kwargs

    model = build_random_model("random:llama-tiny", device="cuda", dtype="bfloat16")
    fm = get_focus_model(model, FocusConfig(num_groups=4, top_k=1, window=4, sink_tokens=1)).eval()
    ids = random_token_ids(512, 2, 34, seed=3).cuda()
    with torch.inference_mode():
        cache = StaticCache(config=model.config, max_cache_len=48)
        fm(input_ids=ids[:, :30], **cache_kwargs(cache), use_cache=True)
        eager_cache = repeat_cache(cache, 1)
        tokens, outs = ids[:, 30:31].clone(), []

        def call():
            outs.append(fm(input_ids=tokens, **cache_kwargs(cache), use_cache=True).logits)

        replay = graphs.graph_step(call, warmup=1)
        tokens.copy_(ids[:, 31:32])
        replay()
        torch.cuda.synchronize()
        eager = [fm(input_ids=ids[:, i : i + 1], **cache_kwargs(eager_cache), use_cache=True).logits
                 for i in (30, 31)]  # fmt: skip
    bf16_logits = 3e-2  # bfloat16 logits of one step, replayed or eager (two steps differ more)
    assert torch.allclose(outs[-1].float(), eager[1].float(), atol=bf16_logits)
    assert not torch.allclose(eager[0].float(), eager[1].float(), atol=bf16_logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_static_row_is_captured_on_cuda():
    result = _decode(kv_cache="static", batch_size=(1, 2), device="cuda", dtype="bfloat16",
                     cuda_graphs=True, levels=("op", "model"), contexts=(256,))  # fmt: skip
    for row in result["rows"]:
        assert row["cuda_graph"], (row["level"], row["method"], row["graph_note"])
    assert result["crossover"][0]["device"] == torch.cuda.get_device_name()
