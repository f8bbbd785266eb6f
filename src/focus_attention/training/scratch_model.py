"""The model and tokenizer of a from-scratch run (docs/method.md §6, "From scratch"): a small
LLaMA-style transformers model from random initialisation (its shape presets,
:data:`~focus_attention.training.settings.SIZES`, are settings), and a byte-level BPE
tokenizer trained on the corpus's training split.

Tokenizer (choice): a byte-level BPE of :attr:`~.settings.ModelSize.vocab_size` tokens (4,096 for
``small``) trained with the ``tokenizers`` library on the training split only, saved as a
``transformers.PreTrainedTokenizerFast`` directory. An existing tokenizer such as SmolLM2's
(49,152 tokens) would put 49,152 x 256 = 12.6M parameters into the embedding of a 256-wide
model, four times the rest of it, and most of those rows would never be trained in a few
hundred steps; 4,096 tokens learned from the corpus keep the embedding a quarter of the
model (linux-docs' training split, 2.9M whitespace-separated words of reST and code, becomes
7.4M tokens). Byte-level BPE has no unknown token: every text, validation and test included,
encodes. One special token, ``<|endoftext|>``, is BOS,
EOS (the document separator of :func:`~focus_attention.assets.blocks.token_blocks`) and
padding.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    set_seed,
)

from ..utils.checks import check_int
from .settings import MIN_VOCAB, ModelSize

__all__ = [
    "END_OF_TEXT",
    "build_llama",
    "load_tokenizer",
    "train_tokenizer",
]

#: the tokenizer's only special token: BOS, EOS (document separator) and padding
END_OF_TEXT = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens trained on ``texts``
    (module docstring), as a ``transformers.PreTrainedTokenizerFast``. Deterministic for the
    same texts in the same order.

    Raises:
        ValueError: ``vocab_size`` below 257.
    """
    check_int("train_tokenizer", "vocab_size", vocab_size, MIN_VOCAB)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT
    )


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in directory ``path`` (``AutoTokenizer.from_pretrained``).

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        ValueError: the tokenizer has no EOS token (documents could not be separated).
    """
    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer: {path} is not a directory (a save_pretrained folder)")
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {path}: no EOS token to separate documents")
    return tok


def build_llama(size: ModelSize, vocab_size: int, seq_len: int, seed: int) -> Any:
    """A ``transformers.LlamaForCausalLM`` of shape ``size`` with ``vocab_size`` tokens and
    room for ``seq_len`` positions, randomly initialised by transformers' own initialiser
    after ``transformers.set_seed(seed)`` (so the same arguments give the same weights),
    float32, SDPA attention, tied input/output embedding, in train mode.

    Raises:
        ValueError: ``vocab_size`` or ``seq_len`` not a positive int.
    """
    check_int("build_llama", "vocab_size", vocab_size, 1)
    check_int("build_llama", "seq_len", seq_len, 1)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    set_seed(seed)
    model = LlamaForCausalLM(config)
    model.train()
    return model
