"""``torch.compile`` of a Focus model gives the eager model's logits (reviewer finding:
inductor silently changed them by ~0.2)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from tiny import focus, ids


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
