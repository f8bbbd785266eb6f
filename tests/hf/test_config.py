"""FocusConfig: defaults, JSON round trip and validation (docs/method.md §8)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from focus_attention import FocusConfig as TopLevelFocusConfig
from focus_attention import get_focus_model as top_level_get_focus_model
from focus_attention.hf import FocusConfig, get_focus_model
from focus_attention.hf.config import INFERENCE_SETTINGS, InferenceSetting


def test_defaults():
    c = FocusConfig()
    assert (c.num_groups, c.group_dim, c.window, c.top_k) == (8, 16, 128, 2)
    assert (c.temperature, c.sinkhorn_iters) == (0.1, 10)
    assert c.gate in ("paper", "log") and c.gate_sharpness > 0
    assert c.sink_tokens == 4
    assert (c.routing, c.inference_routing, c.layers, c.seed) == ("auto", "causal", None, 0)


def test_top_level_exports():
    assert TopLevelFocusConfig is FocusConfig
    assert top_level_get_focus_model is get_focus_model


def test_json_round_trip(tmp_path):
    c = FocusConfig(num_groups=4, top_k=3, gate="paper", layers=[3, 1], seed=9, sink_tokens=0)
    assert c.layers == (1, 3)
    text = c.to_json_string()
    assert json.loads(text)["format_version"] == 1
    assert FocusConfig.from_json_string(text) == c
    (tmp_path / "c.json").write_text(text)
    assert FocusConfig.from_json_file(tmp_path / "c.json") == c
    assert FocusConfig.from_dict(c.to_dict()) == c
    assert c.replace(window=64).window == 64
    # override: None keeps the field, anything else replaces it (and is validated)
    o = c.override(window=64, sink_tokens=None, dense_layers=None)
    assert o == c.replace(window=64) and o.sink_tokens == c.sink_tokens
    assert c.override() == c
    with pytest.raises(ValueError, match="window"):
        c.override(window=0)


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_groups", 0),
        ("num_groups", 2.0),
        ("group_dim", 0),
        ("window", 0),
        ("top_k", 0),
        ("top_k", 9),  # > num_groups
        ("temperature", 0.0),
        ("temperature", float("nan")),
        ("sinkhorn_iters", -1),
        ("gate", "sigmoid"),
        ("gate_sharpness", -1.0),
        ("sink_tokens", -1),
        ("routing", "hard"),
        ("inference_routing", "future"),
        ("layers", [0, 0]),
        ("layers", [-1]),
        ("layers", []),
        ("layers", "0,1"),
        ("seed", "0"),
        ("bias_momentum", 0.0),
        ("bias_momentum", True),
    ],
)
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"FocusConfig.{field}: received"):
        FocusConfig(**{field: value})


def test_unknown_keys_and_versions_are_errors():
    with pytest.raises(ValueError, match="unknown keys"):
        FocusConfig.from_dict({"num_groups": 4, "groups": 4})
    with pytest.raises(ValueError, match="format_version"):
        FocusConfig.from_dict({"format_version": 99})
    with pytest.raises(ValueError, match="not valid JSON"):
        FocusConfig.from_json_string("{")


@pytest.mark.parametrize(
    "content, what",
    [
        ('{"num_groups": 4,', "invalid JSON"),
        (b"\xff\xfe{}", "invalid JSON"),
        ("[1, 2]", "a JSON list, expected an object"),
        ('{"num_groups": 0}', "FocusConfig.num_groups: received 0"),
    ],
)
def test_corrupt_config_file_is_a_value_error_naming_it(tmp_path, content, what):
    path = tmp_path / "focus_config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ValueError, match="focus_config.json: not a valid Focus config") as err:
        FocusConfig.from_json_file(path)
    assert str(path) in str(err.value) and what in str(err.value)


def test_each_inference_setting_is_the_focusconfig_field_its_declaration_makes():
    fields = {f.name: f for f in dataclasses.fields(FocusConfig)}
    assert list(INFERENCE_SETTINGS) == [
        "window", "sink_tokens", "dense_layers", "dense_heads", "top_k", "query_top_k",
        "inference_routing", "attention_backend",
    ]  # fmt: skip
    for name, setting in INFERENCE_SETTINGS.items():
        assert setting.name == name
        field = fields[name]  # a new setting is named in FocusConfig's body, where it goes
        assert (field.type, field.default) == (setting.type, setting.default), name
        assert dict(field.metadata) == setting.flag_metadata(setting.help), name
        assert getattr(FocusConfig(), name) == setting.default


def test_a_declared_setting_checks_its_values_as_declared():
    with pytest.raises(ValueError, match=r"^X\.window: received 0, expected an int >= 1$"):
        INFERENCE_SETTINGS["window"].check_value("X", 0)
    INFERENCE_SETTINGS["query_top_k"].check_value("X", None)  # optional
    with pytest.raises(ValueError, match=r"X\.inference_routing: received 'x', expected one of"):
        INFERENCE_SETTINGS["inference_routing"].check_value("X", "x")
    with pytest.raises(ValueError, match="registered sparse-attention backend"):
        INFERENCE_SETTINGS["attention_backend"].check_value("X", "nope")
    with pytest.raises(TypeError, match="list setting"):
        INFERENCE_SETTINGS["dense_layers"].check_value("X", (1,))
    toy = InferenceSetting(name="toy", type="int", default=3, help="h", override_help="o", low=2)
    with pytest.raises(ValueError, match=r"X\.toy: received 1, expected an int >= 2"):
        toy.check_value("X", 1)
    assert toy.config_field().default == 3 and toy.flag_metadata("h") == {"help": "h"}
