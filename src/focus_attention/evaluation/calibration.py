"""An adapter set up for long inputs (docs/method.md §4 and §9, "Long-context settings"):
the causal routing bias collected afresh at the evaluation length, and the inference
settings (window, sink tokens, dense layers, top_k) written into the adapter's config, so
that every tool that loads it (``focus eval``, ``focus bench``, ``FocusModel.from_pretrained``)
runs those settings without overrides. The routers' trained projections and centroids are
copied unchanged; only ``routing_bias`` and ``bias_updates`` change."""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..assets.blocks import token_blocks
from ..assets.corpora import load_corpus
from ..assets.models import auto_prepend_bos, load_model
from ..hf import FocusModel
from ..hf.architectures import kv_heads_of
from ..hf.files import CONFIG_NAME, adapter_layout, weights_file_sha256
from ..utils.env import environment, library_versions
from ..utils.io import replace_entries, write_json_atomic
from .head_budget import choose_dense_heads, read_head_ranking
from .retrieval import rank_calibration_heads
from .settings import CalibrateConfig

__all__ = ["CALIBRATION_NAME", "CalibrateConfig", "calibrate_adapter", "calibrate_on", "calibration_blocks",
           "head_budget_choice", "head_ranking_for"]  # fmt: skip

#: the record :func:`calibrate_adapter` writes beside the adapter
CALIBRATION_NAME = "calibration.json"


def calibration_blocks(tokenizer: Any, corpus: str, split: str, seq_len: int, count: int, prepend_bos: bool, quiet: bool = True) -> torch.Tensor:  # fmt: skip
    """The first ``count`` blocks of ``seq_len`` tokens of ``corpus``'s ``split``, long
    ``[count, seq_len]``, cut as ``focus eval`` cuts its windows.

    Raises:
        ValueError: the split has fewer than ``count`` such blocks.
    """
    texts = load_corpus(corpus, quiet=quiet).texts(split)
    blocks = token_blocks(tokenizer, texts, seq_len, max_tokens=count * seq_len,
                          prepend_bos=prepend_bos)  # fmt: skip
    if blocks.shape[0] < count:
        have = blocks.shape[0]
        raise ValueError(
            f"calibration with {count} blocks: the {split} split of {corpus} has {have} "
            f"{'block' if have == 1 else 'blocks'} of {seq_len} tokens"
        )
    return blocks


def calibrate_on(model: Any, blocks: torch.Tensor, progress: Any = None) -> None:
    """Collect every router's causal bias afresh from ``blocks`` ``[n, N]`` (one sequence at
    a time, the first forgetting the bias as trained; :meth:`FocusModel.calibrate`)."""
    for i, block in enumerate(blocks):
        model.calibrate(block[None], reset=i == 0)
        if progress is not None:
            progress.update(1)


def _check_out(config: CalibrateConfig) -> Path:
    """The output directory, refused when it is a file, the source or already holds an
    adapter (without ``overwrite``); a local source adapter refused when it is a file or
    holds no adapter (before the model loads; a hub repo id is left to the loader)."""
    out = Path(config.out)
    if Path(config.adapter).exists():
        adapter_layout(Path(config.adapter))
    if out.exists() and not out.is_dir():
        raise ValueError(f"out (--out): received {config.out!r}, which is a file, not a folder; "
                         "expected a folder to write the adapter into")  # fmt: skip
    if out.resolve() == Path(config.adapter).resolve():
        raise ValueError(f"--out {out} is the source adapter: write the new adapter elsewhere")
    if (out / CONFIG_NAME).exists() and not config.overwrite:
        raise FileExistsError(f"{out} already holds an adapter: pass --overwrite to replace it")
    return out


def head_ranking_for(config: CalibrateConfig) -> dict[str, Any]:
    """The head ranking ``config.head_budget`` is filled from: read from the
    ``config.head_ranking`` file (:func:`~.head_budget.read_head_ranking`), else made here
    on pass-key prompts (:func:`~.retrieval.rank_calibration_heads`).

    Returns:
        ``head_ranking`` (``(layer, kv_head)`` tuples, first ranked first), ``by_head`` and
        ``source`` (the file and its model, or the ranking's ``config``, ``prompts`` and
        ``seconds``).

    Raises:
        ValueError, FileNotFoundError: as :func:`~.head_budget.read_head_ranking` and
            :func:`~.retrieval.rank_calibration_heads` raise them.
    """
    if config.head_ranking is not None:
        ranking = read_head_ranking(config.head_ranking, config.model)
        source = {"file": ranking["file"], "model": ranking["model"]}
    else:
        ranking = rank_calibration_heads(config)
        source = {"ranked_here": {k: ranking[k] for k in ("config", "prompts", "seconds")}}
    return {"head_ranking": [tuple(p) for p in ranking["head_ranking"]],
            "by_head": ranking["by_head"], "source": source}  # fmt: skip


def head_budget_choice(config: CalibrateConfig, fm: Any, ranking: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Set ``fm``'s ``dense_heads`` to the top pairs of ``ranking`` (as
    :func:`head_ranking_for` returns it) that fill ``config.head_budget``
    (:func:`~.head_budget.choose_dense_heads`).

    Returns:
        The record: ``share``, ``kv_heads`` (of the Focus layers, all), ``dense_kv_heads``
        (dense layers' and dense heads'), ``dense_heads`` chosen, ``ranking`` (``source``,
        ``head_ranking``, ``by_head``).

    Raises:
        ValueError: as :func:`~.head_budget.choose_dense_heads` raises it.
    """
    cfg, kv = fm.focus_config, kv_heads_of(fm.base_model.config)
    chosen = choose_dense_heads(ranking["head_ranking"], config.head_budget, fm.focus_layers,
                                kv, cfg.dense_layers)  # fmt: skip
    fm.focus_config = cfg.replace(dense_heads=chosen)
    total = len(fm.focus_layers) * kv
    dense = len(chosen) + len(set(cfg.dense_layers)) * kv
    return {"share": config.head_budget, "kv_heads": total, "dense_kv_heads": dense,
            "dense_share": dense / total, "dense_heads": [list(p) for p in chosen],
            "ranking": {"source": ranking["source"],
                        "head_ranking": [list(p) for p in ranking["head_ranking"]],
                        "by_head": ranking["by_head"]}}  # fmt: skip


def calibrate_adapter(config: CalibrateConfig) -> dict[str, Any]:
    """Write the adapter of ``config.adapter`` with the new settings and, unless
    ``blocks == 0``, the causal routing bias collected from ``blocks`` blocks of ``seq_len``
    tokens, into ``config.out`` with a :data:`CALIBRATION_NAME` record: both are staged and
    put in place together, so a failure leaves ``out`` as it was (docs/method.md §8, "Files
    and failures").

    Returns:
        The record: ``config``, the ``source`` adapter and the SHA-256 of its weights,
        ``focus`` (the new adapter's settings), ``bias_change`` (largest absolute change of a
        router's ``routing_bias``), ``tokens`` calibrated on, ``seconds``, ``versions``,
        ``environment``; ``head_budget`` (:func:`head_budget_choice`'s record, or None; a
        ``head_budget`` without a ``head_ranking`` file is filled from
        :func:`~.retrieval.rank_calibration_heads`, run after ``out`` is checked and before
        the model loads).

    Raises:
        ValueError: bad settings (as :class:`FocusConfig` raises them), ``out`` a file or
            equal to the source, too few blocks in the split, a head ranking that does not
            fit the budget or the model.
        FileExistsError: ``out`` already holds an adapter and ``overwrite`` is False.
        FileNotFoundError: the source adapter is missing, or is a file.
    """
    t0 = time.monotonic()
    out = _check_out(config)
    ranking = None if config.head_budget is None else head_ranking_for(config)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    quiet = not config.progress
    base, tokenizer = load_model(config.model, quiet=quiet)
    fm = FocusModel.from_pretrained(base, config.adapter)
    fm.focus_config = fm.focus_config.override(**config.overrides())
    budget = None if ranking is None else head_budget_choice(config, fm, ranking)
    before = {i: r.routing_bias.clone() for i, r in fm.routers.items()}
    tokens = 0
    if config.blocks:
        bos = auto_prepend_bos(base) if config.prepend_bos is None else config.prepend_bos
        blocks = calibration_blocks(tokenizer, config.corpus, config.split, config.seq_len,
                                    config.blocks, bos, quiet)  # fmt: skip
        with tqdm(total=config.blocks, disable=quiet, desc="calibrate", dynamic_ncols=True) as bar:
            calibrate_on(fm, blocks, bar)
        tokens = int(blocks.numel())
    change = max((float((r.routing_bias - before[i]).abs().max()) for i, r in fm.routers.items()),
                 default=0.0)  # fmt: skip
    record = {
        "config": asdict(config),
        "source": {
            "adapter": config.adapter,
            "weights_sha256": weights_file_sha256(config.adapter),
        },  # fmt: skip
        "focus": fm.focus_config.to_dict(),
        "bias_change": change,
        "head_budget": budget,
        "tokens": tokens,
        "seconds": time.monotonic() - t0,
        "versions": library_versions(),
        "environment": environment(),
    }
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".calibrated-", dir=out) as staged:
        fm.save_pretrained(staged)
        write_json_atomic(Path(staged) / CALIBRATION_NAME, record)
        replace_entries(staged, out)  # the adapter and its record together
    return record
