"""A corpus as model input: documents tokenised one by one, joined with a separator token
and cut into non-overlapping fixed-length blocks of token ids (``torch.long``), the input of
``focus train``, ``focus eval`` and ``focus calibrate``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .corpora import Document

__all__ = ["token_blocks"]


def token_blocks(
    tokenizer: Any,
    texts: Iterable[str | Document] | str,
    seq_len: int,
    *,
    max_tokens: int | None = None,
    separator_id: int | None = None,
    prepend_bos: bool = False,
) -> torch.Tensor:
    """Tokenise documents into non-overlapping fixed-length blocks.

    Each text is tokenised on its own (no special tokens added), the token lists are joined
    with one separator token between consecutive documents (the tokenizer's EOS unless
    ``separator_id`` is given), the stream is truncated to ``max_tokens`` when given, and cut
    into ``len // seq_len`` consecutive blocks; the remainder is dropped. Empty texts are
    skipped. Deterministic.

    Args:
        tokenizer: a Hugging Face tokenizer (callable returning ``input_ids``).
        texts: strings or :class:`Document` objects (a single string is one document).
        seq_len: tokens per block (> 0).
        max_tokens: cap on the tokens taken from the stream before cutting (documents after
            the cap are not tokenised).
        separator_id: token id placed between documents (default ``tokenizer.eos_token_id``).
        prepend_bos: start every block with ``tokenizer.bos_token_id`` followed by
            ``seq_len - 1`` stream tokens (``max_tokens`` then counts stream tokens). Models
            trained with a BOS at every sequence start (e.g. Gemma) need it for sane
            perplexity; SmolLM2 does not use one
            (:func:`focus_attention.assets.models.auto_prepend_bos` tells which).

    Returns:
        ``torch.LongTensor`` of shape ``[n_blocks, seq_len]``.

    Raises:
        ValueError: ``seq_len``/``max_tokens`` not positive, no separator available, or too
            few tokens for one block.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    bos = getattr(tokenizer, "bos_token_id", None) if prepend_bos else None
    if prepend_bos and (bos is None or seq_len < 2):
        raise ValueError("prepend_bos needs a tokenizer with a BOS token and seq_len >= 2")
    width = seq_len - 1 if prepend_bos else seq_len
    sep = separator_id if separator_id is not None else getattr(tokenizer, "eos_token_id", None)
    if sep is None:
        raise ValueError("the tokenizer has no EOS token to separate documents: pass separator_id")
    if isinstance(texts, (str, Document)):
        texts = [texts]
    stream = _token_stream(tokenizer, texts, int(sep), max_tokens)
    n_blocks = stream.numel() // width
    if n_blocks == 0:
        raise ValueError(
            f"only {stream.numel()} tokens: not enough for one block of seq_len={seq_len}"
        )
    blocks = stream[: n_blocks * width].reshape(n_blocks, width)
    if prepend_bos:
        blocks = torch.cat([torch.full((n_blocks, 1), int(bos), dtype=torch.long), blocks], 1)
    return blocks.clone()


def _token_stream(
    tokenizer: Any, texts: Iterable[str | Document], sep: int, max_tokens: int | None
) -> torch.Tensor:
    """The non-empty texts tokenised one by one (no special tokens) and joined with ``sep``
    between consecutive documents, cut to ``max_tokens``: a 1-D ``torch.long`` tensor.
    Tokenising stops at the first document that reaches the cap."""
    pieces: list[torch.Tensor] = []
    total = 0
    sep_t = torch.tensor([sep], dtype=torch.long)
    for item in texts:
        text = item.text if isinstance(item, Document) else item
        if not text:
            continue
        ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)[
            "input_ids"
        ]
        if not len(ids):
            continue
        if pieces:
            pieces.append(sep_t)
            total += 1
        pieces.append(torch.as_tensor(ids, dtype=torch.long))
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    stream = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
    if max_tokens is not None:
        stream = stream[:max_tokens]
    return stream
