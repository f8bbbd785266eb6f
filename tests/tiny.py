"""Tiny offline stand-ins shared by the tests: a word-level tokenizer and a random LLaMA."""

from __future__ import annotations

import torch


def word_tokenizer(words):
    """A ``PreTrainedTokenizerFast`` over ``words`` (whitespace split), with ``[UNK]`` and
    ``<eos>``, built offline with the ``tokenizers`` library."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers import models as tmodels
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tmodels.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(words)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eos>"])
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]")


def tiny_llama(vocab: int, seed: int = 0):
    """A randomly initialised 2-layer LLaMA (hidden 32, 4/2 heads) in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()
