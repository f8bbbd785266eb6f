"""The transformers names that changed between releases (src/focus_attention/hf/compat.py):
the package's own calls raise no deprecation warning on the installed release, and the suite
turns such a warning from the package or the tests into a failure."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from tiny import focus, ids
from tolerances import tolerance
from transformers import GenerationMixin, PreTrainedModel

from focus_attention.hf import compat


def test_the_names_follow_the_installed_release():
    generation = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    assert ("cache" if "cache" in generation else "past_key_values") == compat.CACHE_KWARG
    has_new = hasattr(PreTrainedModel, "activation_checkpointing_enable")
    assert compat.ACTIVATION_CHECKPOINTING is has_new


def test_decoding_through_the_helpers_is_exact_and_raises_no_deprecation():
    _, fm = focus("llama", top_k=1, window=8, sink_tokens=2)
    x = ids(1, 30, seed=3)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        full = fm(input_ids=x, use_cache=False).logits
        cache = compat.cache_of(fm(input_ids=x[:, :20], use_cache=True))
        steps = [fm(input_ids=x[:, t : t + 1], **compat.cache_kwargs(cache), use_cache=True).logits
                 for t in range(20, 30)]  # fmt: skip
        fm.generate(x[:, :5], max_new_tokens=3, do_sample=False)
        assert not compat.activation_checkpointing_enabled(fm)
        compat.enable_activation_checkpointing(fm, use_reentrant=False)
        assert compat.activation_checkpointing_enabled(fm)
    assert cache.get_seq_length() == 30
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 20:], **tolerance("oracle"))


@pytest.mark.parametrize(
    "module,message",
    [
        ("focus_attention.hf.model", "some_call is deprecated"),
        ("focus_attention.bench.decode", "an argument will change"),
        ("test_settings", "a test's own call"),
        ("hf.test_something", "a test's own call in a package"),
        ("hf.conftest", "a fixture's call in a package"),
        ("ops.helpers", "a test helper's call in a package"),
        (
            "torch.nn.modules.module",
            "`past_key_values` is deprecated and will be removed in version 9.0",
        ),
    ],
)
@pytest.mark.parametrize("category", [FutureWarning, DeprecationWarning])
def test_the_suite_fails_on_a_deprecation_from_the_package_or_the_tests(module, message, category):
    """The filters of pyproject.toml ([tool.pytest.ini_options] filterwarnings) are active in
    every test: a deprecation attributed to the package, to a test module, or a transformers
    rename message (which transformers attributes to torch's module-call frame) is an error."""
    if module.startswith("torch") and category is DeprecationWarning:
        pytest.skip("transformers renames warn with FutureWarning")
    with pytest.raises(category, match=message.split()[-1]):
        warnings.warn_explicit(message, category, "file.py", 1, module=module)


def test_other_libraries_deprecations_stay_warnings():
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit("old", DeprecationWarning, "file.py", 1, module="somelib.api")
    assert [str(w.message) for w in seen] == ["old"]
