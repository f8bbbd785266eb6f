"""Tiny offline stand-ins shared by the tests: a word-level tokenizer and a random LLaMA."""

from __future__ import annotations

import torch


def word_tokenizer(words, *, bos: bool = False):
    """A ``PreTrainedTokenizerFast`` over ``words`` (whitespace split), with ``[UNK]``,
    ``<eos>`` (and ``<bos>`` when asked), built offline with the ``tokenizers`` library."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers import models as tmodels
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tmodels.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]", "<eos>"] + (["<bos>"] if bos else [])
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=special))
    extra = {"bos_token": "<bos>"} if bos else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]", **extra
    )


def tiny_llama(vocab: int, seed: int = 0, *, max_positions: int = 64, **config):
    """A randomly initialised 2-layer LLaMA (hidden 32, 4/2 heads) in eval mode; ``config``
    adds LlamaConfig fields (for example token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        **config,
    )
    return LlamaForCausalLM(cfg).eval()
