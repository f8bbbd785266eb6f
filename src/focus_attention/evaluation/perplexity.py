"""``focus eval``: perplexity of a base model and of what a training run produced (its Focus
adapter, LoRA or trained base weights) on held-out text (docs/method.md §9).

Window scheme: the split's documents are tokenised and joined with EOS (with
``prepend_bos`` every window starts with BOS), the stream is capped at ``max_tokens`` and cut
into non-overlapping ``seq_len`` windows (the remainder is dropped). Each window is scored
independently, with no context from the previous window; every token of a window except its
first is a target, so a run scores ``windows * (seq_len - 1)`` tokens. Perplexity is
``exp(sum of NLL / scored tokens)`` over all windows (token-weighted), NLL in nats computed
in float32 from the logits.

Evaluated, on exactly the same windows:

* ``base``: the pretrained model before the adapter is attached;
* ``tuned``: for runs that trained LoRA or base weights (``focus train --method``, see
  :mod:`.trained`), the tuned model with dense attention (Focus, where the run has it, not
  attached); the Focus rows below then use the tuned model too;
* ``focus_soft``: soft Sinkhorn routing with the soft gate (the training-time model; its
  Sinkhorn columns run over the whole window, so it is not causal, §2);
* ``focus_topk[k]`` for every ``k`` asked for: hard top-k routing through exact sparse
  attention, the adapter switched to ``top_k = k``.

Routing is recorded on every window: ``pairs_retained[k]`` is the share of the causal
(query, key) pairs that top-k routing keeps (local window and sinks included), pooled over
every Focus layer and window; ``dominance`` is the share of tokens (top-k: of memberships)
held by the largest group (mean and worst layer); ``group_shares`` lists the per-group
shares layer by layer. The SHA-256 of every base-model tensor is taken before the adapter is
attached and after the last evaluation; a difference raises ``RuntimeError``. For a run that
trained LoRA or base weights the change is reported instead (``base_weights_sha256``:
``after`` of the tuned model's base tensors, ``changed`` names); the tuned model's weights
must then be the same after the evaluation as when loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..assets.blocks import token_blocks
from ..assets.corpora import load_corpus
from ..assets.models import auto_prepend_bos, load_model
from ..hf import FocusModel
from ..hf.architectures import kv_heads_of
from ..hf.card import adapter_digest
from ..hf.config import FocusConfig
from ..hf.files import CONFIG_NAME, check_adapter_folder, sweep_hint, weights_file_sha256
from ..hf.run_folder import base_weights_report, run_parts, tensor_digests, tuned_model
from ..ops import pairs_retained
from ..utils.env import environment, library_versions, weights_sha256
from ..utils.io import (
    TRAIN_CONFIG_NAME,
    atomic_write_text,
    check_output_file,
    write_json_atomic,
)
from .calibration import calibrate_on, calibration_blocks
from .coverage import evenly_spaced_rows, topk_coverage
from .positions import PositionNLL, bucket_bounds, position_table
from .settings import DEFAULT_MAX_TOKENS, DEFAULT_SEQ_LEN, EvalConfig

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_SEQ_LEN",
    "EvalConfig",
    "EvalResult",
    "RoutingStats",
    "evaluate",
    "markdown_table",
    "score_windows",
]

#: how the windows are scored (recorded in every result)
WINDOW_SCHEME = (
    "non-overlapping seq_len windows scored independently; every token but the first of each "
    "window is a target; token-weighted PPL"
)


@dataclass
class EvalResult:
    """What :func:`evaluate` returns; :meth:`to_dict` is the JSON file's content.

    Attributes:
        ppl: ``{"base": float, "focus_soft": float, "focus_topk": {"k": float}}``; a run
            that trained LoRA or base weights adds ``"tuned"`` (dense), and one without
            Focus has only ``base`` and ``tuned``; ``focus_soft`` (and every other ``soft``
            entry below) is absent when the config's ``soft`` is False.
        pairs_retained: ``{"k": share}`` of the causal pairs kept by top-k routing.
        tokens: scored tokens; windows: evaluated windows.
        base_weights_sha256: ``{"before", "after", "equal"}``; for a run that trained LoRA
            or base weights also ``trained`` (True), ``changed`` (names of the base tensors
            that differ from the untouched base), ``changed_count``, ``tensors`` and
            ``lora_tensors``.
        dominance: ``soft`` / ``soft_max`` and ``topk`` / ``topk_max`` ``{"k": ...}``: mean
            over layers and worst layer (None when every Focus layer runs dense attention).
        group_shares: ``soft`` and ``topk`` ``{"k": {layer: [K shares]}}``.
        pairs_retained_by_layer: ``{"k": {layer: share}}``.
        routing_affected_share: share of scored tokens that have keys beyond the window
            (None without Focus).
        config: what was evaluated (model, adapter, corpus, split, window scheme, the Focus
            settings, the adapter's training settings when known...).
        versions, environment: libraries and hardware (:mod:`focus_attention.utils.env`).
        seconds: ``load``, ``base``, ``soft``, ``topk`` {"k"}, ``total``.
        ppl_by_position: ``buckets`` (``[start, end)`` token positions in the window),
            ``tokens`` per bucket, and per bucket the perplexity of ``base``, ``focus_soft``
            and ``focus_topk`` ``{"k": [...]}`` (None in results written before it existed).
        coverage: with ``coverage_queries``, :func:`~.coverage.topk_coverage`'s ``topk``,
            ``by_layer`` and ``distant_share`` (else None).
    """

    ppl: dict[str, Any]
    pairs_retained: dict[str, float]
    tokens: int
    windows: int
    base_weights_sha256: dict[str, Any]
    dominance: dict[str, Any]
    group_shares: dict[str, Any]
    pairs_retained_by_layer: dict[str, Any]
    routing_affected_share: float | None
    config: dict[str, Any]
    versions: dict[str, Any]
    environment: dict[str, Any]
    seconds: dict[str, Any]
    ppl_by_position: dict[str, Any] | None = None
    coverage: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field, in order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalResult:
        """Inverse of :meth:`to_dict` (for example a JSON result file read back)."""
        fields = dataclasses.fields(cls)
        required = [f.name for f in fields if f.default is dataclasses.MISSING]
        return cls(**{f.name: data[f.name] for f in fields if f.name in data or f.name in required})


def score_windows(
    model: Any,
    blocks: torch.Tensor,
    *,
    recorder: Any | None = None,
    on_window: Callable[[int, list[dict[str, Any]]], None] | None = None,
    progress: Any | None = None,
    positions: PositionNLL | None = None,
) -> tuple[float, int]:
    """Next-token negative log-likelihood of independent windows (module docstring).

    Args:
        model: a causal LM (a ``FocusModel`` or a plain transformers model) called as
            ``model(input_ids=..., use_cache=False)``; it is used as it is (train/eval mode
            and routing are the caller's).
        blocks: ``LongTensor [n_windows, seq_len]``; every row is scored on its own, one row
            per forward.
        recorder: a ``FocusModel`` whose ``record_routing()`` wraps every forward; the
            records of window ``i`` are passed to ``on_window(i, records)`` and then dropped.
        on_window: see ``recorder``.
        progress: a tqdm bar advanced by one per window (or None).
        positions: a :class:`PositionNLL` that also receives every window's per-token NLL.

    Returns:
        ``(nll_sum, n_tokens)``: the summed NLL in nats (float64 accumulation) and the number
        of scored tokens, ``n_windows * (seq_len - 1)``.

    Raises:
        ValueError: ``blocks`` is not a 2-D tensor with ``seq_len >= 2``.
    """
    if blocks.ndim != 2 or blocks.shape[1] < 2:
        raise ValueError(f"blocks: expected [n_windows, seq_len >= 2], got {tuple(blocks.shape)}")
    total = 0.0
    count = 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for i in range(blocks.shape[0]):
            x = blocks[i : i + 1].to(device)
            ctx = recorder.record_routing() if recorder is not None else contextlib.nullcontext([])
            with ctx as records:
                logits = model(input_ids=x, use_cache=False).logits
            nll = F.cross_entropy(logits[0, :-1].float(), x[0, 1:], reduction="sum")
            total += float(nll.double())
            if positions is not None:
                positions.add(F.cross_entropy(logits[0, :-1].float(), x[0, 1:], reduction="none"))
            count += x.shape[1] - 1
            del logits
            if on_window is not None:
                on_window(i, records)
            if progress is not None:
                progress.update(1)
    return total, count


class RoutingStats:
    """Routing statistics of one routing setting, accumulated over windows: pairs retained
    (top-k), group shares and dominance per layer (docs/method.md §2, §9). The layers in
    ``dense_layers`` run dense attention and record nothing: they count as keeping every
    pair. ``dense_head_share`` ``{layer: share}``: the share of a layer's key-value heads
    in ``FocusConfig.dense_heads``, which keep every pair beside the routed heads' mask."""

    def __init__(self, window: int, num_groups: int, dense_layers: tuple[int, ...] = (),
                 dense_head_share: dict[int, float] | None = None) -> None:  # fmt: skip
        self.window = window
        self.num_groups = num_groups
        self.dense_layers = tuple(dense_layers)
        self.dense_head_share = dict(dense_head_share or {})
        self.kept = 0.0
        self.pairs = 0.0
        self.layer_mass: dict[int, Any] = {}
        self.layer_pairs: dict[int, list[float]] = {}

    def _add_pairs(self, layer: int, record: dict[str, Any]) -> None:
        q = record["query_groups"]
        n = q.shape[1]
        causal = n * (n + 1) / 2 * q.shape[0]
        frac = pairs_retained(q, record["key_groups"], self.window, record.get("key_padding"))
        self.kept += frac * causal
        self.pairs += causal
        kept_pairs = self.layer_pairs.setdefault(layer, [0.0, 0.0])
        kept_pairs[0] += frac * causal
        kept_pairs[1] += causal

    def add(self, index: int, records: list[dict[str, Any]]) -> None:
        """Fold in the routing records of window ``index``.

        Raises:
            RuntimeError: no record (Focus is not attached or is disabled).
        """
        if not records and not self.dense_layers:
            raise RuntimeError("no routing was recorded: is Focus attached and enabled?")
        for r in records:
            layer = int(r["layer"])
            if r["mode"] == "soft":
                assign = F.one_hot(r["probs"].argmax(-1), self.num_groups).float()
            else:
                assign = r["query_groups"].float()
                self._add_pairs(layer, r)
            # per key-value head memberships [B, N, H_kv, K] pool their heads
            mass = assign.reshape(-1, assign.shape[-1]).sum(dim=0).double()
            self.layer_mass[layer] = self.layer_mass.get(layer, 0) + mass

    def summary(self) -> dict[str, Any]:
        """``dominance``, ``dominance_max``, ``group_shares`` and, for top-k routing,
        ``pairs_retained`` and ``pairs_retained_by_layer`` (the dense layers at 1.0; every
        Focus layer has the same causal pairs, so the overall share is the layers' mean)."""
        shares = {}
        for layer in sorted(self.layer_mass):
            m = self.layer_mass[layer]
            shares[str(layer)] = [round(float(v), 6) for v in (m / m.sum()).tolist()]
        doms = [max(v) for v in shares.values()]
        out: dict[str, Any] = {
            "dominance": sum(doms) / len(doms) if doms else None,
            "dominance_max": max(doms) if doms else None,
            "group_shares": shares,
        }
        if self.pairs or self.dense_layers:
            by_layer = {k: v[0] / v[1] for k, v in self.layer_pairs.items()}
            for k, share in self.dense_head_share.items():
                if k in by_layer:  # the dense heads keep every pair
                    by_layer[k] = share + (1 - share) * by_layer[k]
            by_layer.update({k: 1.0 for k in self.dense_layers})
            out["pairs_retained"] = (
                sum(by_layer.values()) / len(by_layer)
                if self.dense_layers or self.dense_head_share
                else self.kept / self.pairs
            )
            out["pairs_retained_by_layer"] = {str(k): v for k, v in sorted(by_layer.items())}
        return out


def dense_head_share(fm: Any) -> dict[int, float]:
    """``{layer: share of its key-value heads in FocusConfig.dense_heads}`` of a
    :class:`~focus_attention.hf.FocusModel` (empty without dense heads)."""
    pairs = fm.focus_config.dense_heads
    if not pairs:
        return {}
    kv = kv_heads_of(fm.base_model.config)
    share: dict[int, float] = {}
    for layer, _ in pairs:
        share[layer] = share.get(layer, 0.0) + 1 / kv
    return share


def _adapter_top_k_values(cfg: EvalConfig) -> tuple[Any, list[int]]:
    """The adapter's saved Focus settings and the ``top_k`` values to evaluate (``(None,
    [])`` for a run without Focus); checked before the model loads (that takes a while).

    Raises:
        FileNotFoundError: no such folder, a file in its place, or neither a Focus adapter
            nor LoRA / trained weights in it.
        ValueError: a ``top_k`` outside ``1..K``; Focus settings for a run without Focus.
    """
    adapter = check_adapter_folder(cfg.adapter)
    parts = run_parts(adapter)
    if not parts["focus"]:
        if not adapter.is_dir():
            raise FileNotFoundError(f"adapter folder {adapter} not found (--adapter); expected "
                                    "a Focus adapter or a focus train run")  # fmt: skip
        if not (parts["lora"] or parts["model"]):
            raise FileNotFoundError(
                f"{adapter / CONFIG_NAME} not found: not a Focus adapter, and no LoRA adapter "
                f"(lora/) or trained model (model/) of a focus train run either{sweep_hint(adapter)}"
            )
        _refuse_focus_settings(cfg, adapter)
        return None, []
    saved = FocusConfig.from_json_file(adapter / CONFIG_NAME)
    k_all = list(range(1, saved.num_groups + 1))
    ks = k_all if cfg.top_k is None else list(cfg.top_k)
    outside = [k for k in ks if k not in k_all]
    expected = f"values in 1..{saved.num_groups}, the adapter's number of groups K"
    if outside:
        raise ValueError(f"top_k (--top-k): received {outside}, expected {expected}")
    if cfg.query_top_k is not None and cfg.query_top_k not in k_all:
        raise ValueError(f"query_top_k (--query-top-k): received {cfg.query_top_k}, expected "
                         f"{expected}")  # fmt: skip
    return saved, ks


def _refuse_focus_settings(cfg: EvalConfig, adapter: Path) -> None:
    """Refuse the Focus settings (their flags) given for a run without Focus.

    Raises:
        ValueError: one was given (the message names every one).
    """
    asked = {**cfg.overrides(), "calibrate_blocks": cfg.calibrate_blocks or None,
             "coverage_queries": cfg.coverage_queries or None}  # fmt: skip
    given = sorted("--" + k.replace("_", "-") for k, v in asked.items() if v is not None)
    if given:
        raise ValueError(f"{', '.join(given)}: {adapter} holds no Focus adapter (a dense run), "
                         "so there is no routing to set")  # fmt: skip


class _Scores:
    """What the evaluation collects, setting by setting."""

    def __init__(self) -> None:
        self.ppl: dict[str, Any] = {"focus_topk": {}}
        self.pairs: dict[str, float] = {}
        self.pairs_by_layer: dict[str, Any] = {}
        self.dominance: dict[str, Any] = {"topk": {}, "topk_max": {}}
        self.shares: dict[str, Any] = {"topk": {}}
        self.seconds: dict[str, Any] = {"topk": {}}
        self.by_position: dict[str, Any] = {"focus_topk": {}}
        self.coverage: dict[str, Any] | None = None

    def add_soft(self, ppl: float, summary: dict[str, Any], seconds: float, by_position: list) -> None:  # fmt: skip
        self.ppl["focus_soft"] = ppl
        self.by_position["focus_soft"] = by_position
        self.dominance["soft"] = summary["dominance"]
        self.dominance["soft_max"] = summary["dominance_max"]
        self.shares["soft"] = summary["group_shares"]
        self.seconds["soft"] = seconds

    def add_topk(self, k: int, ppl: float, summary: dict[str, Any], seconds: float, by_position: list) -> None:  # fmt: skip
        key = str(k)
        self.ppl["focus_topk"][key] = ppl
        self.by_position["focus_topk"][key] = by_position
        self.pairs[key] = summary["pairs_retained"]
        self.pairs_by_layer[key] = summary["pairs_retained_by_layer"]
        self.dominance["topk"][key] = summary["dominance"]
        self.dominance["topk_max"][key] = summary["dominance_max"]
        self.shares["topk"][key] = summary["group_shares"]
        self.seconds["topk"][key] = seconds


def _score_routed(fm: Any, blocks: torch.Tensor, bar: Any, bounds: list) -> tuple:
    """Perplexity, routing summary, seconds and perplexity per position bucket (``bounds``)
    of the adapter in its current routing."""
    t = time.monotonic()
    cfg = fm.focus_config
    stats = RoutingStats(cfg.window, cfg.num_groups, cfg.dense_layers, dense_head_share(fm))
    positions = PositionNLL(blocks.shape[1])
    nll, n = score_windows(
        fm, blocks, recorder=fm, on_window=stats.add, progress=bar, positions=positions
    )
    return math.exp(nll / n), stats.summary(), time.monotonic() - t, positions.perplexities(bounds)


def _score_adapter(base: Any, cfg: EvalConfig, blocks: torch.Tensor, ks: list[int], scores: _Scores, bar: Any, calib: torch.Tensor | None) -> tuple[dict, list[int]]:  # fmt: skip
    """Attach the adapter (with the overrides, and the routing bias collected from
    ``calib`` when given) and score soft routing and every top-k; returns the Focus
    settings used and the Focus layers."""
    fm = FocusModel.from_pretrained(base, cfg.adapter)
    fm.focus_config = fm.focus_config.override(**cfg.overrides(without=("top_k",)))
    settings = fm.focus_config.to_dict()  # the adapter's, before top_k changes below
    if calib is not None:
        calibrate_on(fm, calib)
    fm.eval()
    bounds = bucket_bounds(cfg.position_buckets, cfg.seq_len)
    if cfg.soft:
        bar.set_description("eval Focus soft")
        fm.set_routing("soft")
        scores.add_soft(*_score_routed(fm, blocks, bar, bounds))
    fm.set_routing("topk")
    for k in ks:
        bar.set_description(f"eval Focus top-{k}")
        fm.set_top_k(k)
        scores.add_topk(k, *_score_routed(fm, blocks, bar, bounds))
    if cfg.coverage_queries:
        bar.set_description("eval coverage")
        rows = evenly_spaced_rows(cfg.seq_len, fm.focus_config.window, cfg.coverage_queries)
        scores.coverage = topk_coverage(fm, blocks, ks, rows=rows)
    fm.set_routing("auto")
    return settings, fm.focus_layers


def _train_config(adapter: Path) -> dict[str, Any] | None:
    """The ``train_config.json`` beside the adapter, when there is a readable one."""
    path = adapter / TRAIN_CONFIG_NAME
    if path.is_file():
        with contextlib.suppress(ValueError, OSError):
            return json.loads(path.read_text())
    return None


def _config_record(cfg: EvalConfig, bos: bool, ks: list[int], focus: dict, layers: list[int]) -> dict[str, Any]:  # fmt: skip
    """The ``config`` block of the result (``focus`` None and no layers without Focus)."""
    train_config = _train_config(Path(cfg.adapter))
    return {
        "model": str(cfg.model),
        "adapter": str(cfg.adapter),
        "adapter_weights_sha256": weights_file_sha256(cfg.adapter) if cfg.adapter else None,
        "adapter_sha256": adapter_digest(cfg.adapter) if cfg.adapter else None,
        "corpus": str(cfg.corpus),
        "split": cfg.split,
        "seq_len": cfg.seq_len,
        "max_tokens": cfg.max_tokens,
        "prepend_bos": bos,
        "top_k_values": ks,
        "trained_top_k": focus["top_k"] if focus else None,
        "overrides": cfg.overrides(without=("top_k",)),  # top_k: top_k_values
        "calibrate_blocks": cfg.calibrate_blocks,
        "soft": cfg.soft,
        "window_scheme": WINDOW_SCHEME,
        "focus": focus,
        "focus_layers": layers,
        "method": (train_config or {}).get("method", "focus"),
        "parts": run_parts(cfg.adapter),
        "train_config": train_config,
    }


def _load(cfg: EvalConfig) -> tuple[Any, torch.Tensor, bool, torch.Tensor | None]:
    """Read the split, load the base model and cut the windows: ``(model, blocks, bos,
    calibration blocks or None)``.

    Raises:
        ValueError: the validation split has fewer than ``calibrate_blocks`` blocks.
    """
    quiet = not cfg.progress
    texts = load_corpus(cfg.corpus, quiet=quiet).texts(cfg.split)
    base, tokenizer = load_model(cfg.model, quiet=quiet)
    bos = auto_prepend_bos(base) if cfg.prepend_bos is None else cfg.prepend_bos
    blocks = token_blocks(tokenizer, texts, cfg.seq_len, max_tokens=cfg.max_tokens,
                          prepend_bos=bos)  # fmt: skip
    calib = None
    if cfg.calibrate_blocks:
        calib = calibration_blocks(tokenizer, cfg.corpus, "validation", cfg.seq_len,
                                   cfg.calibrate_blocks, bos, quiet)  # fmt: skip
    return base, blocks, bos, calib


def evaluate(config: EvalConfig | None = None, /, **settings: Any) -> EvalResult:
    """Perplexity of the base model and of a Focus adapter (soft and every top-k) on one
    split of a corpus (scheme in the module docstring; docs/method.md §9).

    Args:
        config: an :class:`EvalConfig`; or give its fields as keyword arguments
            (``evaluate(adapter="runs/austen", max_tokens=2048)``), which also override the
            fields of ``config``.

    Returns:
        an :class:`EvalResult`, also written to ``config.json`` (and the table to
        ``config.markdown``) when set.

    Raises:
        ValueError: bad settings, a ``json`` or ``markdown`` path that cannot be written
            (found before any work), a ``top_k`` outside ``1..K``, too little text, an
            adapter saved for another base model.
        FileNotFoundError: the adapter files are missing, or ``adapter`` is a file.
        RuntimeError: the base weights changed during the evaluation.
    """
    cfg = dataclasses.replace(config, **settings) if config is not None else EvalConfig(**settings)
    t_all = time.monotonic()
    for name in ("json", "markdown"):
        if getattr(cfg, name) is not None:
            check_output_file(getattr(cfg, name), name)
    saved, ks = _adapter_top_k_values(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    scores = _Scores()
    t = time.monotonic()
    base, blocks, bos, calib = _load(cfg)
    sha_before = weights_sha256(base)
    parts = run_parts(cfg.adapter)
    tuned = parts["lora"] or parts["model"]
    digests = tensor_digests(base) if tuned else None
    scores.seconds["load"] = time.monotonic() - t
    n_win = int(blocks.shape[0])
    rows = 1 + int(tuned) + (int(cfg.soft) + len(ks) if saved is not None else 0)
    bar = tqdm(total=n_win * rows, disable=not cfg.progress, desc="eval",
               dynamic_ncols=True, file=sys.stderr)  # fmt: skip
    bounds = bucket_bounds(cfg.position_buckets, cfg.seq_len)
    focus, layers = None, []
    try:
        n_tok, positions = _score_dense(base, blocks, "base", scores, bar, bounds)
        scores.by_position.update(buckets=[list(b) for b in bounds],
                                  tokens=positions.tokens(bounds))  # fmt: skip
        model = base
        if tuned:
            model = tuned_model(base, cfg.adapter)
            loaded = tensor_digests(model)
            _score_dense(model, blocks, "tuned", scores, bar, bounds)
        if saved is not None:
            focus, layers = _score_adapter(model, cfg, blocks, ks, scores, bar, calib)
    finally:
        bar.close()
    if tuned:
        weights = _tuned_weights(model, digests, loaded, sha_before)
    else:
        weights = _unchanged_weights(base, sha_before)
    scores.seconds["total"] = time.monotonic() - t_all
    result = _result(cfg, scores, n_tok, n_win, weights, bos, ks, focus, layers)
    _write(result, cfg)
    return result


def _result(cfg: EvalConfig, scores: _Scores, n_tok: int, n_win: int, weights: dict, bos: bool, ks: list[int], focus: dict | None, layers: list[int]) -> EvalResult:  # fmt: skip
    """The :class:`EvalResult` of the scores (a run without Focus: no Focus rows)."""
    if focus is None:
        scores.ppl.pop("focus_topk")
        scores.by_position.pop("focus_topk")
        scores.seconds.pop("topk")
    window = focus["window"] if focus else None
    return EvalResult(
        ppl=scores.ppl,
        pairs_retained=scores.pairs,
        tokens=n_tok,
        windows=n_win,
        base_weights_sha256=weights,
        dominance=scores.dominance if focus else {},
        group_shares=scores.shares if focus else {},
        pairs_retained_by_layer=scores.pairs_by_layer,
        routing_affected_share=(
            max(0, cfg.seq_len - window) / (cfg.seq_len - 1) if window is not None else None
        ),  # fmt: skip
        config=_config_record(cfg, bos, ks, focus, layers),
        versions=library_versions(),
        environment=environment(),
        seconds=scores.seconds,
        ppl_by_position=scores.by_position,
        coverage=scores.coverage,
    )


def _score_dense(model: Any, blocks: torch.Tensor, name: str, scores: _Scores, bar: Any, bounds: list) -> tuple[int, PositionNLL]:  # fmt: skip
    """Score ``model`` (dense: a transformers model, no Focus attached) as row ``name``
    (``base`` or ``tuned``): perplexity, perplexity by position and seconds; returns
    ``(scored tokens, the per-position NLL)``."""
    t = time.monotonic()
    bar.set_description(f"eval {name}")
    model.eval()
    positions = PositionNLL(blocks.shape[1])
    nll, n_tok = score_windows(model, blocks, progress=bar, positions=positions)
    scores.ppl[name] = math.exp(nll / n_tok)
    scores.by_position[name] = positions.perplexities(bounds)
    scores.seconds[name] = time.monotonic() - t
    return n_tok, positions


def _unchanged_weights(base: Any, sha_before: str) -> dict[str, Any]:
    """The base-weights record of a run that trained no base weights.

    Raises:
        RuntimeError: the base weights changed during the evaluation.
    """
    sha_after = weights_sha256(base)
    if sha_after != sha_before:
        raise RuntimeError(
            f"the base model's weights changed during evaluation (SHA-256 {sha_before} before, "
            f"{sha_after} after)"
        )
    return {"before": sha_before, "after": sha_after, "equal": True}


def _tuned_weights(model: Any, digests: dict, loaded: dict, sha_before: str) -> dict[str, Any]:
    """The base-weights record of a run that trained LoRA or base weights: how the tuned
    model's base tensors differ from the untouched base (``digests``).

    Raises:
        RuntimeError: the tuned model's weights changed during the evaluation (``loaded``:
            its digests when loaded).
    """
    if tensor_digests(model) != loaded:
        raise RuntimeError("the tuned model's weights changed during evaluation")
    report = base_weights_report(digests, model)
    return {"before": sha_before, "after": report["after"],
            "equal": report["after"] == sha_before, "trained": True,
            **{k: report[k] for k in ("changed", "changed_count", "tensors", "lora_tensors")}}  # fmt: skip


def _write(result: EvalResult, cfg: EvalConfig) -> None:
    """The result as JSON and its table as markdown, where ``cfg`` asks for them."""
    if cfg.json is not None:
        write_json_atomic(cfg.json, result.to_dict())
    if cfg.markdown is not None:
        path = Path(cfg.markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, markdown_table(result) + "\n")


def _title(r: dict[str, Any]) -> str:
    """The first line of :func:`markdown_table`: what was evaluated, on what."""
    cfg, focus = r["config"], r["config"]["focus"]
    method = cfg.get("method") or "focus"
    what = f"Focus adapter `{cfg['adapter']}`" if method == "focus" else (
        f"`{cfg['adapter']}` (focus train --method {method})")  # fmt: skip
    text = (f"{cfg['model']} + {what} on {cfg['corpus']}/{cfg['split']}: {r['tokens']:,d} "
            f"scored tokens in {r['windows']} windows of {cfg['seq_len']}")  # fmt: skip
    if focus:
        text += (f" (K={focus['num_groups']}, window={focus['window']}, gate={focus['gate']}, "
                 f"sink_tokens={focus['sink_tokens']}, "
                 f"inference_routing={focus['inference_routing']}")  # fmt: skip
        if focus.get("query_top_k") is not None:
            text += f", query_top_k={focus['query_top_k']}"
        dense = focus.get("dense_layers")
        text += f", dense_layers={','.join(map(str, dense))})" if dense else ")"
    return text


def markdown_table(result: EvalResult | dict[str, Any]) -> str:
    """The evaluation as a markdown table: one row for the base model, one for the tuned
    model (runs that trained LoRA or base weights), one for soft routing and one per
    evaluated ``top_k`` (PPL, change against the base, pairs retained, dominance: ``-``
    where no layer routes), after a one-line description of what was measured; then the
    perplexity-by-position table with a row for each model scored (none for results
    written before it existed). ``result`` may be an :class:`EvalResult` or its dict (a
    JSON result file)."""
    r = result.to_dict() if isinstance(result, EvalResult) else result
    base = r["ppl"]["base"]

    def rel(v: float) -> str:
        return f"{100 * (v / base - 1):+.1f}%"

    lines = [
        _title(r),
        "",
        "| model | top_k | PPL | vs base | pairs retained | dominance |",
        "|---|---:|---:|---:|---:|---:|",
        f"| base (dense) | - | {base:.3f} | - | 100.0% | - |",
    ]
    if "tuned" in r["ppl"]:
        v = r["ppl"]["tuned"]
        lines.append(f"| tuned (dense) | - | {v:.3f} | {rel(v)} | 100.0% | - |")
    if "focus_soft" in r["ppl"]:
        soft = r["ppl"]["focus_soft"]
        dsoft = r["dominance"].get("soft")
        dsoft_s = f"{dsoft:.3f}" if dsoft is not None else "-"
        lines.append(f"| Focus soft | - | {soft:.3f} | {rel(soft)} | (gated, dense) | {dsoft_s} |")
    for k, v in r["ppl"].get("focus_topk", {}).items():
        pr = r["pairs_retained"][k]
        d = r["dominance"]["topk"][k]  # None when every Focus layer runs dense attention
        d_s = "-" if d is None else f"{d:.3f}"
        lines.append(f"| Focus top-k | {k} | {v:.3f} | {rel(v)} | {100 * pr:.1f}% | {d_s} |")
    by_position = r.get("ppl_by_position")
    if by_position and by_position.get("base"):
        table = position_table(by_position)
        if by_position.get("tuned"):  # the tuned model's row after the base's
            cells = " | ".join("-" if v is None else f"{v:.3f}" for v in by_position["tuned"])
            at = next(i for i, line in enumerate(table) if line.startswith("| base (dense) |"))
            table.insert(at + 1, f"| tuned (dense) | {cells} |")
        lines += table
    if r.get("coverage"):
        cov = r["coverage"]
        lines += ["", f"Dense attention beyond the window: {100 * cov['distant_share']:.1f}% of "
                  "the measured queries' attention; share of it kept by top-k routing: "
                  + ", ".join(f"top-{k} {100 * v:.1f}%" for k, v in cov["topk"].items())]  # fmt: skip
    return "\n".join(lines)
