"""The inference settings of a compiled FocusModel are read when its Focus operator runs, never
when dynamo traces it: after the first compiled call, changing any of them recompiles nothing
(``error_on_recompile``) and the compiled logits follow the new value, equal to the eager
model's. A setting read at trace time would either recompile or, unguarded, keep serving the
old value. (``inference_routing`` is also read by the entry point, which defaults
``use_cache`` from it: changing it recompiles the entry point once, and the logits follow.)"""

from __future__ import annotations

import pytest
import torch
from tiny import focus, ids

#: each setting changed in turn (cumulatively), from top_k=1, window=8, sink_tokens=2
CHANGES = [
    ("top_k", 2),
    ("window", 4),
    ("sink_tokens", 0),
    ("dense_layers", (1,)),
    ("dense_heads", ((0, 1),)),
    ("query_top_k", 3),
]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_each_setting_is_read_when_the_compiled_model_runs():
    _, fm = focus("llama", num_groups=4, top_k=1, window=8, sink_tokens=2)
    x = ids(2, 24, seed=4)
    torch._dynamo.reset()
    compiled = torch.compile(fm, backend="eager", fullgraph=True)
    try:
        with torch.no_grad():
            before = compiled(x, use_cache=False).logits
            assert torch.equal(before, fm(x, use_cache=False).logits)
            with torch._dynamo.config.patch(error_on_recompile=True):
                for name, value in CHANGES:
                    fm.focus_config = fm.focus_config.replace(**{name: value})
                    got = compiled(x, use_cache=False).logits
                    assert torch.equal(got, fm(x, use_cache=False).logits), name
                    assert not torch.equal(got, before), f"{name} changed nothing here"
                    before = got
            fm.focus_config = fm.focus_config.replace(inference_routing="sequence")
            got = compiled(x, use_cache=False).logits
            assert torch.equal(got, fm(x, use_cache=False).logits)
            assert not torch.equal(got, before)
    finally:
        torch._dynamo.reset()
