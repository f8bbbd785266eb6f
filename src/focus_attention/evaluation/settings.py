"""The settings of the evaluation commands, composed from the shared groups of
:mod:`focus_attention.settings`: :class:`EvalConfig` (``focus eval``, docs/method.md §9),
:class:`CalibrateConfig` (``focus calibrate``, §4 and §9 "Long-context settings"),
:class:`InspectConfig` (``focus inspect``, §9 "Group inspection") and
:class:`RetrievalLayersConfig` (the retrieval ranking of ``focus bench retrieval-layers`` and
of ``focus calibrate --head-budget``, §9). Imports neither torch nor transformers."""

from __future__ import annotations

import argparse
from dataclasses import field
from typing import Any

from ..settings import (
    NEEDLE_MIN_TOKENS,
    AdapterOverrides,
    BlockSettings,
    BosSettings,
    LengthSettings,
    ModelSettings,
    OutputSettings,
    ResultFile,
    RunSettings,
    SeedSettings,
    TextSettings,
    TopKValues,
    check_grid,
    settings_class,
)
from ..utils.checks import bad, check_int, comma_ints

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_SEQ_LEN",
    "HAYSTACKS",
    "POSITION_BUCKETS",
    "CalibrateConfig",
    "EvalConfig",
    "InspectConfig",
    "RetrievalLayersConfig",
    "check_prompts",
    "parse_max_tokens",
]

#: evaluation window length (tokens)
DEFAULT_SEQ_LEN = 1024
#: the haystacks of the needle prompts (:mod:`focus_attention.evaluation.needles`): a short
#: filler paragraph repeated (the pass-key test), or held-out prose of a corpus
HAYSTACKS = ("passkey", "book")
#: default cap on evaluated tokens: four 1024-token windows keep base + soft + top-k 1..8 of
#: smollm2-135m within a few minutes on a 2-core CPU; ``None`` = the whole split
DEFAULT_MAX_TOKENS = 4096
#: default starts of the position buckets of the perplexity-by-position table, in tokens
#: from the start of the window
POSITION_BUCKETS = (0, 128, 512, 2048, 8192)


def parse_max_tokens(text: str) -> int | None:
    """The ``--max-tokens`` flag: a count ``>= 1``, or ``all`` (or ``none``) for no cap.

    Raises:
        argparse.ArgumentTypeError: anything else (0 and negative counts included).
    """
    if text.strip().lower() in ("all", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a number of tokens (an int >= 1) or 'all' for the whole split, got {text!r}"
        )
    return value


@settings_class(
    defaults={"adapter": "runs/austen"}, renamed={"top_k_values": "top_k"}, several=("top_k",)
)
class EvalConfig(ResultFile, RunSettings, BosSettings, AdapterOverrides, BlockSettings, TextSettings, ModelSettings):  # fmt: skip
    """Settings of one evaluation; every field is a ``focus eval`` flag (``seq_len`` ->
    ``--seq-len``) and a key of the ``[eval]`` table of ``--config``.

    ``top_k`` lists the top_k values evaluated (default None: every one in ``1..K``),
    stored sorted and distinct; ``window`` and the other :class:`AdapterOverrides` take
    one value each. ``top_k_values`` is the deprecated name of ``top_k``.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    max_tokens: int | None = field(
        default=DEFAULT_MAX_TOKENS,
        metadata={"help": "cap on evaluated tokens: an int >= 1, or 'all' for the whole split",
                  "type": parse_max_tokens},
    )  # fmt: skip
    calibrate_blocks: int = field(
        default=0,
        metadata={"help": "collect the causal routing bias afresh from this many "
                  "validation-split blocks of seq_len tokens before scoring (0: the bias "
                  "as trained)"},
    )  # fmt: skip
    position_buckets: tuple[int, ...] = field(
        default=POSITION_BUCKETS,
        metadata={"help": "starts of the position buckets of the perplexity-by-position "
                  "table", "type": comma_ints, "metavar": "P0,P1,..."},
    )  # fmt: skip
    coverage_queries: int = field(
        default=0,
        metadata={"help": "also report the share of the dense model's attention beyond the "
                  "window that each top_k keeps, on this many evenly spaced queries per "
                  "window (0: skip; costs one more dense forward per window)"},
    )  # fmt: skip
    soft: bool = field(
        default=True,
        metadata={"help": "also score Focus with soft routing, the training-time model (at "
                  "long context it costs about as much as the base model and two top-k "
                  "values together)"},
    )  # fmt: skip
    markdown: str | None = field(
        default=None, metadata={"help": "also write the markdown table here"}
    )

    def __post_init__(self) -> None:
        self.check_shared()
        owner = "EvalConfig"
        if self.adapter is None:
            raise bad(owner, "adapter", None, "an adapter or run directory")
        check_int(owner, "max_tokens", self.max_tokens, 1, optional=True)
        check_int(owner, "calibrate_blocks", self.calibrate_blocks, 0)
        check_int(owner, "coverage_queries", self.coverage_queries, 0)
        if self.top_k is not None:
            self.top_k = tuple(sorted(set(self.top_k)))
        starts = tuple(int(p) for p in self.position_buckets)
        if not starts or any(s < 0 for s in starts) or list(starts) != sorted(set(starts)):
            raise ValueError(
                f"position buckets: received {starts!r}, expected increasing starts >= 0 "
                "(for example 0,128,512,2048)"
            )
        self.position_buckets = starts


@settings_class(defaults={"split": "validation", "seq_len": 4096})
class CalibrateConfig(OutputSettings, RunSettings, BosSettings, AdapterOverrides, BlockSettings, TextSettings, ModelSettings):  # fmt: skip
    """Settings of ``focus calibrate`` (each field a flag and a key of the ``[calibrate]``
    table of ``--config``): the calibration text (``split`` defaults to validation, keep the
    test split for evaluation; ``seq_len`` is the length to serve) and the new inference
    settings (:class:`AdapterOverrides`, one value each) written into the adapter.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    blocks: int = field(
        default=4,
        metadata={"help": "blocks the bias is collected from (0: keep the bias as trained "
                  "and change only the settings)"},
    )  # fmt: skip
    overwrite: bool = field(default=False, metadata={"help": "replace an adapter already in --out"})
    head_budget: float | None = field(
        default=None,
        metadata={"help": "share of the Focus layers' key-value heads kept dense, in (0, 1]: "
                  "the top ceil(share x heads) pairs of the head ranking become dense_heads "
                  "(a dense layer's heads count as dense)"},
    )  # fmt: skip
    head_ranking: str | None = field(
        default=None,
        metadata={"help": "JSON ranking of (layer, key-value head) pairs for --head-budget "
                  "(head_ranking of focus bench retrieval-layers --json or of focus train "
                  "--method head-gates); default: rank them here by the dense model's "
                  "attention on pass-key prompts of --split"},
    )  # fmt: skip
    ranking_length: int = field(
        default=2048,
        metadata={"help": "tokens of the pass-key prompts the heads are ranked on (--head-budget "
                  f"without --head-ranking; at least {NEEDLE_MIN_TOKENS})"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        self.check_shared()
        owner = "CalibrateConfig"
        for name in ("adapter", "out"):
            if not getattr(self, name):
                raise bad(owner, name, getattr(self, name), "a directory")
        self.out = str(self.out)
        check_int(owner, "blocks", self.blocks, 0)
        check_int(owner, "ranking_length", self.ranking_length, NEEDLE_MIN_TOKENS)
        self._check_head_budget(owner)

    def _check_head_budget(self, owner: str) -> None:
        budget = self.head_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not 0 < budget <= 1):  # fmt: skip
            raise bad(owner, "head_budget", budget, "a share of the key-value heads in (0, 1]")
        if self.head_ranking is not None and budget is None:
            raise bad(owner, "head_ranking", self.head_ranking, "--head-budget with it")
        if budget is not None and self.dense_heads is not None:
            raise bad(owner, "dense_heads", self.dense_heads,
                      "no --dense-heads with --head-budget (the budget chooses them)")  # fmt: skip


@settings_class(defaults={"top_k": 1}, renamed={"tokens": "max_tokens"})
class InspectConfig(OutputSettings, RunSettings, SeedSettings, TopKValues, BlockSettings, TextSettings, ModelSettings):  # fmt: skip
    """Settings of one inspection (each field with help text a ``focus inspect`` flag and a
    key of the ``[inspect]`` table of ``--config``). ``top_k`` is one value (default 1:
    each token's first group); ``seed`` seeds the permutations; ``out`` is required on the
    command line, and None in Python writes no files; ``tokens`` is the deprecated name of
    ``max_tokens``.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    max_tokens: int = field(default=4096, metadata={"help": "tokens inspected (at most)"})
    layers: tuple[int, ...] | None = field(
        default=None,
        metadata={"help": "Focus layers whose groups are detailed (default: every one)"},
    )
    top_tokens: int = field(default=8, metadata={"help": "tokens listed per group and list"})
    min_count: int = field(
        default=5, metadata={"help": "occurrences a token needs to be listed as typical"}
    )
    snippets: int = field(default=3, metadata={"help": "context snippets per group"})
    context: int = field(default=8, metadata={"help": "tokens of context on each side"})
    baseline: bool = field(
        default=True, metadata={"help": "also route with the untrained initialisation"}
    )
    shuffles: int = field(
        default=20, metadata={"help": "permutations for the chance-level NMI (0: none)"}
    )

    def __post_init__(self) -> None:
        self.check_shared()
        owner = "InspectConfig"
        check_int(owner, "max_tokens", self.max_tokens, 1)
        for name in ("top_tokens", "min_count", "snippets", "context", "shuffles"):
            check_int(owner, name, getattr(self, name), 0)
        if self.max_tokens < self.seq_len:
            raise bad(owner, "max_tokens", self.max_tokens, f"at least seq_len={self.seq_len}")
        if self.layers is not None:
            layers = tuple(self.layers)
            if not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                 for i in layers):  # fmt: skip
                raise bad(owner, "layers", self.layers,
                          "None or a non-empty list of layer indices (ints >= 0)")  # fmt: skip
            self.layers = tuple(sorted(set(layers)))


def check_prompts(owner: str, config: Any) -> None:
    """The prompt settings shared by the needle configs (:class:`RetrievalLayersConfig`,
    :class:`focus_attention.bench.settings.NeedleBenchConfig`): ``lengths`` (ints >=
    :data:`~focus_attention.settings.NEEDLE_MIN_TOKENS` tokens),
    ``haystacks`` (some of :data:`HAYSTACKS`), ``depths`` (fractions in [0, 1]) and
    ``trials`` (an int >= 1).

    Raises:
        ValueError: the first bad one, named with ``owner``.
    """
    for n in config.lengths:
        check_int(owner, "lengths", n, NEEDLE_MIN_TOKENS)
    config.haystacks, config.depths = tuple(config.haystacks), tuple(config.depths)
    if not config.haystacks or any(h not in HAYSTACKS for h in config.haystacks):
        raise bad(owner, "haystacks", config.haystacks, f"some of {HAYSTACKS}")
    if not config.depths or any(not 0.0 <= float(d) <= 1.0 for d in config.depths):
        raise bad(owner, "depths", config.depths, "fractions in [0, 1]")
    check_int(owner, "trials", config.trials, 1)


@settings_class(
    defaults={"adapter": "runs/austen", "split": "validation", "lengths": (2048,), "seed": 1}
)
class RetrievalLayersConfig(ResultFile, RunSettings, SeedSettings, LengthSettings, TextSettings, ModelSettings):  # fmt: skip
    """Settings of the retrieval-layer ranking (``focus bench retrieval-layers``): needle
    prompts of the validation split (keep the test split for the benchmark), scored on the
    dense model.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    haystacks: tuple[str, ...] = field(
        default=HAYSTACKS, metadata={"help": f"haystacks, of {HAYSTACKS}"}
    )
    depths: tuple[float, ...] = field(
        default=(0.25, 0.5, 0.75), metadata={"help": "needle depths, 0 (start) to 1 (end)"}
    )
    trials: int = field(default=2, metadata={"help": "prompts per (haystack, length, depth)"})
    count: int = field(default=5, metadata={"help": "layers to suggest as dense_layers"})
    heads: int = field(
        default=8, metadata={"help": "(layer, key-value head) pairs to suggest as dense_heads"}
    )

    def __post_init__(self) -> None:
        self.check_shared()
        check_grid("RetrievalLayersConfig", self)
        check_int("RetrievalLayersConfig", "count", self.count, 1)
        check_int("RetrievalLayersConfig", "heads", self.heads, 1)
        check_prompts("RetrievalLayersConfig", self)
