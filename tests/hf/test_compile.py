"""``torch.compile`` of a Focus model gives the eager model's logits (inductor once changed
them by ~0.2); inference traces each Focus layer as one operator, so the model is one graph
and changing settings, lengths, padding and routing compiles a bounded number of graphs;
switches, recorders, caches and training run the eager layer."""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._inductor.config
import torch._logging
from tiny import focus, ids, left_pad
from tolerances import tolerance

import focus_attention
from focus_attention.hf.attention import eager_focus_attention, eager_pre_hook
from focus_attention.hf.layer_handle import handle_of
from focus_attention.hf.masks import FocusMask

#: the package's source directory
SOURCE = Path(focus_attention.__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_focus_model_matches_eager(inductor):
    base, fm = focus("llama", num_groups=4, top_k=1, window=8, sink_tokens=2)
    x = ids(1, 40)
    with torch.no_grad():
        eager = fm(x).logits
        reference = base(x).logits
    # the sparse mask matters at this length (else the check would prove nothing)
    assert (eager - reference).abs().max() > 1e-3
    torch._dynamo.reset()
    compiled = torch.compile(fm)
    # one compile thread: no worker-process pool (minutes to start on a loaded machine)
    with torch._inductor.config.patch(compile_threads=1), torch.no_grad():
        first = compiled(x).logits  # with a KV cache: the eager Focus layers
        second = compiled(x).logits
        traced = compiled(x, use_cache=False).logits  # the Focus layers as operators
    torch.testing.assert_close(first, eager, **tolerance("oracle"))
    torch.testing.assert_close(second, eager, **tolerance("oracle"))
    torch.testing.assert_close(traced, eager, **tolerance("oracle"))


class _Recompiles(logging.Handler):
    """Collects the source file of every function dynamo recompiles."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = re.match(r"Recompiling function \S+ in (\S+):\d+", record.getMessage())
        if match:
            self.files.append(match.group(1))


@contextlib.contextmanager
def _recompiles():
    handler = _Recompiles()
    torch._logging.set_logs(recompiles=True)
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield handler.files
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


def _round(compiled, fm, settings, lengths, seed):
    """Each setting at its length, unpadded and left-padded, in top-k and soft routing: the
    compiled model gives the eager logits bitwise (dynamo without a backend compiler)."""
    for step, (cfg, n) in enumerate(zip(settings, lengths, strict=True)):
        fm.focus_config = fm.focus_config.replace(**cfg)
        x, mask = left_pad([ids(1, n - 3 * i, seed=seed + step + i)[0] for i in range(2)])
        for routing in ("topk", "soft"):
            fm.set_routing(routing)
            for kw in ({}, {"attention_mask": mask}):
                with torch.no_grad():
                    got = compiled(x, use_cache=False, **kw).logits
                    expected = fm(x, use_cache=False, **kw).logits
                assert torch.equal(got, expected), (cfg, n, routing, kw.keys())
    fm.set_routing("auto")


#: settings of the first round; the second round runs them in reverse at other lengths
SETTINGS = [
    dict(top_k=1),
    dict(top_k=2, dense_layers=(1,)),
    dict(window=4, dense_layers=(), dense_heads=((0, 1),)),
    dict(sink_tokens=0, top_k=3, dense_layers=(0, 2), dense_heads=()),
    dict(sink_tokens=2, top_k=1, dense_layers=()),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,layers", [("llama", 6), ("gpt2", 3), ("mistral", 3)])
def test_compiled_focus_model_compiles_boundedly_without_hitting_the_limit(arch, layers):
    """A compiled Focus model (transformers' own forward wrappers in place) traces to one
    graph per call: the settings (top_k, window, sink_tokens, dense_layers, dense_heads,
    the routing) are read when the Focus operator runs, so changing them, the length and the
    padding compiles nothing beyond the entry point's variants (mask or none, static or
    dynamic length); the limit is never hit (graph breaks around each layer once made dynamo
    compile transformers' shared keyword-deprecation wrapper over and over until "hit
    config.recompile_limit (8)"), and a second round at new lengths compiles nothing.
    Mistral's layers carry a sliding-window mask."""
    _, fm = focus(arch, top_k=1, window=8, sink_tokens=2,
                  model_overrides=dict(num_hidden_layers=layers))  # fmt: skip
    torch._dynamo.reset()
    compiled = torch.compile(fm, backend="eager")
    patch = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
    with patch, _recompiles() as files:
        _round(compiled, fm, SETTINGS, [20, 27, 33, 41, 24], seed=0)
        first = list(files)
        _round(compiled, fm, SETTINGS[::-1], [50, 23, 38, 29, 35], seed=10)
    torch._dynamo.reset()
    # only our entry point recompiles: mask or none, static then dynamic length
    assert {Path(f) for f in files} == {SOURCE / "hf" / "model.py"}, files
    assert len(first) <= 3, first
    assert files == first  # bounded: the second round compiled nothing new


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_inference_is_one_graph():
    """Inference without gradients or cache, with or without padding, in top-k and soft
    routing, compiles with ``fullgraph=True`` (no graph break: each Focus layer is one
    operator) and gives the eager logits bitwise."""
    _, fm = focus("llama", top_k=1, window=8, sink_tokens=2)
    torch._dynamo.reset()
    compiled = torch.compile(fm, backend="eager", fullgraph=True)
    x, mask = left_pad([ids(1, 24, seed=1)[0], ids(1, 19, seed=2)[0]])
    for routing in ("topk", "soft"):
        fm.set_routing(routing)
        for kw in ({}, {"attention_mask": mask}):
            with torch.no_grad():
                got = compiled(x, use_cache=False, **kw).logits
                expected = fm(x, use_cache=False, **kw).logits
            assert torch.equal(got, expected), (routing, kw.keys())
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_model_honours_switches_recorders_and_training():
    """The per-thread switches and recorders, the KV cache and training run the eager layer
    behind a graph break: ``disable_focus()`` gives the base logits, ``record_routing()``
    the eager records, a cached call the eager logits, and a training step the eager
    gradients and routing-bias update."""
    base, fm = focus("llama", num_groups=4, top_k=1, window=8, sink_tokens=2)
    twin = copy.deepcopy(fm)  # the eager reference, with its own routers and biases
    torch._dynamo.reset()
    compiled = torch.compile(fm, backend="eager")
    x = ids(2, 24, seed=3)
    with torch.no_grad():
        focus_logits = compiled(x, use_cache=False).logits
        with fm.disable_focus():
            assert torch.equal(compiled(x, use_cache=False).logits, base(x).logits)
            assert not torch.equal(compiled(x, use_cache=False).logits, focus_logits)
        with fm.record_routing() as got, twin.record_routing() as expected:
            compiled(x, use_cache=False)
            twin(x, use_cache=False)
        assert len(got) == len(expected) > 0
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a["query_groups"], b["query_groups"])
        assert torch.equal(compiled(x).logits, twin(x).logits)  # with a KV cache
    for model in (fm, twin):
        model.train()
    compiled(x, use_cache=False).logits.square().mean().backward()
    twin(x, use_cache=False).logits.square().mean().backward()
    for (name, a), b in zip(fm.routers.named_parameters(), twin.routers.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **tolerance("rounding"), msg=name)
    for a, b in zip(fm.routers.buffers(), twin.routers.buffers(), strict=True):
        assert torch.equal(a, b)
    torch._dynamo.reset()


def test_focus_layer_operator_passes_opcheck_and_equals_the_eager_layer():
    """``focus_attention::focus_layer`` passes ``torch.library.opcheck`` (schema, fake
    implementation, dynamic shapes) and gives the eager layer's output bitwise, without and
    with padding; a name no layer holds is a clear error."""
    _, fm = focus("llama", top_k=1, window=4, sink_tokens=1)
    module = next(m for m in fm.modules() if getattr(handle_of(m), "router", None) is not None)
    handle, cfg = handle_of(module), fm.base_model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dim, (bsz, n) = cfg.hidden_size // heads, (2, 12)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(bsz, heads, n, dim, generator=gen)
    k, v = (torch.randn(bsz, kv, n, dim, generator=gen) for _ in range(2))
    hidden = torch.randn(bsz, n, cfg.hidden_size, generator=gen)
    padding = torch.ones(bsz, n, dtype=torch.bool)
    padding[1, :3] = False
    op = torch.ops.focus_attention.focus_layer
    for pad in (None, padding):
        args = (q, k, v, hidden, pad, None, handle.compiled_key, None, None)
        torch.library.opcheck(op, args)
        mask = None if pad is None else FocusMask.of_call(pad, q, fm.base_model.config)
        _, inputs = eager_pre_hook(module, (hidden,), {})
        expected, _ = eager_focus_attention(module, q, k, v, mask, **inputs)
        assert torch.equal(op(*args), expected)
    with pytest.raises(ValueError, match="no Focus layer is registered"):
        op(q, k, v, hidden, None, None, -1, None, None)
