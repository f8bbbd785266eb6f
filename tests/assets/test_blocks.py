"""Token blocks: documents tokenised one by one, joined by a separator, capped, cut into
fixed-length blocks (with a BOS per block on request), and the errors."""

from __future__ import annotations

import pytest
import torch
from tiny import word_tokenizer
from tiny_assets import WORDS, make_text

from focus_attention.assets.blocks import token_blocks
from focus_attention.assets.corpora import Document


def _tokenizer():
    return word_tokenizer(WORDS)


def test_token_blocks():
    tok = _tokenizer()
    eos = tok.eos_token_id
    docs = ["the a of and to", "", "in was he", Document("x", "she it that his her")]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ("the a of and to", "in was he")]
    ids.append(tok("she it that his her", add_special_tokens=False)["input_ids"])
    stream = ids[0] + [eos] + ids[1] + [eos] + ids[2]  # empty text skipped, no trailing EOS
    assert len(stream) == 15
    blocks = token_blocks(tok, docs, 4)
    assert blocks.dtype == torch.long and blocks.shape == (3, 4)
    assert blocks.flatten().tolist() == stream[:12]  # remainder dropped
    assert torch.equal(blocks, token_blocks(tok, docs, 4))  # deterministic
    capped = token_blocks(tok, docs, 3, max_tokens=7)
    assert capped.flatten().tolist() == stream[:6]
    sep = token_blocks(tok, docs[:1] + docs[2:3], 9, separator_id=0)
    assert sep.flatten().tolist() == ids[0] + [0] + ids[1]
    assert token_blocks(tok, "the a of and", 2).shape == (2, 2)  # a single string
    tok.bos_token = "[UNK]"
    bos = token_blocks(tok, docs, 5, prepend_bos=True)
    assert bos.shape == (3, 5) and (bos[:, 0] == tok.bos_token_id).all()
    assert bos[:, 1:].flatten().tolist() == stream[:12]
    with pytest.raises(ValueError, match="BOS"):
        token_blocks(_tokenizer(), docs, 5, prepend_bos=True)
    with pytest.raises(ValueError, match="not enough"):
        token_blocks(tok, ["the a"], 8)
    with pytest.raises(ValueError, match="seq_len"):
        token_blocks(tok, docs, 0)
    with pytest.raises(ValueError, match="max_tokens"):
        token_blocks(tok, docs, 4, max_tokens=0)
    tok_no_eos = _tokenizer()
    tok_no_eos.eos_token = None
    with pytest.raises(ValueError, match="EOS"):
        token_blocks(tok_no_eos, docs, 4)


def test_token_blocks_long_document_no_warning(capfd):
    tok = _tokenizer()
    tok.model_max_length = 16
    text = make_text(3, 450)
    tokens = len(tok(text, add_special_tokens=False, verbose=False).input_ids)
    blocks = token_blocks(tok, [text], 32)
    assert blocks.shape == (tokens // 32, 32) and tokens // 32 > 1
    assert "longer than the specified maximum" not in capfd.readouterr().err
