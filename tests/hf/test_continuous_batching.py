"""Focus layers under transformers' continuous batching (``generate_batch`` and the
``ContinuousBatchingManager``; :mod:`focus_attention.hf.paged`): packed requests of different
lengths over the paged KV cache give each request the greedy tokens of its own ``generate``,
and logits within float32 tolerance, on every supported architecture; with requests added,
finishing and cancelled at different times; with dense layers, dense heads, sink tokens,
``query_top_k`` and streaming routing; what is not causal is refused."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny import ARCHS, focus, ids, word_tokenizer
from tiny_assets import WORDS
from tolerances import tolerance
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from focus_attention import export_model
from focus_attention.hf import FocusConfig, FocusSlidingWindowWarning, get_focus_model, paged
from focus_attention.hf.paged import MAX_PADDING_FACTOR, FocusBatchingManager, decoding_batches

TOL = tolerance("oracle")["atol"]  # decoding through the paged cache: as through any cache
NEW = 6
#: prompt lengths: odd, shorter and longer than the window (8), one longer than a batch
#: (64 tokens: a chunked prefill), two sharing a 40-token prefix (shared cache blocks)
LENGTHS = (5, 13, 41, 100)
#: Mistral's default sliding_window puts every layer in the paged cache's sliding group
NO_SLIDING = {"mistral": {"sliding_window": None}}


class DecodingBatches:
    """Records the batches of decoding steps the packed calls ran: ``(batch size, whether
    some sequence of the batch was padded)`` per call."""

    def __init__(self, monkeypatch) -> None:
        self.seen: list[tuple[int, bool]] = []
        decoding = paged.Packed.decoding

        def spy(packed, spans):
            call = decoding(packed, spans)
            self.seen.append((len(spans), len({k1 - k0 for _, _, k0, k1 in spans}) > 1))
            return call

        monkeypatch.setattr(paged.Packed, "decoding", spy)


@pytest.fixture(params=["per-sequence", "batched"])
def decoding(request, monkeypatch) -> DecodingBatches | None:
    """Sequences that decode one token run one by one (the CPU's default), or as padded
    batches (the default on accelerators, forced here): a recorder of the batches then."""
    if request.param == "per-sequence":
        assert not paged.batches_decoding(torch.device("cpu"))
        return None
    monkeypatch.setattr(paged, "batches_decoding", lambda device: True)
    return DecodingBatches(monkeypatch)


def ran_padded_batches(recorder: DecodingBatches | None) -> None:
    """The batched path ran, on batches of several sequences of different lengths."""
    if recorder is not None:
        assert any(size > 1 and padded for size, padded in recorder.seen), recorder.seen


def cb_config(**kw) -> ContinuousBatchingConfig:
    """A small paged cache (16-token pages, 64 tokens per batch): fast on CPU."""
    return ContinuousBatchingConfig(page_size=16, num_blocks=48, max_batch_tokens=64, **kw)


def gen_config(new: int = NEW) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None)


def prompts() -> list[list[int]]:
    out = [ids(1, n, seed=n)[0].tolist() for n in LENGTHS]
    shared = ids(1, 40, seed=99)[0].tolist()
    return out + [shared + ids(1, 7, seed=7)[0].tolist(), shared + ids(1, 11, seed=8)[0].tolist()]


def alone(model, prompt: list[int], new: int = NEW) -> tuple[list[int], list[torch.Tensor]]:
    """Per-request greedy ``generate``: the tokens and each step's logits ``[V]``."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [s[0] for s in out.logits]


class StepLogits:
    """Records, from a forward hook on the model the manager runs, every packed forward's
    tokens, positions, sequence boundaries and next-token logits by packed row (the manager
    passes ``logits_to_keep``, the rows of the sequences that produce a token: a chunk of a
    prefill in the middle of a packed call has none)."""

    def __init__(self, model) -> None:
        self.calls: list[tuple] = []
        self.hook = model.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output) -> None:
        logits = output.logits[0].detach().float()
        kept = kwargs.get("logits_to_keep")
        if isinstance(kept, torch.Tensor):
            assert kept.numel() == logits.shape[0]
            by_row = dict(zip(kept.tolist(), logits, strict=True))
        else:  # every row kept
            by_row = dict(enumerate(logits))
        self.calls.append((
            kwargs["input_ids"][0].tolist(), kwargs["position_ids"][0].tolist(),
            kwargs["cu_seq_lens_q"].tolist(), by_row,
        ))  # fmt: skip

    def by_request(self, full: dict[str, list[int]], prompt_len: dict[str, int]) -> dict:
        """``{request: {step: logits [V]}}``: each packed sequence matched to the one request
        whose tokens it holds at its positions (ambiguous matches are left out), its logits
        those of its last row."""
        rows: dict[str, dict[int, torch.Tensor]] = {r: {} for r in full}
        for tokens, pos, cu, by_row in self.calls:
            for s in range(len(cu) - 1):
                part, start = tokens[cu[s] : cu[s + 1]], pos[cu[s]]
                end = start + len(part)
                match = [r for r, seq in full.items() if seq[start:end] == part]
                if len(match) == 1 and end - prompt_len[match[0]] >= 0 and cu[s + 1] - 1 in by_row:
                    rows[match[0]][end - prompt_len[match[0]]] = by_row[cu[s + 1] - 1]
        return rows


def check_batch(ref, fm, requests: list[list[int]], **kw) -> tuple[float, int]:
    """``generate_batch`` against per-request ``generate``: equal tokens, every step's
    logits within :data:`TOL`, and tokens that differ from the dense base model's on some
    request (Focus matters). Returns the largest logit difference and the number of tokens
    the packed forwards ran."""
    recorder = StepLogits(fm)
    try:
        out = fm.generate_batch(requests, generation_config=gen_config(), continuous_batching_config=cb_config(**kw), progress_bar=False)  # fmt: skip
    finally:
        recorder.hook.remove()
    got = {r: out[r].generated_tokens for r in out}
    assert len(got) == len(requests)
    want = {f"req_{i}": alone(fm, p) for i, p in enumerate(requests)}
    assert got == {r: w[0] for r, w in want.items()}
    full = {f"req_{i}": p + got[f"req_{i}"] for i, p in enumerate(requests)}
    lens = {f"req_{i}": len(p) for i, p in enumerate(requests)}
    rows = recorder.by_request(full, lens)
    worst = 0.0
    for r, (_, logits) in want.items():
        assert len(rows[r]) >= NEW - 1, f"{r}: steps {sorted(rows[r])}"
        for step, row in rows[r].items():
            if step < NEW:
                worst = max(worst, float((row - logits[step]).abs().max()))
    assert worst <= TOL
    dense = [alone(ref, p)[0] for p in requests]
    assert dense != list(got.values())
    return worst, sum(len(call[0]) for call in recorder.calls)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_batch_equals_generate_per_request(arch, decoding):
    ref, fm = focus(arch, model_overrides=NO_SLIDING.get(arch))
    requests = prompts()
    worst, ran = check_batch(ref, fm, requests)
    ran_padded_batches(decoding)
    print(f"{arch}: generate_batch == generate per request, max |logit diff| {worst:.3g}")
    if arch not in ("gemma2", "gemma3_text"):  # no sliding layers: cache blocks are shared
        # the 40-token common prefix: one full 16-token block read from the cache, not rerun
        assert ran == sum(map(len, requests)) + len(requests) * (NEW - 1) - 16


@pytest.mark.parametrize(
    "settings",
    [
        dict(dense_layers=(0,)),
        dict(dense_heads=((1, 0),)),
        dict(sink_tokens=0),
        dict(sink_tokens=4),
        dict(top_k=1, query_top_k=2),
        dict(top_k=2, window=4),
        dict(inference_routing="streaming", sink_tokens=3, window=4),
        dict(router_input="query_key"),
        dict(router_input="query_key", top_k=1, query_top_k=2, sink_tokens=2),
    ],
)
def test_settings(settings, decoding):
    ref, fm = focus("llama", **settings)
    check_batch(ref, fm, prompts())
    ran_padded_batches(decoding)


def test_sliding_base_layers_of_gemma2_with_dense_heads(decoding):
    """Gemma-2: the sliding layer runs the base attention with its window per sequence (or
    padded batch), beside a Focus layer with a dense head (prompts longer than the 16-token
    window)."""
    ref, fm = focus("gemma2", dense_heads=((1, 1),))
    check_batch(ref, fm, prompts())
    ran_padded_batches(decoding)


@pytest.mark.parametrize("router_input", ["hidden_state", "query_key"])
def test_forked_requests_copy_the_groups_of_their_cache_blocks(decoding, router_input):
    """``num_return_sequences=2``: the manager forks each request after its prefill, copying
    its partly filled cache blocks; the Focus groups (per key-value head for query-key
    routers) are copied with them, so each child (sampling with top_k=1: the greedy tokens)
    equals the request's own generate."""
    _, fm = focus("llama", router_input=router_input)
    requests = prompts()
    gen = GenerationConfig(max_new_tokens=NEW, do_sample=True, top_k=1, eos_token_id=None,
                           num_return_sequences=2)  # fmt: skip
    out = fm.generate_batch(requests, generation_config=gen, continuous_batching_config=cb_config())  # fmt: skip
    assert len(out) == 2 * len(requests)
    want = {f"req_{i}": alone(fm, p)[0] for i, p in enumerate(requests)}
    for rid, result in out.items():
        assert result.generated_tokens == want[rid.split("__")[0]], rid
    ran_padded_batches(decoding)


def _collect(manager, on_result, wanted: set[str], timeout: float = 120.0) -> dict:
    """Final results of ``wanted`` (streamed partial results go to ``on_result``)."""
    finals, deadline = {}, time.monotonic() + timeout
    while not wanted <= set(finals) and time.monotonic() < deadline:
        result = manager.get_result(timeout=0.5)
        if result is None:
            continue
        on_result(result)
        if result.is_finished():
            finals[result.request_id] = result
    return finals


def test_requests_added_finishing_and_cancelled_at_different_times(decoding):
    """A manager serving requests that arrive while others decode, finish at different
    lengths, and one cancelled mid-way: the others' tokens are those of their own generate."""
    _, fm = focus("llama")
    p = prompts()
    manager = fm.init_continuous_batching(gen_config(), cb_config())
    assert isinstance(manager, FocusBatchingManager)
    news = {"a": 40, "b": 3, "c": 9, "d": 60}
    streamed: dict[str, list[int]] = {}
    manager.start()
    try:
        manager.add_request(p[3], request_id="a", max_new_tokens=news["a"], streaming=True)
        manager.add_request(p[0], request_id="b", max_new_tokens=news["b"])
        manager.add_request(p[4], request_id="d", max_new_tokens=news["d"], streaming=True)

        def on_result(result):
            rid, tokens = result.request_id, list(result.generated_tokens)
            streamed[rid] = tokens
            if rid == "a" and len(tokens) == 2:  # a later request joins the running ones
                manager.add_request(p[1], request_id="c", max_new_tokens=news["c"])
            if rid == "d" and len(tokens) == 3:
                manager.cancel_request("d")

        finals = _collect(manager, on_result, {"a", "b", "c"})
    finally:
        manager.stop(block=True)
    assert set(finals) >= {"a", "b", "c"}
    assert finals["c"].lifespan[0] < finals["a"].lifespan[1]  # c started before a finished
    for rid, prompt in (("a", p[3]), ("b", p[0]), ("c", p[1])):
        assert finals[rid].generated_tokens == alone(fm, prompt, news[rid])[0], rid
    assert "d" not in finals or len(finals["d"].generated_tokens) < news["d"]
    d_want = alone(fm, p[4], news["d"])[0]
    assert 3 <= len(streamed["d"]) < news["d"]
    assert streamed["d"] == d_want[: len(streamed["d"])]
    ran_padded_batches(decoding)


@given(st.lists(st.integers(1, 5000), max_size=40))
def test_decoding_batches_take_every_sequence_once_within_the_padding_bound(lengths):
    batches = decoding_batches(lengths)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        held = [lengths[i] for i in batch]
        assert len(batch) * max(held) <= MAX_PADDING_FACTOR * sum(held)
    # sequences of equal length share one batch
    assert len(decoding_batches([7] * len(lengths))) == min(1, len(lengths))


def test_decoding_is_batched_on_accelerators_only():
    assert not paged.batches_decoding(torch.device("cpu"))
    assert paged.batches_decoding(torch.device("cuda"))
    assert paged.batches_decoding(torch.device("meta"))


def test_requests_evicted_from_a_full_cache_are_computed_again_exactly(decoding):
    """A paged cache too small for every request at once: the manager evicts requests and
    prefills them again later (its default; CPU offloading is refused, see below), and every
    request still gets the tokens and logits of its own generate."""
    ref, fm = focus("llama", sink_tokens=4, top_k=2)
    requests = [ids(1, n, seed=i)[0].tolist() for i, n in enumerate((30, 31, 29, 33, 40, 28, 35, 27, 1, 2))]  # fmt: skip
    new = 24
    recorder = StepLogits(fm)
    small = ContinuousBatchingConfig(page_size=8, num_blocks=24, max_batch_tokens=64)
    try:
        out = fm.generate_batch(requests, generation_config=gen_config(new), continuous_batching_config=small, progress_bar=False)  # fmt: skip
    finally:
        recorder.hook.remove()
    want = [alone(fm, p, new) for p in requests]
    assert [out[f"req_{i}"].generated_tokens for i in range(len(requests))] == [w[0] for w in want]
    ran = sum(len(call[0]) for call in recorder.calls)
    assert ran > sum(map(len, requests)) + len(requests) * (new - 1)  # some prefilled again
    full = {f"req_{i}": p + out[f"req_{i}"].generated_tokens for i, p in enumerate(requests)}
    rows = recorder.by_request(full, {f"req_{i}": len(p) for i, p in enumerate(requests)})
    worst = max(float((row - want[int(r[4:])][1][step]).abs().max())
                for r in rows for step, row in rows[r].items() if step < new)  # fmt: skip
    assert worst <= TOL
    ran_padded_batches(decoding)


def test_refused_settings():
    _, fm = focus("llama")
    x = prompts()[:2]
    run = dict(generation_config=gen_config(), continuous_batching_config=cb_config())
    fm.set_routing("soft")
    with pytest.raises(ValueError, match="soft"):
        fm.generate_batch(x, **run)
    fm.set_routing("auto")
    fm.focus_config = fm.focus_config.replace(inference_routing="sequence")
    with pytest.raises(ValueError, match="inference_routing='sequence'"):
        fm.generate_batch(x, **run)
    fm.focus_config = fm.focus_config.replace(inference_routing="causal")
    with fm.disable_focus(), pytest.raises(ValueError, match="disable_focus"):
        fm.generate_batch(x, **run)
    for bad in (dict(use_cuda_graph=True), dict(default_compile_level=1), dict(cpu_offload_space=1.0)):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            fm.generate_batch(x, generation_config=gen_config(), continuous_batching_config=cb_config(**bad))  # fmt: skip
    assert fm.generate_batch(x, **run)  # still usable


def test_focus_layers_in_the_paged_sliding_group_are_refused():
    """Mistral with its model-wide sliding_window: the paged cache keeps only the last
    sliding_window keys of every layer; Focus layers need every key (so do Focus layers
    chosen among Gemma's sliding layers)."""
    _, fm = focus("mistral")
    with pytest.raises(ValueError, match="sliding_window=None"):
        fm.generate_batch(prompts()[:2], generation_config=gen_config(), continuous_batching_config=cb_config())  # fmt: skip
    # Gemma-2 with a Focus layer chosen among its sliding layers
    _, gemma = focus("gemma2", layers=[0, 1])
    with pytest.raises(ValueError, match=r"layers \[0\] in its sliding-window group"):
        gemma.generate_batch(prompts()[:2], generation_config=gen_config(), continuous_batching_config=cb_config())  # fmt: skip
    # the same layers as dense layers run the base attention, with the window
    fm.focus_config = fm.focus_config.replace(dense_layers=(0, 1))
    requests = prompts()[:2]
    got = fm.generate_batch(requests, generation_config=gen_config(), continuous_batching_config=cb_config())  # fmt: skip
    assert [got[f"req_{i}"].generated_tokens for i in range(2)] == [alone(fm, p)[0] for p in requests]  # fmt: skip


PRIDE = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such a "
    "man may be on his first entering a neighbourhood, this truth is so well fixed in the minds "
    "of the surrounding families, that he is considered the rightful property of some one or "
    "other of their daughters. "
)


@pytest.mark.assets
@pytest.mark.slow
def test_smollm2_generate_batch_equals_generate_per_request(decoding):
    """The real smollm2-135m (30 layers, GQA 9/3) with Focus: equal greedy tokens, logits
    within float32 rounding of 30 layers (measured 4.7e-5 on logits of magnitude ~20)."""
    from focus_attention.assets.models import is_prepared, load_model

    if not is_prepared("smollm2-135m"):
        pytest.skip("smollm2-135m is not prepared (run `focus setup` to download the assets)")
    model, tokenizer = load_model("smollm2-135m")
    model.generation_config.eos_token_id = None
    text = tokenizer(PRIDE * 4).input_ids
    requests = [text[:37], text[5:95], text[11:222]]
    fm = get_focus_model(model, FocusConfig(num_groups=8, top_k=2, window=32, sink_tokens=4))
    recorder = StepLogits(fm.eval())
    try:
        out = fm.generate_batch(requests, generation_config=gen_config(12), continuous_batching_config=cb_config())  # fmt: skip
    finally:
        recorder.hook.remove()
    got = [out[f"req_{i}"].generated_tokens for i in range(len(requests))]
    want = [alone(fm, p, 12) for p in requests]
    assert got == [w[0] for w in want]
    full = {f"req_{i}": p + got[i] for i, p in enumerate(requests)}
    rows = recorder.by_request(full, {f"req_{i}": len(p) for i, p in enumerate(requests)})
    diffs = [(rows[r][s] - want[int(r[4:])][1][s]).abs().max() for r in rows for s in rows[r]]
    assert len(diffs) == 3 * 12 and max(diffs) <= 1e-3
    print(f"smollm2-135m: max |logit diff| {max(diffs):.3g} over {len(diffs)} steps")
    with fm.disable_focus():
        assert [alone(fm, p, 12)[0] for p in requests] != got
    ran_padded_batches(decoding)


def test_the_exported_directory_runs_generate_batch(tmp_path, decoding):
    _, fm = focus("llama")
    out = export_model(fm, tmp_path / "export", word_tokenizer(WORDS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FocusSlidingWindowWarning)
        model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    requests = prompts()
    got = model.generate_batch(requests, generation_config=gen_config(), continuous_batching_config=cb_config())  # fmt: skip
    assert [got[f"req_{i}"].generated_tokens for i in range(len(requests))] == [
        alone(fm, p)[0] for p in requests
    ]
    ran_padded_batches(decoding)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["auto", "masked"])
def test_cuda_generate_batch_equals_generate_per_request(backend, monkeypatch):
    """On a GPU, where decoding steps run as padded batches by default: equal greedy tokens
    and logits within float32 tolerance of per-request generate, on the GPU."""
    recorder = DecodingBatches(monkeypatch)
    ref, fm = focus("llama", attention_backend=backend)
    ref, fm = ref.cuda(), fm.cuda()
    requests = prompts()
    out = fm.generate_batch(requests, generation_config=gen_config(), continuous_batching_config=cb_config(), progress_bar=False)  # fmt: skip
    got = [out[f"req_{i}"].generated_tokens for i in range(len(requests))]
    with torch.no_grad():
        want = [
            fm.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW, do_sample=False)[
                0, len(p) :
            ].tolist()  # fmt: skip
            for p in requests
        ]
    assert got == want
    ran_padded_batches(recorder)
