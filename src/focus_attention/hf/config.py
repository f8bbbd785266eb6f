"""``FocusConfig``: the settings of a Focus retrofit, validated and JSON round-trippable."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import FrozenInstanceError, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..ops.names import GATES, SPARSE_BACKENDS
from ..utils.checks import bad, check_int, check_number
from ..utils.io import read_file_bytes

#: version of the on-disk config layout (``focus_config.json``).
CONFIG_FORMAT_VERSION = 1

__all__ = [
    "CONFIG_FORMAT_VERSION",
    "GATES",
    "INFERENCE_ROUTINGS",
    "INFERENCE_SETTINGS",
    "QUERY_POOLINGS",
    "ROUTER_INPUTS",
    "ROUTINGS",
    "SAVED_EXTRA_KEYS",
    "SPARSE_BACKENDS",
    "FocusConfig",
    "InferenceSetting",
    "check_attention_backend",
    "parse_config_document",
    "read_config_file",
]

ROUTINGS = ("auto", "soft", "topk")
INFERENCE_ROUTINGS = ("causal", "sequence", "streaming")
#: what a router reads: the hidden state (one routing shared by every head, docs/method.md
#: §1) or each key-value head's queries and keys before the rotary embedding (§4,
#: "Query-key routing")
ROUTER_INPUTS = ("hidden_state", "query_key")
#: how a query-key router pools the scores of the query heads sharing a key-value head
QUERY_POOLINGS = ("mean", "max")


# checks that name the field as "FocusConfig.<field>"
_bad = functools.partial(bad, "FocusConfig")
_int = functools.partial(check_int, "FocusConfig")
_positive_float = functools.partial(check_number, "FocusConfig")


def check_attention_backend(owner: str, name: str, value: object) -> None:
    """Field ``name`` of ``owner``, an attention backend: ``"auto"``, a built-in backend, or
    one registered by then (looked up in the registry, which imports torch, only for other
    names).

    Raises:
        ValueError: ``"<owner>.<name>: received ..., expected ..."``.
    """
    if value in SPARSE_BACKENDS:
        return
    if isinstance(value, str) and value:
        from ..ops.sparse.dispatch import backend_names  # torch: the settings import without it

        if value in backend_names():
            return
    raise bad(owner, name, value, "'auto' or a registered sparse-attention backend "
              f"(built in: {', '.join(SPARSE_BACKENDS[1:])})")  # fmt: skip


def parse_layer_heads(text: str) -> tuple[tuple[int, int], ...]:
    """``"18:0,20:1"`` -> ``((18, 0), (20, 1))``: the ``--dense-heads`` flag.

    Raises:
        ValueError: an item that is not ``LAYER:HEAD`` with two whole numbers.
    """
    pairs = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        layer, sep, head = item.partition(":")
        if not sep or not layer.strip().isdigit() or not head.strip().isdigit():
            raise ValueError(f"expected LAYER:HEAD pairs like 18:0,20:1, got {text!r}")
        pairs.append((int(layer), int(head)))
    return tuple(pairs)


@dataclass(frozen=True)
class InferenceSetting:
    """The declaration of one inference-time setting of :class:`FocusConfig`: a setting
    that can change on a trained adapter, each declared once in :data:`INFERENCE_SETTINGS`.
    Built from it: the :class:`FocusConfig` field (and the flag of ``focus train``), the
    commands' override flags (:class:`focus_attention.settings.AdapterOverrides`), the
    keys of an exported model's ``config.json`` and ``from_pretrained`` keywords
    (:mod:`focus_attention.deploy`) and the exported model card's list of them. A new
    setting is a row of :data:`INFERENCE_SETTINGS` and a line of :class:`FocusConfig`'s
    body naming it (where its field goes), with its check in :meth:`FocusConfig.validate`.

    Attributes:
        name: the field's name (flag ``--name-with-dashes``, ``config.json`` key, keyword).
        type: the :class:`FocusConfig` field's annotation, as text (``"int"``,
            ``"tuple[int, ...]"``; ``"... | None"`` when None is a value).
        default: the :class:`FocusConfig` field's default.
        help: the :class:`FocusConfig` field's help text (the flag of ``focus train``).
        override_help: the help text of a command's override flag (its value replaces the
            adapter's; unset keeps it).
        low: the least value of an int setting, or of each int of a list of ints (None:
            neither).
        choices: the names the flag offers (None: any); a value outside them is refused
            unless ``check`` decides.
        check: ``check(owner, name, value)`` of a value, raising ``ValueError``, instead of
            the ``choices`` (None: ``low`` and ``choices`` only).
        parse: parser of the flag's text, one comma-separated value (None: read from
            ``type``).
        metavar: how the flag's help names its value (None: argparse's own).
        several: the override takes one value or several (``int | tuple[int, ...]``, each
            run in turn where a command's settings class lists it in ``SEVERAL``).
    """

    name: str
    type: str
    default: Any
    help: str
    override_help: str
    low: int | None = None
    choices: tuple[str, ...] | None = None
    check: Callable[[str, str, Any], None] | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    several: bool = False

    def flag_metadata(self, help: str) -> dict[str, Any]:
        """The ``metadata`` of a settings field with this setting's flag and ``help``
        (:mod:`focus_attention.cli.flags` reads it)."""
        extra = {"choices": self.choices, "type": self.parse, "metavar": self.metavar}
        return {"help": help, **{k: v for k, v in extra.items() if v is not None}}

    def config_field(self) -> Any:
        """The :class:`FocusConfig` field (a ``dataclasses.field``)."""
        return field(default=self.default, metadata=self.flag_metadata(self.help))

    @property
    def is_list(self) -> bool:
        """Whether a value is a list of values (``type`` is a ``tuple[...]``)."""
        return self.type.startswith("tuple[")

    @property
    def optional(self) -> bool:
        """Whether None is a value of the :class:`FocusConfig` field."""
        return self.type.endswith("| None")

    def check_value(self, owner: str, value: Any) -> None:
        """Check a value of a setting that is not a list (:attr:`is_list`; FocusConfig
        checks those itself): ``check``, else one of ``choices``, else an int at least
        ``low`` (None passes where the setting is :attr:`optional`).

        Raises:
            ValueError: ``"<owner>.<name>: received ..., expected ..."``.
        """
        if self.is_list:
            raise TypeError(f"{self.name}: a list setting, checked by its owner")
        if self.check is not None:
            self.check(owner, self.name, value)
        elif self.choices is not None and value not in self.choices:
            raise bad(owner, self.name, value, f"one of {self.choices}")
        elif self.low is not None:
            check_int(owner, self.name, value, self.low, optional=self.optional)


#: the inference-time settings of :class:`FocusConfig`, by name, each declared once (the
#: order of the override flags and of an export's ``config.json``)
INFERENCE_SETTINGS: dict[str, InferenceSetting] = {
    s.name: s
    for s in (
        InferenceSetting(
            name="window",
            type="int",
            default=128,
            help="local window in tokens, the query included",
            override_help="local window in tokens, the query included, over the adapter's "
            "(the routers stay as trained)",
            low=1,
            several=True,
        ),
        InferenceSetting(
            name="sink_tokens",
            type="int",
            default=4,
            help="first real tokens that belong to every group",
            override_help="first real tokens that belong to every group, over the adapter's",
            low=0,
        ),
        InferenceSetting(
            name="dense_layers",
            type="tuple[int, ...]",
            default=(),
            help="Focus layers that run dense attention, e.g. the retrieval layers (default: none)",
            override_help="Focus layers that run dense attention, over the adapter's (the "
            "retrieval layers focus bench retrieval-layers ranks)",
            low=0,
        ),
        InferenceSetting(
            name="dense_heads",
            type="tuple[tuple[int, int], ...]",
            default=(),
            help="(layer, key-value head) pairs that attend densely while the other heads "
            "of their layer route, as LAYER:HEAD,... (default: none)",
            override_help="(layer, key-value head) pairs that attend densely while the other "
            "heads of their layer route, over the adapter's",
            parse=parse_layer_heads,
            metavar="L:H,...",
        ),
        InferenceSetting(
            name="top_k",
            type="int",
            default=2,
            help="groups each token keeps at inference",
            override_help="groups each token keeps at inference (top-k routing), over the "
            "adapter's",
            low=1,
            several=True,
        ),
        InferenceSetting(
            name="query_top_k",
            type="int | None",
            default=None,
            help="groups each query keeps at inference, if not top_k (keys keep top_k)",
            override_help="groups each query keeps, over the adapter's (keys keep top_k; "
            "default: the adapter's query_top_k, else top_k)",
            low=1,
        ),
        InferenceSetting(
            name="inference_routing",
            type="str",
            default="causal",
            help="how top-k groups are chosen (streaming: none, only the window and the sink "
            "tokens)",
            override_help="how top-k groups are chosen, over the adapter's (streaming: none, "
            "only the window and the sink tokens)",
            choices=INFERENCE_ROUTINGS,
        ),
        InferenceSetting(
            name="attention_backend",
            type="str",
            default="auto",
            help="backend of the Focus layers' sparse attention (masked: every key under the "
            "mask, no host synchronisation; for decoding on a GPU)",
            override_help="backend of Focus's sparse attention (default: an adapter's own, "
            "else auto; masked: every key under the mask, no host synchronisation)",
            choices=SPARSE_BACKENDS,
            check=check_attention_backend,
        ),
    )
}


def _declared_fields(cls: type) -> type:
    """Class decorator (under ``@dataclass``): each class attribute that is an
    :class:`InferenceSetting` becomes its field, with the declaration's type, default and
    flag metadata, where the class body names it (so that the fields keep their order)."""
    annotations = cls.__dict__["__annotations__"]
    for name, value in list(vars(cls).items()):
        if isinstance(value, InferenceSetting):
            annotations[name] = value.type
            setattr(cls, name, value.config_field())
    return cls


@dataclass(frozen=True)
@_declared_fields
class FocusConfig:
    """Settings of a Focus retrofit (docs/method.md §1-§4 and §8).

    Immutable (a frozen dataclass): assigning a field raises ``FrozenInstanceError`` (an
    ``AttributeError``). Change settings with :meth:`replace`, which returns a validated
    copy; on a wrapped model assign it to ``FocusModel.focus_config`` (or use
    ``FocusModel.set_top_k``) so that the model uses it.

    Attributes:
        num_groups: ``K``, the number of learned groups per layer (paper default 8).
        group_dim: ``d_g``, the width of the routing projection (paper: 16; unused by
            query-key routers).
        router_input: what a router reads (docs/method.md §4, "Query-key routing"):
            ``"hidden_state"`` (default, the paper's: the hidden state entering the layer,
            one routing shared by every head) or ``"query_key"`` (experimental: per
            key-value head, centroids ``[H_kv, K, head_dim]`` score each key's and each
            query's vectors before the rotary embedding; no soft routing, trained with
            ``focus train --objective attention`` or ``coverage``; refuses the static and
            the paged cache, ``dense_heads`` and head gates).
        query_pooling: how a query-key router scores a query against a key-value head's
            centroids from the ``H / H_kv`` query heads sharing it: ``"mean"`` (default: the
            mean query's scores) or ``"max"`` (each centroid's best score over those heads,
            as the oracle pools attention); ``"mean"`` only with hidden-state routing.
        window: local window in tokens; key ``j`` is local to query ``i`` when
            ``0 <= i - j < window`` (the window counts the query itself; docs/method.md §3).
        top_k: groups each token keeps at inference, ``1 <= top_k <= num_groups``: the
            groups a key is a member of (and a query's, unless ``query_top_k`` is set).
        query_top_k: groups each *query* keeps at inference, ``1..num_groups``, when it
            should differ from ``top_k`` (default None: ``top_k``). A query then sees the
            keys of its ``query_top_k`` best groups, each key being a member of its ``top_k``
            best: ``top_k=1, query_top_k=2`` sees about twice the distant keys of top-1
            routing and half those of top-2 (docs/method.md §4, "Asymmetric top-k"). Soft
            routing and the KV cache's key groups do not depend on it.
        temperature: ``tau`` of the routing scores (paper default 0.1).
        sinkhorn_iters: Sinkhorn iterations in soft routing (paper default 10; 0 turns the
            balancing off: a softmax over groups, the paper's group-dominance ablation).
        gate: soft training gate, ``"paper"`` (Eq. 2, multiplicative sigmoid) or ``"log"``
            (additive ``log(eps + g_i . g_j)``, whose hard limit is the inference mask).
        gate_sharpness: ``lambda`` of the paper gate (not given in the paper; default 10).
        sink_tokens: the first ``sink_tokens`` real tokens of every sequence are members of
            every group (every query sees them), in soft and top-k routing alike
            (docs/method.md §3; default 4, the usual attention-sink count).
        routing: ``"auto"`` (soft Sinkhorn routing in ``train()`` mode, hard top-k in
            ``eval()`` mode), or ``"soft"`` / ``"topk"`` to force one.
        inference_routing: how top-k groups are chosen: ``"causal"`` (default; top-k of the
            token's own scores plus a per-group bias calibrated during soft training, so a
            token's groups depend on that token only) or ``"sequence"`` (the paper's
            sequence-wide Sinkhorn before top-k: non-causal, refuses a KV cache), or
            ``"streaming"``, a reference without groups: a query sees its window and the
            sink tokens only, the "streaming heads" of DuoAttention (Xiao et al., 2024),
            so ``top_k`` and the routers go unused (docs/method.md §9). A KV cache keeps
            the groups its keys were cached with (streaming keys have none): switching
            between streaming and routing mid-generation mixes the two, so start from an
            empty cache.
        attention_backend: the backend of the Focus layers' exact sparse attention, a
            ``backend=`` of :func:`~focus_attention.ops.sparse_attention` (docs/method.md
            §5, "Backends"): ``"auto"`` (default: the first backend that can run each call),
            a built-in one (:data:`SPARSE_BACKENDS`) or one registered with
            :func:`~focus_attention.ops.register_backend`. ``"masked"`` decodes without a
            host synchronisation, reading every cached key. A backend that cannot run a
            call raises ``ValueError`` then, naming the reason. Not used by soft routing.
        layers: indices of the layers that get Focus, stored as a sorted tuple (any iterable
            of ints is accepted); ``None`` = every full-attention layer (layers a model
            declares as sliding-window in ``config.layer_types`` are left as they are). An
            explicitly listed sliding-window layer gets Focus and a full cache.
        dense_layers: Focus layers that run the base model's own attention (dense: every
            earlier key, or the base layer's own sliding window where it has one) instead of
            routing through their groups, stored as a sorted tuple; default none. For the
            layers that retrieve from far back (a needle, a fact given early):
            ``focus bench retrieval-layers``
            (:func:`focus_attention.evaluation.retrieval.rank_retrieval_layers`) ranks them
            (docs/method.md §9). Their routers are kept, so the set can change at any time,
            but while their layer is dense they get no gradient, no routing-bias update (in
            soft training or :meth:`FocusModel.calibrate`) and no routing record. A KV cache
            filled earlier keeps the layout it was filled with (a layer switched
            mid-generation raises ``ValueError``).
        dense_heads: ``(layer, kv_head)`` pairs of Focus layers whose key-value heads (and
            the query heads that share them) attend densely, with the base model's own
            attention, while the layer's other heads route through their groups; stored as
            a sorted tuple of pairs; default none (docs/method.md §9). The layer is routed
            once for its other heads; a head index beyond the layer's key-value heads raises
            ``ValueError`` when the layer runs. Pairs of layers in ``dense_layers`` are
            refused (every head of those is dense).
        seed: seed of the deterministic router initialisation.
        bias_momentum: momentum of the running mean of the Sinkhorn column bias kept during
            soft training (cumulative mean for the first ``1 / bias_momentum`` updates, then
            an exponential moving average; docs/method.md §4).
        soft_chunk_size: query rows per chunk of the soft-gated attention (0: every row at
            once). With gradients each chunk is recomputed in the backward pass, so a soft
            layer holds ``O(chunk * N)`` attention floats instead of ``O(N^2)``: long blocks
            train in bounded memory for one extra attention forward. The result is the same
            up to float rounding (docs/method.md §6).
        straight_through: soft routing with the hard top-k mask in the loop
            (docs/method.md §6, "Straight-through routing"): the forward pass of a soft layer
            attends under the causal top-k groups inference uses (``query_top_k`` for the
            queries, ``top_k`` for the keys, biased by ``routing_bias``), the backward pass
            takes the gradient of the Sinkhorn rows (straight-through estimator). Needs
            ``inference_routing="causal"``, ``gate="log"`` and ``top_k == 1`` or
            ``query_top_k == 1``: then the log gate of the hard rows is exactly the inference
            mask (up to ``eps``); checked when a soft layer runs
            (:meth:`check_straight_through`). Default False.

    Raises:
        ValueError: on construction, for any field outside its range (the message names the
            field, what was received and what was expected).
    """

    # "card": a trained shape, listed in the model card before the inference settings
    num_groups: int = field(
        default=8, metadata={"help": "K, learned groups per layer", "card": True}
    )
    group_dim: int = field(
        default=16, metadata={"help": "d_g, width of the routing projection", "card": True}
    )
    router_input: str = field(
        default="hidden_state",
        metadata={"help": "what routes tokens: the hidden state (one routing shared by the "
                  "heads) or each key-value head's pre-rotary queries and keys (query_key, "
                  "experimental; trained with --objective attention, coverage or ranking)",
                  "choices": ROUTER_INPUTS, "card": True},
    )  # fmt: skip
    query_pooling: str = field(
        default="mean",
        metadata={"help": "query_key routing: a query's score for a group from the query heads "
                  "sharing its key-value head: that of their mean query, or the max of theirs",
                  "choices": QUERY_POOLINGS, "card": True},
    )  # fmt: skip
    # an inference setting names its declaration (INFERENCE_SETTINGS), whose type, default
    # and help the field takes (_declared_fields)
    window: InferenceSetting = INFERENCE_SETTINGS["window"]
    top_k: InferenceSetting = INFERENCE_SETTINGS["top_k"]
    query_top_k: InferenceSetting = INFERENCE_SETTINGS["query_top_k"]
    temperature: float = field(default=0.1, metadata={"help": "tau of the routing scores"})
    sinkhorn_iters: int = field(
        default=10, metadata={"help": "Sinkhorn iterations of soft routing (0: off, softmax)"}
    )
    gate: str = field(default="log", metadata={"help": "soft training gate", "choices": GATES})
    gate_sharpness: float = field(default=10.0, metadata={"help": "lambda of the paper gate"})
    sink_tokens: InferenceSetting = INFERENCE_SETTINGS["sink_tokens"]
    routing: str = field(
        default="auto",
        metadata={"help": "soft in train(), top-k in eval(), or forced", "choices": ROUTINGS},
    )
    inference_routing: InferenceSetting = INFERENCE_SETTINGS["inference_routing"]
    attention_backend: InferenceSetting = INFERENCE_SETTINGS["attention_backend"]
    layers: tuple[int, ...] | None = field(
        default=None, metadata={"help": "layers that get Focus (default: every full layer)"}
    )
    dense_layers: InferenceSetting = INFERENCE_SETTINGS["dense_layers"]
    dense_heads: InferenceSetting = INFERENCE_SETTINGS["dense_heads"]
    seed: int = field(default=0, metadata={"help": "seed of the router initialisation"})
    bias_momentum: float = field(
        default=0.01, metadata={"help": "momentum of the calibrated causal routing bias"}
    )
    soft_chunk_size: int = field(
        default=0,
        metadata={"help": "query rows per chunk of soft attention, recomputed in backward "
                  "(0: no chunking); bounds training memory at long blocks"},
    )  # fmt: skip
    straight_through: bool = field(
        default=False,
        metadata={"help": "soft routing attends under the hard top-k mask (forward) with "
                  "the Sinkhorn rows' gradient (backward); needs top_k or query_top_k 1, "
                  "gate log and causal inference routing"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (and store ``layers`` as a sorted tuple); raises ``ValueError``
        naming the first bad one."""
        _int("num_groups", self.num_groups, 1)
        _int("group_dim", self.group_dim, 1)
        if self.router_input not in ROUTER_INPUTS:
            raise _bad("router_input", self.router_input, f"one of {ROUTER_INPUTS}")
        if self.query_pooling not in QUERY_POOLINGS:
            raise _bad("query_pooling", self.query_pooling, f"one of {QUERY_POOLINGS}")
        if self.query_pooling != "mean" and self.router_input != "query_key":
            raise _bad("query_pooling", self.query_pooling,
                       "'mean' unless router_input is 'query_key' (hidden-state routers read "
                       "no queries)")  # fmt: skip
        self._check_setting("window")
        self._check_setting("top_k")
        if self.top_k > self.num_groups:
            raise _bad("top_k", self.top_k, f"an int in 1..num_groups={self.num_groups}")
        self._check_setting("query_top_k")
        if self.query_top_k is not None and self.query_top_k > self.num_groups:
            raise _bad(
                "query_top_k",
                self.query_top_k,
                f"None or an int in 1..num_groups={self.num_groups}",
            )
        _positive_float("temperature", self.temperature)
        _int("sinkhorn_iters", self.sinkhorn_iters, 0)
        if self.gate not in GATES:
            raise _bad("gate", self.gate, f"one of {GATES}")
        _positive_float("gate_sharpness", self.gate_sharpness)
        self._check_setting("sink_tokens")
        _int("soft_chunk_size", self.soft_chunk_size, 0)
        if self.routing not in ROUTINGS:
            raise _bad("routing", self.routing, f"one of {ROUTINGS}")
        self._check_setting("inference_routing")
        self._check_setting("attention_backend")
        if self.layers is not None:
            layers = _layer_indices("layers", self.layers)
            if not layers:
                raise _bad("layers", self.layers, "None or a non-empty list of layer indices")
            object.__setattr__(self, "layers", layers)  # frozen dataclass
        object.__setattr__(self, "dense_layers", _layer_indices("dense_layers", self.dense_layers))
        if self.layers is not None and not set(self.dense_layers) <= set(self.layers):
            outside = sorted(set(self.dense_layers) - set(self.layers))
            raise _bad(
                "dense_layers", self.dense_layers, f"Focus layers (layers {outside} are not)"
            )
        self._validate_dense_heads()
        _int("seed", self.seed)
        self._validate_straight_through()
        if (
            isinstance(self.bias_momentum, bool)
            or not isinstance(self.bias_momentum, (int, float))
            or not 0 < self.bias_momentum <= 1
        ):
            raise _bad("bias_momentum", self.bias_momentum, "a number in (0, 1]")

    def _check_setting(self, name: str) -> None:
        """Check the inference setting ``name`` as its declaration says
        (:meth:`InferenceSetting.check_value`)."""
        INFERENCE_SETTINGS[name].check_value("FocusConfig", getattr(self, name))

    def _validate_dense_heads(self) -> None:
        """``dense_heads`` as a sorted tuple of distinct ``(layer, kv_head)`` pairs of Focus
        layers that are not in ``dense_layers`` (a whole dense layer needs no heads)."""
        heads = _layer_heads("dense_heads", self.dense_heads)
        object.__setattr__(self, "dense_heads", heads)  # frozen dataclass
        layers = {layer for layer, _ in heads}
        if self.layers is not None and not layers <= set(self.layers):
            outside = sorted(layers - set(self.layers))
            raise _bad("dense_heads", heads, f"heads of Focus layers (layers {outside} are not)")
        both = sorted(layers & set(self.dense_layers))
        if both:
            raise _bad("dense_heads", heads,
                       f"heads of routed layers (layers {both} are in dense_layers, every head "
                       "of them is dense)")  # fmt: skip

    def _validate_straight_through(self) -> None:
        """``straight_through`` is a bool (its combination with the routing is checked when
        it runs: :meth:`check_straight_through`)."""
        if not isinstance(self.straight_through, bool):
            raise _bad("straight_through", self.straight_through, "True or False")

    def check_straight_through(self) -> None:
        """Check that ``straight_through`` can run with these settings: causal inference
        routing, the ``"log"`` gate and ``top_k == 1`` or ``query_top_k == 1``. Checked
        when a soft layer runs (and by ``focus train``), not on construction, so that an
        adapter trained this way can still be evaluated at any ``top_k``.

        Raises:
            ValueError: ``straight_through=True`` with ``inference_routing="sequence"``,
                another gate, or several groups for both queries and keys (the hard
                affinity would count shared groups).
        """
        if not self.straight_through:
            return
        if self.inference_routing != "causal":
            raise _bad(
                "straight_through",
                True,
                f"False with inference_routing={self.inference_routing!r} (it trains "
                "under the causal groups of inference_routing='causal')",
            )
        if self.gate != "log":
            raise _bad(
                "straight_through",
                True,
                f"False with gate={self.gate!r} (the hard rows give the inference mask "
                "through the 'log' gate only)",
            )
        if min(self.top_k, self.resolved_query_top_k) != 1:
            raise _bad(
                "straight_through",
                True,
                f"False with top_k={self.top_k} and query_top_k="
                f"{self.resolved_query_top_k}: it needs one of them to be 1 (with "
                "several groups on both sides the hard affinity counts the shared groups)",
            )

    @property
    def resolved_query_top_k(self) -> int:
        """Groups each query keeps at inference: ``query_top_k``, or ``top_k`` when unset."""
        return self.top_k if self.query_top_k is None else self.query_top_k

    # --- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON dict of every field (plus ``format_version``)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        out = json.loads(json.dumps(out))  # deep copy, JSON types only
        out["format_version"] = CONFIG_FORMAT_VERSION
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FocusConfig:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: unknown keys, a newer ``format_version``, or invalid values.
        """
        if not isinstance(data, dict):
            raise ValueError(
                f"FocusConfig.from_dict: received {type(data).__name__}, expected a dict"
            )
        data = dict(data)
        version = data.pop("format_version", CONFIG_FORMAT_VERSION)
        if version != CONFIG_FORMAT_VERSION:
            raise ValueError(
                f"FocusConfig: format_version {version!r} is not supported "
                f"(this library reads version {CONFIG_FORMAT_VERSION})"
            )
        known = {f.name for f in fields(cls) if not f.name.startswith("_")}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"FocusConfig: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)

    def to_json_string(self) -> str:
        """The config as an indented JSON document."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json_string(cls, text: str) -> FocusConfig:
        """Parse :meth:`to_json_string` output. Raises ``ValueError`` on bad JSON or values."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"FocusConfig: not valid JSON ({err})") from err
        return cls.from_dict(data)

    @classmethod
    def from_json_file(cls, path: str | Path) -> FocusConfig:
        """Read a ``focus_config.json`` (extra top-level keys written by ``save_pretrained``,
        such as the base-model fingerprint, are ignored).

        Raises:
            FileNotFoundError: no such file.
            ValueError: a corrupt file (invalid JSON or UTF-8, not a JSON object) or invalid
                settings; the message names the file.
        """
        return read_config_file(path)[0]

    def replace(self, **changes: Any) -> FocusConfig:
        """A validated copy with some fields changed."""
        data = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        data.update(changes)
        return FocusConfig(**data)

    def override(self, **settings: Any) -> FocusConfig:
        """:meth:`replace` with the settings that are not None (an override left unset, as
        a command-line flag not given, keeps the field)."""
        return self.replace(**{k: v for k, v in settings.items() if v is not None})


#: top-level keys of a saved ``focus_config.json`` that are not FocusConfig fields
SAVED_EXTRA_KEYS = ("base_model_fingerprint", "library")


def read_config_file(path: str | Path) -> tuple[FocusConfig, dict[str, Any]]:
    """Read a ``focus_config.json``: ``(config, extra)``, ``extra`` holding the
    :data:`SAVED_EXTRA_KEYS` present in the file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a corrupt file (invalid JSON or UTF-8, not a JSON object), a directory
            in its place, an unreadable file, or invalid settings; the message names the
            file and what is wrong.
    """
    path = Path(path)
    try:
        text = read_file_bytes(path, "a Focus config (JSON)").decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a valid Focus config file (invalid JSON: {err})") from err
    return parse_config_document(text, f"{path}")


def parse_config_document(text: str, where: str) -> tuple[FocusConfig, dict[str, Any]]:
    """Parse the text of a saved config document: ``(config, extra)``, ``extra`` holding the
    :data:`SAVED_EXTRA_KEYS` present.

    Raises:
        ValueError: invalid JSON, not a JSON object, or invalid settings; the message starts
            with ``where`` (a file name or a state-dict key).
    """
    what = f"{where}: not a valid Focus config file"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} (invalid JSON: {err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{what} (a JSON {type(data).__name__}, expected an object)")
    extra = {k: data.pop(k) for k in SAVED_EXTRA_KEYS if k in data}
    try:
        config = FocusConfig.from_dict(data)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from err
    return config, extra


def _refuse_assignment(self: FocusConfig, name: str, value: object) -> None:
    raise FrozenInstanceError(
        f"FocusConfig is immutable: cannot set {name!r} to {value!r}; use "
        f"config.replace({name}=...) for a validated copy (on a FocusModel: "
        f"model.focus_config = model.focus_config.replace({name}=...))"
    )


# The frozen dataclass's own __setattr__ only says "cannot assign to field": replace it with
# one that says what to do instead (construction does not go through __setattr__).
FocusConfig.__setattr__ = _refuse_assignment  # type: ignore[method-assign]


def _layer_heads(name: str, value: Any) -> tuple[tuple[int, int], ...]:
    """``value`` as a sorted tuple of distinct ``(layer, kv_head)`` pairs of ints >= 0 (lists
    of two ints, as JSON holds them, are accepted); ``ValueError`` naming ``name`` otherwise."""
    want = "a list of (layer, key-value head) pairs of ints >= 0"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise _bad(name, value, want)
    pairs = []
    for pair in value:
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__iter__"):
            raise _bad(name, value, want)
        pair = tuple(pair)
        if len(pair) != 2 or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in pair):  # fmt: skip
            raise _bad(name, value, want)
        pairs.append(pair)
    if len(set(pairs)) != len(pairs):
        raise _bad(name, value, "distinct (layer, key-value head) pairs")
    return tuple(sorted(pairs))


def _layer_indices(name: str, value: Any) -> tuple[int, ...]:
    """``value`` as a sorted tuple of distinct layer indices; ``ValueError`` naming ``name``
    otherwise."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise _bad(name, value, "a list of layer indices")
    layers = list(value)
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise _bad(name, value, "a list of ints >= 0")
    if len(set(layers)) != len(layers):
        raise _bad(name, value, "distinct layer indices")
    return tuple(sorted(layers))
