"""``focus bench serve`` (docs/deploy.md): its settings, the summary of a cell (every request
counted, answered or not), the directories it serves (Focus at each top_k, the dense base on
the same weights) and, end to end on a tiny exported model, a result with every request
answered, its JSON and its plot. Timings are reported, never asserted."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import focus, ids, word_tokenizer
from tiny_assets import PUNCT, WORDS, make_corpus_dir
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from transformers.utils.import_utils import is_serve_available

from focus_attention import export_model
from focus_attention.bench.serve import cell_row, percentile, served_variants
from focus_attention.bench.settings import ServeBenchConfig
from focus_attention.deploy.settings import exported_settings


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tok = word_tokenizer(WORDS + PUNCT)
    overrides = {"vocab_size": len(tok), "max_position_embeddings": 256}
    _, fm = focus("llama", window=8, top_k=1, model_overrides=overrides)
    return export_model(fm, tmp_path_factory.mktemp("bench-serve") / "tiny-focus", tok)


def test_the_settings_name_a_bad_field():
    with pytest.raises(ValueError, match="ServeBenchConfig.adapter"):
        ServeBenchConfig()  # neither an adapter nor an exported directory
    with pytest.raises(ValueError, match="ServeBenchConfig.adapter"):
        ServeBenchConfig(adapter="a", export="b")
    with pytest.raises(ValueError, match="ServeBenchConfig.concurrency"):
        ServeBenchConfig(adapter="a", concurrency=(0,))
    with pytest.raises(ValueError, match="ServeBenchConfig.max_new_tokens"):
        ServeBenchConfig(adapter="a", max_new_tokens=0)
    with pytest.raises(ValueError, match="ServeBenchConfig.dtype"):
        ServeBenchConfig(adapter="a", dtype="bf16")
    with pytest.raises(ValueError, match="ServeBenchConfig.warmup"):
        ServeBenchConfig(adapter="a", warmup=-1)
    config = ServeBenchConfig(adapter="a")
    assert (config.dtype, config.warmup) == (None, 1)
    assert (config.top_k, config.concurrency, config.lengths) == ((1, 2), (16, 64), (1024, 2048, 4096, 8000))  # fmt: skip


def test_a_cell_counts_every_request_and_its_percentiles():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99
    ok = [{"ttft_s": t, "latency_s": 2 * t, "tokens": 4, "prompt_tokens": 10, "error": None}
          for t in (1.0, 2.0, 3.0)]  # fmt: skip
    failed = [{"ttft_s": None, "latency_s": None, "tokens": 0, "error": "cell timeout"}] * 2
    row = cell_row(ok + failed, wall=6.0)
    assert (row["sent"], row["answered"], row["errors"]) == (5, 3, {"cell timeout": 2})
    assert row["tokens_per_second"] == 2.0 and row["generated_tokens"] == 12
    assert (row["ttft_p50_s"], row["latency_p99_s"]) == (2.0, 6.0)


def test_the_variants_serve_focus_at_each_top_k_and_the_dense_base(exported, tmp_path):
    variants = served_variants(exported, (1, 2), True, tmp_path)
    assert [(v["method"], v["top_k"]) for v in variants] == [("focus", 1), ("focus", 2), ("dense", None)]  # fmt: skip
    assert variants[0]["directory"] == exported  # its own top_k: the export itself
    assert (
        AutoConfig.from_pretrained(variants[1]["directory"], trust_remote_code=True).focus["top_k"]
        == 2
    )
    focus_model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    dense = AutoModelForCausalLM.from_pretrained(variants[2]["directory"])  # no custom code
    assert type(dense) is LlamaForCausalLM and not hasattr(dense, "focus_model")
    x = ids(1, 48, seed=2, vocab=focus_model.config.vocab_size)
    with torch.no_grad():
        with focus_model.focus_model.disable_focus():
            want = focus_model(input_ids=x).logits
        got = dense(input_ids=x).logits
        assert torch.equal(got, want)
        assert not torch.equal(focus_model(input_ids=x).logits, want)


def test_the_settings_reach_an_export_served_as_it_is(exported, tmp_path):
    """``--export DIR`` with an inference setting (``--attention-backend masked``): every
    Focus variant's ``config.json`` carries it, the one at the export's own top_k too."""
    own = exported_settings(json.loads((exported / "config.json").read_text()))["top_k"]
    variants = served_variants(exported, (own, 2), False, tmp_path,
                               {"attention_backend": "masked", "dense_heads": ((0, 0),)})  # fmt: skip
    assert all(v["directory"] != exported for v in variants)
    for v in variants:
        config = AutoConfig.from_pretrained(v["directory"], trust_remote_code=True).focus
        assert (config["attention_backend"], config["top_k"]) == ("masked", v["top_k"])
        assert config["dense_heads"] == [[0, 0]]
    # a top_k given twice (or None beside the export's own) is one variant, and a work
    # directory of an earlier run is reused
    again = served_variants(exported, (None, own, 2, 2), True, tmp_path, {"attention_backend": "masked"})  # fmt: skip
    assert [(v["method"], v["top_k"]) for v in again] == [("focus", own), ("focus", 2), ("dense", None)]  # fmt: skip


def test_continuous_batching_servers_size_their_cache_for_the_cells(exported, tmp_path, monkeypatch):  # fmt: skip
    """Servers started together with ``--continuous-batching`` size their KV cache for the
    cells, not from the memory free when each starts (three together ran out of memory, or
    stalled with a full cache): room for every request of the largest cell at the longest
    prompt, in blocks of 256 tokens."""
    from focus_attention.assets.corpora import prepare_corpus
    from focus_attention.bench import serve

    started = []

    class Recording:
        def __init__(self, directory, log, **kw):
            self.extra = kw["extra"]

        def start(self):
            started.append(self.extra)

        def stop(self):
            pass

        def wait_ready(self):
            raise RuntimeError("not serving in this test")

    monkeypatch.setattr(serve, "ServedModel", Recording)
    monkeypatch.setenv("FOCUS_HOME", str(tmp_path / "home"))
    corpus = make_corpus_dir(tmp_path / "books", n_docs=3, n_words=600)
    prepare_corpus(corpus, quiet=True)
    config = ServeBenchConfig(export=str(exported), corpus=str(corpus), top_k=(1, 2),
                              concurrency=(2, 3), lengths=(24, 300), max_new_tokens=8,
                              continuous_batching=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="not serving"):
        serve.run_serve_benchmark(config, log=lambda line: None)
    assert len(started) == 3  # top-1, top-2, dense
    blocks = 3 * 2 + 8  # 3 requests of 300 + 8 + 16 tokens: 2 blocks each, and 8 spare
    for extra in started:
        assert extra[:3] == ("--continuous-batching", "--cb-num-blocks", str(blocks))


def _served_settings(exported, tmp_path, monkeypatch, **overrides) -> tuple[list[dict], dict]:
    """The settings in the ``config.json`` of every Focus variant ``focus bench serve --export`` would serve
    with ``overrides``, and the overrides its result records (the servers are not started)."""
    from focus_attention.assets.corpora import prepare_corpus
    from focus_attention.bench import serve

    served = []

    def run_cells(variants, *args):
        served.extend(exported_settings(json.loads((v["directory"] / "config.json").read_text()))
                      for v in variants if v["method"] == "focus")  # fmt: skip
        return []

    monkeypatch.setattr(serve, "_run_cells", run_cells)
    monkeypatch.setenv("FOCUS_HOME", str(tmp_path / "home"))
    corpus = make_corpus_dir(tmp_path / "books", n_docs=3, n_words=600)
    prepare_corpus(corpus, quiet=True)
    config = ServeBenchConfig(export=str(exported), corpus=str(corpus), top_k=(1, 2),
                              lengths=(24,), work_dir=str(tmp_path / "work"), **overrides)  # fmt: skip
    result = serve.run_serve_benchmark(config, log=lambda line: None)
    return served, result["config"]["overrides"]


def test_every_override_of_an_export_is_served_falsy_ones_too(tmp_path, monkeypatch):
    """``--export DIR`` with settings that are 0 or empty (``--sink-tokens 0``, no dense
    layers or heads) against an export whose own are not: every Focus variant serves the
    given value, and the result records what was served."""
    tok = word_tokenizer(WORDS + PUNCT)
    overrides = {"vocab_size": len(tok), "max_position_embeddings": 256}
    _, fm = focus("llama", window=8, top_k=1, sink_tokens=2, dense_layers=(1,),
                  dense_heads=((0, 0),), model_overrides=overrides)  # fmt: skip
    exported = export_model(fm, tmp_path / "export", tok)
    given = {"sink_tokens": 0, "dense_layers": (), "dense_heads": (), "window": 4}
    served, recorded = _served_settings(exported, tmp_path, monkeypatch, **given)
    assert [c["top_k"] for c in served] == [1, 2]
    for name, value in given.items():
        for config in served:
            assert config[name] == (list(value) if isinstance(value, tuple) else value), name
        assert recorded[name] == value, name
    served, recorded = _served_settings(exported, tmp_path / "own", monkeypatch)
    assert [(c["sink_tokens"], c["dense_layers"]) for c in served] == [(2, [1]), (2, [1])]


class _Server:
    url, model = "http://127.0.0.1:1", "tiny"


def _stream(events: list[dict]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"  # fmt: skip


def test_a_stream_that_ends_without_a_finish_reason_is_an_error_not_an_answer(monkeypatch):
    """A completion streamed without a finish reason (a server that stopped mid-answer)
    counts as an error: it is not answered, and neither its tokens nor its short latency
    enter tokens/s and the percentiles; a finished stream is answered."""
    import asyncio

    import httpx

    from focus_attention.bench import serve

    usage = {"completion_tokens": 3, "prompt_tokens": 5}
    finished = [{"choices": [{"text": "a", "finish_reason": None}]},
                {"choices": [{"text": "b", "finish_reason": "length"}], "usage": usage}]  # fmt: skip
    cut = [{"choices": [{"text": "a", "finish_reason": None}], "usage": usage}]

    def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        return httpx.Response(200, content=_stream(cut if prompt == "cut" else finished))

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))  # fmt: skip
    config = ServeBenchConfig(export="x", max_new_tokens=3, cell_timeout=30)
    records, wall = asyncio.run(serve._cell(_Server(), ["ok", "cut", "ok"], config, 3))
    assert [r["error"] for r in records] == [None, "the stream ended without a finish reason", None]  # fmt: skip
    row = cell_row(records, wall)
    assert (row["sent"], row["answered"], row["generated_tokens"]) == (3, 2, 6)
    assert row["errors"] == {"the stream ended without a finish reason": 1}
    answered = [r["latency_s"] for r in records if r["error"] is None]
    assert row["latency_p99_s"] == percentile(answered, 99)


@pytest.mark.slow
@pytest.mark.skipif(not is_serve_available(), reason="the serve extra: pip install '.[serve]'")
def test_the_benchmark_answers_every_request_and_writes_json_and_a_plot(exported, tmp_path, monkeypatch):  # fmt: skip
    from focus_attention.assets.corpora import prepare_corpus
    from focus_attention.bench.serve import plot_serve, run_serve_benchmark, serve_table

    monkeypatch.setenv("FOCUS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    corpus = make_corpus_dir(tmp_path / "books", n_docs=3, n_words=600)
    prepare_corpus(corpus, quiet=True)
    config = ServeBenchConfig(export=str(exported), corpus=str(corpus), top_k=(2,),
                              concurrency=(2,), requests=3, lengths=(24, 40),
                              max_new_tokens=3, device="cpu", ready_timeout=180,
                              cell_timeout=300, dtype="float32", warmup=1)  # fmt: skip
    partial = []
    result = run_serve_benchmark(config, log=lambda line: None, checkpoint=partial.append)
    rows = result["rows"]
    # both served at once, each cell sent to each in turn
    assert [(r["method"], r["top_k"], r["prompt_tokens"]) for r in rows] == [
        (m, k, n) for n in (24, 40) for m, k in (("focus", 2), ("dense", None))
    ]
    # after every cell, the result so far
    assert [len(p["rows"]) for p in partial] == [1, 2, 3, 4]
    assert not any(p["complete"] for p in partial) and result["complete"]
    assert partial[-1]["rows"] == rows
    for r in rows:
        assert (r["sent"], r["answered"], r["errors"]) == (3, 3, {}), r
        assert r["generated_tokens"] == 9 and r["tokens_per_second"] > 0
        assert r["ttft_p50_s"] <= r["latency_p99_s"]
        assert r["warmup_s"] > 0  # one request of each length before the cells
    assert (result["config"]["dtype"], result["config"]["warmup_requests_per_length"]) == ("float32", 1)  # fmt: skip
    assert result["config"]["server_env"] == {"USE_HUB_KERNELS": "0"}  # no Hub kernels offline
    assert {"git_commit", "torch", "cpu"} <= set(result["environment"])
    json.dumps(result)
    assert "| focus top_k=2 | 2 | 40 | 3/3 |" in serve_table(result)
    plot_serve(result, str(tmp_path / "serve.png"))
    assert (tmp_path / "serve.png").stat().st_size > 0
