"""The human-readable output of ``focus inspect`` (:mod:`.groups`): a markdown summary and
two PNG figures (matplotlib, Agg backend), all made from the result dict alone, so a
result read back from ``inspect.json`` gives the same files."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..utils.plots import save_png

__all__ = ["COMPOSITION_PNG", "SHARES_PNG", "markdown_summary", "write_group_plots"]

#: file names of the figures
COMPOSITION_PNG, SHARES_PNG = "composition.png", "shares.png"
#: routings in the order tables and plots show them, with their labels
ROUTING_LABELS = {
    "trained": "trained",
    "untrained": "untrained",
    "untrained_calibrated": "untrained, bias calibrated",
}
#: a category is named among a group's salient ones when it holds at least this share of it
SALIENT_SHARE = 0.05


def _code(text: str) -> str:
    """A token in a markdown table cell: a code span, pipes escaped, leading space as ␣."""
    shown = text.replace("\n", "⏎").replace("\t", "⇥").replace("`", "ˋ")
    if shown.startswith(" "):
        shown = "␣" + shown[1:]
    return "`" + shown.replace("|", "\\|") + "`"


def _salient(group: dict[str, Any], n: int = 3) -> str:
    """The group's categories with the highest lift among those holding >= SALIENT_SHARE."""
    cats = [c for c, s in group["categories"].items() if s >= SALIENT_SHARE]
    cats = sorted(cats, key=lambda c: -group["lift"][c])[:n]
    return ", ".join(f"{c} {100 * group['categories'][c]:.0f}% (x{group['lift'][c]:.1f})" for c in cats)  # fmt: skip


def _nmi_table(r: dict[str, Any]) -> list[str]:
    names = [n for n in ROUTING_LABELS if n in r["routings"]]
    head = ["layer", *(f"NMI {ROUTING_LABELS[n]}" for n in names), "NMI shuffled (chance)",
            *(f"I/H(C) {ROUTING_LABELS[n]}" for n in names),
            *(f"dominance {ROUTING_LABELS[n]}" for n in names)]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]

    def chance(v: dict | None) -> str:
        return "-" if not v else f"{v['mean']:.4f} ± {v['std']:.4f}"

    s = r["summary"]
    mean_chance = "-" if s["nmi_shuffled"] is None else f"{s['nmi_shuffled']:.4f}"
    lines.append("| **mean** | " + " | ".join(
        [*(f"**{s[f'nmi_{n}']:.4f}**" for n in names), mean_chance,
         *(f"{s[f'category_explained_{n}']:.4f}" for n in names),
         *(f"{s[f'dominance_{n}']:.3f}" for n in names)]) + " |")  # fmt: skip
    for layer, v in r["layers"].items():
        cells = [*(f"{v[n]['nmi']:.4f}" for n in names), chance(v["nmi_shuffled"]),
                 *(f"{v[n]['category_explained']:.4f}" for n in names),
                 *(f"{v[n]['dominance']:.3f}" for n in names)]  # fmt: skip
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return lines


def _layer_section(layer: str, groups: list[dict[str, Any]], nmi: float) -> list[str]:
    lines = [
        f"### Layer {layer} (NMI {nmi:.4f})",
        "",
        "| group | share | salient categories: share of the group (lift) | most frequent "
        "tokens | most typical tokens (P(group \\| token)) |",
        "|---:|---:|---|---|---|",
    ]
    for g in groups:
        freq = " ".join(_code(t["token"]) for t in g["frequent"])
        typ = " ".join(f"{_code(t['token'])} {t['p_group']:.2f}" for t in g["typical"])
        lines.append(f"| {g['group']} | {100 * g['share']:.1f}% | {_salient(g)} | {freq} | {typ} |")
    lines.append("")
    for g in groups:
        lines += [f"- group {g['group']}: {_code(s)}" for s in g["snippets"]]
    return lines + [""]


def markdown_summary(result: dict[str, Any]) -> str:
    """The inspection as markdown: what was inspected, the NMI table (every Focus layer,
    every routing, the chance level), the categories' base rates and one section per
    detailed layer (groups, their salient categories, tokens and snippets)."""
    r, cfg, focus = result, result["config"], result["focus"]
    total = r["tokens"]
    lines = [
        f"# Focus groups: {cfg['model']} + adapter `{cfg['adapter']}` on "
        f"{cfg['corpus']}/{cfg['split']}",
        "",
        f"{total:,d} tokens in {r['windows']} windows of {cfg['seq_len']}; top-{cfg['top_k']} "
        f"{focus['inference_routing']} routing (a token in k groups counts 1/k in each); "
        f"K={focus['num_groups']}, window={focus['window']}, sink_tokens={focus['sink_tokens']}. "
        "Categories: lexical word classes (the closed classes of the Universal Dependencies "
        "tagset from fixed word lists, punctuation, numbers, line breaks, capitalised words, "
        "other), not a tagger; a token continuing a word has the word's category.",
        "",
        "## How far the groups are from random",
        "",
        "Normalised mutual information between group and word category (0: independent, "
        "1: the groups are the categories); chance: the trained groups shuffled over the "
        "tokens; I/H(C): the share of the category entropy that knowing the group removes "
        "(unlike NMI it does not rise when groups get less balanced); dominance: share of the "
        "largest group.",
        "",
        *_nmi_table(r),
        "",
        "## Categories in the text",
        "",
        "| category | tokens | share |",
        "|---|---:|---:|",
    ]
    for c, n in r["categories"]["counts"].items():
        if n:
            lines.append(f"| {c} | {n:,d} | {100 * n / total:.1f}% |")
    lines += ["", "## Groups of the trained adapter", ""]
    for layer, groups in r["groups"].items():
        lines += _layer_section(layer, groups, r["layers"][layer]["trained"]["nmi"])
    return "\n".join(lines).rstrip()


def _log2_lift(result: dict[str, Any], layer: str, cats: list[str]) -> list[list[float]]:
    """``[K][len(cats)]`` log2 lift of each category in each group of ``layer``, clipped to
    [0, 3]: only over-representation shows (0 = at or below the category's rate in the
    text, an absent category included)."""
    rows = []
    for g in result["groups"][layer]:
        rows.append([min(3.0, math.log2(g["lift"][c])) if g["lift"][c] > 1 else 0.0
                     for c in cats])  # fmt: skip
    return rows


def _plot_composition(plt: Any, result: dict[str, Any], path: Path) -> Path | None:
    """Grid of group x category heatmaps (log2 lift, over-representation), one per
    detailed layer; the y labels give each group's share of the tokens."""
    layers = list(result["groups"])
    if not layers:
        return None
    counts = result["categories"]["counts"]
    cats = [c for c in result["categories"]["names"] if counts.get(c, 0) > 0]
    cols = min(3, len(layers))
    rows = math.ceil(len(layers) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols + 1.0, 3.0 * rows + 0.8),
                             squeeze=False, constrained_layout=True)  # fmt: skip
    image = None
    for ax, layer in zip(axes.flat, layers, strict=False):
        image = ax.imshow(_log2_lift(result, layer, cats), cmap="Reds", vmin=0, vmax=3,
                          aspect="auto", interpolation="nearest")  # fmt: skip
        nmi = result["layers"][layer]["trained"]["nmi"]
        ax.set_title(f"layer {layer} (NMI {nmi:.3f})", fontsize=9)
        groups = result["groups"][layer]
        ax.set_yticks(range(len(groups)),
                      [f"g{g['group']} {100 * g['share']:.0f}%" for g in groups], fontsize=7)  # fmt: skip
        ax.set_xticks(range(len(cats)), cats, rotation=90, fontsize=7)
    for ax in axes.flat[len(layers) :]:
        ax.set_visible(False)
    fig.colorbar(image, ax=axes, shrink=0.7,
                 label="log2 lift: category share in the group / in the text (0: not above)")  # fmt: skip
    fig.suptitle("What the trained groups over-represent, by word category", fontsize=11)
    return save_png(fig, path, dpi=90)


def _plot_shares(plt: Any, result: dict[str, Any], path: Path) -> Path:
    """Token shares per group over layers (stacked) and NMI per layer of every routing."""
    layers = list(result["layers"])
    xs = [int(v) for v in layers]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
    shares = [result["layers"][k]["trained"]["shares"] for k in layers]
    bottom = [0.0] * len(layers)
    for g in range(len(shares[0])):
        ys = [s[g] for s in shares]
        ax1.bar(xs, ys, bottom=bottom, width=0.85, label=f"g{g}")
        bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    ax1.axhline(0, color="k", lw=0.5)
    ax1.set_xlabel("layer")
    ax1.set_ylabel("share of tokens")
    ax1.set_title(f"token share per group (trained, top-{result['config']['top_k']})")
    ax1.legend(fontsize=7, ncol=min(8, len(shares[0])), loc="upper center",
               bbox_to_anchor=(0.5, -0.15))  # fmt: skip
    for name in result["routings"]:
        ax2.plot(xs, [result["layers"][k][name]["nmi"] for k in layers], "o-", ms=3,
                 label=ROUTING_LABELS.get(name, name))  # fmt: skip
    chance = [result["layers"][k]["nmi_shuffled"] for k in layers]
    if all(chance):
        mean = [c["mean"] for c in chance]
        ax2.plot(xs, mean, "k--", lw=1, label="shuffled (chance)")
    ax2.set_xlabel("layer")
    ax2.set_ylabel("NMI(group; word category)")
    ax2.set_ylim(bottom=0)
    ax2.set_title("how far the groups are from random")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, path, dpi=90)


def write_group_plots(result: dict[str, Any], out: str | Path) -> list[Path]:
    """Write ``composition.png`` (group x category heatmaps of the detailed layers, log2
    lift) and ``shares.png`` (group shares over layers, NMI per layer) into the existing
    directory ``out``, atomically (matplotlib, Agg backend); returns the paths written."""
    import matplotlib  # heavy, used only to draw: loaded when a plot is written

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    out = Path(out)
    paths = [_plot_shares(plt, result, out / SHARES_PNG)]
    comp = _plot_composition(plt, result, out / COMPOSITION_PNG)
    return paths + ([comp] if comp is not None else [])
