"""The record of what a result was measured with: the weight digest (one hash for a whole
model and for each tensor), the environment and the torch-free versions."""

from __future__ import annotations

import hashlib
import types

import torch

from focus_attention import __version__
from focus_attention.utils.env import environment, hash_tensor, state_sha256, weights_sha256
from focus_attention.utils.versions import PACKAGE_VERSION, library_versions


def test_weights_sha256_is_the_digest_results_recorded():
    g = torch.Generator().manual_seed(0)
    state = {
        "b.weight": torch.randn(3, 4, generator=g),
        "a.bias": torch.arange(5, dtype=torch.bfloat16),
        "e": torch.empty(0),
        "c.base_layer.weight": torch.ones(2, 2, dtype=torch.float16).t(),
        "c.lora_A.weight": torch.zeros(1, 2),
    }
    model = types.SimpleNamespace(state_dict=lambda: state)
    want = "78a291a57b92d5c93cf5322eaa282fe8d7d8ca8f08792975425c040d62180ad6"
    assert weights_sha256(model) == state_sha256(state) == want


def test_hash_tensor_reads_label_then_bytes():
    t = torch.tensor([1.0, 2.0]).expand(3, 2).t()  # not contiguous
    a, b = hashlib.sha256(), hashlib.sha256(b"x")
    hash_tensor(a, t, "x")
    b.update(t.contiguous().numpy().tobytes())
    assert a.hexdigest() == b.hexdigest()


def test_environment_and_versions():
    assert __version__ == PACKAGE_VERSION
    env = environment()
    assert env["focus_attention"] == PACKAGE_VERSION and env["torch"] == torch.__version__
    assert set(library_versions(("torch",))) == {"python", "torch"}
