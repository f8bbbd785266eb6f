"""The settings of ``focus bench`` (each field with help text a flag of its sub-command and a
key of its ``[bench.<name>]`` table of ``--config``), composed from the shared groups of
:mod:`focus_attention.settings`, with the benchmarks' default grids. Imports neither torch
nor transformers."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..assets.benchmarks import BENCHMARKS
from ..assets.model_registry import DEFAULT_MODEL
from ..assets.presets import PRESETS, RANDOM_PREFIX, is_random_model, preset_named
from ..evaluation.settings import HAYSTACKS, RetrievalLayersConfig, check_prompts
from ..settings import (
    AdapterOverrides,
    AttentionBackendSetting,
    BatchSettings,
    DeviceSettings,
    FreshRouters,
    GenerationLength,
    LengthSettings,
    ModelSettings,
    OutputSettings,
    PlotFile,
    QueryTopKValue,
    ResultFile,
    RunSettings,
    SeedSettings,
    Settings,
    TextSettings,
    ThreadSettings,
    TopKValues,
    WindowValues,
    adapter_groups,
    check_grid,
    settings_class,
)
from ..utils.checks import bad, check_int, check_number
from .ruler_tasks import (
    RULER_ANSWER_RESERVE,
    RULER_DEFAULT_TASKS,
    RULER_MIN_TOKENS,
    RULER_TASKS,
    check_ruler_tasks,
)

__all__ = [
    "AttentionShape",
    "BENCH_MODEL_HELP",
    "KV_CACHES",
    "SHAPE_FIELDS",
    "DECODE_CONTEXTS",
    "DENSE_KERNELS",
    "QUERY_DRAWS",
    "DTYPE_NAMES",
    "ComputeDtype",
    "FRESH_WINDOW",
    "HAYSTACKS",
    "KERNEL_LENGTHS",
    "LEVELS",
    "MODEL_LENGTHS",
    "NEEDLE_DEPTHS",
    "NEEDLE_DIAGNOSTICS",
    "NEEDLE_LENGTHS",
    "DecodeBatch",
    "DecodeBenchConfig",
    "DenseKernelSetting",
    "DenseReference",
    "ExampleLimit",
    "InstructionsBenchConfig",
    "KernelBenchConfig",
    "MergeResultsConfig",
    "PlotResultsConfig",
    "ModelBenchConfig",
    "NeedleBenchConfig",
    "RetrievalLayersConfig",
    "RULER_LENGTHS",
    "RulerBenchConfig",
    "SERVE_CONCURRENCY",
    "SERVE_LENGTHS",
    "ServeBenchConfig",
    "TasksBenchConfig",
    "adapter_groups",
    "check_grid",
    "check_bench_model",
    "command_help",
    "parse_batch_size",
]

#: sequence lengths of the README's kernel table (tokens)
KERNEL_LENGTHS = (1024, 4096, 16384, 32768)
#: torch dtype names a benchmark runs in (the kernel benchmark's inputs, the served weights)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: dense kernels: ``auto`` lets SDPA choose; the others force one SDPA backend
DENSE_KERNELS = ("auto", "flash", "cudnn", "efficient", "math")
#: prefill lengths of the README's end-to-end table (tokens)
MODEL_LENGTHS = (4096, 16384)
#: local window of fresh routers and of the op level when no window is asked for (tokens)
FRESH_WINDOW = 128
#: cached tokens of the default decoding run
DECODE_CONTEXTS = (4096, 16384, 32768)
#: the levels of the decoding benchmark
LEVELS = ("op", "model")
#: prompt lengths (tokens) and needle depths (fraction of the haystack before the needle)
NEEDLE_LENGTHS = (1024, 2048, 4096, 8192)
NEEDLE_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: diagnostic modes of the needle benchmark, each at top-k's budget of distant keys (k the
#: command's ``diagnostic_top_k``; module docstring of
#: :mod:`focus_attention.bench.needle_diagnostics`)
NEEDLE_DIAGNOSTICS = ("oracle", "kmeans", "kmeans-fine")
#: ``focus bench kernel --query-draw``: how queries draw their own ``query_top_k`` groups
#: (``balanced``: consecutive groups from a balanced start, K distinct sets; ``random``: any
#: ``query_top_k`` of K uniformly, per token and head, as many sets as learned routing makes)
QUERY_DRAWS = ("balanced", "random")
#: the KV caches of the decoding benchmark's model level: transformers' ``DynamicCache``
#: (and Focus's own dynamic cache), or transformers' ``StaticCache`` (what a CUDA graph
#: captures)
KV_CACHES = ("dynamic", "static")
#: the help of ``--model`` in the benchmarks that also build models with random weights
BENCH_MODEL_HELP = (
    "base model: registered name, model directory or hub id, or "
    f"{RANDOM_PREFIX}PRESET (random weights in a preset's shape, built on the device, no "
    f"download; token ids drawn at random; presets: {', '.join(PRESETS)})"
)


def command_help(**texts: str) -> Callable[[type], type]:
    """Class decorator, written above :func:`~focus_attention.settings.settings_class`:
    this command's own help text of inherited fields it gives a default of its own (listed
    in its ``defaults``), where the group's text does not fit it (it speaks of an adapter
    the command does not take, or of another command's use). ``COMMAND_HELP`` of the class
    records the texts.

    Raises:
        TypeError: a field without a command default (its ``Field`` is the group's).
    """

    def build(cls: type) -> type:
        for name, text in texts.items():
            if name not in cls.COMMAND_DEFAULTS:
                raise TypeError(f"{cls.__name__}.{name}: command help needs a command default")
            found = cls.__dataclass_fields__[name]
            found.metadata = types.MappingProxyType({**found.metadata, "help": text})
        cls.COMMAND_HELP = dict(texts)
        return cls

    return build


def check_bench_model(owner: str, config: Any) -> None:
    """A ``random:PRESET`` model names a preset and takes fresh routers (a trained adapter
    belongs to the real model it was trained on).

    Raises:
        ValueError: an unknown preset (the message lists them), or an adapter with one.
    """
    if not is_random_model(config.model):
        return
    try:
        preset_named(config.model)
    except ValueError:
        known = ", ".join(RANDOM_PREFIX + name for name in PRESETS)
        raise bad(owner, "model", config.model, f"a model, or one of the presets {known}") from None  # fmt: skip
    if getattr(config, "adapter", None) is not None:
        raise bad(owner, "adapter", config.adapter, f"None with the random-weight model "
                  f"{config.model} (fresh routers: --num-groups, --window, ...)")  # fmt: skip


@dataclass
class DenseKernelSetting(Settings):
    """The SDPA kernel of a benchmark's dense attention calls."""

    dense_kernel: str = field(
        default="auto",
        metadata={"help": "the dense SDPA kernel (auto: SDPA's own choice; flash, cudnn, "
                  "efficient or math force one)", "choices": DENSE_KERNELS},
    )  # fmt: skip


@dataclass
class DecodeBatch(Settings):
    """The batch sizes of a decoding benchmark."""

    batch_size: tuple[int, ...] = field(
        default=(1,),
        metadata={"help": "requests decoding together, each with the same cached tokens "
                  "(each value run in turn)"},
    )  # fmt: skip


@dataclass
class ComputeDtype(Settings):
    """The dtype a benchmark computes in, on a cpu or cuda ``device`` (the group adds the
    checks of both)."""

    dtype: str = field(
        default="float32",
        metadata={"help": "dtype of the timed computation (the kernel's query, key and "
                  "value; the model's weights)", "choices": DTYPE_NAMES},
    )  # fmt: skip

    def check_compute(self, owner: str) -> None:
        """Check ``dtype`` and ``device`` (``cpu`` or ``cuda``; None: cuda when torch sees
        one).

        Raises:
            ValueError: a dtype outside :data:`DTYPE_NAMES`, another device, or cuda asked
                for where torch sees no CUDA device.
        """
        if self.dtype not in DTYPE_NAMES:
            raise bad(owner, "dtype", self.dtype, f"one of {DTYPE_NAMES}")
        device = getattr(self, "device", "cpu")
        kind = str(device).split(":", 1)[0]
        if device is not None and kind not in ("cpu", "cuda"):
            raise bad(owner, "device", device, "cpu or cuda")
        if kind == "cuda":
            import torch  # this module stays torch-free until cuda must be checked

            if not torch.cuda.is_available():
                raise ValueError(f"{owner}.device: cuda was asked for but torch sees no CUDA device")  # fmt: skip


#: the attention shape fields of :class:`AttentionShape`
SHAPE_FIELDS = ("num_heads", "num_key_value_heads", "head_dim")


@dataclass
class ExampleLimit(Settings):
    """How many examples of each task an lm-eval benchmark scores."""

    limit: int | None = field(
        default=None, metadata={"help": "score the first N examples of each task (default all)"}
    )


@dataclass
class DenseReference(Settings):
    """Whether a benchmark of Focus modes also runs the dense model."""

    dense: bool = field(default=True, metadata={"help": "also run the dense model (the reference)"})  # fmt: skip


@dataclass
class AttentionShape(Settings):
    """The attention shape of a benchmark's synthetic inputs (None: a command's own default,
    such as its model's shape)."""

    num_heads: int | None = field(default=None, metadata={"help": "query heads H"})
    num_key_value_heads: int | None = field(
        default=None, metadata={"help": "key/value heads H_kv (H a multiple of it)"}
    )
    head_dim: int | None = field(default=None, metadata={"help": "head_dim D"})

    def check_shape(self, owner: str) -> None:
        """Each field None or an int >= 1, and ``num_heads`` a multiple of
        ``num_key_value_heads`` when both are given.

        Raises:
            ValueError: naming the first bad field.
        """
        for name in SHAPE_FIELDS:
            check_int(owner, name, getattr(self, name), 1, optional=True)
        heads, kv = self.num_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise bad(owner, "num_key_value_heads", kv, f"a divisor of num_heads={heads}")

    def shape_over(self, shape: dict[str, int]) -> dict[str, int]:
        """``shape`` (``{"heads", "kv_heads", "head_dim"}``) with the fields given here over
        it."""
        given = zip(("heads", "kv_heads", "head_dim"), SHAPE_FIELDS, strict=True)
        return {**shape, **{k: getattr(self, f) for k, f in given if getattr(self, f) is not None}}  # fmt: skip


@command_help(
    top_k="groups each token joins in the random memberships (at most --num-groups)",
    query_top_k="groups each query joins, its own random draw (default: the keys' top_k "
    "groups, shared with them); the keys join top_k",
    window="local window in tokens, the query included",
    num_groups="K, the groups of the random memberships",
    attention_backend="backend of Focus's sparse attention (masked: every key under the "
    "mask, no host synchronisation)",
    device="torch device: cpu or cuda",
)
@settings_class(
    defaults={"top_k": (1, 2), "window": FRESH_WINDOW, "lengths": KERNEL_LENGTHS, "device": "cpu",
              "num_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
              "attention_backend": "auto", "num_groups": 8, "query_top_k": None},
    renamed={"backend": "attention_backend"},
    several=("top_k",),
)  # fmt: skip
class KernelBenchConfig(PlotFile, ResultFile, RunSettings, ComputeDtype, DeviceSettings, SeedSettings, LengthSettings, FreshRouters, WindowValues, TopKValues, QueryTopKValue, AttentionShape, AttentionBackendSetting, DenseKernelSetting):  # fmt: skip
    """Settings of the kernel benchmark (``focus bench kernel``). The default shape is
    SmolLM2-135M's attention: 9 query heads, 3 key/value heads, D = 64; ``top_k`` lists
    the values timed, ``window`` is the one local window; ``device`` is cpu or cuda;
    ``attention_backend`` is the op's ``backend`` (``backend`` is its deprecated name).

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    repeats: int = field(default=3, metadata={"help": "timed runs (median) after a warm-up"})
    memory: bool = field(
        default=True, metadata={"help": "measure peak memory (a fresh process per call)"}
    )
    gates: bool = field(
        default=True, metadata={"help": "also time the soft gates against eager at N=1024"}
    )
    per_head_groups: bool = field(
        default=False,
        metadata={"help": "memberships per key-value head, [1, N, H_kv, K] (each head its own "
                  "balanced draw: a routing per head), instead of one [1, N, K] shared by "
                  "every head"},
    )  # fmt: skip
    query_draw: str = field(
        default="balanced",
        metadata={
            "help": "how queries draw their own --query-top-k groups: balanced (consecutive "
            "groups from a balanced start: K distinct sets) or random (any query_top_k of K, "
            "uniformly per token and head: as many distinct sets as learned routing makes)",
            "choices": QUERY_DRAWS,
        },
    )

    def __post_init__(self) -> None:
        self.check_shared()
        owner = "KernelBenchConfig"
        if self.query_draw not in QUERY_DRAWS:
            raise bad(owner, "query_draw", self.query_draw, f"one of {QUERY_DRAWS}")
        if self.query_draw != "balanced" and self.query_top_k is None:
            raise bad(owner, "query_draw", self.query_draw, "'balanced' unless query_top_k is set")
        check_grid(owner, self)
        self.check_compute(owner)
        if self.dense_kernel not in DENSE_KERNELS:
            raise bad(owner, "dense_kernel", self.dense_kernel, f"one of {DENSE_KERNELS}")
        for name in (*SHAPE_FIELDS, "repeats"):
            check_int(owner, name, getattr(self, name), 1)
        self.check_shape(owner)
        if self.attention_backend is None:
            raise bad(owner, "attention_backend", None, "a backend name ('auto' for any)")


@command_help(
    model=BENCH_MODEL_HELP,
    device="torch device: cpu or cuda (default: cuda if available, else cpu)",
)
@settings_class(
    defaults={"top_k": (1, 2), "lengths": MODEL_LENGTHS, "model": DEFAULT_MODEL, "device": None},
    renamed={"windows": "window"},
    several=("top_k", "window"),
)
class ModelBenchConfig(PlotFile, ResultFile, RunSettings, ComputeDtype, DeviceSettings, SeedSettings, LengthSettings, FreshRouters, AdapterOverrides, TextSettings, ModelSettings):  # fmt: skip
    """Settings of the end-to-end benchmark (``focus bench model``): prefill of the first
    ``lengths`` tokens of the corpus split (of seeded random ids for a ``random:PRESET``
    model), stock sdpa against Focus at every ``top_k`` and ``window`` (default: the
    adapter's window, :data:`FRESH_WINDOW` for fresh routers), on ``device`` in ``dtype``.
    ``windows`` is the deprecated name of ``window``; ``seed`` seeds a random model's
    weights and token ids.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    floor: bool = field(
        default=True,
        metadata={"help": "also time the model without attention (the floor no attention "
                  "kernel can go below)"},
    )  # fmt: skip
    repeats: int = field(default=1, metadata={"help": "timed runs (median)"})
    warmup: int = field(
        default=0,
        metadata={"help": "untimed forwards of each row at its own length before the timed "
                  "ones (kernels compiled for that length, caches warmed)"},
    )  # fmt: skip
    warmup_tokens: int = field(default=512, metadata={"help": "tokens of the warm-up forward"})

    def __post_init__(self) -> None:
        self.check_shared()
        owner = "ModelBenchConfig"
        check_grid(owner, self)
        self.check_compute(owner)
        check_bench_model(owner, self)
        check_int(owner, "repeats", self.repeats, 1)
        check_int(owner, "warmup", self.warmup, 0)
        check_int(owner, "warmup_tokens", self.warmup_tokens, 1)


@command_help(
    num_heads="query heads H of the op level (default: the model's)",
    num_key_value_heads="key/value heads H_kv of the op level, H a multiple of it (default: "
    "the model's)",
    head_dim="head_dim D of the op level (default: the model's)",
    model=BENCH_MODEL_HELP,
    dense_kernel="the op level's dense SDPA kernel (auto: SDPA's own choice; flash, cudnn, "
    "efficient or math force one; the model level runs the model's own sdpa attention)",
)
@settings_class(
    defaults={"top_k": (1, 2), "num_heads": None, "num_key_value_heads": None, "head_dim": None,
              "model": DEFAULT_MODEL, "dense_kernel": "auto"},
    several=("top_k",),
)  # fmt: skip
class DecodeBenchConfig(PlotFile, ResultFile, RunSettings, ComputeDtype, DeviceSettings, SeedSettings, DecodeBatch, FreshRouters, AdapterOverrides, TextSettings, ModelSettings, AttentionShape, DenseKernelSetting):  # fmt: skip
    """Settings of the decoding benchmark (``focus bench decode``). ``window`` is one value:
    the local window of the op level and of fresh routers (default :data:`FRESH_WINDOW`),
    and over the adapter's when given; ``seed`` seeds the op level's inputs; ``device``
    (cpu or cuda, default cuda when torch sees one) and ``dtype`` are those of both levels'
    tensors and of the model's weights (the routers stay float32). The op level's shape is
    the model's, with ``num_heads``, ``num_key_value_heads`` and ``head_dim`` over it
    (another model's attention, without loading it: the op level alone with all three
    given loads no model). ``batch_size`` lists the batches run in turn: ``B`` requests
    with the same cached tokens decoding together. ``kv_cache`` picks the model level's
    caches (:data:`KV_CACHES`); ``cuda_graphs`` times CUDA-graph replays of each row's step
    (a CUDA device; at the model level the static cache).

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    contexts: tuple[int, ...] = field(default=DECODE_CONTEXTS, metadata={"help": "cached tokens"})
    levels: tuple[str, ...] = field(default=LEVELS, metadata={"help": "op and/or model"})
    steps: int = field(default=16, metadata={"help": "timed decoding steps (median)"})
    warmup: int = field(default=2, metadata={"help": "untimed steps before them"})
    kv_cache: str = field(
        default="dynamic",
        metadata={"help": "the model level's KV caches: dynamic (dense through transformers' "
                  "DynamicCache and a buffered one, Focus through its own) or static "
                  "(transformers' StaticCache for dense and Focus: what a CUDA graph captures)",
                  "choices": KV_CACHES},
    )  # fmt: skip
    cuda_graphs: bool = field(
        default=False,
        metadata={"help": "capture one decoding step of each row in a CUDA graph (after "
                  "warm-up steps on a side stream) and time its replays; a row whose step "
                  "reads back to the host stays eager, with the reason recorded (needs a "
                  "CUDA device, and --kv-cache static at the model level)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        self.check_shared()
        owner = "DecodeBenchConfig"
        check_grid(owner, self)
        self.check_compute(owner)
        check_int(owner, "steps", self.steps, 1)
        check_int(owner, "warmup", self.warmup, 0)
        self.contexts, self.levels = tuple(self.contexts), tuple(self.levels)
        if not self.contexts:
            raise bad(owner, "contexts", self.contexts, "one or more ints >= 1")
        for v in self.contexts:
            check_int(owner, "contexts", v, 1)
        unknown = [x for x in self.levels if x not in LEVELS]
        if unknown or not self.levels:
            raise bad(owner, "levels", self.levels, f"one or more of {LEVELS}")
        self.check_shape(owner)
        self.check_batch(owner)
        check_bench_model(owner, self)

    def check_batch(self, owner: str) -> None:
        """``batch_size`` (one or more ints >= 1), ``kv_cache`` and ``cuda_graphs`` (a CUDA
        device; the static cache when the model level runs).

        Raises:
            ValueError: naming the first bad field.
        """
        self.batch_size = tuple(self.batch_size)
        if not self.batch_size:
            raise bad(owner, "batch_size", self.batch_size, "one or more ints >= 1")
        for v in self.batch_size:
            check_int(owner, "batch_size", v, 1)
        if self.kv_cache not in KV_CACHES:
            raise bad(owner, "kv_cache", self.kv_cache, f"one of {KV_CACHES}")
        if not self.cuda_graphs:
            return
        if self.resolved_device.split(":", 1)[0] != "cuda":
            raise bad(owner, "cuda_graphs", True, f"a CUDA device (the run's device is "
                      f"{self.resolved_device}: CUDA graphs capture CUDA work only)")  # fmt: skip
        if "model" in self.levels and self.kv_cache != "static":
            raise bad(owner, "kv_cache", self.kv_cache, "static with cuda_graphs at the model "
                      "level (a dynamic cache changes shape every step: no graph replays it)")  # fmt: skip

    @property
    def resolved_device(self) -> str:
        """The device the run uses: ``device``, else cuda where torch sees one, else cpu."""
        if self.device is not None:
            return str(self.device)
        import torch  # this module stays torch-free until a device must be resolved

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def needs_model(self) -> bool:
        """Whether the run loads the model: a model level, or an op level whose shape is
        not given whole."""
        given = all(getattr(self, name) is not None for name in SHAPE_FIELDS)
        return "model" in self.levels or not given

    @property
    def op_groups(self) -> int:
        """K of the op level's random memberships: the adapter's, else ``num_groups``."""
        return adapter_groups(self.adapter) or self.num_groups

    @property
    def op_window(self) -> int:
        """The local window of the op level and of fresh routers, in tokens."""
        return FRESH_WINDOW if self.window is None else self.window


@settings_class(
    defaults={
        "adapter": "runs/austen",
        "top_k": (1, 2),
        "lengths": NEEDLE_LENGTHS,
        "max_new_tokens": 8,
    },
    several=("top_k",),
)
class NeedleBenchConfig(PlotFile, GenerationLength, ResultFile, RunSettings, SeedSettings, LengthSettings, AdapterOverrides, TextSettings, ModelSettings):  # fmt: skip
    """Settings of the retrieval benchmark (``focus bench needle``): the dense model and
    Focus at every ``top_k``, with the other :class:`AdapterOverrides` (one value each)
    over the adapter's; ``seed`` seeds the needles and book offsets.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    haystacks: tuple[str, ...] = field(
        default=HAYSTACKS, metadata={"help": f"haystacks, of {HAYSTACKS}"}
    )
    depths: tuple[float, ...] = field(
        default=NEEDLE_DEPTHS, metadata={"help": "needle depths, 0 (start) to 1 (end)"}
    )
    trials: int = field(default=2, metadata={"help": "prompts per (haystack, length, depth)"})
    dense: bool = field(default=True, metadata={"help": "also run the dense model (the reference)"})
    diagnostics: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "diagnostic modes beside dense and Focus, each keeping the adapter's "
            "window, sinks and dense layers and about top-1's share of a query's distant "
            "keys: oracle (its ceil(distant / K) best by q.k), kmeans (the keys' k-means "
            "group, of K, whose centroid its q scores best), kmeans-fine (its best 4 of 4K "
            "groups)",
            "choices": NEEDLE_DIAGNOSTICS,
        },
    )
    diagnostic_top_k: int = field(
        default=1,
        metadata={
            "help": "the diagnostic modes' budget in groups of K: each query keeps "
            "ceil(k * distant / K) distant keys (oracle), or its best k (kmeans) or 4k "
            "(kmeans-fine) groups; a mode at k > 1 is named oracle/top-k"
        },
    )

    def __post_init__(self) -> None:
        self.check_shared()
        check_grid("NeedleBenchConfig", self)
        check_prompts("NeedleBenchConfig", self)
        check_int("NeedleBenchConfig", "diagnostic_top_k", self.diagnostic_top_k, 1)
        self.diagnostics = tuple(dict.fromkeys(self.diagnostics))
        if any(d not in NEEDLE_DIAGNOSTICS for d in self.diagnostics):
            raise bad("NeedleBenchConfig", "diagnostics", self.diagnostics,
                      f"some of {NEEDLE_DIAGNOSTICS}")  # fmt: skip


def parse_batch_size(text: str) -> str:
    """``"auto"``, ``"auto:N"`` or a positive int, as text (lm-eval's batch sizes).

    Raises:
        ValueError: anything else.
    """
    if text == "auto" or (text.startswith("auto:") and text[5:].replace(".", "", 1).isdigit()):
        return text
    if text.isdigit() and int(text) >= 1:
        return text
    raise ValueError(f"TasksBenchConfig.batch_size: received {text!r}, expected an int >= 1 or 'auto'")  # fmt: skip


@settings_class()
class TasksBenchConfig(ExampleLimit, ResultFile, ThreadSettings, DeviceSettings, WindowValues, TopKValues, ModelSettings):  # fmt: skip
    """Settings of ``focus bench tasks``: the dense model, or an adapter (``top_k`` and
    ``window``, one value each, over its own; a stressed window is 16 or 32).

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    tasks: tuple[str, ...] = field(
        default=tuple(BENCHMARKS), metadata={"help": f"tasks, of {tuple(BENCHMARKS)}"}
    )
    batch_size: str = field(
        default="8",
        metadata={"help": "lm-eval batch size: an int, or auto", "type": parse_batch_size},
    )
    bootstrap_iters: int = field(
        default=1000, metadata={"help": "bootstrap resamples for stderrs lm-eval cannot compute in closed form (perplexity)"}
    )  # fmt: skip
    log_samples: bool = field(default=False, metadata={"help": "keep every example's requests and answers in the JSON"})  # fmt: skip

    def __post_init__(self) -> None:
        self.check_shared()
        owner = "TasksBenchConfig"
        check_grid(owner, self)
        check_int(owner, "limit", self.limit, 1, optional=True)
        check_int(owner, "bootstrap_iters", self.bootstrap_iters, 0)
        self.batch_size = parse_batch_size(str(self.batch_size))
        self.tasks = tuple(self.tasks)
        if not self.tasks or any(t not in BENCHMARKS for t in self.tasks):
            raise bad(owner, "tasks", self.tasks, f"some of {tuple(BENCHMARKS)}")
        if self.adapter is None and (self.top_k is not None or self.window is not None):
            raise bad(owner, "adapter", None, "an adapter directory when top_k or window is set")


@command_help(batch_size="prompts generated together (one batch)")
@settings_class(defaults={"batch_size": 8, "max_new_tokens": 256}, several=("top_k", "window"))
class InstructionsBenchConfig(GenerationLength, ResultFile, RunSettings, DeviceSettings, SeedSettings, BatchSettings, WindowValues, TopKValues, TextSettings, ModelSettings):  # fmt: skip
    """Settings of ``focus bench instructions``: the untouched model (an instruct model with
    a chat template), or it and Focus at every ``top_k`` and ``window`` (default: the
    adapter's; 32 is a stressed window); the passages come from the corpus split;
    ``seed`` seeds the prompt set.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    prompts: int = field(default=200, metadata={"help": "size of the fixed prompt set"})
    limit: int | None = field(
        default=None, metadata={"help": "answer the first N prompts of the set (default all)"}
    )
    passage_share: float = field(default=0.5, metadata={"help": "share of passage prompts"})
    kl: bool = field(default=True, metadata={"help": "measure the KL divergence from the untouched model"})  # fmt: skip

    def __post_init__(self) -> None:
        self.check_shared()
        owner = "InstructionsBenchConfig"
        check_grid(owner, self)
        for name in ("prompts", "batch_size"):
            check_int(owner, name, getattr(self, name), 1)
        check_int(owner, "limit", self.limit, 1, optional=True)
        check_number(owner, "passage_share", self.passage_share, low=0.0, inclusive=True)
        if self.passage_share > 1:
            raise bad(owner, "passage_share", self.passage_share, "a share in [0, 1]")
        if self.adapter is None and (self.top_k is not None or self.window is not None):
            raise bad(owner, "adapter", None, "an adapter directory when top_k or window is set")


#: the lengths of ``focus bench ruler`` without ``--lengths`` (tokens; RULER's own start at
#: 4,096, and 8,192 is SmolLM2's context)
RULER_LENGTHS = (2048, 4096, 8192)


@command_help(
    limit="samples per task and length, the first N the generator makes (default all: RULER's 500)"
)
@settings_class(defaults={"lengths": RULER_LENGTHS, "limit": None}, several=("top_k",))
class RulerBenchConfig(DenseReference, ExampleLimit, PlotFile, ResultFile, RunSettings, DeviceSettings, SeedSettings, LengthSettings, AdapterOverrides, ModelSettings):  # fmt: skip
    """Settings of ``focus bench ruler``: lm-eval's RULER tasks (and their variants on
    offline haystacks) at every length, for the dense model and, with an adapter, Focus at
    every ``top_k`` (default: the adapter's), the other :class:`AdapterOverrides` (one value
    each) over the adapter's; ``seed`` seeds the samples' generation.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    tasks: tuple[str, ...] = field(
        default=RULER_DEFAULT_TASKS,
        metadata={"help": f"RULER tasks (lm-eval's names), of {tuple(RULER_TASKS)}; the "
                  "_pg_essays and _persuasion ones are variants on offline haystacks"},
    )  # fmt: skip
    max_gen_toks: int | None = field(
        default=None,
        metadata={"help": "tokens generated per answer, at most (default: what the task's "
                  "answers need, twice the longest reference answer's tokens plus 8, at "
                  "most the task's own bound)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        self.check_shared()
        owner = "RulerBenchConfig"
        check_grid(owner, self)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < RULER_MIN_TOKENS for n in self.lengths):  # fmt: skip
            raise bad(owner, "lengths", self.lengths, f"ints >= {RULER_MIN_TOKENS} (tokens: "
                      f"RULER keeps {RULER_ANSWER_RESERVE} of each length for the answer and "
                      "its templates need the rest)")  # fmt: skip
        check_ruler_tasks(owner, self.tasks)
        check_int(owner, "limit", self.limit, 1, optional=True)
        check_int(owner, "max_gen_toks", self.max_gen_toks, 1, optional=True)
        overridden = [k for k, v in self.overrides().items() if v is not None]
        if self.adapter is None and overridden:
            raise bad(owner, overridden[0], getattr(self, overridden[0]),
                      "an adapter directory as well (it overrides the adapter's setting)")  # fmt: skip
        if self.adapter is None and not self.dense:
            raise bad(owner, "dense", False, "true without an adapter (nothing else to run)")


#: prompt lengths of the serving benchmark (tokens; the longest leaves room for the answer
#: in SmolLM2's 8,192-token context)
SERVE_LENGTHS = (1024, 2048, 4096, 8000)
#: concurrent requests of the serving benchmark
SERVE_CONCURRENCY = (16, 64)


@command_help(dense="also serve the dense base model")
@settings_class(defaults={"top_k": (1, 2), "lengths": SERVE_LENGTHS, "dense": True}, several=("top_k",))  # fmt: skip
class ServeBenchConfig(DenseReference, PlotFile, GenerationLength, ResultFile, DeviceSettings, LengthSettings, AdapterOverrides, TextSettings, ModelSettings):  # fmt: skip
    """Settings of ``focus bench serve``: ``transformers serve`` on 127.0.0.1 answering
    ``concurrency`` simultaneous streaming completion requests with ``lengths``-token
    prompts of the corpus split, for Focus (``--adapter`` exported with ``--model``, or an
    exported directory ``--export``) at every ``top_k`` and, with ``dense``, the dense base
    model served the same way (the same weights, without the adapter).

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    export: str | None = field(
        default=None,
        metadata={"help": "a directory written by focus export to serve (instead of exporting "
                  "--model with --adapter)"},
    )  # fmt: skip
    concurrency: tuple[int, ...] = field(
        default=SERVE_CONCURRENCY, metadata={"help": "simultaneous requests (one cell each)"}
    )
    requests: int | None = field(
        default=None,
        metadata={"help": "requests sent per cell (default: its concurrency, all at once)"},
    )
    cell_timeout: float = field(
        default=1800.0,
        metadata={"help": "seconds a cell may take; requests unanswered by then are cancelled "
                  "and counted as not answered"},
    )  # fmt: skip
    ready_timeout: float = field(
        default=600.0, metadata={"help": "seconds the server may take to load the model"}
    )
    continuous_batching: bool = field(
        default=False,
        metadata={"help": "serve with transformers serve --continuous-batching"},
    )
    dtype: str | None = field(
        default=None,
        metadata={"help": "dtype the server loads the weights in (transformers serve --dtype; "
                  "default: the checkpoint's own)", "choices": DTYPE_NAMES},
    )  # fmt: skip
    warmup: int = field(
        default=1,
        metadata={"help": "requests of each prompt length sent to a server and not counted "
                  "before its cells (compilation and caches warm up outside the timing)"},
    )  # fmt: skip
    work_dir: str | None = field(
        default=None,
        metadata={"help": "where the served directories and server logs go (default: a "
                  "temporary directory, removed after the run)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        self.check_shared()
        owner = "ServeBenchConfig"
        check_grid(owner, self)
        self.concurrency = tuple(self.concurrency)
        if not self.concurrency:
            raise bad(owner, "concurrency", self.concurrency, "one or more ints >= 1")
        for v in self.concurrency:
            check_int(owner, "concurrency", v, 1)
        check_int(owner, "requests", self.requests, 1, optional=True)
        check_int(owner, "warmup", self.warmup, 0)
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise bad(owner, "dtype", self.dtype, f"one of {DTYPE_NAMES}")
        check_number(owner, "cell_timeout", self.cell_timeout)
        check_number(owner, "ready_timeout", self.ready_timeout)
        if (self.adapter is None) == (self.export is None):
            raise bad(owner, "adapter", self.adapter, "an adapter, or an exported directory "
                      "given as export (one of them)")  # fmt: skip


@dataclass
class ResultFiles(Settings):
    """Result files a command reads."""

    results: tuple[str, ...] = field(
        default=(),
        metadata={"help": "JSON result files of focus bench kernel, model, decode, needle, "
                  "ruler or serve (or merged by focus bench merge)"},
    )  # fmt: skip

    def check_results(self, owner: str) -> None:
        """``results``: one or more paths (stored as a tuple of str).

        Raises:
            ValueError: none given.
        """
        self.results = tuple(str(path) for path in self.results)
        if not self.results:
            raise bad(owner, "results", self.results, "one or more JSON result files")


@settings_class()
class MergeResultsConfig(ResultFile, ResultFiles):
    """Settings of ``focus bench merge``: result files of one benchmark merged, in order,
    into the JSON file ``json``.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    def __post_init__(self) -> None:
        self.check_results("MergeResultsConfig")


@command_help(out="folder the PNGs are written into (default: beside each result file)")
@settings_class(defaults={"out": None})
class PlotResultsConfig(OutputSettings, ResultFiles):
    """Settings of ``focus bench plot``: one PNG per result held in each file.

    Raises:
        ValueError: on construction, naming the first bad field.
    """

    def __post_init__(self) -> None:
        self.check_shared()
        self.check_results("PlotResultsConfig")
