"""``focus export`` / ``export_model``: a model directory that transformers loads through
``trust_remote_code`` with Focus active, equal to the FocusModel it was exported from
(logits, generation, ``pipeline``, lm-eval's ``HFLM``), with settings that change at load
time, written all-or-nothing (docs/deploy.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from stops import ERRORS, run_until_stopped, stop_writes
from tiny import ARCHS, focus, ids, word_tokenizer
from tiny_assets import WORDS
from tolerances import tolerance
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from focus_attention import export_model
from focus_attention.deploy.loading import TRAINED_FIELDS
from focus_attention.deploy.settings import (
    AUTO_MAP,
    BASE_NAME_KEY,
    REMOTE_CODE_NAME,
    SETTING_FIELDS,
    SETTINGS_KEY,
    exported_settings,
)
from focus_attention.hf import FocusModel, FocusSlidingWindowWarning
from focus_attention.hf.card import setting_keywords_line
from focus_attention.hf.config import INFERENCE_SETTINGS
from focus_attention.hf.files import CONFIG_NAME, WEIGHTS_NAME


def load(directory, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FocusSlidingWindowWarning)  # Mistral's default window
        return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, **kwargs)


def exported(tmp_path, arch: str = "llama", **cfg):
    """``(focus_model, directory)``: a tiny FocusModel and its export (with a tokenizer)."""
    _, fm = focus(arch, **cfg)
    out = tmp_path / f"export-{arch}"
    export_model(fm, out, word_tokenizer(WORDS))
    return fm, out


@pytest.mark.parametrize("arch", ARCHS)
def test_the_export_loads_with_focus_and_equal_logits(tmp_path, arch):
    fm, out = exported(tmp_path, arch)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", CONFIG_NAME, WEIGHTS_NAME, REMOTE_CODE_NAME,
            "README.md", "tokenizer.json"} <= names  # fmt: skip
    model = load(out)
    assert type(model) is type(fm.base_model)  # the base model's own class
    assert not model.training and model.config._attn_implementation == "focus"
    assert isinstance(model.focus_model, FocusModel)
    assert model.focus_model.focus_config == fm.focus_config
    x = ids(2, 48, seed=3)  # longer than the window: the sparse mask matters
    with torch.no_grad():
        want, got = fm(input_ids=x).logits, model(input_ids=x).logits
        with fm.disable_focus():
            dense = fm(input_ids=x).logits
    print(f"{arch}: max |logit difference| export vs FocusModel {(got - want).abs().max():.3g}")
    assert torch.equal(got, want)
    assert not torch.equal(got, dense)  # Focus is active, not the dense base
    kw = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(x[:, :20], **kw), fm.generate(x[:, :20], **kw))


def test_settings_change_at_load_time_by_keyword_or_config_edit(tmp_path):
    fm, out = exported(tmp_path, "llama", num_groups=4, top_k=1, window=8)
    x = ids(1, 48, seed=4)
    fm.focus_config = fm.focus_config.replace(top_k=2, window=16, dense_layers=[1])
    with torch.no_grad():
        want = fm(input_ids=x).logits
    by_keyword = load(out, top_k=2, window=16, dense_layers=[1])
    config = by_keyword.focus_model.focus_config
    assert (config.top_k, config.window, config.dense_layers) == (2, 16, (1,))
    doc = json.loads((out / "config.json").read_text())
    assert doc[SETTINGS_KEY]["top_k"] == 1
    doc[SETTINGS_KEY].update(top_k=2, window=16, dense_layers=[1])
    (out / "config.json").write_text(json.dumps(doc))
    by_edit = load(out)
    edited = AutoConfig.from_pretrained(out, trust_remote_code=True)
    edited.focus["top_k"] = 1
    in_memory = load(out, config=edited)
    with torch.no_grad():
        assert torch.equal(by_keyword(input_ids=x).logits, want)
        assert torch.equal(by_edit(input_ids=x).logits, want)
    assert in_memory.focus_model.focus_config.top_k == 1
    with pytest.raises(ValueError, match="top_k"):
        load(out, top_k=9)  # more than num_groups


def test_the_attention_backend_changes_at_load_time_and_keeps_the_logits(tmp_path):
    """``attention_backend`` is a load-time setting: by keyword and in ``config.json``; the
    backend changes the arithmetic's order only (logits within float32 rounding)."""
    fm, out = exported(tmp_path, "llama", num_groups=4, top_k=1, window=8)
    x = ids(1, 48, seed=5)
    with torch.no_grad():
        want = fm(input_ids=x).logits
    masked = load(out, attention_backend="masked")
    assert masked.focus_model.focus_config.attention_backend == "masked"
    assert (
        json.loads((out / "config.json").read_text())[SETTINGS_KEY]["attention_backend"] == "auto"
    )
    with torch.no_grad():
        torch.testing.assert_close(masked(input_ids=x).logits, want, **tolerance("oracle"))
    with pytest.raises(ValueError, match="attention_backend") as err:
        load(out, attention_backend="nope")
    assert str(out) in str(err.value)  # the directory whose settings are wrong


def test_the_config_names_the_custom_code(tmp_path):
    fm, out = exported(tmp_path)
    doc = json.loads((out / "config.json").read_text())
    assert doc["model_type"] == "focus" and doc["auto_map"] == AUTO_MAP
    assert doc["base_config"]["model_type"] == "llama"
    assert "architectures" not in doc  # tools that read it look among transformers' classes
    assert (out / REMOTE_CODE_NAME).read_text().count("pip install ./focus-attention") == 1
    # without trust_remote_code transformers refuses (no silent dense base model)
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)


def test_pipeline_generates_as_the_focus_model(tmp_path):
    from transformers import pipeline

    fm, out = exported(tmp_path)
    tok = word_tokenizer(WORDS)
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(0, 60, 7))
    generate = pipeline("text-generation", str(out), trust_remote_code=True)
    assert generate.model.focus_model.focus_config == fm.focus_config
    text = generate(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)
    x = tok(prompt, return_tensors="pt").input_ids
    want = fm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False)
    assert text[0]["generated_text"] == tok.decode(want[0, x.shape[1] :])


def test_the_loader_of_transformers_serve_loads_it(tmp_path):
    try:
        from transformers.cli.serving.model_manager import ModelLoader
    except ImportError as err:
        pytest.skip(f"transformers serve's model loader is not importable: {err}")
    fm, out = exported(tmp_path)
    model, tokenizer = ModelLoader(device="cpu", trust_remote_code=True).load_model_and_processor(str(out))  # fmt: skip
    assert model.focus_model.focus_config == fm.focus_config
    x = ids(1, 40, seed=6)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, fm(input_ids=x).logits)


def test_lm_eval_hflm_scores_as_the_focus_model(tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    fm, out = exported(tmp_path)
    lm = HFLM(pretrained=str(out), trust_remote_code=True, batch_size=1, device="cpu")
    assert lm.model.focus_model.focus_config == fm.focus_config
    context = " ".join(WORDS[i % len(WORDS)] for i in range(0, 120, 3))
    requests = [Instance("loglikelihood", {}, (context, " the house"), 0)]
    ((got, _),) = lm.loglikelihood(requests, disable_tqdm=True)
    ctx, cont = lm._encode_pair(context, " the house")
    whole = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(fm(input_ids=whole[:, :-1]).logits.double(), -1)[0]
    want = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    print(f"HFLM loglikelihood {got:.6f}, FocusModel {want:.6f}")
    assert abs(got - want) < 1e-4


@pytest.mark.slow
def test_a_missing_package_is_named(tmp_path):
    _, out = exported(tmp_path)
    code = (
        "import sys\n"
        "sys.modules['focus_attention'] = None  # as if not installed\n"
        "from transformers import AutoModelForCausalLM\n"
        "try:\n"
        f"    AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
        "except ImportError as err:\n"
        "    print('ImportError:', err)\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "ImportError:" in done.stdout and "pip install ./focus-attention" in done.stdout


def test_an_existing_folder_is_kept_unless_overwrite(tmp_path):
    fm, out = exported(tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_model(fm, out)
    fm.focus_config = fm.focus_config.replace(top_k=2)
    export_model(fm, out, overwrite=True)
    assert json.loads((out / "config.json").read_text())[SETTINGS_KEY]["top_k"] == 2
    assert "tokenizer.json" not in {p.name for p in out.iterdir()}  # replaced as a whole
    assert before["config.json"] != (out / "config.json").read_bytes()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        export_model(fm, tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    export_model(fm, empty)
    assert (empty / "config.json").is_file()


def test_a_failed_export_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    fm, out = exported(tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    tok = word_tokenizer(WORDS)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tok, "save_pretrained", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_model(fm, out, tok, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no staging left


def _export_window(out) -> int:
    """The window of the export in ``out``, checked to be its adapter's and its weights
    file's too, and the window the loaded model runs with."""
    from safetensors import safe_open

    window = json.loads((out / "config.json").read_text())[SETTINGS_KEY]["window"]
    assert json.loads((out / CONFIG_NAME).read_text())["window"] == window
    with safe_open(str(out / WEIGHTS_NAME), framework="pt") as f:
        assert json.loads(f.metadata()["focus_config"])["window"] == window
    assert load(out).focus_model.focus_config.window == window
    return window


@pytest.mark.parametrize("error", list(ERRORS))
def test_a_stop_at_any_write_leaves_the_earlier_export_or_the_new_one(tmp_path, monkeypatch, error):  # fmt: skip
    """Ctrl-C or a full disk at each write of an export over an earlier one: the folder is
    the earlier export (window 8) or the new one (window 6), whole, and loads."""
    import focus_attention.deploy.export as module

    fm, out = exported(tmp_path, window=8)

    def export(window, at=None):
        fm.focus_config = fm.focus_config.replace(window=window)
        module.export_model(fm, out, word_tokenizer(WORDS), overwrite=True)

    with monkeypatch.context() as m:
        seen = stop_writes(m, module, "export_model")
        export(6)
    assert seen.count("replace") >= 3
    for at in range(len(seen)):
        export(8)
        with monkeypatch.context() as m:
            stop_writes(m, module, "export_model", at, ERRORS[error])
            run_until_stopped(lambda: export(6), ERRORS[error])
        assert _export_window(out) in (6, 8), f"write {at} ({seen[at]})"
        assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no staging left


def test_a_loaded_export_exports_again(tmp_path):
    fm, out = exported(tmp_path)
    model = load(out)
    again = export_model(model.focus_model, tmp_path / "again")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same base, no stray router weights
        reloaded = load(again)
    x = ids(1, 40, seed=5)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, fm(input_ids=x).logits)


def test_a_saved_again_export_names_the_original_base_model(tmp_path):
    """The export records its base model's name; a model loaded from it (whose base model
    comes from the export's folder) and saved, or exported, again names the original."""
    _, fm = focus("llama")
    out = tmp_path / "export"
    export_model(fm, out, base_name="org/tiny-base")
    assert json.loads((out / "config.json").read_text())[BASE_NAME_KEY] == "org/tiny-base"
    model = load(out)
    model.save_pretrained(tmp_path / "saved")
    export_model(model.focus_model, tmp_path / "again")
    for again in (tmp_path / "saved", tmp_path / "again"):
        card = (again / "README.md").read_text()
        assert "# org/tiny-base with Focus sparse attention" in card, again
        assert "base_model: org/tiny-base" in card and str(out) not in card
        assert json.loads((again / "config.json").read_text())[BASE_NAME_KEY] == "org/tiny-base"


def _weight_names(directory) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_save_pretrained_of_a_loaded_export_writes_an_export_that_loads_with_focus(tmp_path, caplog):  # fmt: skip
    """The loaded model's own save_pretrained writes a complete exported directory: no router
    tensors among the base weights (no unexpected-keys report on reload), the adapter, the
    settings it runs with, the custom code; files already there (a tokenizer) stay."""
    fm, out = exported(tmp_path)
    model = load(out, window=6)
    saved = tmp_path / "saved"
    word_tokenizer(WORDS).save_pretrained(saved)  # the usual pair of calls, either order
    model.save_pretrained(saved)
    assert not [k for k in _weight_names(saved) if k.startswith("focus_routers")]
    assert _weight_names(saved) == _weight_names(out)
    assert {CONFIG_NAME, WEIGHTS_NAME, REMOTE_CODE_NAME, "tokenizer.json"} <= {p.name for p in saved.iterdir()}  # fmt: skip
    assert json.loads((saved / "config.json").read_text())[SETTINGS_KEY]["window"] == 6
    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reloaded = load(saved)
    assert "unexpected" not in caplog.text.lower()
    assert reloaded.focus_model.focus_config.window == 6
    fm.focus_config = fm.focus_config.replace(window=6)
    x = ids(1, 40, seed=5)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, fm(input_ids=x).logits)
    assert not [p for p in saved.iterdir() if p.name.startswith(".")]


def test_save_pretrained_of_a_loaded_export_takes_the_trainers_arguments(tmp_path):
    """What transformers.Trainer passes (the full state dict, routers included) gives the
    same export; a sharded save replaces the single weights file; push_to_hub is refused
    with what to do instead."""
    _, out = exported(tmp_path)
    model = load(out)
    saved = tmp_path / "saved"
    model.save_pretrained(saved, state_dict=model.state_dict(), safe_serialization=True)
    assert _weight_names(saved) == _weight_names(out)
    model.save_pretrained(saved, max_shard_size="100KB")
    names = {p.name for p in saved.iterdir()}
    assert "model.safetensors.index.json" in names and "model.safetensors" not in names
    assert load(saved).focus_model is not None
    with pytest.raises(ValueError, match="push_to_hub"):
        model.save_pretrained(tmp_path / "hub", push_to_hub=True)
    assert not (tmp_path / "hub").exists()


@pytest.mark.parametrize("error", list(ERRORS))
def test_save_pretrained_of_a_loaded_export_stopped_at_any_write_keeps_the_earlier_save(tmp_path, monkeypatch, error):  # fmt: skip
    _, out = exported(tmp_path)
    model = load(out, window=8)
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    model.focus_model.focus_config = model.focus_model.focus_config.replace(window=6)
    with monkeypatch.context() as m:
        seen = stop_writes(m, model, "save_pretrained")
        model.save_pretrained(tmp_path / "count")
    assert seen.count("replace") >= 3
    for at in range(len(seen)):
        with monkeypatch.context() as m:
            stop_writes(m, model, "save_pretrained", at, ERRORS[error])
            run_until_stopped(lambda: model.save_pretrained(saved), ERRORS[error])
        assert _export_window(saved) in (6, 8), f"write {at} ({seen[at]})"
        assert not [p for p in saved.iterdir() if p.name.startswith(".")]


def test_a_model_that_is_not_a_focus_model_is_refused_before_writing(tmp_path):
    fm, out = exported(tmp_path)
    model = load(out)
    with pytest.raises(TypeError, match=r"loaded from an exported directory.*model\.focus_model"):
        export_model(model, tmp_path / "again")
    with pytest.raises(TypeError, match="received a LlamaForCausalLM, expected a FocusModel"):
        export_model(fm.unload(), tmp_path / "again")
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # nothing written


def test_the_card_loads_the_path_as_given(tmp_path, monkeypatch):
    """The card's example names the directory as the caller gave it (a relative path stays
    relative: no local absolute path to publish with the card)."""
    _, fm = focus("llama")
    monkeypatch.chdir(tmp_path)
    export_model(fm, "exports/tiny")
    card = (tmp_path / "exports" / "tiny" / "README.md").read_text()
    assert 'from_pretrained("exports/tiny"' in card.replace("'", '"')
    assert str(tmp_path) not in card


def test_focus_export_command(tmp_path, capsys):
    from tiny_assets import make_model_dir

    from focus_attention.cli import main
    from focus_attention.hf import FocusConfig, get_focus_model

    model_dir = make_model_dir(tmp_path / "model")
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    fm = get_focus_model(base, FocusConfig(num_groups=4, top_k=1, window=8, sink_tokens=1))
    fm.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "out"
    argv = ["export", "--model", str(model_dir), "--adapter", str(tmp_path / "adapter"),
            "--out", str(out), "--top-k", "2"]  # fmt: skip
    assert main(argv) == 0
    assert str(out) in capsys.readouterr().out
    model = load(out)
    assert model.focus_model.focus_config.top_k == 2
    assert main(argv) == 1  # not empty, no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    (tmp_path / "adapter" / "lora").mkdir()
    (tmp_path / "adapter" / "lora" / "adapter_config.json").write_text("{}")
    assert main([*argv, "--overwrite"]) == 1  # a run with LoRA: the export would drop it
    assert "lora/ (LoRA)" in capsys.readouterr().err


@pytest.mark.assets
@pytest.mark.slow
def test_smollm2_export_matches_its_focus_model(tmp_path):
    from focus_attention.assets.models import is_prepared, load_model
    from focus_attention.hf import FocusConfig, get_focus_model

    if not is_prepared("smollm2-135m"):
        pytest.skip("smollm2-135m is not prepared (run `focus setup`)")
    base, tokenizer = load_model("smollm2-135m", quiet=True)
    fm = get_focus_model(base, FocusConfig(num_groups=8, top_k=2, window=32)).eval()
    out = export_model(fm, tmp_path / "smollm2-focus", tokenizer)
    model = load(out)
    text = "It is a truth universally acknowledged, that a single man in possession " * 6
    x = tokenizer(text, return_tensors="pt").input_ids[:, :96]
    with torch.no_grad():
        want, got = fm(input_ids=x).logits, model(input_ids=x).logits
    print(f"smollm2-135m: max |logit difference| {(got - want).abs().max():.3g}")
    assert torch.equal(got, want)
    kw = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(x))
    assert torch.equal(model.generate(x, **kw), fm.generate(x, **kw))


def test_the_settings_import_without_torch():
    code = (
        "import sys, focus_attention.deploy, focus_attention.deploy.settings\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("how", ["keyword", "config.json", "config.json table", "config object"])
def test_a_trained_shape_is_refused_at_load_time_naming_it(tmp_path, how):
    _, out = exported(tmp_path, "llama", num_groups=4)
    kwargs = {}
    doc = json.loads((out / "config.json").read_text())
    if how == "keyword":
        kwargs["num_groups"] = 2
    elif how == "config.json":
        (out / "config.json").write_text(json.dumps({**doc, "num_groups": 2}))
    elif how == "config.json table":
        doc[SETTINGS_KEY]["num_groups"] = 2
        (out / "config.json").write_text(json.dumps(doc))
    else:
        config = AutoConfig.from_pretrained(out, trust_remote_code=True)
        config.num_groups = 2
        kwargs["config"] = config
    with pytest.raises(ValueError, match=r"num_groups=2 cannot change at load time.*training"):
        load(out, **kwargs)


@pytest.mark.parametrize("where", ["top level", "settings table", "keyword"])
@pytest.mark.parametrize(("key", "meant"), [("windw", "window"), ("top-k", "top_k"), ("topk", "top_k"), ("num_group", "num_groups"), ("dense_layer", "dense_layers")])  # fmt: skip
def test_a_misspelt_setting_is_refused_naming_it(tmp_path, key, meant, where):
    """In ``config.json`` (either place) or as a ``from_pretrained`` keyword, a name close
    to a setting's gets "did you mean", not a silent default or the base model's
    ``TypeError``; other keys load."""
    _, out = exported(tmp_path)
    doc = json.loads((out / "config.json").read_text())
    kwargs = {}
    if where == "top level":
        (out / "config.json").write_text(json.dumps({**doc, key: 64}))
    elif where == "settings table":
        (out / "config.json").write_text(json.dumps({**doc, SETTINGS_KEY: {**doc[SETTINGS_KEY], key: 64}}))  # fmt: skip
    else:
        kwargs[key] = 64
    with pytest.raises(ValueError, match=f"'{key}', which is no Focus setting: did you mean '{meant}'"):  # fmt: skip
        load(out, **kwargs)
    (out / "config.json").write_text(json.dumps({**doc, "comment": "kept"}))  # other keys load
    loaded = load(out, dtype=torch.float32)  # and from_pretrained's own keywords
    assert loaded.focus_model.focus_config.window == doc[SETTINGS_KEY]["window"]


def test_an_unknown_key_of_the_settings_table_is_refused(tmp_path):
    _, out = exported(tmp_path)
    doc = json.loads((out / "config.json").read_text())
    doc[SETTINGS_KEY]["comment"] = "not a setting"
    (out / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"focus\.comment: no such Focus setting; the settings are window"):  # fmt: skip
        load(out)


def test_a_setting_at_the_top_level_of_a_new_export_is_refused_naming_its_table(tmp_path):
    _, out = exported(tmp_path)
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    config.window = 16  # where the first layout kept it
    with pytest.raises(ValueError, match=r"'window' at its top level.*config\.focus\['window'\]"):
        load(out, config=config)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_no_reader_of_the_models_config_finds_focus_settings(tmp_path, arch):
    """A tool that builds its sampling defaults from the config (``GenerationConfig.
    from_model_config``) gets the base model's, not Focus's ``top_k``: no setting is a
    top-level key of ``config.json``."""
    fm, out = exported(tmp_path, arch, top_k=1)
    doc = json.loads((out / "config.json").read_text())
    assert set(SETTING_FIELDS).isdisjoint(doc) and doc[SETTINGS_KEY]["top_k"] == 1
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert set(SETTING_FIELDS).isdisjoint(vars(config))
    base = GenerationConfig.from_model_config(fm.base_model.config).to_dict()
    from_export = GenerationConfig.from_model_config(config).to_dict()
    assert {k: from_export[k] for k in base if k != "transformers_version"} == {
        k: v for k, v in base.items() if k != "transformers_version"}  # fmt: skip
    assert from_export["top_k"] == base["top_k"] != 1
    generated = load(out).generation_config
    assert generated.top_k == fm.base_model.generation_config.top_k


def _first_layout(out) -> dict:
    """The export's ``config.json`` rewritten as the first layout wrote it: the settings at
    the top level, layout 1, no base model name."""
    doc = json.loads((out / "config.json").read_text())
    settings = doc.pop(SETTINGS_KEY)
    doc.pop(BASE_NAME_KEY, None)
    old = {k: v for k, v in doc.items() if k != "base_config"}
    old.update(settings, focus_export_format=1, base_config=doc["base_config"])
    (out / "config.json").write_text(json.dumps(old, indent=2))
    return old


def test_an_export_of_the_first_layout_still_loads_with_its_settings(tmp_path):
    fm, out = exported(tmp_path, "llama", num_groups=4, top_k=1, window=8)
    old = _first_layout(out)
    old.update(top_k=2, window=16)  # over the adapter's: read from config.json
    (out / "config.json").write_text(json.dumps(old))
    assert exported_settings(old)["top_k"] == 2
    x = ids(1, 48, seed=6)
    fm.focus_config = fm.focus_config.replace(top_k=2, window=16)
    with torch.no_grad():
        want = fm(input_ids=x).logits
    model = load(out)
    assert (model.focus_model.focus_config.top_k, model.focus_model.focus_config.window) == (2, 16)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, want)
    by_keyword = load(out, top_k=1, window=8).focus_model.focus_config
    assert (by_keyword.top_k, by_keyword.window) == (1, 8)
    with pytest.raises(ValueError, match="did you mean 'top_k'"):
        load(out, topk=1)


def test_the_exported_files_get_the_umask_mode(tmp_path):
    mask = os.umask(0o022)
    os.umask(mask)
    _, out = exported(tmp_path, "llama")
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert modes and set(modes.values()) == {0o666 & ~mask}, modes  # model.safetensors too


def test_the_config_gives_the_base_models_context_length(tmp_path):
    """``transformers serve`` reads the context length of the directory's config (its text
    config): the base model's, so that it refuses prompts longer than the model's."""
    fm, out = exported(tmp_path, "llama")
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    text = config.get_text_config(decoder=True)
    assert text.max_position_embeddings == fm.base_model.config.max_position_embeddings == 1024
    assert text.vocab_size == fm.base_model.config.vocab_size


def test_the_exported_settings_are_the_declared_inference_settings(tmp_path):
    assert tuple(INFERENCE_SETTINGS) == SETTING_FIELDS
    _, out = exported(tmp_path)
    assert tuple(json.loads((out / "config.json").read_text())[SETTINGS_KEY]) == SETTING_FIELDS
    for name in INFERENCE_SETTINGS:
        assert re.search(rf"[ `]{name}=", setting_keywords_line()), name
    assert f"the `{SETTINGS_KEY}` table of `config.json`" in (out / "README.md").read_text()
    assert set(TRAINED_FIELDS).isdisjoint(INFERENCE_SETTINGS)
