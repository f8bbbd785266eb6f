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

from ..hf.files import CONFIG_NAME, weights_file_sha256
from ..utils.env import environment, library_versions
from ..utils.io import replace_entries, write_json_atomic
from .settings import CalibrateConfig

__all__ = ["CALIBRATION_NAME", "CalibrateConfig", "calibrate_adapter", "calibrate_on", "calibration_blocks"]  # fmt: skip

#: the record :func:`calibrate_adapter` writes beside the adapter
CALIBRATION_NAME = "calibration.json"


def calibration_blocks(tokenizer: Any, corpus: str, split: str, seq_len: int, count: int, prepend_bos: bool, quiet: bool = True) -> torch.Tensor:  # fmt: skip
    """The first ``count`` blocks of ``seq_len`` tokens of ``corpus``'s ``split``, long
    ``[count, seq_len]``, cut as ``focus eval`` cuts its windows.

    Raises:
        ValueError: the split has fewer than ``count`` such blocks.
    """
    from ..assets.corpora import load_corpus, token_blocks

    texts = load_corpus(corpus, quiet=quiet).texts(split)
    blocks = token_blocks(tokenizer, texts, seq_len, max_tokens=count * seq_len,
                          prepend_bos=prepend_bos)  # fmt: skip
    if blocks.shape[0] < count:
        raise ValueError(
            f"calibration with {count} blocks: the {split} split of {corpus} has "
            f"{blocks.shape[0]} blocks of {seq_len} tokens"
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
    """The output directory, refused when it is the source or already holds an adapter
    (without ``overwrite``)."""
    out = Path(config.out)
    if out.resolve() == Path(config.adapter).resolve():
        raise ValueError(f"--out {out} is the source adapter: write the new adapter elsewhere")
    if (out / CONFIG_NAME).exists() and not config.overwrite:
        raise FileExistsError(f"{out} already holds an adapter: pass --overwrite to replace it")
    return out


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
        ``environment``.

    Raises:
        ValueError: bad settings (as :class:`FocusConfig` raises them), ``out`` equal to the
            source, too few blocks in the split.
        FileExistsError: ``out`` already holds an adapter and ``overwrite`` is False.
        FileNotFoundError: the source adapter is missing.
    """
    from tqdm.auto import tqdm

    from ..assets.models import auto_prepend_bos, load_model
    from ..hf import FocusModel

    t0 = time.monotonic()
    out = _check_out(config)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    quiet = not config.progress
    base, tokenizer = load_model(config.model, quiet=quiet)
    fm = FocusModel.from_pretrained(base, config.adapter)
    fm.focus_config = fm.focus_config.override(**config.overrides())
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
