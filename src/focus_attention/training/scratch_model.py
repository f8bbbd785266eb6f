"""The model and tokenizer of a from-scratch run (docs/method.md §6, "From scratch"): a small
LLaMA-style transformers model from random initialisation, and a byte-level BPE tokenizer
trained on the corpus's training split.

Tokenizer (choice): a byte-level BPE of :attr:`ModelSize.vocab_size` tokens (4,096 for
``small``) trained with the ``tokenizers`` library on the training split only, saved as a
``transformers.PreTrainedTokenizerFast`` directory. An existing tokenizer such as SmolLM2's
(49,152 tokens) would put 49,152 x 256 = 12.6M parameters into the embedding of a 256-wide
model, four times the rest of it, and most of those rows would never be trained in a few
hundred steps; 4,096 tokens learned from the corpus keep the embedding a quarter of the
model (linux-docs' training split, 2.9M whitespace-separated words of reST and code, becomes
7.4M tokens). Byte-level BPE has no unknown token: every text, validation and test included,
encodes. One special token, ``<|endoftext|>``, is BOS,
EOS (the document separator of :func:`~focus_attention.assets.corpora.token_blocks`) and
padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..utils.checks import bad, check_int

__all__ = [
    "END_OF_TEXT",
    "SIZES",
    "ModelSize",
    "build_llama",
    "load_tokenizer",
    "resolve_size",
    "train_tokenizer",
]

#: the tokenizer's only special token: BOS, EOS (document separator) and padding
END_OF_TEXT = "<|endoftext|>"
#: byte-level BPE starts from the 256 byte symbols plus the special token
MIN_VOCAB = 257


@dataclass(frozen=True)
class ModelSize:
    """Shape of a LLaMA-style model (``transformers.LlamaConfig`` fields).

    Attributes:
        hidden_size: model width ``d_model``.
        num_layers: decoder layers.
        num_heads: attention heads; ``hidden_size / num_heads`` is the head width, which must
            be even (rotary embedding).
        num_kv_heads: key/value heads (grouped-query attention when fewer than the heads;
            must divide ``num_heads``).
        intermediate_size: width of the SwiGLU MLP.
        vocab_size: tokens of the BPE tokenizer trained for the run (the model takes the
            trained tokenizer's actual size, which is smaller on a tiny corpus).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        owner = "ModelSize"
        for f in dataclasses.fields(self):
            check_int(owner, f.name, getattr(self, f.name), 1)
        if self.vocab_size < MIN_VOCAB:
            raise bad(
                owner, "vocab_size", self.vocab_size, f"an int >= {MIN_VOCAB} (256 bytes + 1)"
            )
        if self.hidden_size % self.num_heads:
            raise bad(
                owner, "num_heads", self.num_heads, f"a divisor of hidden_size {self.hidden_size}"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise bad(owner, "num_heads", self.num_heads,
                      "a head width hidden_size / num_heads that is even (rotary embedding)")  # fmt: skip
        if self.num_heads % self.num_kv_heads:
            raise bad(
                owner, "num_kv_heads", self.num_kv_heads, f"a divisor of num_heads {self.num_heads}"
            )

    def num_parameters(self, vocab_size: int | None = None) -> int:
        """Parameters of the model (tied input/output embedding), without Focus routers."""
        v = self.vocab_size if vocab_size is None else vocab_size
        d, f = self.hidden_size, self.intermediate_size
        kv = d // self.num_heads * self.num_kv_heads
        layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d  # q, o, k, v, MLP, two RMSNorms
        return v * d + self.num_layers * layer + d


#: named sizes: ``tiny`` for tests (about 0.1M parameters), ``small`` (4.2M with its 4,096
#: tokens; the size of the README's comparison), ``medium`` (29M, for a GPU)
SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(64, 2, 2, 2, 128, 512),
    "small": ModelSize(256, 4, 4, 4, 688, 4096),
    "medium": ModelSize(512, 8, 8, 8, 1376, 8192),
}


def resolve_size(name: str, **overrides: int | None) -> ModelSize:
    """The preset ``name`` of :data:`SIZES` with the non-None ``overrides`` (field names of
    :class:`ModelSize`) applied, validated.

    Raises:
        ValueError: an unknown preset or field, or an invalid resulting shape.
    """
    if name not in SIZES:
        raise bad("PretrainConfig", "size", name, f"one of {sorted(SIZES)}")
    fields = {f.name for f in dataclasses.fields(ModelSize)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"ModelSize: unknown fields {unknown} (fields: {sorted(fields)})")
    size = dataclasses.replace(SIZES[name], **{k: v for k, v in overrides.items() if v is not None})
    size.validate()
    return size


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens trained on ``texts``
    (module docstring), as a ``transformers.PreTrainedTokenizerFast``. Deterministic for the
    same texts in the same order.

    Raises:
        ValueError: ``vocab_size`` below 257.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    from transformers import AutoTokenizer

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
    from transformers import LlamaConfig, LlamaForCausalLM, set_seed

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
