"""Focus adapters and exported models on the Hugging Face hub, tested offline: a hub cache
laid out as ``huggingface_hub`` lays it out (``models--org--name/snapshots/<commit>/``,
``refs/main``) with ``HF_HUB_OFFLINE=1``, and an upload whose ``HfApi`` calls are recorded
instead of sent (docs/deploy.md)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest
import torch
from tiny import build_model, focus, ids

from focus_attention import export_model
from focus_attention.hf import FocusModel, FocusSlidingWindowWarning
from focus_attention.hf.files import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache in ``tmp_path`` with the hub offline (``HF_HUB_OFFLINE=1``)."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads both when it is imported
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_repo(cache, repo_id: str, folder, commit: str = COMMIT) -> None:
    """Put the files of ``folder`` in ``cache`` as the snapshot ``commit`` of ``repo_id``,
    the ``main`` branch pointing at it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def test_an_adapter_loads_by_repo_id_from_the_hub_cache(tmp_path, hub_cache):
    _, fm = focus("llama")
    fm.save_pretrained(tmp_path / "adapter")
    cache_repo(hub_cache, "org/focus-tiny", tmp_path / "adapter")
    x = ids(1, 40, seed=1)
    for revision in (None, "main", COMMIT):
        again = FocusModel.from_pretrained(build_model("llama"), "org/focus-tiny", revision=revision)  # fmt: skip
        assert again.focus_config == fm.focus_config
        assert torch.equal(logits(again, x), logits(fm, x))
    explicit = FocusModel.from_pretrained(build_model("llama"), "org/focus-tiny", cache_dir=hub_cache)  # fmt: skip
    assert torch.equal(logits(explicit, x), logits(fm, x))


def test_a_repo_the_cache_lacks_is_reported(tmp_path, hub_cache):
    with pytest.raises(FileNotFoundError, match=r"'org/missing'.*HF_HUB_OFFLINE"):
        FocusModel.from_pretrained(build_model("llama"), "org/missing")
    _, fm = focus("llama")
    fm.save_pretrained(tmp_path / "adapter")
    cache_repo(hub_cache, "org/focus-tiny", tmp_path / "adapter")
    with pytest.raises(FileNotFoundError, match="revision v2"):
        FocusModel.from_pretrained(build_model("llama"), "org/focus-tiny", revision="v2")


def test_an_offline_typo_of_a_local_folder_says_so_without_the_hub_clients_error(tmp_path, hub_cache, monkeypatch):  # fmt: skip
    (tmp_path / "runs" / "austen-4k").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        FocusModel.from_pretrained(build_model("llama"), "runs/austen4k")
    message = str(err.value)
    assert message == (
        "Focus adapter 'runs/austen4k': no such local folder (did you mean 'runs/austen-4k'?); "
        "as a Hugging Face hub repo id: HF_HUB_OFFLINE is set, so the hub is not asked, and its "
        "cache holds no such repo"
    )


def test_no_network_is_said_in_words_not_the_clients_dns_error(tmp_path, monkeypatch):
    """Online without a network: the hub client's chain of errors (a DNS failure under a
    cache miss) becomes one plain reason."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    from focus_attention.hf import hub

    def no_network(*args, **kwargs):
        try:
            raise ConnectionError("[Errno -2] Name or service not known")
        except ConnectionError as dns:
            raise LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known") from dns  # fmt: skip

    monkeypatch.setattr(hub, "snapshot_download", no_network)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        hub.resolve_adapter("runs/austen4k")
    message = str(err.value)
    assert message.endswith("the hub cannot be reached (no network?) and its cache holds no such repo")  # fmt: skip
    assert (
        "Errno" not in message and "ConnectError" not in message and "did you mean" not in message
    )


def test_a_local_folder_wins_over_a_repo_id(tmp_path, hub_cache, monkeypatch):
    _, fm = focus("llama")
    fm.save_pretrained(tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    again = FocusModel.from_pretrained(build_model("llama"), "org/name")  # the folder, offline
    assert again.focus_config == fm.focus_config
    with pytest.raises(FileNotFoundError):  # a path, never a repo id
        FocusModel.from_pretrained(build_model("llama"), tmp_path / "org" / "other")


def test_an_exported_model_loads_by_repo_id(tmp_path, hub_cache):
    from transformers import AutoModelForCausalLM

    _, fm = focus("qwen2")
    export_model(fm, tmp_path / "export")
    cache_repo(hub_cache, "org/focus-export", tmp_path / "export")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FocusSlidingWindowWarning)
        model = AutoModelForCausalLM.from_pretrained(
            "org/focus-export", trust_remote_code=True, top_k=2
        )
    assert model.focus_model.focus_config.top_k == 2
    fm.set_top_k(2)
    x = ids(2, 40, seed=2)
    assert torch.equal(logits(model, x), logits(fm, x))


class Recorder:
    """Stands in for the hub: records ``create_repo`` and what ``upload_folder`` would send."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, dict]] = []
        self.files: dict[str, bytes] = {}

        def create_repo(api, repo_id, **kwargs):
            self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(api, **kwargs):
            self.calls.append(("upload_folder", kwargs))
            self.files = {p.name: p.read_bytes() for p in Path(kwargs["folder_path"]).iterdir()}
            return "commit-info"

        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)


def test_push_to_hub_uploads_the_adapter_and_its_card(tmp_path, monkeypatch):
    hub = Recorder(monkeypatch)
    _, fm = focus("llama", window=8)
    result = fm.push_to_hub("org/focus-tiny", private=True, revision="main")
    assert result == "commit-info"
    (create, created), (upload, uploaded) = hub.calls
    assert (create, created["repo_id"], created["private"], created["exist_ok"]) == ("create_repo", "org/focus-tiny", True, True)  # fmt: skip
    assert upload == "upload_folder"
    assert (uploaded["repo_id"], uploaded["revision"]) == ("org/focus-tiny", "main")
    assert sorted(hub.files) == sorted([CARD_NAME, CONFIG_NAME, WEIGHTS_NAME])
    card = hub.files[CARD_NAME].decode()
    assert "library_name: focus-attention" in card and "| window | `8` |" in card
    # what was uploaded is the adapter: it loads back
    for name, raw in hub.files.items():
        (tmp_path / name).write_bytes(raw)
    again = FocusModel.from_pretrained(build_model("llama"), tmp_path)
    x = ids(1, 30, seed=3)
    assert torch.equal(logits(again, x), logits(fm, x))


@pytest.mark.parametrize("repo_id", ["", "org/name/extra", "../up", "a b"])
def test_push_to_hub_refuses_a_bad_repo_id(repo_id):
    _, fm = focus("llama")
    with pytest.raises(ValueError, match="repo_id"):
        fm.push_to_hub(repo_id)
