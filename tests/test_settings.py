"""The settings classes: every setting declared once (a field name in at most two settings
classes: a shared group and, for an adapter setting, FocusConfig), the shared groups'
defaults per command, and the deprecated names."""

from __future__ import annotations

import collections
import dataclasses
import subprocess
import sys

import pytest

from focus_attention.bench import settings as bench_settings
from focus_attention.cli.settings import ModelsPrepareConfig, SetupConfig
from focus_attention.evaluation import settings as eval_settings
from focus_attention.evaluation.settings import CalibrateConfig, EvalConfig, InspectConfig
from focus_attention.hf.config import INFERENCE_SETTINGS, FocusConfig
from focus_attention.settings import (
    ADAPTER_OVERRIDES,
    SHARED_CHECKS,
    AdapterOverrides,
    TextSettings,
    override_check,
    override_type,
    settings_class,
)

#: the settings classes of the commands outside training
COMMAND_CLASSES = [
    FocusConfig,
    EvalConfig,
    CalibrateConfig,
    InspectConfig,
    SetupConfig,
    ModelsPrepareConfig,
    *(getattr(bench_settings, name) for name in bench_settings.__all__ if name.endswith("Config")),
]
#: settings of the training commands declared in more classes than the rule allows
#: (field -> those classes); empty: every training command composes the shared groups
TRAINING_EXCESS: dict[str, set[str]] = {}
#: one word naming a different count in each benchmark (forwards, decoding steps, requests;
#: decoding requests, lm-eval's batch, sequences): not one setting, so not one group
OTHER_UNITS: dict[str, set[str]] = {
    "warmup": {"ModelBenchConfig", "DecodeBenchConfig", "ServeBenchConfig"},
    "batch_size": {"DecodeBatch", "TasksBenchConfig", "BatchSettings"},
}


def _training_classes() -> list[type]:
    from focus_attention.experiments.settings import SweepConfig
    from focus_attention.training.config import TrainConfig
    from focus_attention.training.pretrain import PretrainConfig

    return [TrainConfig, PretrainConfig, SweepConfig]


def _declarations(classes: list[type]) -> dict[str, set[str]]:
    """Field name -> the classes (of ``classes`` and their bases) that declare it with help
    text; a command's other default for a group's field is not a declaration."""
    found = collections.defaultdict(set)
    for cls in classes:
        for owner in cls.__mro__:
            if not dataclasses.is_dataclass(owner):
                continue
            for name in owner.__dict__.get("__annotations__", {}):
                field = owner.__dataclass_fields__.get(name)
                if field is None or "help" not in field.metadata:
                    continue
                if name not in owner.__dict__.get("COMMAND_DEFAULTS", {}):
                    found[name].add(owner.__qualname__)
    return found


@pytest.mark.slow  # imports the training package (torch)
def test_no_setting_is_declared_in_more_than_two_classes():
    found = _declarations(COMMAND_CLASSES + _training_classes())
    excess = {}
    for name, owners in found.items():
        allowed = TRAINING_EXCESS.get(name, set()) | OTHER_UNITS.get(name, set())
        if len(owners - allowed) > 2:
            excess[name] = sorted(owners)
    assert not excess, f"settings declared in more than two classes: {excess}"
    stale = {n: sorted(c - found.get(n, set())) for n, c in TRAINING_EXCESS.items()}
    assert not any(stale.values()), f"shrink TRAINING_EXCESS, no longer declared: {stale}"


def test_adapter_settings_are_declared_by_focusconfig_and_one_group():
    found = _declarations(COMMAND_CLASSES)
    for name in ("window", "top_k", "sink_tokens", "dense_layers", "dense_heads", "query_top_k",
                 "inference_routing"):  # fmt: skip
        assert found[name] == {"FocusConfig", _group_of(name)}, name
    for name in ("seq_len", "split", "threads", "progress", "json"):
        assert len(found[name]) == 1, (name, found[name])
    for name in ("model", "corpus"):  # and focus setup's lists of the ones to prepare
        assert found[name] - {"SetupConfig"} == {
            "BaseModelSettings" if name == "model" else "CorpusSettings"
        }


def _group_of(name: str) -> str:
    groups = {"top_k": "TopKValues", "window": "WindowValues", "query_top_k": "QueryTopKValue"}
    return groups.get(name, "AdapterOverrides")


def test_settings_modules_hold_every_command_class():
    # bench.settings re-exports the retrieval ranking's settings, which evaluation holds
    for module in (eval_settings, bench_settings):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and name.endswith("Config"):
                assert obj.__module__ in (module.__name__, eval_settings.__name__)


def test_a_command_default_keeps_the_groups_help_and_type():
    field = {f.name: f for f in dataclasses.fields(CalibrateConfig)}["split"]
    group = {f.name: f for f in dataclasses.fields(TextSettings)}["split"]
    assert field.default == "validation" and group.default == "test"
    assert field.metadata["help"] == group.metadata["help"] and field.type == group.type
    assert CalibrateConfig(adapter="a", out="b").split == "validation"
    assert EvalConfig().split == "test"
    with pytest.raises(TypeError, match="no inherited settings field 'bogus'"):
        settings_class(defaults={"bogus": 1})(type("X", (TextSettings,), {}))


def test_one_or_several_values_follow_the_class():
    assert EvalConfig(top_k=[2, 1, 2]).top_k == (1, 2)  # several: sorted, distinct
    assert CalibrateConfig(adapter="a", out="b", top_k=[3]).top_k == 3  # one
    with pytest.raises(ValueError, match=r"CalibrateConfig.top_k: received \(1, 2\), expected None or one int >= 1"):  # fmt: skip
        CalibrateConfig(adapter="a", out="b", top_k=(1, 2))
    with pytest.raises(ValueError, match="EvalConfig.window: .*one int"):
        EvalConfig(window=(64, 128))
    assert bench_settings.ModelBenchConfig(window=[64, 128]).window == (64, 128)
    with pytest.raises(ValueError, match="EvalConfig.top_k: received"):
        EvalConfig(top_k=(0,))


@pytest.mark.parametrize(
    "cls, old, new, value",
    [
        (EvalConfig, "top_k_values", "top_k", (1, 2)),
        (InspectConfig, "tokens", "max_tokens", 2048),
        (bench_settings.ModelBenchConfig, "windows", "window", (64, 128)),
    ],
)
def test_deprecated_names_still_work_with_a_warning(cls, old, new, value):
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated, use '{new}'"):
        config = cls(**{old: value})
    assert getattr(config, new) == value and getattr(config, old) == value
    with pytest.warns(DeprecationWarning):
        assert getattr(cls.from_dict({old: value}), new) == value
    assert getattr(dataclasses.replace(config, **{new: value}), new) == value
    assert old not in {f.name for f in dataclasses.fields(cls)}


def test_overrides_are_the_focusconfig_fields_they_override():
    overrides = AdapterOverrides(window=64, top_k=1, dense_layers=(3,)).overrides()
    assert set(overrides) <= {f.name for f in dataclasses.fields(FocusConfig)}
    assert FocusConfig().override(**overrides).window == 64


def test_the_override_groups_are_built_from_the_declarations():
    assert tuple(INFERENCE_SETTINGS) == ADAPTER_OVERRIDES
    fields = {f.name: f for f in dataclasses.fields(AdapterOverrides)}
    for name, setting in INFERENCE_SETTINGS.items():
        field = fields[name]
        assert field.default is None and field.type == override_type(setting), name
        assert dict(field.metadata) == setting.flag_metadata(setting.override_help), name
        assert (name in SHARED_CHECKS) == (override_check(setting) is not None), name
    assert override_type(INFERENCE_SETTINGS["top_k"]) == "int | tuple[int, ...] | None"
    assert override_type(INFERENCE_SETTINGS["query_top_k"]) == "int | None"
    assert override_type(INFERENCE_SETTINGS["dense_layers"]) == "tuple[int, ...] | None"


#: a setting added to the declaration before the modules that build on it are imported
TOY_SETTING = """
from focus_attention.hf import config
config.INFERENCE_SETTINGS["toy"] = config.InferenceSetting(
    name="toy", type="int", default=3, help="a toy", override_help="a toy, over the adapter's",
    low=2)
"""


@pytest.mark.slow  # a fresh interpreter importing transformers
def test_a_setting_added_to_the_declaration_reaches_every_consumer():
    code = (
        TOY_SETTING
        + """
import argparse
from focus_attention.cli.flags import add_flags, flag_values
from focus_attention.deploy.settings import SETTING_FIELDS, ExportConfig
from focus_attention.evaluation.settings import EvalConfig
from focus_attention.hf.card import setting_keywords_line
from focus_attention.settings import ADAPTER_OVERRIDES
parser = argparse.ArgumentParser()
add_flags(parser, EvalConfig)
assert "a toy, over the adapter's" in parser.format_help()
assert flag_values(parser.parse_args(["--toy", "5"]), EvalConfig) == {"toy": 5}
assert EvalConfig(toy=5).overrides()["toy"] == 5
try:
    ExportConfig(adapter="a", out="b", toy=1)
except ValueError as err:
    assert str(err) == "ExportConfig.toy: received 1, expected None or an int >= 2", err
else:
    raise AssertionError("toy=1 accepted")
assert ADAPTER_OVERRIDES[-1] == SETTING_FIELDS[-1] == "toy"
assert "`toy=`" in setting_keywords_line()
# the model card's settings table
from focus_attention.hf.card import adapter_card, card_settings
assert card_settings()[-1] == "toy"
assert "| toy | `4` |" in adapter_card({"toy": 4, "layers": []}, {})
# the export's config.json and the keywords of its from_pretrained
from focus_attention.deploy.export import export_document
from focus_attention.deploy.loading import setting_keywords
from focus_attention.deploy.settings import SETTINGS_KEY, exported_settings
class Stub:
    def to_dict(self):
        return {name: 1 for name in SETTING_FIELDS}
doc = export_document({"model_type": "llama"}, Stub())
assert exported_settings(doc)["toy"] == 1 and "toy" not in doc
keywords = {"toy": 5, "dtype": "float32"}
assert setting_keywords("export", keywords) == {"toy": 5} and keywords == {"dtype": "float32"}
try:
    setting_keywords("export", {"toys": 5})
except ValueError as err:
    assert "'toys', which is no Focus setting: did you mean 'toy'?" in str(err), err
else:
    raise AssertionError("toys=5 accepted")
# what a focus eval record says it overrode
assert EvalConfig(toy=5).overrides(without=("top_k",))["toy"] == 5
print("ok")
"""
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr
