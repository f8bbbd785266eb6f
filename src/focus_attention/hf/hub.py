"""Focus adapters on the Hugging Face hub, as PEFT shares its adapters (docs/deploy.md):
an adapter reference that is a repo id (``org/name``) resolves to its snapshot in the hub
cache (``huggingface_hub.snapshot_download``, which handles the revision, the token, the
cache folder and ``HF_HUB_OFFLINE``), and an adapter uploads with ``HfApi.upload_folder``."""

from __future__ import annotations

import difflib
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub import constants as hf_constants

from .files import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME

__all__ = ["ADAPTER_FILES", "is_repo_id", "push_adapter", "resolve_adapter"]

#: the files of an adapter on the hub
ADAPTER_FILES = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME)
#: ``name`` or ``org/name`` as the hub spells repo ids
REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.\-]*/)?[A-Za-z0-9][\w.\-]*$")


def is_repo_id(reference: Any) -> bool:
    """Whether ``reference`` reads as a hub repo id: a string ``org/name`` (one slash, no
    leading ``.``, ``/`` or ``~``) that is not an existing path. A ``Path`` never is one."""
    return (
        isinstance(reference, str)
        and reference.count("/") == 1
        and REPO_ID.match(reference) is not None
        and ".." not in reference
        and not Path(reference).expanduser().exists()
    )


def resolve_adapter(
    reference: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """The local folder of the adapter ``reference``: a path as it is, or the snapshot of
    the hub repo ``reference`` (:func:`is_repo_id`) holding :data:`ADAPTER_FILES`, from the
    hub or, with ``HF_HUB_OFFLINE=1``, from the hub cache.

    Args:
        reference: a folder, or a hub repo id.
        revision, token, cache_dir: ``snapshot_download``'s, for a repo id (ignored for a
            folder).

    Raises:
        FileNotFoundError: a repo id the hub (or its cache, offline) cannot provide; the
            message names the repo, the revision and the error.
    """
    if not is_repo_id(reference):
        return Path(reference)

    try:
        return Path(
            snapshot_download(
                reference,
                revision=revision,
                token=token,
                cache_dir=cache_dir,
                allow_patterns=list(ADAPTER_FILES),
                library_name="focus-attention",
            )
        )
    except Exception as err:  # network, authentication, missing revision, offline cache miss
        raise FileNotFoundError(
            f"Focus adapter {reference!r}: no such local folder{_nearby(reference)}; as a "
            f"Hugging Face hub repo id: {_why_not_fetched(err, revision)}"
        ) from err


def _causes(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from, outermost first."""
    chain: list[BaseException] = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


#: names of the exceptions (of httpx, requests, urllib3, socket) that mean no network
NETWORK_ERRORS = ("ConnectError", "ConnectTimeout", "ConnectionError", "NetworkError",
                  "NameResolutionError", "gaierror")  # fmt: skip


def _offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (as huggingface_hub reads it, or in the
    environment now)."""
    value = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return bool(hf_constants.HF_HUB_OFFLINE) or value in ("1", "ON", "YES", "TRUE")


def _why_not_fetched(err: Exception, revision: str | None) -> str:
    """Why the hub gave no snapshot, in a user's words: offline (``HF_HUB_OFFLINE``), no
    network, no such repo (or a private one), no such revision, else the error's first
    line."""
    chain = _causes(err)
    names = {type(e).__name__ for e in chain}
    if _offline() or "OfflineModeIsEnabled" in names:
        at = f" at revision {revision}" if revision else ""
        return f"HF_HUB_OFFLINE is set, so the hub is not asked, and its cache holds no such repo{at}"  # fmt: skip
    if "RevisionNotFoundError" in names:
        return f"the repo has no revision {revision!r}"
    if names & {"RepositoryNotFoundError", "GatedRepoError"}:
        return "the hub has no such repo, or it is private or gated (give a token)"
    if any(isinstance(e, (ConnectionError, TimeoutError)) for e in chain) or any(
        word in name for name in names for word in NETWORK_ERRORS
    ):
        return "the hub cannot be reached (no network?) and its cache holds no such repo"
    first = (str(err).splitlines() or [""])[0]
    return f"the hub could not provide it (revision {revision or 'main'}; {type(err).__name__}: {first})"  # fmt: skip


def _nearby(reference: str) -> str:
    """`` (did you mean 'runs/austen-4k'?)`` where a local folder beside the one
    ``reference`` names is close to it (a typo), else ``""``."""
    path = Path(reference).expanduser()
    parent = path.parent
    if not parent.is_dir():
        return ""
    try:
        names = [p.name for p in parent.iterdir() if p.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return f" (did you mean {str(parent / close[0])!r}?)" if close else ""


def push_adapter(
    model: Any,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
) -> Any:
    """Upload ``model``'s adapter (``model.save_pretrained`` output: config, weights and
    model card) to the hub repo ``repo_id``, creating the repo if needed
    (``FocusModel.push_to_hub``).

    Returns:
        the ``huggingface_hub.CommitInfo`` of the upload.

    Raises:
        ValueError: ``repo_id`` is not ``name`` or ``org/name``.
    """
    if not isinstance(repo_id, str) or REPO_ID.match(repo_id) is None or ".." in repo_id:
        raise ValueError(
            f"push_to_hub: repo_id {repo_id!r} is not a hub repo id; expected 'name' or 'org/name'"
        )

    api = HfApi(token=token, library_name="focus-attention")
    with tempfile.TemporaryDirectory(prefix="focus-push-") as folder:
        model.save_pretrained(folder)
        repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        return api.upload_folder(
            repo_id=getattr(repo, "repo_id", repo_id),
            folder_path=folder,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or "Upload Focus adapter",
            create_pr=create_pr,
        )
