"""Validation perplexity of a model being trained, one function for every training command
(docs/method.md §6 and §9): ``focus train`` (:class:`~.trainer.FocusTrainer`) and ``focus
pretrain`` score their validation blocks with :func:`validation_perplexities`."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..evaluation.perplexity import score_windows

__all__ = ["base_perplexity", "perplexity", "validation_perplexities"]


def perplexity(nll_sum: float, tokens: int) -> float:
    """``exp(nll_sum / tokens)`` (``inf`` when it overflows)."""
    try:
        return math.exp(nll_sum / tokens)
    except OverflowError:
        return math.inf


@torch.no_grad()
def validation_perplexities(
    model: Any, focus: Any, blocks: torch.Tensor, top_k: tuple[int, ...], train_top_k: int
) -> dict[str, float]:
    """Validation perplexity of ``blocks`` ``LongTensor [n, seq_len]`` by
    :func:`~focus_attention.evaluation.score_windows` (every block on its own, token-weighted;
    docs/method.md §9), the model in eval mode.

    Returns:
        ``ppl`` (dense: the model; Focus: soft Sinkhorn routing, the training-time model;
        query-key routers, which have no soft routing: hard top-k at ``train_top_k``),
        with Focus ``ppl_top<k>`` for every ``k`` in ``top_k`` (hard causal top-k routing,
        the inference-time model), ``loss`` (``log ppl``, nats per token) and ``tokens``.
        ``model`` ends in the mode it was in; ``focus`` (the :class:`FocusModel`, or None)
        ends with routing ``"auto"`` and ``top_k = train_top_k``.
    """
    was_training = model.training
    model.eval()
    out: dict[str, float] = {}
    try:
        if focus is None:
            nll, n = score_windows(model, blocks)
            out["ppl"] = perplexity(nll, n)
        else:
            out.update(_focus_perplexities(focus, blocks, top_k, train_top_k))
            n = out.pop("tokens")
    finally:
        if focus is not None:
            focus.set_routing("auto")
            focus.set_top_k(train_top_k)
        model.train(was_training)
    out["loss"] = math.log(out["ppl"])
    out["tokens"] = float(n)
    return out


def _focus_perplexities(focus: Any, blocks: torch.Tensor, top_k: tuple[int, ...], train_top_k: int) -> dict[str, float]:  # fmt: skip
    """``ppl`` (soft routing; for query-key routers, which have no soft routing, hard top-k
    at ``train_top_k``, scored among the ``ppl_top<k>``), ``ppl_top<k>`` for every ``k`` and
    ``tokens``."""
    out: dict[str, float] = {}
    soft = focus.focus_config.router_input != "query_key"
    if soft:
        focus.set_routing("soft")
        nll, n = score_windows(focus, blocks)
        out["ppl"] = perplexity(nll, n)
    focus.set_routing("topk")
    for k in top_k if soft else dict.fromkeys((*top_k, train_top_k)):
        focus.set_top_k(k)
        nll, n = score_windows(focus, blocks)
        out[f"ppl_top{k}"] = perplexity(nll, n)
    if not soft:
        out["ppl"] = out[f"ppl_top{train_top_k}"]
    out["tokens"] = float(n)
    return out


@torch.no_grad()
def base_perplexity(focus: Any, blocks: torch.Tensor) -> float:
    """Perplexity of ``blocks`` ``LongTensor [n, seq_len]`` under the base model of the
    :class:`FocusModel` ``focus`` (Focus disabled, eval mode; scored as in
    :func:`validation_perplexities`); the mode is restored."""
    was_training = focus.training
    focus.eval()
    try:
        with focus.disable_focus():
            return perplexity(*score_windows(focus, blocks))
    finally:
        focus.train(was_training)
