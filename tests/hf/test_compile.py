"""``torch.compile`` of a Focus model gives the eager model's logits (inductor once changed
them by ~0.2), and changing settings and lengths recompiles no Focus code."""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._inductor.config
import torch._logging
from tiny import focus, ids, left_pad

import focus_attention

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
        first = compiled(x).logits
        second = compiled(x).logits
    torch.testing.assert_close(first, eager, rtol=0, atol=1e-5)
    torch.testing.assert_close(second, eager, rtol=0, atol=1e-5)


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


@pytest.mark.slow
@pytest.mark.parametrize("arch,layers", [("llama", 6), ("gpt2", 3)])
def test_compiled_focus_code_is_never_recompiled(arch, layers):
    """Focus layers and hooks run eagerly behind a graph break and hold no entry in dynamo's
    cache, so changing settings, lengths, padding and routing recompiles no Focus code (a
    shared wrapper and a per-layer guard in the attention function once reached dynamo's
    recompile limit), and a second round of new settings and lengths compiles nothing new."""
    _, fm = focus(arch, top_k=1, window=8, sink_tokens=2,
                  model_overrides=dict(num_hidden_layers=layers))  # fmt: skip
    torch._dynamo.reset()
    compiled = torch.compile(fm, backend="eager")
    settings = [dict(top_k=1), dict(top_k=2), dict(window=4), dict(sink_tokens=0, top_k=3)]
    with _recompiles() as files:
        _round(compiled, fm, settings, [20, 27, 33, 41], seed=0)
        first = len(files)
        _round(compiled, fm, settings[::-1], [50, 23, 38, 29], seed=10)
    torch._dynamo.reset()
    ours = [f for f in files if Path(f).is_relative_to(SOURCE)]
    # only the compiled entry point, for its arguments: a mask or none, static or dynamic length
    assert set(ours) <= {str(SOURCE / "hf" / "model.py")} and len(ours) <= 3, ours
    assert len(files) == first  # bounded: the second round recompiled nothing
