"""Benchmark plumbing (no timing assertions: timings are benchmarked, not tested)."""

import json
from dataclasses import replace

import pytest
import torch
from tolerances import tolerance

from focus_attention import cli, pairs_retained
from focus_attention.bench import kernel as bench
from focus_attention.utils.io import write_json_atomic


def test_balanced_memberships_are_exactly_balanced_and_top_k():
    gen = torch.Generator().manual_seed(0)
    for top_k in (1, 2, 3):
        g = bench.balanced_memberships(96, 8, top_k, gen)
        assert g.dtype == torch.bool and g.shape == (1, 96, 8)
        assert (g.sum(-1) == top_k).all()
        assert (g[0].sum(0) == 96 * top_k // 8).all()


def test_kernel_benchmark_writes_json_table_and_plot(tmp_path):
    out = tmp_path / "k.json"
    rc = cli.main(
        [
            "bench", "kernel", "--json", str(out), "--lengths", "64", "96", "--top-k", "1",
            "--repeats", "1", "--no-memory", "--no-gates", "--window", "8",
        ]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "kernel"
    assert {r["N"] for r in data["rows"]} == {64, 96}
    for r in data["rows"]:
        assert r["dense_s"] > 0 and r["sparse_s"] > 0
        assert 0 < r["density"] <= 1
        assert r["ideal_speedup"] == pytest.approx(1 / r["density"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["ideal_speedup"])
    assert data["environment"]["torch"] == torch.__version__
    assert (tmp_path / "k.png").stat().st_size > 0
    table = bench.kernel_table(data)
    assert table.count("\n") == 3


def test_kernel_inputs_are_the_same_numbers_in_every_dtype():
    cfg = dict(num_heads=2, num_key_value_heads=1, head_dim=8, num_groups=4, seed=3)
    q32, k32, _, g32, _ = bench.kernel_inputs(32, 2, {**cfg, "dtype": "float32"})
    q16, k16, _, g16, _ = bench.kernel_inputs(32, 2, {**cfg, "dtype": "bfloat16"})
    assert q16.dtype == torch.bfloat16 and q32.dtype == torch.float32
    assert torch.equal(q16, q32.to(torch.bfloat16)) and torch.equal(k16, k32.to(torch.bfloat16))
    assert torch.equal(g16, g32)


@pytest.mark.parametrize("dense_kernel", ["auto", "math"])
def test_dense_kernel_choice_gives_dense_causal_attention(dense_kernel):
    cfg = dict(num_heads=4, num_key_value_heads=2, head_dim=8, num_groups=4, seed=0)
    q, k, v, qg, kg = bench.kernel_inputs(40, 1, cfg)
    out = bench.kernel_call("dense", q, k, v, qg, kg, 8, dense_kernel=dense_kernel)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    logits = (q @ kk.transpose(-1, -2)) * 8**-0.5
    logits = logits.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ vv, **tolerance("oracle"))


def test_kernel_benchmark_records_dtype_and_device(tmp_path):
    out = tmp_path / "k.json"
    args = ["bench", "kernel", "--json", str(out), "--lengths", "64", "--top-k", "1",
            "--repeats", "1", "--no-memory", "--no-gates", "--window", "8",
            "--dtype", "bfloat16", "--dense-kernel", "math"]  # fmt: skip
    assert cli.main(args) == 0
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["dtype"], cfg["device"], cfg["dense_kernel"]) == ("bfloat16", "cpu", "math")


@pytest.mark.parametrize("per_head", [False, True])
def test_kernel_queries_can_join_more_groups_than_the_keys(per_head, tmp_path):
    """``query_top_k``: queries draw their own balanced memberships of that many groups, keys
    keep ``top_k``; the density recorded is that of the two memberships."""
    cfg = dict(num_heads=4, num_key_value_heads=2, head_dim=8, num_groups=8, seed=1,
               per_head_groups=per_head, query_top_k=3)  # fmt: skip
    _, _, _, qg, kg = bench.kernel_inputs(48, 1, cfg)
    assert qg.shape == kg.shape == ((1, 48, 2, 8) if per_head else (1, 48, 8))
    assert bool((qg.sum(-1) == 3).all()) and bool((kg.sum(-1) == 1).all())
    out = tmp_path / "k.json"
    args = ["bench", "kernel", "--json", str(out), "--lengths", "48", "--top-k", "1",
            "--query-top-k", "3", "--repeats", "1", "--no-memory", "--no-gates", "--window", "4",
            "--num-groups", "8", "--num-heads", "4", "--num-key-value-heads", "2",
            "--head-dim", "8", "--seed", "1", *(["--per-head-groups"] if per_head else [])]  # fmt: skip
    assert cli.main(args) == 0
    data = json.loads(out.read_text())
    assert data["config"]["query_top_k"] == 3
    assert data["rows"][0]["density"] == pytest.approx(pairs_retained(qg, kg, 4))
    with pytest.raises(ValueError, match="query_top_k"):
        bench.KernelBenchConfig(num_groups=4, query_top_k=5)


@pytest.mark.parametrize("per_head", [False, True])
def test_kernel_queries_can_draw_their_groups_at_random(per_head, tmp_path):
    """``query_draw="random"``: each query in exactly ``query_top_k`` groups, drawn among all
    sets (many distinct ones, where the balanced draw makes K), keys still balanced; the
    result records the draw; without ``query_top_k`` it is refused by name."""
    cfg = dict(num_heads=4, num_key_value_heads=2, head_dim=8, num_groups=16, seed=1,
               per_head_groups=per_head, query_top_k=4)  # fmt: skip
    _, _, _, balanced, _ = bench.kernel_inputs(256, 1, cfg)
    _, _, _, qg, kg = bench.kernel_inputs(256, 1, {**cfg, "query_draw": "random"})
    assert qg.shape == kg.shape == ((1, 256, 2, 16) if per_head else (1, 256, 16))
    assert bool((qg.sum(-1) == 4).all()) and bool((kg.sum(-1) == 1).all())
    assert bool((kg.sum(1) == 16).all())  # 256 keys, 16 per group
    sets = {tuple(row) for row in qg.reshape(-1, 16).int().tolist()}
    assert len({tuple(row) for row in balanced.reshape(-1, 16).int().tolist()}) == 16
    assert len(sets) > 150
    out = tmp_path / "k.json"
    args = ["bench", "kernel", "--json", str(out), "--lengths", "48", "--top-k", "1",
            "--query-top-k", "4", "--query-draw", "random", "--repeats", "1", "--no-memory",
            "--no-gates", "--window", "4", "--num-groups", "16", "--num-heads", "4",
            "--num-key-value-heads", "2", "--head-dim", "8", "--seed", "1"]  # fmt: skip
    assert cli.main(args) == 0
    assert json.loads(out.read_text())["config"]["query_draw"] == "random"
    with pytest.raises(ValueError, match="query_draw.*unless query_top_k"):
        bench.KernelBenchConfig(query_draw="random")
    with pytest.raises(ValueError, match="query_draw"):
        bench.KernelBenchConfig(query_top_k=2, query_draw="sorted")


def test_kernel_benchmark_rejects_bad_settings():
    with pytest.raises(ValueError, match="dtype"):
        bench.KernelBenchConfig(dtype="int8")
    with pytest.raises(ValueError, match="device"):
        bench.KernelBenchConfig(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            bench.KernelBenchConfig(device="cuda")
    with pytest.raises(ValueError, match="KernelBenchConfig.attention_backend: received 'nope'"):
        bench.KernelBenchConfig(attention_backend="nope")


def test_kernel_benchmark_backend_is_the_shared_attention_backend_setting(capsys):
    """The kernel benchmark's backend is ``attention_backend``, as on every other command;
    ``backend`` (its earlier name) still works as a key and as a flag, with a warning."""
    with pytest.warns(DeprecationWarning, match="backend"):
        assert bench.KernelBenchConfig(backend="masked").attention_backend == "masked"
    assert bench.KernelBenchConfig().attention_backend == "auto"
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "kernel", "--backend", "math"])
    assert "deprecated, use --attention-backend" in capsys.readouterr().err
    assert args.attention_backend == "math"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_benchmark_on_cuda_measures_allocator_memory():
    config = bench.KernelBenchConfig(lengths=(512,), top_k=(1,), repeats=1, gates=False,
                                     device="cuda", dtype="bfloat16", progress=False)  # fmt: skip
    row = bench.run_kernel_benchmark(config)["rows"][0]
    # the bf16 output alone is 9 * 512 * 64 * 2 bytes
    assert row["dense_peak_bytes"] >= 9 * 512 * 64 * 2
    assert row["sparse_peak_bytes"] >= 9 * 512 * 64 * 2


@pytest.mark.slow  # a fresh Python process that imports torch: about 4 s
def test_peak_memory_is_measured_in_a_fresh_process():
    cfg = dict(num_heads=2, num_key_value_heads=1, head_dim=16, window=8, num_groups=4, seed=0)
    peak = bench.kernel_peak_memory("sparse", 4096, 1, cfg)
    if peak is None:
        pytest.skip("no /proc/self/clear_refs on this platform")
    # the fp32 output alone is 2 * 4096 * 16 * 4 bytes = 512 KiB
    assert peak >= 2 * 4096 * 16 * 4


def test_gate_benchmark_rows():
    rows = bench.run_gate_benchmark(64, num_heads=2, num_key_value_heads=1, head_dim=8, repeats=1)
    assert [r["method"] for r in rows] == ["eager_dense", "gate_paper", "gate_log"]
    assert rows[0]["forward_ratio"] == 1.0


def test_cli_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for name in ("setup", "models", "data", "bench"):
        assert name in text


def test_write_json_atomic_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "r.json"
    write_json_atomic(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in target.parent.iterdir()] == ["r.json"]


def test_environment_records_the_code_version():
    from focus_attention.utils.env import environment

    env = environment()
    for key in ("focus_attention", "torch", "python", "cpu", "torch_threads", "date"):
        assert env[key], key
    commit = env["git_commit"]  # this test runs from the repository
    assert commit is not None and len(commit.split("+")[0]) == 40


def test_environment_records_the_focus_variables_set(monkeypatch):
    """``FOCUS_NO_EXTENSION`` changes the path a run takes: a result says it was set."""
    from focus_attention.utils.env import environment

    monkeypatch.setenv("FOCUS_NO_EXTENSION", "1")
    monkeypatch.setenv("NOT_FOCUS_X", "1")
    assert environment()["focus_variables"].get("FOCUS_NO_EXTENSION") == "1"
    assert "NOT_FOCUS_X" not in environment()["focus_variables"]


def test_model_benchmark_rows_per_window_and_top_k(tmp_path, monkeypatch):
    """``focus bench model`` on a tiny model: one stock row and one Focus row per (window,
    top_k) and length, each with its window; the table names them."""
    from tiny_assets import make_tiny_assets, use_tiny_assets

    from focus_attention.bench.model import ModelBenchConfig, model_table, run_model_benchmark

    assets = use_tiny_assets(make_tiny_assets(tmp_path), monkeypatch)
    cfg = ModelBenchConfig(model=str(assets["model"]), corpus=str(assets["corpus"]),
                           lengths=(48, 64), top_k=(1, 2), windows=(8, 16), num_groups=4,
                           warmup_tokens=8, threads=1, progress=False)  # fmt: skip
    result = run_model_benchmark(cfg)
    rows = result["rows"]
    assert len(rows) == 2 * (2 + 2 * 2)  # sdpa, the floor and (window, top_k) per length
    floors = [r for r in rows if r["method"] == "none"]
    assert sorted(r["N"] for r in floors) == [48, 64]
    for r in rows:
        if r["method"] not in ("none", "sdpa"):
            continue
        floor = next(f for f in floors if f["N"] == r["N"])
        spent = r["seconds"] - floor["seconds"]
        assert r.get("attention_seconds") == (None if r["method"] == "none" else spent)
    focus_rows = [(r["N"], r["top_k"], r["window"]) for r in rows if r["method"] == "focus"]
    assert sorted(focus_rows) == sorted(
        (n, k, w) for n in (48, 64) for k in (1, 2) for w in (8, 16)
    )
    assert all(r["seconds"] > 0 and r["speedup_vs_sdpa"] > 0 for r in rows)
    assert result["config"]["windows"] == [8, 16]
    assert result["config"]["routers"] == {"adapter": None, "fresh": True}
    assert "focus top_k=2, window=16" in model_table(result)
    assert result["versions"]["transformers"] and result["config"]["max_position_embeddings"]
    assert "none (floor)" in model_table(result)


def test_decode_benchmark_rows_at_both_levels(tmp_path, monkeypatch, kernel_built):
    """``focus bench decode`` on a tiny model: per context a dense and a Focus row per top_k
    at each level (two dense rows at the model level: stock and buffered cache), shares of
    keys seen in (0, 1] and consistent derived columns."""
    from tiny_assets import make_tiny_assets, use_tiny_assets

    from focus_attention.bench.decode import DecodeBenchConfig, decode_table, run_decode_benchmark

    assets = use_tiny_assets(make_tiny_assets(tmp_path), monkeypatch)
    cfg = DecodeBenchConfig(model=str(assets["model"]), corpus=str(assets["corpus"]),
                            contexts=(24, 48), top_k=(1, 2), num_groups=4, window=8, steps=2,
                            warmup=1, threads=1, progress=False)  # fmt: skip
    result = run_decode_benchmark(cfg)
    rows = result["rows"]
    methods = {"op": (("dense", 0), ("focus", 1), ("focus", 2)),
               "model": (("dense", 0), ("dense", 0), ("focus", 1), ("focus", 2))}  # fmt: skip
    for level in ("op", "model"):
        got = sorted((r["N"], r["method"], r["top_k"] or 0) for r in rows if r["level"] == level)
        assert got == sorted((n, m, k) for n in (24, 48) for m, k in methods[level])
    model_rows = [r for r in rows if r["level"] == "model"]
    assert sorted(r["cache"] for r in model_rows if r["N"] == 24) == ["buffered", "dynamic", "focus", "focus"]  # fmt: skip
    dense = {(r["N"], r["cache"]): r["seconds"] for r in model_rows if r["method"] == "dense"}
    for r in rows:
        assert 0 < r["share"] <= 1 and r["seconds"] > 0
        assert r["ideal_speedup"] == pytest.approx(1 / r["share"])
        same_cache = r["speedup_vs_dense"] if r["level"] == "op" else r["speedup_vs_buffered_dense"]
        assert r["efficiency"] == pytest.approx(same_cache / r["ideal_speedup"])
        if r["level"] == "model":
            assert r["speedup_vs_dense"] == pytest.approx(dense[(r["N"], "dynamic")] / r["seconds"])
            assert r["speedup_vs_buffered_dense"] == pytest.approx(dense[(r["N"], "buffered")] / r["seconds"])  # fmt: skip
        if r["method"] == "focus":
            assert r["share"] < 1  # the window (8) is far below the context
    op = {(r["N"], r["top_k"]): r["share"] for r in rows if r["level"] == "op" and r["top_k"]}
    assert op[(48, 1)] < op[(48, 2)]  # a second group shows more keys
    assert "| model | 48 | 1 | focus top_k=2 | focus |" in decode_table(result)
    assert "| model | 48 | 1 | dense | buffered |" in decode_table(result)
    assert result["versions"]["transformers"] and result["versions"]["numpy"]


def test_decode_and_model_benchmarks_with_dense_layers(tmp_path, monkeypatch, kernel_built):
    """``--dense-layers``: recorded in the config and named in the table; a dense layer sees
    every cached key, so with every layer dense the decoded share is 1."""
    from tiny_assets import make_tiny_assets, use_tiny_assets

    from focus_attention.bench.decode import DecodeBenchConfig, run_decode_benchmark
    from focus_attention.bench.model import ModelBenchConfig, model_table, run_model_benchmark

    assets = use_tiny_assets(make_tiny_assets(tmp_path), monkeypatch)
    shares = {}
    for dense in ((1,), (0, 1)):
        cfg = DecodeBenchConfig(model=str(assets["model"]), corpus=str(assets["corpus"]),
                                contexts=(24,), top_k=(1,), levels=("model",), num_groups=4,
                                window=4, steps=2, warmup=1, threads=1, dense_layers=dense,
                                progress=False)  # fmt: skip
        result = run_decode_benchmark(cfg)
        assert result["config"]["dense_layers"] == list(dense)
        shares[dense] = next(r["share"] for r in result["rows"] if r["method"] == "focus")
    assert shares[(1,)] < 1 and shares[(0, 1)] == 1.0
    cfg = ModelBenchConfig(model=str(assets["model"]), corpus=str(assets["corpus"]),
                           lengths=(32,), top_k=(1,), windows=(8,), num_groups=4,
                           warmup_tokens=8, threads=1, dense_layers=(1,), sink_tokens=3,
                           query_top_k=2, progress=False)  # fmt: skip
    result = run_model_benchmark(cfg)
    assert result["config"]["dense_layers"] == [1] and result["config"]["sink_tokens"] == 3
    assert result["config"]["query_top_k"] == 2
    assert "focus top_k=1, window=8, dense layers 1, 3 sink tokens, query_top_k=2" in model_table(result)  # fmt: skip
    with pytest.raises(ValueError, match="query_top_k"):
        run_model_benchmark(replace(cfg, query_top_k=5))


def test_model_benchmark_records_the_adapters_number_of_groups(tmp_path, monkeypatch, kernel_built):
    """With an adapter the result records its K (here 3, a query-key adapter), not the
    ``num_groups`` of fresh routers."""
    from tiny_assets import make_tiny_assets, use_tiny_assets
    from transformers import AutoModelForCausalLM

    from focus_attention.bench.model import ModelBenchConfig, run_model_benchmark
    from focus_attention.hf import FocusConfig, get_focus_model

    assets = use_tiny_assets(make_tiny_assets(tmp_path), monkeypatch)
    base = AutoModelForCausalLM.from_pretrained(assets["model"])
    settings = FocusConfig(num_groups=3, top_k=1, window=8, router_input="query_key")
    get_focus_model(base, settings).save_pretrained(tmp_path / "adapter")
    cfg = ModelBenchConfig(model=str(assets["model"]), corpus=str(assets["corpus"]),
                           adapter=str(tmp_path / "adapter"), lengths=(32,), top_k=(1,),
                           warmup_tokens=8, threads=1, progress=False, floor=False)  # fmt: skip
    assert cfg.num_groups == 8
    assert run_model_benchmark(cfg)["config"]["num_groups"] == 3


def _decode_in(tmp_path, monkeypatch, **kw) -> dict:
    """``focus bench decode`` of the tiny model at both levels, 24 cached tokens."""
    from tiny_assets import make_tiny_assets, use_tiny_assets

    from focus_attention.bench.decode import DecodeBenchConfig, run_decode_benchmark

    assets = use_tiny_assets(make_tiny_assets(tmp_path), monkeypatch)
    cfg = DecodeBenchConfig(model=str(assets["model"]), corpus=str(assets["corpus"]),
                            contexts=(24,), top_k=(1,), num_groups=4, window=8, steps=2,
                            warmup=1, threads=1, progress=False, **kw)  # fmt: skip
    return run_decode_benchmark(cfg)


def test_decode_share_counts_what_the_decoded_query_attends(tmp_path, monkeypatch, kernel_built):
    """The model level's share of keys seen comes from the groups the layers routed with:
    streaming sees its window and the sinks (10 of the cached keys here), a query in every
    group sees every key, and a dense head adds its share of the layer; the overrides reach
    the model and the JSON."""
    from focus_attention.bench.decode import SHARE_STEPS, decode_table

    def share(**kw):
        result = _decode_in(tmp_path, monkeypatch, levels=("model",), **kw)
        return next(r for r in result["rows"] if r["method"] == "focus")["share"], result

    # the timed steps end at position 24 + 1 warm-up + 2 steps, then one counted step: the
    # share steps see 29.. keys
    keys = [24 + 1 + 2 + 1 + 1 + i for i in range(SHARE_STEPS)]
    got, result = share(inference_routing="streaming", sink_tokens=2)
    assert got == pytest.approx(sum(10 / n for n in keys) / len(keys))
    assert result["config"]["overrides"]["inference_routing"] == "streaming"
    assert "focus streaming (no groups)" in decode_table(result)
    assert share(query_top_k=4)[0] == pytest.approx(1.0)  # K = 4: the query is in every group
    plain = share()[0]
    heads, result = share(dense_heads=((0, 0),))
    assert plain < heads < 1.0
    assert result["config"]["overrides"]["dense_heads"] == ((0, 0),)


def test_decode_benchmark_in_bfloat16_records_dtype_and_device(tmp_path, monkeypatch, kernel_built):
    """``--dtype bfloat16 --device cpu``: both levels run in bfloat16 and say so."""
    result = _decode_in(tmp_path, monkeypatch, dtype="bfloat16", device="cpu")
    assert (result["config"]["dtype"], result["config"]["device"]) == ("bfloat16", "cpu")
    assert {r["level"] for r in result["rows"]} == {"op", "model"}
    assert all(r["seconds"] > 0 for r in result["rows"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_benchmark_on_cuda_names_the_decoding_backend(tmp_path, monkeypatch):
    """On CUDA a one-query call goes to ``gather`` (auto's choice for decoding), and the
    model level runs on the device."""
    result = _decode_in(tmp_path, monkeypatch, dtype="bfloat16", device="cuda")
    assert result["config"]["device"] == "cuda"
    assert {r["backend"] for r in result["rows"] if r["level"] == "op" and r["method"] == "focus"} == {"gather"}  # fmt: skip


@pytest.mark.parametrize(
    "changes, match",
    [(dict(levels=("gpu",)), "levels"), (dict(contexts=()), "contexts"), (dict(steps=0), "steps"),
     (dict(top_k=(0,)), "top_k"), (dict(dtype="int8"), "dtype"), (dict(device="tpu"), "device")],
)  # fmt: skip
def test_decode_benchmark_rejects_bad_settings(changes, match):
    from focus_attention.bench.decode import DecodeBenchConfig

    with pytest.raises(ValueError, match=match):
        DecodeBenchConfig(**changes)


def test_routers_record_names_the_adapter_its_weights_and_training(tmp_path):
    import hashlib
    import json

    from tiny import tiny_llama_focus

    from focus_attention.bench.model import routers_record

    tiny_llama_focus().save_pretrained(tmp_path / "a")
    digest = hashlib.sha256((tmp_path / "a" / "focus_model.safetensors").read_bytes()).hexdigest()
    assert routers_record(str(tmp_path / "a")) == {"adapter": str(tmp_path / "a"), "fresh": False,
                                                   "weights_sha256": digest}  # fmt: skip
    (tmp_path / "a" / "train_result.json").write_text(json.dumps({"steps": 80, "config": {"method": "focus"}}))  # fmt: skip
    record = routers_record(str(tmp_path / "a"))
    assert record["steps"] == 80 and record["method"] == "focus"


def test_interleaved_timing_calls_in_turns_inside_their_contexts():
    """Each round calls every function once, in order, inside its context; warm-up rounds
    are not timed."""
    import contextlib

    from focus_attention.bench.timing import interleaved_median_seconds

    log = []

    @contextlib.contextmanager
    def ctx():
        log.append("enter")
        yield
        log.append("exit")

    calls = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
    timed = interleaved_median_seconds(calls, repeats=3, warmup=2, contexts={"b": ctx})
    assert log == ["a", "enter", "b", "exit"] * 5
    assert set(timed) == {"a", "b"}
    for median, times in timed.values():
        assert len(times) == 3 and min(times) <= median <= max(times)


def test_model_benchmark_runs_the_adapters_own_window_by_default(assets, adapter, kernel_built):
    """Without ``windows`` an adapter runs with its own window (a calibrated adapter's
    settings are not replaced) and fresh routers with 128; given windows override both."""
    from focus_attention.bench.model import FRESH_WINDOW, ModelBenchConfig, run_model_benchmark

    def focus_windows(**kw):
        cfg = ModelBenchConfig(model=str(assets["model"]), corpus=str(assets["corpus"]),
                               lengths=(32,), top_k=(1,), num_groups=4, floor=False,
                               warmup_tokens=8, threads=1, progress=False, **kw)  # fmt: skip
        result = run_model_benchmark(cfg)
        rows = [r["window"] for r in result["rows"] if r["method"] == "focus"]
        assert result["config"]["windows"] == sorted(set(rows))
        return rows

    assert focus_windows(adapter=str(adapter)) == [8]  # tiny_config's window
    assert focus_windows(adapter=str(adapter), windows=(5, 6)) == [5, 6]
    assert focus_windows() == [FRESH_WINDOW]


def test_device_synchronize_waits_for_cuda_only():
    from focus_attention.bench.timing import device_synchronize

    assert device_synchronize("cpu") is None and device_synchronize(torch.device("cpu")) is None
    assert device_synchronize("cuda:0") is torch.cuda.synchronize


def _decode_share(fm) -> float:
    """The model level's share of keys seen over 10 decoding steps after a 30-token prompt."""
    from tiny import ids

    from focus_attention.bench.decode_model import attention_shape, recorded_reads, recorded_share
    from focus_attention.hf.compat import cache_kwargs, cache_of

    x = ids(1, 40, seed=1)
    with torch.inference_mode():
        cache = cache_of(fm(input_ids=x[:, :30], use_cache=True))
        pos = iter(range(30, 40))

        def step():
            i = next(pos)
            fm(input_ids=x[:, i : i + 1], use_cache=True, **cache_kwargs(cache))

        kv_heads = attention_shape(fm.base_model)["kv_heads"]
        return recorded_share(fm, recorded_reads(fm, step, kv_heads))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_recorded_share_on_models_with_and_without_grouped_query_heads(arch):
    """The model level's share reads the key-value head count the model has (GPT-2 names
    none): a dense head raises the share above routing alone, below every key."""
    from tiny import focus

    _, fm = focus(arch, num_groups=4, top_k=1, window=8)
    routed = _decode_share(fm)
    fm.focus_config = fm.focus_config.replace(dense_heads=((fm.focus_layers[-1], 0),))
    assert routed < _decode_share(fm) < 1.0


def test_recorded_share_of_query_key_routers_is_per_key_value_head():
    """Query-key routers route each key-value head (here 2): the share is averaged over the
    heads, not summed, so one group (every key in it) sees every key, and K = 4 fewer."""
    from tiny import focus

    def share(num_groups: int) -> float:
        _, fm = focus("llama", num_groups=num_groups, top_k=1, window=8, router_input="query_key")
        assert fm.base_model.config.num_key_value_heads > 1
        return _decode_share(fm)

    assert share(1) == pytest.approx(1.0)
    assert 8 / 40 < share(4) < 1.0


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_count_operations_counts_operations_views_and_host_syncs(inference):
    """An add, a view, a nonzero (its size is read back), a sum, a comparison and a
    ``bool()`` (its value is read back): five operations, one view, two host syncs."""
    from focus_attention.bench.operations import count_operations

    x = torch.ones(4)

    def call():
        y = x + 1
        y.view(2, 2).nonzero()
        assert bool(y.sum() > 0)

    with torch.inference_mode(inference):
        got = count_operations(call)
    assert (got["operations"], got["views"], got["host_syncs"]) == (5, 1, 2)
    assert got["by_name"]["nonzero"] == 1


def test_decode_rows_count_operations_and_the_backend_setting_reaches_both_levels(tmp_path, monkeypatch, kernel_built):  # fmt: skip
    """Every row has its operation counts; ``--attention-backend masked`` reaches the op and
    model levels (the op level names it), and it reads nothing back from the device where
    ``gather`` reads one count per Focus layer and step."""
    runs = {b: _decode_in(tmp_path, monkeypatch, attention_backend=b) for b in ("gather", "masked")}  # fmt: skip
    for result in runs.values():
        assert all(r["operations"] > 0 and r["host_syncs"] >= 0 for r in result["rows"])
    focus = {b: {r["level"]: r for r in res["rows"] if r["method"] == "focus"} for b, res in runs.items()}  # fmt: skip
    assert focus["masked"]["op"]["backend"] == focus["masked"]["model"]["backend"] == "masked"
    from focus_attention.bench.decode import decode_table

    assert "focus top_k=1 (masked)" in decode_table(runs["masked"])
    assert runs["masked"]["config"]["overrides"]["attention_backend"] == "masked"
    assert focus["masked"]["op"]["host_syncs"] == 0 < focus["gather"]["op"]["host_syncs"]
    layers = 2  # the tiny model's Focus layers
    assert focus["masked"]["model"]["host_syncs"] + layers <= focus["gather"]["model"]["host_syncs"]  # fmt: skip
    dense = next(r for r in runs["masked"]["rows"] if r["level"] == "model" and r["method"] == "dense")  # fmt: skip
    assert dense["operations"] < focus["masked"]["model"]["operations"]


def test_decode_op_level_in_another_attention_shape_loads_no_model():
    """``--levels op`` with the whole shape given (here a larger model's 8 query and 2
    key-value heads of 32) runs without loading a model, in that shape; a shape whose
    heads are not a multiple of the key-value heads is refused."""
    from focus_attention.bench.decode import DecodeBenchConfig, run_decode_benchmark

    cfg = DecodeBenchConfig(model="no-such-model", levels=("op",), contexts=(40,), top_k=(1,),
                            num_groups=4, window=8, steps=2, warmup=1, threads=1,
                            progress=False, num_heads=8, num_key_value_heads=2, head_dim=32,
                            attention_backend="masked")  # fmt: skip
    result = run_decode_benchmark(cfg)
    assert result["config"]["model"] is None
    assert result["config"]["attention_shape"] == {"heads": 8, "kv_heads": 2, "head_dim": 32}
    assert {r["method"] for r in result["rows"]} == {"dense", "focus"}
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DecodeBenchConfig(num_heads=9, num_key_value_heads=2)
    assert DecodeBenchConfig(num_heads=8).needs_model  # part of a shape: the model's fills it


def test_count_operations_sees_index_reads_and_flex_attention():
    """An index by a bool mask and ``repeat_interleave`` by a tensor of counts read back to
    the host (an int index and a given ``output_size`` do not); FlexAttention's
    higher-order operator is counted, not refused."""
    from focus_attention.bench.operations import count_operations
    from focus_attention.ops import sparse_attention

    x, counts = torch.arange(6.0), torch.tensor([1, 2, 3])
    syncs = {name: count_operations(call)["host_syncs"] for name, call in {
        "bool index": lambda: x[x > 2], "int index": lambda: x[torch.tensor([0, 1])],
        "counts": lambda: torch.arange(3).repeat_interleave(counts),
        "counts, size given": lambda: torch.arange(3).repeat_interleave(counts, output_size=6),
    }.items()}  # fmt: skip
    assert syncs == {"bool index": 1, "int index": 0, "counts": 1, "counts, size given": 0}
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8, generator=g), *torch.randn(2, 1, 1, 20, 8, generator=g)
    qg, kg = torch.rand(1, 4, 3, generator=g) > 0.5, torch.rand(1, 20, 3, generator=g) > 0.5
    with torch.inference_mode():
        got = count_operations(lambda: sparse_attention(q, k, v, qg, kg, 4, backend="flex"))
    assert got["by_name"]["flex_attention"] >= 1


def test_decode_refuses_a_partial_shape_the_model_cannot_take(tmp_path, monkeypatch):
    """``--num-heads 3`` over the tiny model's 2 key-value heads: a clear error naming the
    settings, before anything is timed."""
    with pytest.raises(ValueError, match="3 query heads are not a multiple of its 2 key-value heads"):  # fmt: skip
        _decode_in(tmp_path, monkeypatch, levels=("op",), num_heads=3)
