"""``focus eval``: perplexity of a base model and of its Focus adapter on held-out text
(issue 4 section 3).

Window scheme (product decision): the split's documents are tokenised and joined with EOS
(:func:`focus_attention.data.token_blocks`; with ``prepend_bos`` every window starts with
BOS), the stream is capped at ``max_tokens`` and cut into non-overlapping ``seq_len``
windows (the remainder is dropped). Each window is scored independently, with no context
from the previous window; every token of a window except its first is a target, so a run
scores ``windows * (seq_len - 1)`` tokens. Perplexity is ``exp(sum of NLL / scored tokens)``
over all windows (token-weighted), NLL in nats computed in float32 from the logits.

Evaluated, on exactly the same windows:

* ``base``: the pretrained model before the adapter is attached;
* ``focus_soft``: soft Sinkhorn routing with the soft gate (the training-time model; its
  Sinkhorn columns run over the whole window, so it is not causal, spec section 2);
* ``focus_topk[k]`` for every ``k`` in ``1..K``: hard top-k routing through exact sparse
  attention, the loaded adapter switched to ``top_k = k`` (``FocusModel.set_top_k``).

Routing is recorded on every evaluated window: ``pairs_retained[k]`` is the fraction of the
causal (query, key) pairs that top-k routing keeps (local window and sinks included), pooled
over every Focus layer and window (:func:`focus_attention.ops.pairs_retained`);
``dominance`` is the share of tokens (top-k: of memberships) held by the largest group
(mean and max over layers); ``group_shares`` lists the per-group shares layer by layer.

The SHA-256 of every base-model tensor (parameters and persistent buffers, by name) is
computed before the adapter is attached and after the last evaluation; a difference raises
``RuntimeError``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import argparse

    import torch

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_SEQ_LEN",
    "evaluate",
    "markdown_table",
    "register_cli",
    "score_windows",
    "weights_sha256",
]

#: evaluation window length (tokens)
DEFAULT_SEQ_LEN = 1024
#: default cap on evaluated tokens: four 1024-token windows keep base + soft + top-k 1..8 of
#: smollm2-135m within the README's time budget on a 2-core CPU; ``None`` = the whole split
DEFAULT_MAX_TOKENS = 4096


def weights_sha256(model: Any) -> str:
    """SHA-256 (hex) of every tensor of ``model.state_dict()`` (parameters and persistent
    buffers): names, dtypes, shapes and raw bytes, in name order. Tied tensors are hashed
    under each of their names. Reads every weight (about a second per 500 MB)."""
    import torch

    digest = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        if t.numel():
            flat = t.to("cpu").contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def score_windows(
    model: Any,
    blocks: torch.Tensor,
    *,
    recorder: Any | None = None,
    on_window: Callable[[int, list[dict[str, Any]]], None] | None = None,
    progress: Any | None = None,
) -> tuple[float, int]:
    """Next-token negative log-likelihood of independent windows (see the module docstring).

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

    Returns:
        ``(nll_sum, n_tokens)``: the summed NLL in nats (float64 accumulation) and the number
        of scored tokens, ``n_windows * (seq_len - 1)``.

    Raises:
        ValueError: ``blocks`` is not a 2-D tensor with ``seq_len >= 2``.
    """
    import torch
    import torch.nn.functional as F

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
            nll = F.cross_entropy(
                logits[0, :-1].float(), x[0, 1:], reduction="sum"
            )  # [L-1] targets
            total += float(nll.double())
            count += x.shape[1] - 1
            del logits
            if on_window is not None:
                on_window(i, records)
            if progress is not None:
                progress.update(1)
    return total, count


class _RoutingStats:
    """Accumulates routing statistics over windows for one routing setting."""

    def __init__(self, window: int, num_groups: int) -> None:
        self.window = window
        self.num_groups = num_groups
        self.kept = 0.0
        self.pairs = 0.0
        self.layer_mass: dict[int, Any] = {}
        self.layer_pairs: dict[int, list[float]] = {}

    def add(self, index: int, records: list[dict[str, Any]]) -> None:
        import torch

        from .ops import pairs_retained

        if not records:
            raise RuntimeError("no routing was recorded: is Focus attached and enabled?")
        for r in records:
            layer = int(r["layer"])
            if r["mode"] == "soft":
                probs = r["probs"]
                assign = torch.nn.functional.one_hot(probs.argmax(-1), self.num_groups).float()
            else:
                q = r["query_groups"]
                assign = q.float()
                n = q.shape[1]
                causal = n * (n + 1) / 2 * q.shape[0]
                frac = pairs_retained(q, r["key_groups"], self.window, r.get("key_padding"))
                self.kept += frac * causal
                self.pairs += causal
                self.layer_pairs.setdefault(layer, [0.0, 0.0])
                self.layer_pairs[layer][0] += frac * causal
                self.layer_pairs[layer][1] += causal
            mass = assign.sum(dim=(0, 1)).double()
            self.layer_mass[layer] = self.layer_mass.get(layer, 0) + mass

    def summary(self) -> dict[str, Any]:
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
        if self.pairs:
            out["pairs_retained"] = self.kept / self.pairs
            out["pairs_retained_by_layer"] = {
                str(k): v[0] / v[1] for k, v in sorted(self.layer_pairs.items())
            }
        return out


def library_versions() -> dict[str, str | None]:
    """Python and library versions (None: not installed), for every result file: the
    ``versions`` block of ``focus eval``'s JSON and of ``train_result.json``."""
    import importlib.metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("focus-attention", "torch", "transformers", "tokenizers", "safetensors", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def evaluate(
    model: str = "smollm2-135m",
    adapter: str | os.PathLike[str] = "runs/austen",
    corpus: str = "austen",
    split: str = "test",
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    top_k_values: Sequence[int] | None = None,
    inference_routing: str | None = None,
    sink_tokens: int | None = None,
    prepend_bos: bool | None = None,
    threads: int | None = None,
    json_path: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Perplexity of the base model and of a Focus adapter (soft and every top-k) on one
    split of a corpus (issue 4 section 3; scheme in the module docstring).

    Args:
        model: registered model name, model directory or hub id (must be the adapter's base).
        adapter: a directory written by ``FocusModel.save_pretrained`` (e.g. ``focus train``'s
            ``--out``).
        corpus: registered corpus or local text file/folder; split: ``train``,
            ``validation`` or ``test``.
        seq_len: window length in tokens (>= 2).
        max_tokens: cap on the token stream (``None``: the whole split).
        top_k_values: which ``top_k`` to evaluate (default every value in ``1..K``).
        inference_routing: override the adapter's ``inference_routing`` (``causal`` /
            ``sequence``); sink_tokens: override its ``sink_tokens``.
        prepend_bos: start windows with BOS (``None``: automatic, True for Gemma models).
        threads: torch intra-op threads (``None``: unchanged).
        json_path: also write the result there (atomically).
        progress: show a tqdm bar and messages on stderr.

    Returns:
        dict with ``ppl`` (``base``, ``focus_soft``, ``focus_topk`` {"1".."K"}),
        ``pairs_retained`` {"1".."K"}, ``tokens`` (scored tokens), ``windows``,
        ``base_weights_sha256`` (``before``, ``after``, ``equal``), ``dominance`` (``soft``
        and ``topk`` {"k"}: mean over layers; ``*_max``: the worst layer), ``group_shares``
        (``soft``/``topk`` {"k"}: layer -> K shares), ``pairs_retained_by_layer``,
        ``routing_affected_share`` (share of scored tokens that have keys outside the local
        window), ``config``, ``versions``, ``environment``, ``seconds``.

    Raises:
        ValueError: bad arguments, a ``top_k`` outside ``1..K``, too little text, an adapter
            saved for another base model.
        FileNotFoundError: the adapter files are missing.
        RuntimeError: the base weights changed during the evaluation.
    """
    import torch
    from tqdm.auto import tqdm

    from .bench import environment
    from .data import SPLITS, load_corpus, token_blocks
    from .hf import FocusModel
    from .models import load_model
    from .train import auto_prepend_bos
    from .utils.io import write_json_atomic

    t_all = time.monotonic()
    if split not in SPLITS:
        raise ValueError(f"split: received {split!r}, expected one of {SPLITS}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len: received {seq_len!r}, expected an int >= 2")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens: received {max_tokens!r}, expected None or an int >= 1")
    adapter = Path(adapter)
    if not (adapter / "focus_config.json").is_file():
        raise FileNotFoundError(f"{adapter / 'focus_config.json'} not found: not a Focus adapter")
    from .hf import FocusConfig

    # argument errors first: loading the model takes a while
    saved_cfg = FocusConfig.from_json_file(adapter / "focus_config.json")
    k_all = list(range(1, saved_cfg.num_groups + 1))
    ks = k_all if top_k_values is None else sorted({int(k) for k in top_k_values})
    bad = [k for k in ks if k not in k_all]
    if bad or not ks:
        raise ValueError(f"top_k_values: {bad or ks} outside 1..K={saved_cfg.num_groups}")
    if threads is not None:
        torch.set_num_threads(threads)
    quiet = not progress
    seconds: dict[str, Any] = {}

    t = time.monotonic()
    texts = load_corpus(corpus, quiet=quiet).texts(split)
    base, tokenizer = load_model(model, quiet=quiet)
    bos = auto_prepend_bos(base) if prepend_bos is None else prepend_bos
    sha_before = weights_sha256(base)
    blocks = token_blocks(tokenizer, texts, seq_len, max_tokens=max_tokens, prepend_bos=bos)
    seconds["load"] = time.monotonic() - t

    n_win = int(blocks.shape[0])
    bar = tqdm(total=n_win * (2 + len(ks)), disable=quiet, desc="eval", dynamic_ncols=True,
               file=sys.stderr)  # fmt: skip

    ppl: dict[str, Any] = {"focus_topk": {}}
    pairs: dict[str, float] = {}
    pairs_by_layer: dict[str, Any] = {}
    dom: dict[str, Any] = {"topk": {}, "topk_max": {}}
    shares: dict[str, Any] = {"topk": {}}
    seconds["topk"] = {}
    try:
        t = time.monotonic()
        bar.set_description("eval base")
        base.eval()
        nll, n_tok = score_windows(base, blocks, progress=bar)
        ppl["base"] = math.exp(nll / n_tok)
        seconds["base"] = time.monotonic() - t

        fm = FocusModel.from_pretrained(base, adapter)
        overrides = {"inference_routing": inference_routing, "sink_tokens": sink_tokens}
        cfg = fm.focus_config.replace(**{k: v for k, v in overrides.items() if v is not None})
        fm.focus_config = cfg
        fm.eval()

        t = time.monotonic()
        bar.set_description("eval Focus soft")
        stats = _RoutingStats(cfg.window, cfg.num_groups)
        fm.set_routing("soft")
        nll, _ = score_windows(fm, blocks, recorder=fm, on_window=stats.add, progress=bar)
        ppl["focus_soft"] = math.exp(nll / n_tok)
        summary = stats.summary()
        dom["soft"], dom["soft_max"] = summary["dominance"], summary["dominance_max"]
        shares["soft"] = summary["group_shares"]
        seconds["soft"] = time.monotonic() - t

        fm.set_routing("topk")
        for k in ks:
            t = time.monotonic()
            bar.set_description(f"eval Focus top-{k}")
            fm.set_top_k(k)
            stats = _RoutingStats(cfg.window, cfg.num_groups)
            nll, _ = score_windows(fm, blocks, recorder=fm, on_window=stats.add, progress=bar)
            key = str(k)
            ppl["focus_topk"][key] = math.exp(nll / n_tok)
            summary = stats.summary()
            pairs[key] = summary["pairs_retained"]
            pairs_by_layer[key] = summary["pairs_retained_by_layer"]
            dom["topk"][key], dom["topk_max"][key] = summary["dominance"], summary["dominance_max"]
            shares["topk"][key] = summary["group_shares"]
            seconds["topk"][key] = time.monotonic() - t
        fm.set_routing("auto")
        focus_cfg = cfg.to_dict()
        focus_layers = fm.focus_layers
    finally:
        bar.close()

    sha_after = weights_sha256(base)
    if sha_after != sha_before:
        raise RuntimeError(
            f"the base model's weights changed during evaluation (SHA-256 {sha_before} before, "
            f"{sha_after} after)"
        )
    train_cfg = None
    if (adapter / "train_config.json").is_file():
        with contextlib.suppress(ValueError, OSError):
            train_cfg = json.loads((adapter / "train_config.json").read_text())
    window = focus_cfg["window"]
    affected = max(0, seq_len - window) / (seq_len - 1)
    seconds["total"] = time.monotonic() - t_all
    result: dict[str, Any] = {
        "ppl": ppl,
        "pairs_retained": pairs,
        "tokens": n_tok,
        "windows": n_win,
        "base_weights_sha256": {"before": sha_before, "after": sha_after, "equal": True},
        "dominance": dom,
        "group_shares": shares,
        "pairs_retained_by_layer": pairs_by_layer,
        "routing_affected_share": affected,
        "config": {
            "model": str(model),
            "adapter": str(adapter),
            "corpus": str(corpus),
            "split": split,
            "seq_len": seq_len,
            "max_tokens": max_tokens,
            "prepend_bos": bos,
            "top_k_values": ks,
            "trained_top_k": focus_cfg["top_k"],
            "overrides": {"inference_routing": inference_routing, "sink_tokens": sink_tokens},
            "window_scheme": "non-overlapping seq_len windows scored independently; every "
            "token but the first of each window is a target; token-weighted PPL",
            "focus": focus_cfg,
            "focus_layers": focus_layers,
            "train_config": train_cfg,
        },
        "versions": library_versions(),
        "environment": environment(),
        "seconds": seconds,
    }
    if json_path is not None:
        write_json_atomic(json_path, result)
    return result


def markdown_table(result: dict[str, Any]) -> str:
    """The evaluation as a markdown table: one row for the base model, one for soft routing
    and one per evaluated ``top_k`` (PPL, change against the base, pairs retained,
    dominance), preceded by a one-line description of what was measured."""
    cfg = result["config"]
    focus = cfg["focus"]
    base = result["ppl"]["base"]

    def rel(v: float) -> str:
        return f"{100 * (v / base - 1):+.1f}%"

    lines = [
        f"{cfg['model']} + Focus adapter `{cfg['adapter']}` on {cfg['corpus']}/{cfg['split']}: "
        f"{result['tokens']:,d} scored tokens in {result['windows']} windows of "
        f"{cfg['seq_len']} (K={focus['num_groups']}, window={focus['window']}, "
        f"gate={focus['gate']}, sink_tokens={focus['sink_tokens']}, "
        f"inference_routing={focus['inference_routing']})",
        "",
        "| model | top_k | PPL | vs base | pairs retained | dominance |",
        "|---|---:|---:|---:|---:|---:|",
        f"| base (dense) | - | {base:.3f} | - | 100.0% | - |",
    ]
    soft = result["ppl"]["focus_soft"]
    dsoft = result["dominance"].get("soft")
    dsoft_s = f"{dsoft:.3f}" if dsoft is not None else "-"
    lines.append(f"| Focus soft | - | {soft:.3f} | {rel(soft)} | (gated, dense) | {dsoft_s} |")
    for k, v in result["ppl"]["focus_topk"].items():
        pr = result["pairs_retained"][k]
        d = result["dominance"]["topk"][k]
        lines.append(f"| Focus top-k | {k} | {v:.3f} | {rel(v)} | {100 * pr:.1f}% | {d:.3f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        import argparse

        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from e


def _max_tokens(text: str) -> int | None:
    if text.strip().lower() in ("all", "none", "0"):
        return None
    return int(text)


def _cmd_eval(args: argparse.Namespace) -> int:
    result = evaluate(
        args.model,
        args.adapter,
        args.corpus,
        args.split,
        seq_len=args.seq_len,
        max_tokens=args.max_tokens,
        top_k_values=args.top_k_values,
        inference_routing=args.inference_routing,
        sink_tokens=args.sink_tokens,
        prepend_bos=args.prepend_bos,
        threads=args.threads,
        json_path=args.json,
        progress=not args.no_progress,
    )
    table = markdown_table(result)
    print(table)
    if args.markdown:
        from .utils.io import atomic_write_text

        path = Path(args.markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, table + "\n")
    print(f"\nbase weights SHA-256 unchanged: {result['base_weights_sha256']['after']}")
    print(f"{result['seconds']['total']:.0f} s" + (f"; JSON: {args.json}" if args.json else ""))
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``focus eval`` (see :func:`evaluate`)."""
    import argparse

    from .train import run_guarded

    p = subparsers.add_parser(
        "eval",
        help="perplexity of the base model and a Focus adapter (soft and every top-k)",
        description="Token-weighted perplexity over non-overlapping --seq-len windows (each "
        "window scored independently; all tokens but the first of each window count) of the "
        "base model, Focus soft routing and Focus top-k routing for every top_k in 1..K, with "
        "pairs retained, dominance and group shares; checks that the base weights' SHA-256 "
        "is unchanged.",
    )
    p.add_argument("--model", default="smollm2-135m", help="base model (default %(default)s)")
    p.add_argument("--adapter", required=True, help="directory of a saved Focus adapter")
    p.add_argument("--corpus", default="austen", help="corpus (default %(default)s)")
    p.add_argument("--split", default="test", choices=("train", "validation", "test"),
                   help="split (default %(default)s)")  # fmt: skip
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--markdown", default=None, help="also write the markdown table here")
    p.add_argument("--max-tokens", type=_max_tokens, default=DEFAULT_MAX_TOKENS,
                   help="cap on evaluated tokens, 'all' for the whole split (default %(default)s)")  # fmt: skip
    p.add_argument(
        "--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="window length (default %(default)s)"
    )
    p.add_argument("--top-k-values", type=_int_list, default=None,
                   help="comma-separated top_k values to evaluate (default: every one in 1..K)")  # fmt: skip
    p.add_argument("--inference-routing", choices=("causal", "sequence"), default=None,
                   help="override the adapter's inference routing")  # fmt: skip
    p.add_argument(
        "--sink-tokens", type=int, default=None, help="override the adapter's sink_tokens"
    )
    p.add_argument("--prepend-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="start windows with BOS (default: automatic, on for Gemma)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or messages")
    p.set_defaults(func=run_guarded(_cmd_eval))
