"""A compiled FocusModel under the per-thread switches (``disable_focus()``, the routing
recorders): the call runs the base model eagerly behind one graph break at the entry point,
so no transformers frame is compiled for it and dynamo's recompile limit is never reached
however many calls, lengths and layers; the outputs are the eager ones."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
from tiny import focus, ids

import focus_attention

SOURCE = Path(focus_attention.__file__).resolve().parent

#: a model deeper than dynamo's recompile limit (8): one compiled frame per layer would hit it
LAYERS = 10


class _Compiled(logging.Handler):
    """Collects the source file of every frame dynamo compiles or recompiles."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = re.search(r"(?:Recompiling function|torchdynamo start compiling) \S+ (?:in )?(\S+):\d+", record.getMessage())  # fmt: skip
        if match:
            self.files.append(match.group(1))


@contextlib.contextmanager
def _compiled_frames():
    handler = _Compiled()
    torch._logging.set_logs(recompiles=True, dynamo=logging.INFO)
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield handler.files
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_disable_focus_on_a_compiled_model_compiles_no_transformers_frame():
    base, fm = focus("llama", num_groups=4, top_k=1, window=8, sink_tokens=2,
                     model_overrides=dict(num_hidden_layers=LAYERS))  # fmt: skip
    torch._dynamo.reset()
    compiled = torch.compile(fm, backend="eager")
    patch = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
    with patch, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(ids(1, 20, seed=0), use_cache=False)  # the traced path, compiled first
        with _compiled_frames() as files:
            for n in (20, 27, 33, 41):
                x = ids(1, n, seed=n)
                with fm.disable_focus():
                    assert torch.equal(compiled(x, use_cache=False).logits, base(x).logits)
                with fm.record_routing() as records:
                    compiled(x, use_cache=False)
                assert len(records) == LAYERS
    torch._dynamo.reset()
    # only the entry point compiles its variant for an open switch; nothing below it
    assert files and {Path(f) for f in files} == {SOURCE / "hf" / "model.py"}, files
