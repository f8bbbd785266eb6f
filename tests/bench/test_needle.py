"""``focus bench needle``: settings, accuracy tables and plots, on the
tiny offline assets (the real-model numbers are a benchmark, not a test)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_assets import make_tiny_assets, tiny_config, use_tiny_assets

from focus_attention import cli
from focus_attention.bench import needle
from focus_attention.bench.needle import NeedleBenchConfig
from focus_attention.evaluation.needles import answer_margin, answer_of


@pytest.mark.parametrize(
    "change",
    [
        {"trials": 0},
        {"depths": (1.5,)},
        {"haystacks": ("web",)},
        {"lengths": (8,)},
        {"diagnostics": ("random",)},
        {"diagnostic_top_k": 0},
        {"diagnostic_top_k": 1.5},
    ],  # fmt: skip
)
def test_bad_settings_are_errors(change):
    with pytest.raises(ValueError):
        NeedleBenchConfig(**change)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from focus_attention.training import train

    assets = make_tiny_assets(tmp_path_factory.mktemp("needle"))
    with pytest.MonkeyPatch.context() as mp:
        use_tiny_assets(assets, mp)
        out = tmp_path_factory.mktemp("adapter") / "run"
        train(tiny_config(assets, out, steps=2, eval_every=-1, save_every=0))
    return assets, out


def test_every_prompt_runs_in_every_mode_and_the_table_adds_up(tiny, monkeypatch, tmp_path):
    """A stand-in generation that answers right only in dense mode: dense retrieves every
    needle, the Focus modes none; the cells, accuracy, table, JSON and plot agree."""
    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    seen = []

    def fake_answer(model, tokenizer, case, max_new_tokens):
        dense = not model._runtime.current("enabled")  # disable_focus() of this thread
        seen.append((case.input_ids.shape[1], dense, model.focus_config.top_k))
        return (f" {case.answer}." if dense else " 12345."), 0.01, (2.0 if dense else -1.0)

    monkeypatch.setattr(needle, "_answer", fake_answer)
    out = tmp_path / "needle.json"
    rc = cli.main(["bench", "needle", "--model", str(assets["model"]), "--adapter", str(adapter),
                   "--corpus", str(assets["corpus"]), "--lengths", "64", "96", "--depths", "0",
                   "1", "--trials", "2", "--top-k", "1", "2", "--json", str(out),
                   "--no-progress"])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert (
        len(result["cells"]) == 2 * 2 * 2 * 2 * 3
    )  # haystacks x lengths x depths x trials x modes
    assert {n for n, _, _ in seen} == {64, 96}
    assert {k for _, dense, k in seen if not dense} == {1, 2}
    for hay in ("passkey", "book"):
        acc = result["accuracy"][hay]
        assert acc["dense"] == {"64": {"0": 1.0, "1": 1.0}, "96": {"0": 1.0, "1": 1.0}}
        assert all(v == 0.0 for row in acc["top-1"].values() for v in row.values())
        margins = result["answer_margin"][hay]
        assert margins["dense"] == {"64": 2.0, "96": 2.0}
        assert margins["top-1"] == margins["top-2"] == {"64": -1.0, "96": -1.0}
    table = needle.needle_table(result)
    assert "| dense | 64 | 1.00 | 1.00 | 1.00 | +2.00 |" in table
    assert "| top-2 | 96 | 0.00 | 0.00 | 0.00 | -1.00 |" in table
    assert out.with_suffix(".png").stat().st_size > 0


#: generated texts for the needle ``{n}``, some finding it and some not (the scoring rule
#: itself is tested in tests/evaluation/test_needles.py)
ANSWERS = [" {n}. Remember", " {n}0.", "{n}", " 12 then {n}", " x{n}"]


def test_the_stored_correct_flag_and_accuracy_follow_whole_numbers(tiny, monkeypatch):
    """Each cell's ``correct`` flag, and the accuracy built from the flags, are the verdict
    of :func:`~focus_attention.evaluation.needles.answer_of` on the needle of that cell's
    own prompt."""
    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    given = []

    def fake_answer(model, tokenizer, case, max_new_tokens):
        text = ANSWERS[len(given) % len(ANSWERS)].format(n=case.answer)
        given.append(answer_of(text) == case.answer)
        return text, 0.01, None

    monkeypatch.setattr(needle, "_answer", fake_answer)
    config = NeedleBenchConfig(model=str(assets["model"]), adapter=str(adapter),
                               corpus=str(assets["corpus"]), haystacks=("passkey",),
                               lengths=(64,), depths=(0.0, 0.25, 0.5, 0.75, 1.0), trials=1,
                               top_k=(1, 2), progress=False)  # fmt: skip
    result = needle.run_needle_benchmark(config)
    cells = result["cells"]
    assert len(cells) == len(given) == 15 and any(given) and not all(given)
    assert [c["correct"] for c in cells] == given
    for mode, by_length in result["accuracy"]["passkey"].items():
        for depth, share in by_length["64"].items():
            flags = [f for c, f in zip(cells, given, strict=True)
                     if c["mode"] == mode and f"{c['depth']:g}" == depth]  # fmt: skip
            assert share == sum(flags) / len(flags), (mode, depth)


def test_overrides_reach_every_focus_mode(tiny, monkeypatch):
    """``window``, ``sink_tokens``, ``dense_layers``, ``dense_heads``, ``query_top_k`` and
    ``inference_routing`` override the adapter's settings in every Focus mode, and the JSON
    records them; a negative sink count is refused."""
    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    seen = set()

    def fake_answer(model, tokenizer, case, max_new_tokens):
        if model._runtime.current("enabled"):
            cfg = model.focus_config
            seen.add((cfg.window, cfg.sink_tokens, tuple(cfg.dense_layers), cfg.top_k,
                      cfg.query_top_k, cfg.dense_heads, cfg.inference_routing))  # fmt: skip
        return " 1.", 0.01, None

    monkeypatch.setattr(needle, "_answer", fake_answer)
    config = NeedleBenchConfig(model=str(assets["model"]), adapter=str(adapter),
                               corpus=str(assets["corpus"]), haystacks=("passkey",),
                               lengths=(64,), depths=(0.5,), trials=1, top_k=(1, 2), window=5,
                               sink_tokens=3, dense_layers=(1,), query_top_k=2,
                               dense_heads=((0, 0),), inference_routing="streaming",
                               progress=False)  # fmt: skip
    result = needle.run_needle_benchmark(config)
    heads = ((0, 0),)
    assert seen == {(5, 3, (1,), 1, 2, heads, "streaming"), (5, 3, (1,), 2, 2, heads, "streaming")}
    assert result["config"]["sink_tokens"] == 3 and result["config"]["window"] == 5
    assert result["config"]["query_top_k"] == 2
    # the mode of asymmetric routing says so; top-2 with query_top_k 2 is plain top-2
    assert {c["mode"] for c in result["cells"]} == {"dense", "top-1/q2", "top-2"}
    with pytest.raises(ValueError, match="sink_tokens"):
        NeedleBenchConfig(sink_tokens=-1)


def test_every_answered_cell_is_checkpointed(tiny, monkeypatch, tmp_path):
    """The result so far reaches ``checkpoint`` after every cell (``complete`` False), the
    last one holding every cell; the CLI rewrites its JSON with it, so a run stopped in
    the middle keeps the cells it answered."""
    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    answers = iter([" 1.", " 2.", " 3."])

    def fake_answer(model, tokenizer, case, max_new_tokens):
        try:
            return next(answers), 0.01, None
        except StopIteration:
            raise KeyboardInterrupt from None  # the run is stopped at the fourth cell

    monkeypatch.setattr(needle, "_answer", fake_answer)
    out = tmp_path / "needle.json"
    argv = ["bench", "needle", "--model", str(assets["model"]), "--adapter", str(adapter),
            "--corpus", str(assets["corpus"]), "--haystacks", "passkey", "--lengths", "64",
            "--depths", "0.5", "--trials", "2", "--top-k", "1", "--no-progress",
            "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 130  # interrupted
    partial = json.loads(out.read_text())
    assert partial["complete"] is False
    assert [c["generated"] for c in partial["cells"]] == [" 1.", " 2.", " 3."]
    seen = []
    config = NeedleBenchConfig(model=str(assets["model"]), adapter=str(adapter),
                               corpus=str(assets["corpus"]), haystacks=("passkey",),
                               lengths=(64,), depths=(0.5,), trials=1, top_k=(1,),
                               progress=False)  # fmt: skip
    monkeypatch.setattr(needle, "_answer", lambda *a: (" 4.", 0.01, None))
    result = needle.run_needle_benchmark(config, checkpoint=seen.append)
    assert [len(p["cells"]) for p in seen] == [1, 2] and not any(p["complete"] for p in seen)
    assert result["complete"] is True and result["cells"] == seen[-1]["cells"]


def test_real_generation_runs_on_the_tiny_model(tiny, monkeypatch):
    """Without stand-ins: the tiny model answers every prompt (wrongly, it is random) and
    dense answers equal the base model's own greedy generation."""
    from focus_attention.assets.models import auto_prepend_bos, load_model

    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    config = NeedleBenchConfig(model=str(assets["model"]), adapter=str(adapter),
                               corpus=str(assets["corpus"]), lengths=(64,), depths=(0.5,),
                               trials=1, top_k=(1,), max_new_tokens=4, progress=False)  # fmt: skip
    result = needle.run_needle_benchmark(config)
    dense = [c for c in result["cells"] if c["mode"] == "dense"]
    assert len(result["cells"]) == 4 and len(dense) == 2
    base, tok = load_model(str(assets["model"]), quiet=True)
    cases = needle.needle_cases(config, tok, tok.bos_token_id if auto_prepend_bos(base) else None)
    for case, cell in zip(cases, dense, strict=True):
        with torch.no_grad():
            out = base.generate(case.input_ids, attention_mask=torch.ones_like(case.input_ids),
                                max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)  # fmt: skip
            logits = base(out).logits[0, 63:-1]  # teacher-forced: the logits before each new token
        assert tok.decode(out[0, 64:], skip_special_tokens=True) == cell["generated"]
        answer = tok(" " + case.answer, add_special_tokens=False).input_ids
        want = answer_margin(list(logits), out[0, 64:].tolist(), answer)
        assert cell["answer_margin"] == pytest.approx(want, abs=1e-4)
        assert (cell["answer_margin"] > 0) == (out[0, 64 : 64 + len(answer)].tolist() == answer[:4])


def test_needle_attention_equals_the_eager_attention_maps(tiny, monkeypatch):
    """The share per layer equals the base model's own eager attention maps (the last
    query's row, the best head, summed over the span), also while layers are dense."""
    from transformers import AutoModelForCausalLM

    from focus_attention.assets.models import load_model
    from focus_attention.evaluation.retrieval import needle_attention
    from focus_attention.hf import FocusModel

    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    base, _ = load_model(str(assets["model"]), quiet=True)
    fm = FocusModel.from_pretrained(base, adapter).eval()
    fm.focus_config = fm.focus_config.replace(dense_layers=fm.focus_layers[:1])
    x = torch.randint(
        3, base.config.vocab_size, (1, 50), generator=torch.Generator().manual_seed(0)
    )
    got = needle_attention(fm, x, (10, 17))
    assert fm.focus_config.dense_layers == tuple(fm.focus_layers[:1])  # put back
    eager = AutoModelForCausalLM.from_pretrained(str(assets["model"]), attn_implementation="eager")
    with torch.no_grad():
        maps = eager(input_ids=x, output_attentions=True).attentions
    assert sorted(got) == fm.focus_layers
    for layer, share in got.items():
        want = maps[layer][0, :, -1, 10:17].sum(-1).max()
        assert share == pytest.approx(float(want), abs=1e-5)
    with pytest.raises(ValueError, match="expected \\[1, N\\]"):
        needle_attention(fm, x.repeat(2, 1), (10, 17))
    with pytest.raises(ValueError, match="outside"):
        needle_attention(fm, x, (10, 50))


def test_retrieval_layers_rank_and_suggest(tiny, monkeypatch, tmp_path):
    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    out = tmp_path / "layers.json"
    rc = cli.main(["bench", "retrieval-layers", "--model", str(assets["model"]), "--adapter",
                   str(adapter), "--corpus", str(assets["corpus"]), "--lengths", "64",
                   "--trials", "1", "--count", "1", "--heads", "3", "--json", str(out),
                   "--no-progress"])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["config"]["split"] == "validation" and result["prompts"] == 2 * 3
    by_layer = result["by_layer"]
    means = [float(v) for v in by_layer.values()]
    assert all(0 <= v <= 1 for v in means)
    assert [by_layer[str(k)] for k in result["ranking"]] == sorted(means, reverse=True)
    assert result["dense_layers"] == result["ranking"][:1]
    for k, v in by_layer.items():
        per_hay = [result["by_haystack"][h][k] for h in ("passkey", "book")]
        assert v == pytest.approx(sum(per_hay) / 2)
    # head by head: the ranking of every (layer, kv head), its top --heads as dense_heads
    by_head = result["by_head"]
    ranked = [by_head[f"{layer}:{head}"] for layer, head in result["head_ranking"]]
    assert ranked == sorted(by_head.values(), reverse=True) and len(ranked) == len(by_head)
    assert result["dense_heads"] == sorted(result["head_ranking"][:3])
    assert max(by_head.values()) <= max(means) + 1e-12  # a layer's share is its best head's
    with pytest.raises(ValueError, match="count"):
        needle.rank_retrieval_layers(needle.RetrievalLayersConfig(
            model=str(assets["model"]), adapter=str(adapter), corpus=str(assets["corpus"]),
            lengths=(64,), count=99, progress=False))  # fmt: skip
    pairs = len(result["by_head"])  # every (Focus layer, key-value head)
    with pytest.raises(ValueError, match=f"heads: received 1000, expected at most the {pairs} "):
        needle.rank_retrieval_layers(needle.RetrievalLayersConfig(
            model=str(assets["model"]), adapter=str(adapter), corpus=str(assets["corpus"]),
            lengths=(64,), count=1, heads=1000, progress=False))  # fmt: skip


def test_needle_with_every_layer_dense_answers_as_dense(tiny, monkeypatch):
    """--dense-layers: with every Focus layer dense, each top-k answer is the dense one."""
    from focus_attention.assets.models import load_model
    from focus_attention.hf import FocusModel

    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    base, _ = load_model(str(assets["model"]), quiet=True)
    layers = FocusModel.from_pretrained(base, adapter).focus_layers
    config = NeedleBenchConfig(model=str(assets["model"]), adapter=str(adapter),
                               corpus=str(assets["corpus"]), lengths=(64,), depths=(0.5,),
                               trials=1, top_k=(1,), max_new_tokens=4, dense_layers=layers,
                               window=2, progress=False)  # fmt: skip
    result = needle.run_needle_benchmark(config)
    cells = {(c["haystack"], c["mode"]): c["generated"] for c in result["cells"]}
    for hay in ("passkey", "book"):
        assert cells[(hay, "top-1")] == cells[(hay, "dense")]
    assert result["config"]["dense_layers"] == layers and result["config"]["window"] == 2
    with pytest.raises(ValueError, match="window"):
        NeedleBenchConfig(window=0)


def test_no_dense_runs_only_the_focus_modes(tiny, monkeypatch):
    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    modes = []

    def fake_answer(model, tokenizer, case, max_new_tokens):
        modes.append(model._runtime.current("enabled"))
        return " 1.", 0.01, None

    monkeypatch.setattr(needle, "_answer", fake_answer)
    config = NeedleBenchConfig(model=str(assets["model"]), adapter=str(adapter),
                               corpus=str(assets["corpus"]), haystacks=("passkey",),
                               lengths=(64,), depths=(0.5,), trials=2, top_k=(1,),
                               dense=False, progress=False)  # fmt: skip
    result = needle.run_needle_benchmark(config)
    assert modes == [True, True]
    assert list(result["accuracy"]["passkey"]) == ["top-1"]


def test_diagnostic_modes_answer_and_measure_the_distant_keys_kept(tiny, monkeypatch):
    """--diagnostics: each mode answers every prompt beside dense and top-1; the oracle keeps
    exactly ceil(distant / K) of each query's distant keys, dense all of them, and every
    share is measured on the prompt; the table shows the shares."""
    from focus_attention.hf import FocusModel

    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    config = NeedleBenchConfig(model=str(assets["model"]), adapter=str(adapter),
                               corpus=str(assets["corpus"]), haystacks=("passkey",),
                               lengths=(64,), depths=(0.5,), trials=1, top_k=(1,),
                               max_new_tokens=3, window=8, sink_tokens=1,
                               diagnostics=("oracle", "kmeans", "kmeans-fine", "oracle"),
                               progress=False)  # fmt: skip
    assert config.diagnostics == ("oracle", "kmeans", "kmeans-fine")
    result = needle.run_needle_benchmark(config)
    kept = {c["mode"]: c["distant_kept"] for c in result["cells"]}
    assert list(kept) == ["dense", "top-1", "oracle", "kmeans", "kmeans-fine"]
    assert all(isinstance(c["generated"], str) and c["seconds"] > 0 for c in result["cells"])
    k = FocusModel.from_pretrained(load_base(assets), adapter).focus_config.num_groups
    # queries at 64 tokens, window 8, one sink: query i has i - 8 distant keys (i >= 9)
    want = sum(-(-(i - 8) // k) / (i - 8) for i in range(9, 64)) / 55
    assert kept["oracle"] == pytest.approx(want)
    assert kept["dense"] == 1.0
    assert all(0.0 < kept[m] < 1.0 for m in ("top-1", "kmeans", "kmeans-fine"))
    assert result["distant_kept"]["passkey"]["oracle"]["64"] == pytest.approx(want)
    assert f"| {kept['oracle']:.3f} |" in needle.needle_table(result)


def test_diagnostic_modes_at_a_larger_budget(tiny, monkeypatch):
    """--diagnostic-top-k 2: the oracle keeps ceil(2 distant / K) of each query's distant
    keys and is named oracle/top-2; above the adapter's K the run is refused by name."""
    from focus_attention.hf import FocusModel

    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    settings = dict(model=str(assets["model"]), adapter=str(adapter), corpus=str(assets["corpus"]),
                    haystacks=("passkey",), lengths=(64,), depths=(0.5,), trials=1, top_k=(1,),
                    max_new_tokens=2, window=8, sink_tokens=1, dense=False, progress=False,
                    diagnostics=("oracle",))  # fmt: skip
    result = needle.run_needle_benchmark(NeedleBenchConfig(**settings, diagnostic_top_k=2))
    k = FocusModel.from_pretrained(load_base(assets), adapter).focus_config.num_groups
    want = sum(-(-2 * (i - 8) // k) / (i - 8) for i in range(9, 64)) / 55
    kept = {c["mode"]: c["distant_kept"] for c in result["cells"]}
    assert list(kept) == ["top-1", "oracle/top-2"]
    assert kept["oracle/top-2"] == pytest.approx(want)
    with pytest.raises(ValueError, match=rf"diagnostic_top_k.*num_groups = {k}"):
        needle.run_needle_benchmark(NeedleBenchConfig(**settings, diagnostic_top_k=k + 1))


def test_needle_seen_is_measured_per_routed_layer(tiny, monkeypatch):
    """``needle_seen``: with every group kept the prompt's last query sees the whole needle
    in every routed layer; streaming (window and sinks only) sees none of a needle beyond
    the window; a diagnostic mode and top-1 give a share per routed layer; dense None."""
    from focus_attention.hf import FocusModel

    assets, adapter = tiny
    use_tiny_assets(assets, monkeypatch)
    fm = FocusModel.from_pretrained(load_base(assets), adapter)
    k, routed = fm.focus_config.num_groups, len(fm.routers)
    settings = dict(model=str(assets["model"]), adapter=str(adapter), corpus=str(assets["corpus"]),
                    haystacks=("passkey",), lengths=(64,), depths=(0.5,), trials=1,
                    max_new_tokens=2, window=8, sink_tokens=1, progress=False)  # fmt: skip
    result = needle.run_needle_benchmark(
        NeedleBenchConfig(**settings, top_k=(1, k), diagnostics=("oracle",))
    )
    seen = {c["mode"]: c["needle_seen"] for c in result["cells"]}
    assert seen["dense"] is None
    for mode in ("top-1", f"top-{k}", "oracle"):
        assert len(seen[mode]) == routed and all(0.0 <= v <= 1.0 for v in seen[mode].values())
    assert all(v == 1.0 for v in seen[f"top-{k}"].values())
    streaming = needle.run_needle_benchmark(
        NeedleBenchConfig(**settings, top_k=(1,), dense=False, inference_routing="streaming")
    )
    assert all(v == 0.0 for v in streaming["cells"][0]["needle_seen"].values())


def test_needle_seen_share_reads_the_last_query_row():
    from focus_attention.bench.needle_diagnostics import needle_seen_share

    mask = torch.zeros(1, 2, 5, 10, dtype=torch.bool)
    mask[0, 0, -1, 3:5] = True  # head 0 sees 2 of the needle's 4 tokens 3..6, head 1 none
    mask[0, 1, 0, 3:7] = True  # another query row: not counted
    assert needle_seen_share(mask, 3, 7) == pytest.approx(0.25)
    assert needle_seen_share(mask[:, 0], 3, 5) == 1.0
    assert needle_seen_share(mask, 4, 4) == 1.0


def load_base(assets):
    from focus_attention.assets.models import load_model

    return load_model(str(assets["model"]), quiet=True)[0]


def test_an_interrupted_result_reads_as_a_table_and_a_plot(tmp_path):
    """A checkpointed result whose last length lacks some depths: "-" in its cells, its mean
    over the depths it has, and a plot."""
    result = {"accuracy": {"passkey": {"top-1": {"2048": {"0.5": 0.5, "0.25": 1.0},
                                                 "8192": {"0.25": 0.0}}}}}  # fmt: skip
    table = needle.needle_table(result)
    assert "| depth 0.25 | depth 0.5 |" in table
    assert "| top-1 | 2048 | 1.00 | 0.50 | 0.75 | - |" in table
    assert "| top-1 | 8192 | 0.00 | - | 0.00 | - |" in table
    needle.plot_needle(result, str(tmp_path / "needle.png"))
    assert (tmp_path / "needle.png").stat().st_size > 0
