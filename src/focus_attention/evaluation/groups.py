"""``focus inspect``: what the learned groups hold (docs/method.md §9, "Group inspection").

For every Focus layer the tokens of a held-out text are routed by the adapter's hard top-k
routing (default ``top_k = 1``: each token's first group), read from the model's routing
recorder (:meth:`FocusModel.record_routing`). A token routed to ``k`` groups counts ``1/k``
in each, so every layer's counts sum to the number of tokens. Reported per layer:

* the share of tokens per group, and the composition of every group by word category
  (:mod:`.categories`: a lexical categorisation, not a tagger), with the lift of each
  category (its share in the group over its share in the text);
* how far the grouping is from random: the normalised mutual information (NMI) between
  group and category, ``I(G; C) / ((H(G) + H(C)) / 2)`` (natural logs; the arithmetic-mean
  normalisation, NMI_sum of Vinh, Epps & Bailey, JMLR 2010, scikit-learn's default), for the trained routers,
  for the untrained initialisation (a fresh ``get_focus_model`` with the adapter's settings
  and seed: the adapter at step 0, zero routing bias), for that initialisation with its
  causal routing bias calibrated on the inspected text itself (balanced groups, nothing
  trained), and for the trained groups shuffled over the tokens (chance level, mean and
  standard deviation over ``shuffles`` permutations); also ``I(G; C) / H(C)``, the share of
  the category's entropy the group explains (NMI rises a little when the groups get less
  balanced, this does not reward that);
* for the layers asked for (``layers``): each group's most frequent tokens, its most
  typical tokens (among tokens seen at least ``min_count`` times, the highest share of the
  token's occurrences routed to the group, ``P(group | token)``, i.e. the highest lift over
  the group's share; ties by count), and a context snippet for the most typical ones.

Text: the split's documents tokenised and cut into non-overlapping ``seq_len`` windows as in
``focus eval`` (:func:`focus_attention.assets.blocks.token_blocks`), capped at ``tokens``;
every window is routed on its own. Every token of every window is inspected (sink tokens
included: they are routed like the others).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..assets.blocks import token_blocks
from ..assets.corpora import load_corpus
from ..assets.models import auto_prepend_bos, load_model
from ..hf import FocusModel, get_focus_model
from ..hf.config import FocusConfig
from ..hf.files import CONFIG_NAME, check_adapter_folder, sweep_hint
from ..utils.env import environment, library_versions
from ..utils.io import atomic_write_text, write_json_atomic
from .categories import CATEGORIES, token_categories, token_texts
from .group_report import markdown_summary, write_group_plots
from .settings import InspectConfig

__all__ = [
    "InspectConfig",
    "group_category_counts",
    "information",
    "inspect_groups",
    "normalized_mutual_information",
    "shuffled_nmi",
]

#: the files :func:`inspect_groups` writes into ``out``
JSON_NAME, MARKDOWN_NAME = "inspect.json", "inspect.md"


# --------------------------------------------------------------------------------------------
# statistics


def information(joint: torch.Tensor) -> dict[str, float]:
    """Entropies and mutual information of a contingency table, in nats.

    Args:
        joint: ``[n_a, n_b]`` non-negative counts or weights (any float or int dtype), e.g.
            groups x categories; computed in float64.

    Returns:
        ``{"mi": I(A; B), "h_a": H(A), "h_b": H(B), "nmi": I / ((H(A) + H(B)) / 2)}``; the
        NMI is in ``[0, 1]``: 1.0 when both variables are constant (identical trivial
        partitions, the scikit-learn convention), 0.0 when only one is.

    Raises:
        ValueError: not 2-D, negative or non-finite entries, or a zero total.
    """
    if joint.ndim != 2:
        raise ValueError(f"joint: expected a 2-D table, got shape {tuple(joint.shape)}")
    p = joint.double()
    if not bool(torch.isfinite(p).all()) or bool((p < 0).any()):
        raise ValueError("joint: expected finite, non-negative counts")
    total = p.sum()
    if total <= 0:
        raise ValueError("joint: the table is empty (total 0)")
    p = p / total
    pa, pb = p.sum(1), p.sum(0)

    def entropy(q: torch.Tensor) -> float:
        q = q[q > 0]
        return float(-(q * q.log()).sum())

    nz = p > 0
    outer = pa[:, None] * pb[None, :]
    mi = max(0.0, float((p[nz] * (p[nz].log() - outer[nz].log())).sum()))
    h_a, h_b = entropy(pa), entropy(pb)
    denom = (h_a + h_b) / 2
    nmi = 1.0 if denom <= 0 else min(1.0, mi / denom)
    return {"mi": mi, "h_a": h_a, "h_b": h_b, "nmi": nmi}


def normalized_mutual_information(joint: torch.Tensor) -> float:
    """NMI of a contingency table: ``I(A; B) / ((H(A) + H(B)) / 2)``, in ``[0, 1]``
    (:func:`information`, whose errors it raises)."""
    return information(joint)["nmi"]


def group_category_counts(
    memberships: torch.Tensor, categories: torch.Tensor, num_categories: int
) -> torch.Tensor:
    """The group x category table of one layer.

    Args:
        memberships: ``[T, K]`` float weights of each token in each group (rows sum to 1).
        categories: ``[T]`` long category index per token, in ``[0, num_categories)``.
        num_categories: ``C``.

    Returns:
        ``[K, C]`` float64 table; its total is ``T`` when every row sums to 1.

    Raises:
        ValueError: mismatched lengths or a category index out of range.
    """
    if memberships.ndim != 2 or categories.shape != (memberships.shape[0],):
        raise ValueError(
            f"memberships [T, K] and categories [T] expected, got {tuple(memberships.shape)} "
            f"and {tuple(categories.shape)}"
        )
    if categories.numel() and (int(categories.min()) < 0 or int(categories.max()) >= num_categories):  # fmt: skip
        raise ValueError(f"categories: indices outside 0..{num_categories - 1}")
    onehot = torch.nn.functional.one_hot(categories.long(), num_categories).double()
    return memberships.double().t() @ onehot


def shuffled_nmi(
    memberships: torch.Tensor, categories: torch.Tensor, num_categories: int, n: int, seed: int
) -> dict[str, float] | None:
    """Chance level of the NMI: the tokens' group memberships permuted ``n`` times (seeded)
    against fixed categories. Returns ``{"mean", "std"}``, or None when ``n == 0``."""
    if n == 0:
        return None
    gen = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(n):
        perm = torch.randperm(memberships.shape[0], generator=gen)
        joint = group_category_counts(memberships[perm], categories, num_categories)
        values.append(normalized_mutual_information(joint))
    t = torch.tensor(values, dtype=torch.float64)
    return {"mean": float(t.mean()), "std": float(t.std()) if n > 1 else 0.0}


def _round(x: Any, digits: int = 5) -> Any:
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, list):
        return [_round(v, digits) for v in x]
    return round(float(x), digits)


def layer_summary(
    memberships: torch.Tensor, categories: torch.Tensor, continuation: torch.Tensor
) -> dict[str, Any]:
    """Shares, composition, NMI, mutual information (nats), the share of the category
    entropy the group explains (``I(G; C) / H(C)``, which does not reward unbalanced
    groups), dominance and the share of word-continuation tokens per group of one layer (``memberships`` ``[T, K]``, ``categories`` ``[T]`` long,
    ``continuation`` ``[T]`` bool)."""
    counts = group_category_counts(memberships, categories, len(CATEGORIES))
    mass = memberships.double().sum(0)
    shares = mass / memberships.shape[0]
    cont = (memberships.double() * continuation.double()[:, None]).sum(0)
    info = information(counts)
    return {
        "shares": _round(shares),
        "dominance": round(float(shares.max()), 5),
        "nmi": round(info["nmi"], 5),
        "mi": round(info["mi"], 5),
        "category_explained": round(info["mi"] / info["h_b"], 5) if info["h_b"] > 0 else 0.0,
        "composition": _round(counts, 3),
        "continuation_share": _round(cont / mass.clamp(min=1e-12)),
    }


# --------------------------------------------------------------------------------------------
# the tokens of each group


def _shown(text: str) -> str:
    """A token or snippet as plain text on one line: line breaks as ``⏎``, tabs as ``⇥``."""
    return text.replace("\r", "").replace("\n", "⏎").replace("\t", "⇥")


class TokenIndex:
    """The inspected tokens: ids, their decoded texts and categories, and snippets.

    Args:
        tokenizer: the model's tokenizer.
        ids: ``[T]`` long, the inspected tokens in order (windows concatenated).
    """

    def __init__(self, tokenizer: Any, ids: torch.Tensor) -> None:
        self.tokenizer = tokenizer
        self.ids = ids.long().flatten()
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        flags = [int(i) in special for i in self.ids]
        texts = token_texts(tokenizer, self.ids.tolist())
        cats, cont = token_categories(texts, flags)
        index = {c: i for i, c in enumerate(CATEGORIES)}
        self.categories = torch.tensor([index[c] for c in cats], dtype=torch.long)
        self.continuation = torch.tensor(cont, dtype=torch.bool)
        self.unique, self.inverse = torch.unique(self.ids, return_inverse=True)
        self.counts = torch.bincount(self.inverse, minlength=self.unique.numel())
        self._decoded: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """The decoded text of one token id (cached)."""
        if token_id not in self._decoded:
            self._decoded[token_id] = self.tokenizer.decode([token_id])
        return self._decoded[token_id]

    def snippet(self, position: int, context: int) -> str:
        """The text around ``position`` with the token marked ``⟦...⟧`` (one line)."""
        lo, hi = max(0, position - context), min(self.ids.numel(), position + context + 1)
        dec = self.tokenizer.decode
        before = dec(self.ids[lo:position].tolist()) if position > lo else ""
        after = dec(self.ids[position + 1 : hi].tolist()) if hi > position + 1 else ""
        return _shown(f"{before}⟦{self.text(int(self.ids[position]))}⟧{after}")


def _ranked(pairs: list[tuple[tuple, int]], n: int) -> list[int]:
    """The ``n`` unique-token indices with the smallest sort keys."""
    return [u for _, u in sorted(pairs)[:n]]


def _entry(index: TokenIndex, row: torch.Tensor, u: int) -> dict[str, Any]:
    """One listed token of a group: text, id, weight in the group, occurrences in the text,
    and the share of them routed to the group."""
    tid, total = int(index.unique[u]), float(index.counts[u])
    return {"token": index.text(tid), "id": tid, "count": round(float(row[u]), 3),
            "total": int(total), "p_group": round(float(row[u]) / total, 4)}  # fmt: skip


def group_tokens(
    index: TokenIndex, memberships: torch.Tensor, cfg: InspectConfig
) -> list[dict[str, Any]]:
    """Per group of one layer: its most frequent tokens, its most typical tokens and
    snippets (module docstring). ``memberships`` ``[T, K]`` float."""
    m = memberships.double()
    per_token = torch.zeros(m.shape[1], index.unique.numel(), dtype=torch.float64)
    per_token.index_add_(1, index.inverse, m.t())
    totals = index.counts.double()
    out = []
    for g in range(m.shape[1]):
        row = per_token[g]
        seen = torch.nonzero(row > 0).flatten().tolist()
        frequent = _ranked([((-float(row[u]), u), u) for u in seen], cfg.top_tokens)
        typical_pool = [u for u in seen if totals[u] >= cfg.min_count]
        typical = _ranked(
            [((-float(row[u] / totals[u]), -float(row[u]), u), u) for u in typical_pool],
            cfg.top_tokens,
        )

        snippets = []
        for u in typical[: cfg.snippets]:
            where = torch.nonzero((index.inverse == u) & (m[:, g] > 0)).flatten()
            snippets.append(index.snippet(int(where[0]), cfg.context))
        out.append({"group": g, "frequent": [_entry(index, row, u) for u in frequent],
                    "typical": [_entry(index, row, u) for u in typical],
                    "snippets": snippets})  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# routing


@torch.no_grad()
def record_memberships(
    fm: Any, blocks: torch.Tensor, top_k: int, bar: Any | None = None
) -> dict[int, torch.Tensor]:
    """Route ``blocks`` with hard top-k routing and read the groups from the recorder.

    Args:
        fm: a ``FocusModel``; it is left in ``eval()`` mode with routing ``"auto"`` and
            ``top_k`` set to ``top_k``.
        blocks: ``[n_windows, seq_len]`` long; each row is one forward.
        top_k: groups per token.
        bar: a tqdm bar advanced once per window, or None.

    Returns:
        ``{layer: [n_windows * seq_len, K] float32}``, each token's weight ``1/top_k`` in
        each of its groups (rows sum to 1), windows in order.
    """
    fm.eval()
    fm.set_routing("topk")
    fm.set_top_k(top_k)
    device = next(fm.parameters()).device
    per_layer: dict[int, list[torch.Tensor]] = {}
    try:
        for block in blocks:
            with fm.record_routing() as records:
                fm(input_ids=block[None].to(device), use_cache=False)
            for r in records:
                q = r["query_groups"][0].float().cpu()
                per_layer.setdefault(int(r["layer"]), []).append(
                    q / q.sum(-1, keepdim=True).clamp(min=1)
                )
            if bar is not None:
                bar.update(1)
    finally:
        fm.set_routing("auto")
    return {layer: torch.cat(parts) for layer, parts in sorted(per_layer.items())}


def _saved_config(cfg: InspectConfig) -> Any:
    """The adapter's saved Focus settings, checked against ``cfg`` before the model loads.

    Raises:
        ValueError: no adapter given, ``top_k`` above K, layers the adapter does not route
            (not Focus layers, or layers that run dense attention), no routed layer at all,
            an ``out`` that is not a folder.
        FileNotFoundError: no adapter config in the directory, or a file in its place.
    """
    if cfg.adapter is None:
        raise ValueError("an adapter directory is required (--adapter DIR)")
    if cfg.out is not None and Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ValueError(f"out (--out): received {cfg.out!r}, which is a file, not a folder; "
                         "expected a folder to write the results into")  # fmt: skip
    path = check_adapter_folder(cfg.adapter) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {cfg.adapter} is not a Focus adapter{sweep_hint(cfg.adapter)}"
        )
    saved = FocusConfig.from_json_file(path)
    if cfg.top_k > saved.num_groups:
        raise ValueError(f"top_k={cfg.top_k}: expected 1..K={saved.num_groups} (the adapter's K)")
    if saved.layers is not None:
        check_layers(cfg.layers, list(saved.layers), saved.dense_layers)
    return saved


def _spans(layers: list[int]) -> str:
    """Layer indices in short form: ``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for i in sorted(layers):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def check_layers(
    layers: tuple[int, ...] | None, focus_layers: list[int], dense_layers: tuple[int, ...] = ()
) -> list[int]:
    """The layers to detail: ``layers``, or every routed Focus layer (those of
    ``focus_layers`` not in ``dense_layers``, which have no groups) when None.

    Raises:
        ValueError: a layer that is not a Focus layer or runs dense attention (the message
            lists the layers that can be inspected); no routed layer at all.
    """
    routed = [i for i in focus_layers if i not in set(dense_layers)]
    if not routed:
        raise ValueError(
            f"every Focus layer of this adapter runs dense attention (dense_layers "
            f"{_spans(list(dense_layers))}): no layer has groups to inspect"
        )
    if layers is None:
        return routed
    missing = sorted(set(layers) - set(focus_layers))
    if missing:
        raise ValueError(
            f"layers (--layers) {missing} are not Focus layers of this adapter (Focus layers: "
            f"{_spans(focus_layers)}, {len(focus_layers)} in all; layers that can be "
            f"inspected: {_spans(routed)})"
        )
    dense = sorted(set(layers) & set(dense_layers))
    if dense:
        raise ValueError(
            f"layers (--layers) {dense} run dense attention in this adapter (dense_layers "
            f"{_spans(list(dense_layers))}) and have no groups; layers that can be inspected: "
            f"{_spans(routed)}"
        )
    return list(layers)


def _load(cfg: InspectConfig) -> tuple[Any, Any, torch.Tensor, bool]:
    """``(base model, tokenizer, blocks [n, seq_len], prepend_bos)``."""
    quiet = not cfg.progress
    texts = load_corpus(cfg.corpus, quiet=quiet).texts(cfg.split)
    base, tokenizer = load_model(cfg.model, quiet=quiet)
    bos = auto_prepend_bos(base)
    blocks = token_blocks(tokenizer, texts, cfg.seq_len, max_tokens=cfg.max_tokens, prepend_bos=bos)
    return base, tokenizer, blocks, bos


def _route_all(base: Any, saved: Any, cfg: InspectConfig, blocks: torch.Tensor, bar: Any) -> tuple[dict, list[int]]:  # fmt: skip
    """The memberships of every routing inspected: ``{"trained": {layer: [T, K]}, and with
    ``cfg.baseline`` "untrained" and "untrained_calibrated"}``, and the Focus layers."""
    runs: dict[str, dict[int, torch.Tensor]] = {}
    if cfg.baseline:
        fresh = get_focus_model(base, saved.replace(routing="auto"))
        runs["untrained"] = record_memberships(fresh, blocks, cfg.top_k, bar)
        for i, block in enumerate(blocks):
            fresh.calibrate(block[None], reset=i == 0)
        runs["untrained_calibrated"] = record_memberships(fresh, blocks, cfg.top_k, bar)
        base = fresh.unload()
    fm = FocusModel.from_pretrained(base, cfg.adapter)
    layers = list(fm.focus_layers)
    try:
        runs["trained"] = record_memberships(fm, blocks, cfg.top_k, bar)
    finally:
        fm.unload()
    return {
        k: runs[k] for k in ("trained", "untrained", "untrained_calibrated") if k in runs
    }, layers


def _category_rates(index: TokenIndex) -> dict[str, Any]:
    counts = torch.bincount(index.categories, minlength=len(CATEGORIES))
    return {c: int(n) for c, n in zip(CATEGORIES, counts.tolist(), strict=True)}


def _groups_block(index: TokenIndex, trained: dict, layers: list[int], cfg: InspectConfig) -> dict[str, Any]:  # fmt: skip
    """``{layer: [per group: tokens, snippets, category shares and lifts]}``."""
    total = index.categories.numel()
    rates = torch.bincount(index.categories, minlength=len(CATEGORIES)).double() / total
    out = {}
    for layer in layers:
        m = trained[layer]
        counts = group_category_counts(m, index.categories, len(CATEGORIES))
        groups = group_tokens(index, m, cfg)
        for g, entry in enumerate(groups):
            mass = float(counts[g].sum())
            share = counts[g] / max(mass, 1e-12)
            lift = torch.where(rates > 0, share / rates.clamp(min=1e-12), torch.zeros_like(share))
            entry["share"] = round(mass / total, 5)
            entry["categories"] = {
                c: round(float(s), 4) for c, s in zip(CATEGORIES, share.tolist(), strict=True)
            }
            entry["lift"] = {
                c: round(float(v), 3) for c, v in zip(CATEGORIES, lift.tolist(), strict=True)
            }
        out[str(layer)] = groups
    return out


def _layers_block(runs: dict, index: TokenIndex, cfg: InspectConfig) -> dict[str, Any]:
    """``{layer: {routing: layer_summary}, "nmi_shuffled": ...}`` for every Focus layer."""
    out: dict[str, Any] = {}
    for layer in runs["trained"]:
        entry = {
            name: layer_summary(per_layer[layer], index.categories, index.continuation)
            for name, per_layer in runs.items()
        }
        entry["nmi_shuffled"] = shuffled_nmi(runs["trained"][layer], index.categories,
                                             len(CATEGORIES), cfg.shuffles, cfg.seed + layer)  # fmt: skip
        out[str(layer)] = entry
    return out


def _summary(layers: dict[str, Any]) -> dict[str, Any]:
    """Mean NMI (and dominance) over layers of every routing, and the chance level."""
    out: dict[str, Any] = {}
    names = [k for k in next(iter(layers.values())) if k != "nmi_shuffled"]
    for name in names:
        out[f"nmi_{name}"] = round(sum(v[name]["nmi"] for v in layers.values()) / len(layers), 5)
        out[f"category_explained_{name}"] = round(
            sum(v[name]["category_explained"] for v in layers.values()) / len(layers), 5
        )
        out[f"dominance_{name}"] = round(
            sum(v[name]["dominance"] for v in layers.values()) / len(layers), 5
        )
    chance = [v["nmi_shuffled"]["mean"] for v in layers.values() if v["nmi_shuffled"]]
    out["nmi_shuffled"] = round(sum(chance) / len(chance), 5) if chance else None
    best = max(layers, key=lambda k: layers[k]["trained"]["nmi"])
    out["best_layer"] = {"layer": int(best), "nmi": layers[best]["trained"]["nmi"]}
    return out


def inspect_groups(config: InspectConfig | None = None, /, **settings: Any) -> dict[str, Any]:
    """Inspect the groups of a Focus adapter on one split of a corpus (module docstring).

    Args:
        config: an :class:`InspectConfig`; or its fields as keyword arguments, which also
            override the fields of ``config``.

    Returns:
        the result (the content of ``inspect.json``): ``config``, ``tokens``, ``windows``,
        ``categories`` (names and token counts), ``focus`` (the adapter's settings),
        ``focus_layers``, ``dense_layers`` (the Focus layers that run dense attention: no
        groups, not inspected), ``layers`` (every routed Focus layer: per routing
        ``shares``, ``dominance``, ``nmi``, ``composition`` ``[K][C]`` and
        ``continuation_share``; ``nmi_shuffled``),
        ``groups`` (the detailed layers: tokens, snippets, category shares and lifts per
        group), ``summary``, ``versions``, ``environment``, ``seconds``. With ``out`` set,
        ``inspect.json``, ``inspect.md`` and the plots are written there (atomically).

    Raises:
        ValueError: bad settings, a missing adapter argument, ``top_k`` above K, layers that
            are not Focus layers or run dense attention (the default ``layers`` takes the
            routed ones), an adapter whose every Focus layer runs dense attention, an
            ``out`` that is a file, too little text.
        FileNotFoundError: the adapter directory holds no Focus adapter, or is a file.
    """
    cfg = dataclasses.replace(config, **settings) if config is not None else InspectConfig(**settings)  # fmt: skip
    t0 = time.monotonic()
    saved = _saved_config(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    base, tokenizer, blocks, bos = _load(cfg)
    passes = 3 if cfg.baseline else 1
    with tqdm(total=blocks.shape[0] * passes, disable=not cfg.progress, desc="inspect",
              dynamic_ncols=True) as bar:  # fmt: skip
        runs, focus_layers = _route_all(base, saved, cfg, blocks, bar)
    dense = [i for i in focus_layers if i not in runs["trained"]]  # they record no routing
    detail = check_layers(cfg.layers, focus_layers, tuple(dense))
    index = TokenIndex(tokenizer, blocks.flatten())
    layers = _layers_block(runs, index, cfg)
    result = {
        "config": {
            **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "progress"},
            "prepend_bos": bos,
            "detail_layers": detail,
        },  # fmt: skip
        "tokens": int(blocks.numel()),
        "windows": int(blocks.shape[0]),
        "routings": list(runs),
        "categories": {
            "names": list(CATEGORIES),
            "counts": _category_rates(index),
            "scheme": "lexical (focus_attention.evaluation.categories)",
        },  # fmt: skip
        "focus": saved.to_dict(),
        "focus_layers": focus_layers,
        "dense_layers": dense,
        "summary": _summary(layers),
        "layers": layers,
        "groups": _groups_block(index, runs["trained"], detail, cfg),
        "versions": library_versions(),
        "environment": environment(),
        "seconds": round(time.monotonic() - t0, 1),
    }
    if cfg.out is not None:
        write_outputs(result, cfg.out)
    return result


def write_outputs(result: dict[str, Any], out: str | Path) -> list[Path]:
    """Write ``inspect.json``, ``inspect.md`` and the plots of ``result`` into the directory
    ``out`` (created), each file atomically; returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / JSON_NAME, result)
    atomic_write_text(out / MARKDOWN_NAME, markdown_summary(result) + "\n")
    return [out / JSON_NAME, out / MARKDOWN_NAME, *write_group_plots(result, out)]
