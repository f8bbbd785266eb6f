"""The study's combined table and plot: the results of every (mode, length) that has run
(``results/dense-*.json``, ``results/top1-*.json``, ``results/top2-*.json``; their samples
are checked to be the same) as one result, ``results/ruler.json``, with its table ``results/ruler.md`` and
plot ``results/ruler.png``. Run by the study's ``summary`` step; reads ``results/`` only."""

from __future__ import annotations

from pathlib import Path

from focus_attention.bench.ruler import combine_results, plot_ruler, ruler_notes, ruler_table
from focus_attention.utils.io import atomic_write_text, read_json_file, write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results"


def _length(path: Path) -> int:
    return int(path.stem.split("-")[1])


def main() -> None:
    paths = [p for mode in ("dense", "top1", "top2") for p in sorted(RESULTS.glob(f"{mode}-*.json"), key=_length)]  # fmt: skip
    if not paths:
        raise SystemExit(f"no results in {RESULTS}: run the study's bench steps first")
    combined = combine_results([read_json_file(p, "a focus bench ruler result") for p in paths])
    write_json_atomic(RESULTS / "ruler.json", combined)
    text = ruler_table(combined) + "\n\n" + "\n".join(ruler_notes(combined)) + "\n"
    atomic_write_text(RESULTS / "ruler.md", text)
    plot_ruler(combined, str(RESULTS / "ruler.png"))
    print(text)


if __name__ == "__main__":
    main()
