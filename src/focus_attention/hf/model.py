"""``get_focus_model`` / ``FocusModel``: the PEFT-like Focus adapter (docs/method.md §8)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ..utils.compile import eager_only
from . import save_and_load
from .architectures import (
    attention_modules,
    get_architecture,
    hidden_size,
    kv_heads_of,
    layer_types,
    text_config_of,
)
from .attention import focus_pre_hook, register_focus_attention
from .cache import check_cache
from .config import ROUTINGS, FocusConfig
from .files import (
    CONFIG_NAME,
    TRAINER_WEIGHTS_NAME,
    WEIGHTS_NAME,
    FocusBaseMismatchWarning,
    base_model_fingerprint,
)
from .layer_handle import HANDLE_ATTR, LayerHandle
from .masks import GenerateMasks
from .paged import FocusContinuousBatching
from .query_key import QueryKeyRouter
from .router import FocusRouter
from .runtime import (
    ATTN_IMPLEMENTATION,
    RUNTIME_ATTR,
    FocusRuntime,
    model_pre_hook,
    overrides_open,
    runtime_of,
    switched_implementation_error,
)

__all__ = [
    "CONFIG_NAME",
    "FIXED_CONFIG_FIELDS",
    "TRAINER_WEIGHTS_NAME",
    "WEIGHTS_NAME",
    "FocusBaseMismatchWarning",
    "FocusModel",
    "FocusSlidingWindowWarning",
    "base_model_fingerprint",
    "get_focus_model",
]

#: FocusConfig fields fixed once a FocusModel is built: they set the routers' parameter
#: shapes (num_groups, group_dim, router_input), which layers have routers (layers), or only the routers'
#: initialisation (seed).
FIXED_CONFIG_FIELDS = ("num_groups", "group_dim", "router_input", "layers", "seed")


class FocusSlidingWindowWarning(UserWarning):
    """Focus layers replace a sliding-window attention of the base model (they keep every
    earlier key they share a group with), so the base model's window is not applied there."""


# --------------------------------------------------------------------------------------------
# wrapping helpers
# --------------------------------------------------------------------------------------------


def _resolve_layers(
    model_config: Any, modules: dict[int, nn.Module], requested: tuple[int, ...] | None
) -> list[int]:
    """The Focus layers of a model: ``requested`` (``FocusConfig.layers``) or, when it is
    None, every full-attention layer (by ``config.layer_types``).

    Raises:
        ValueError: a requested layer that does not exist, or no full-attention layer and
            no explicit ``layers``.
    """
    if requested is None:
        types = layer_types(model_config, int(model_config.num_hidden_layers))
        layers = [i for i in modules if types[i] == "full_attention"]
        if not layers:
            raise ValueError(
                f"{model_config.model_type}: no full-attention layer (layer_types={types}); "
                "pass FocusConfig(layers=[...]) to choose layers explicitly"
            )
        return layers
    missing = [i for i in requested if i not in modules]
    if missing:
        raise ValueError(
            f"FocusConfig.layers: layers {missing} do not exist; the model has "
            f"attention layers 0..{max(modules)}"
        )
    return list(requested)


def _check_dense_heads(model_config: Any, config: FocusConfig) -> None:
    """Refuse, before any forward, ``dense_heads`` beyond the model's key-value heads.

    Raises:
        ValueError: a pair whose head is not one of the model's ``0..num_key_value_heads-1``.
    """
    kv = kv_heads_of(model_config)
    beyond = [pair for pair in config.dense_heads if pair[1] >= kv]
    if beyond:
        raise ValueError(
            f"FocusConfig.dense_heads: received {beyond}, expected key-value heads 0..{kv - 1} "
            f"(the model has {kv} key-value heads per layer)"
        )


def _warn_replaced_sliding_window(model_config: Any, layers: list[int], window: int) -> None:
    """One :class:`FocusSlidingWindowWarning` when Focus layers replace sliding-window ones:
    Mistral-style models (a model-wide ``sliding_window``, no ``layer_types``) or layers that
    ``layer_types`` marks sliding and that ``FocusConfig.layers`` chose explicitly."""
    sliding = getattr(model_config, "sliding_window", None)
    types = getattr(model_config, "layer_types", None)
    if types is None:
        replaced = list(layers) if sliding is not None else []
    else:
        replaced = [i for i in layers if types[i] == "sliding_attention"]
    if not replaced:
        return
    warnings.warn(
        f"the base model attends within a sliding window of {sliding} tokens on layers "
        f"{replaced}; Focus layers replace that window: they see every earlier token they share "
        f"a group with, plus their own local window of {window} tokens, so their outputs differ "
        "from the base model's for sequences longer than its sliding window, even with "
        "top_k = num_groups (README, Known limits)",
        FocusSlidingWindowWarning,
        stacklevel=4,
    )


def _router_device(module: nn.Module, fallback: torch.device) -> torch.device:
    """Where the router of an attention module lives: its parameters' device, or for modules
    whose parameters are offloaded (meta, with an accelerate hook) the hook's execution
    device."""
    param = next(module.parameters(), None)
    if param is None:
        return fallback
    if param.device.type == "meta":
        hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if hook_device is not None:
            return torch.device(hook_device)
    return param.device


def _pretrained_parts(model: nn.Module) -> list[nn.Module]:
    """The model and every ``PreTrainedModel`` inside it (each opens its own forward calls)."""
    return [m for m in model.modules() if isinstance(m, PreTrainedModel) or m is model]


class FocusModel(FocusContinuousBatching, nn.Module):
    """A Hugging Face causal LM with Focus routers on its attention layers (docs/method.md §8).

    Build it with :func:`get_focus_model`. Every base parameter is frozen; one
    :class:`FocusRouter` per Focus layer holds the only trainable parameters
    (``d_model * d_g + K * d_g`` per layer), always in float32 (casts of the model move them
    but keep float32; see :class:`FocusRouter`). ``forward`` and ``generate`` are the wrapped
    model's; unknown attributes are looked up on the base model.

    Routing: ``train()`` uses soft Sinkhorn routing with the soft gate, ``eval()`` hard top-k
    routing through exact sparse attention; :meth:`set_routing` overrides. KV-cache decoding
    works in top-k mode with causal inference routing (the default).

    Settings: :attr:`focus_config` is the (immutable) config in use; assign a new one, e.g.
    ``model.focus_config = model.focus_config.replace(top_k=1, window=64)``, or call
    :meth:`set_top_k`, to change settings from the next forward on. The fields in
    :data:`FIXED_CONFIG_FIELDS` cannot change.

    Lifecycle: a ``copy.deepcopy`` or a pickled copy (``torch.save(model)``) is an independent
    working FocusModel. :meth:`state_dict` holds only the Focus state (the routers and the
    config), so ``transformers.Trainer`` checkpoints hold the adapter and
    :meth:`from_pretrained` loads them. Switching the attention implementation away from
    ``"focus"`` is refused (use :meth:`disable_focus`).

    Args:
        base_model: a supported transformers causal LM (``gpt2``, ``llama``, ``mistral``,
            ``qwen2``, ``gemma2``, ``gemma3_text``, ``olmo2``).
        config: the :class:`FocusConfig` (default ``FocusConfig()``).

    Raises:
        ValueError: unsupported model type (the message lists the supported ones), a model
            that already has Focus, layer indices that do not exist, a model without any
            full-attention layer and no explicit ``layers``.

    Warns:
        FocusSlidingWindowWarning: Focus layers replace a sliding-window attention.
    """

    def __init__(self, base_model: nn.Module, config: FocusConfig | None = None) -> None:
        super().__init__()
        config = FocusConfig() if config is None else config
        if not isinstance(config, FocusConfig):
            raise ValueError(f"config: received {type(config).__name__}, expected a FocusConfig")
        arch = get_architecture(base_model)
        model_config = base_model.config
        base_impl = model_config._attn_implementation or "eager"
        if base_impl == ATTN_IMPLEMENTATION or runtime_of(base_model) is not None:
            raise ValueError(
                "this model already has Focus attached (call unload() on its FocusModel first)"
            )
        modules = attention_modules(base_model, arch)
        layers = _resolve_layers(model_config, modules, config.layers)
        _check_dense_heads(model_config, config)
        _warn_replaced_sliding_window(model_config, layers, config.window)
        runtime = FocusRuntime(config.replace(layers=layers), base_impl, routing=config.routing)
        runtime.focus_layers, runtime.num_layers = tuple(layers), len(modules)
        runtime.model_config = model_config
        object.__setattr__(self, "_runtime", runtime)
        self.architecture = arch
        self.base_model = base_model
        self.routers = nn.ModuleDict(self._build_routers(config, layers, modules))
        runtime.routers = {int(i): r for i, r in self.routers.items()}
        self._requires_grad = {n: p.requires_grad for n, p in base_model.named_parameters()}
        for p in base_model.parameters():
            p.requires_grad_(False)
        self._modules_by_layer = modules
        self._handles = self._attach(runtime, modules)
        register_focus_attention()
        model_config._attn_implementation = ATTN_IMPLEMENTATION
        base_model.create_masks_for_generate = GenerateMasks(base_model)
        self._unloaded = False
        self.register_load_state_dict_post_hook(save_and_load.base_keys_not_expected)
        self.train(base_model.training)

    def _build_routers(self, config: FocusConfig, layers: list[int], modules: dict) -> dict:
        ref = next(self.base_model.parameters(), None)
        fallback = ref.device if ref is not None else torch.device("cpu")
        if config.router_input == "query_key":
            return self._query_key_routers(config, layers, modules, fallback)
        d_model = hidden_size(self.base_model.config)
        return {
            str(i): FocusRouter(
                d_model,
                config.num_groups,
                config.group_dim,
                config.temperature,
                layer_idx=i,
                seed=config.seed,
                bias_momentum=config.bias_momentum,
                device=_router_device(modules[i], fallback),
            )
            for i in layers
        }

    def _query_key_routers(self, config: FocusConfig, layers: list[int], modules: dict,
                           fallback: torch.device) -> dict:  # fmt: skip
        """One :class:`~.query_key.QueryKeyRouter` per Focus layer."""
        model_config = self.base_model.config
        text = text_config_of(model_config)
        heads, kv_heads = int(text.num_attention_heads), kv_heads_of(model_config)
        return {
            str(i): QueryKeyRouter(
                heads,
                kv_heads,
                int(modules[i].head_dim),
                config.num_groups,
                model_type=self.architecture.model_type,
                layer_idx=i,
                seed=config.seed,
                bias_momentum=config.bias_momentum,
                query_pooling=config.query_pooling,
                device=_router_device(modules[i], fallback),
            )  # fmt: skip
            for i in layers
        }

    def _attach(self, runtime: FocusRuntime, modules: dict) -> dict[int, LayerHandle]:
        """Hand every attention module its handle (a pre-hook on the Focus ones) and every
        PreTrainedModel part the runtime and the call hook; returns the Focus layers'
        handles."""
        handles = {}
        routers = dict(self.routers.items())
        for i, module in modules.items():
            router = routers.get(str(i))
            handle = LayerHandle(i, router, runtime, module=module)
            if router is not None:
                handle.hook = module.register_forward_pre_hook(focus_pre_hook, with_kwargs=True)
                handles[i] = handle
            module.__dict__[HANDLE_ATTR] = handle
        self._model_hooks = []
        for part in _pretrained_parts(self.base_model):
            part.__dict__[RUNTIME_ATTR] = runtime
            self._model_hooks.append(
                part.register_forward_pre_hook(model_pre_hook, with_kwargs=True)
            )
        return handles

    # --- delegation ----------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("base_model", "routers", "_runtime") or name.startswith("__"):
                raise
            try:
                return getattr(self.base_model, name)
            except AttributeError:
                if name in PEFT_MERGE_METHODS:
                    raise AttributeError(_no_merge_message(name)) from None
                if name in PEFT_EQUIVALENTS:
                    raise AttributeError(
                        f"FocusModel has no {name} (PEFT's): {PEFT_EQUIVALENTS[name]}"
                    ) from None
                raise

    @property
    def focus_config(self) -> FocusConfig:
        """The :class:`FocusConfig` in use (immutable; ``layers`` resolved to this model's
        Focus layers).

        Assigning a config makes the next forward use it: ``top_k``, ``window``,
        ``temperature``, ``sinkhorn_iters``, ``gate``, ``gate_sharpness``, ``sink_tokens``,
        ``inference_routing``, ``dense_layers`` and ``bias_momentum`` take effect;
        ``routing``, when it differs from the current config's, acts like
        :meth:`set_routing`. ``layers=None`` means this model's default layers. A KV cache
        filled earlier keeps the groups it was filled with.

        Raises (on assignment):
            ValueError: not a :class:`FocusConfig`; an invalid one; a change to a field in
                :data:`FIXED_CONFIG_FIELDS` (``num_groups``, ``group_dim``, ``layers``,
                ``seed``; the message names the field, what was received and what was
                expected); an unloaded model.
        """
        return self._runtime.focus_config

    @focus_config.setter
    def focus_config(self, config: FocusConfig) -> None:
        self._check_live()
        if not isinstance(config, FocusConfig):
            raise ValueError(
                f"FocusModel.focus_config: received {type(config).__name__}, expected a FocusConfig"
            )
        config.validate()
        current = self._runtime.focus_config
        layers = _resolve_layers(self.base_model.config, self._modules_by_layer, config.layers)
        _check_dense_heads(self.base_model.config, config)
        config = config.replace(layers=layers)
        for name in FIXED_CONFIG_FIELDS:
            received, expected = getattr(config, name), getattr(current, name)
            if received != expected:
                raise ValueError(
                    f"FocusModel.focus_config.{name}: received {received!r}, expected "
                    f"{expected!r} ({name} is fixed once the adapter is built; wrap the base "
                    "model again with get_focus_model to change it)"
                )
        for router in self.routers.values():
            router.temperature = float(config.temperature)
            router.bias_momentum = float(config.bias_momentum)
        if config.routing != current.routing:
            self._runtime.routing = config.routing
        self._runtime.focus_config = config

    def set_top_k(self, top_k: int) -> FocusModel:
        """Route every token to ``top_k`` groups from the next forward on (shorthand for
        ``model.focus_config = model.focus_config.replace(top_k=top_k)``).

        Raises:
            ValueError: ``top_k`` is not an int in ``1..num_groups``.
        """
        self.focus_config = self.focus_config.replace(top_k=top_k)
        return self

    @property
    def focus_layers(self) -> list[int]:
        """Indices of the layers with Focus."""
        return list(self._handles)

    @property
    def routing_mode(self) -> str:
        """``"soft"`` or ``"topk"``: what the next forward uses."""
        return self._runtime.mode(next(iter(self.routers.values())))

    def _check_live(self) -> None:
        """Raise ``ValueError`` on an unloaded model or a switched attention implementation."""
        if self._unloaded:
            raise ValueError("this FocusModel was unloaded; wrap the base model again")
        current = self.base_model.config._attn_implementation
        if current != ATTN_IMPLEMENTATION:
            raise switched_implementation_error(current)

    def _sequence_topk(self) -> bool:
        return (
            self.focus_config.inference_routing == "sequence"
            and self._runtime.current("enabled")
            and self.routing_mode == "topk"
        )

    def _cache_defaults(self, kwargs: dict, args: tuple = (), *, generate: bool = False) -> dict:
        if self._runtime.current("enabled"):
            impl = None
            if generate:  # generate(inputs, generation_config, ...)
                gen_cfg = args[1] if len(args) > 1 else kwargs.get("generation_config")
                gen_cfg = gen_cfg or getattr(self.base_model, "generation_config", None)
                impl = getattr(gen_cfg, "cache_implementation", None)
                impl = kwargs.get("cache_implementation", impl)
            check_cache(kwargs.get("past_key_values", kwargs.get("cache")), impl)
        if self._sequence_topk():
            if (
                kwargs.get("use_cache")
                or kwargs.get("cache") is not None
                or (kwargs.get("past_key_values") is not None)
            ):
                raise ValueError(
                    "inference_routing='sequence' is not causal and cannot use a KV cache; "
                    "call with use_cache=False or use inference_routing='causal'"
                )
            kwargs["use_cache"] = False
        return kwargs

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """The base model's forward (same outputs). The named arguments are those
        ``transformers.Trainer`` reads from the signature to keep a dataset's columns; any
        other keyword goes to the base model as it is. With ``inference_routing="sequence"``
        in top-k mode, ``use_cache`` defaults to False.

        Under ``torch.compile``, a call made while a per-thread switch is open
        (``disable_focus()``, a routing recorder, ``generate()``'s routing) runs eagerly as
        a whole behind one graph break: every layer would run eagerly anyway, and the frames
        between them, compiled once per layer and variant, would reach dynamo's recompile
        limit.

        Raises:
            ValueError: an unloaded model, a switched attention implementation, or a KV
                cache Focus cannot use.
        """
        self._check_live()
        named = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "inputs_embeds": inputs_embeds,
            "labels": labels,
            "use_cache": use_cache,
        }
        kwargs.update({k: v for k, v in named.items() if v is not None})
        if torch.compiler.is_compiling() and overrides_open():
            return _forward_eagerly(self, kwargs)
        return self.base_model(**self._cache_defaults(kwargs))

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The base model's ``generate``, always with top-k routing: generation is inference,
        so under ``routing="auto"`` it routes top-k even while the model is in ``train()``
        mode (no routing-bias update). The top-k routing holds for this call's thread only:
        another thread training the model meanwhile keeps its soft routing. KV-cache
        decoding needs ``inference_routing="causal"``;
        with ``"sequence"`` it runs without a cache (``use_cache=True`` raises ``ValueError``).
        The dynamic cache (the default) and the static one (``cache_implementation="static"``,
        whose decoding steps read nothing back to the host) work; an offloaded-static,
        quantized or other ``cache_implementation`` raises ``ValueError``.

        Raises:
            ValueError: the above, ``set_routing("soft")`` (soft routing cannot decode), an
                unloaded model or a switched attention implementation.
        """
        self._check_live()
        runtime = self._runtime
        routing = runtime.current("routing")
        if runtime.current("enabled") and routing == "soft":
            raise ValueError(
                "generate() with set_routing('soft'): soft (Sinkhorn) routing is not causal and "
                "cannot decode with a KV cache; use set_routing('auto') or 'topk'"
            )
        with runtime.switched(routing="topk" if routing == "auto" else routing):
            kwargs = self._cache_defaults(kwargs, args, generate=True)
            return self.base_model.generate(*args, **kwargs)

    def set_attn_implementation(self, attn_implementation: Any, **kwargs: Any) -> None:
        """Refuse to switch a Focus model to another attention implementation (its Focus
        layers would silently run dense attention while :attr:`focus_config` says Focus).

        Raises:
            ValueError: any implementation other than ``"focus"``; the message names
                :meth:`disable_focus` and :meth:`unload`.
        """
        self._check_live()
        if attn_implementation != ATTN_IMPLEMENTATION:
            raise switched_implementation_error(attn_implementation)

    # --- modes ---------------------------------------------------------------------------

    def set_routing(self, mode: str) -> FocusModel:
        """Force ``"soft"`` or ``"topk"`` routing, or ``"auto"`` (follow train/eval).

        Raises:
            ValueError: unknown mode.
        """
        if mode not in ROUTINGS:
            raise ValueError(f"set_routing: received {mode!r}, expected one of {ROUTINGS}")
        self._runtime.routing = mode
        return self

    def requires_grad_(self, requires_grad: bool = True) -> FocusModel:
        """Set ``requires_grad`` of the routers' parameters only: the base model stays frozen
        (unfreeze it explicitly with ``model.base_model.requires_grad_(True)``)."""
        self.routers.requires_grad_(requires_grad)
        return self

    @contextlib.contextmanager
    def disable_focus(self) -> Iterator[None]:
        """Context in which the model computes exactly the base model (every layer runs its
        base attention implementation, with its masks and caches); Focus comes back on exit.

        The switch belongs to the calling thread (or asyncio task): other threads calling the
        model meanwhile keep Focus. The model's ``config._attn_implementation`` stays
        ``"focus"``; the Focus attention function hands every layer to the base
        implementation (docs/method.md §8)."""
        self._check_live()
        with self._runtime.switched(enabled=False):
            yield

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """PEFT's name of :meth:`disable_focus`: a context in which the model computes
        exactly the base model."""
        with self.disable_focus():
            yield

    def get_base_model(self) -> nn.Module:
        """The wrapped transformers model (PEFT's ``get_base_model``), which runs Focus
        while it is attached: :attr:`base_model`. :meth:`unload` returns it without Focus."""
        return self.base_model

    @contextlib.contextmanager
    def record_routing(self) -> Iterator[list[dict[str, Any]]]:
        """Collect one record per routed Focus-layer call (none from ``dense_layers``):
        ``layer``, ``mode``, ``query_groups`` bool ``[B, Nq, K]``, ``key_groups`` bool
        ``[B, Nk, K]`` (top-k; sinks included), ``key_padding`` bool ``[B, Nk]`` or None,
        ``sinks``, ``num_keys`` and, in soft mode, ``probs`` ``[B, N, K]``. For tests and
        analysis."""
        with self._recording("recorder") as records:
            yield records

    @contextlib.contextmanager
    def record_dense_attention(self) -> Iterator[list[dict[str, Any]]]:
        """Context in which the model computes exactly the base model (every layer runs the
        base attention implementation) while each routed Focus layer (not those in
        ``dense_layers``) records the inputs of its dense attention: ``layer``, ``hidden``
        ``[B, N, d_model]`` (the hidden state its router reads), ``query`` ``[B, H, N, D]``
        and ``key`` ``[B, H_kv, N, D]`` (after the rotary embedding), ``scale``,
        ``softcap``, ``key_padding`` bool ``[B, N]`` or None and ``sinks`` bool ``[B, N]``
        or None, all detached. The dense teacher of the coverage
        objective (docs/method.md §6).

        Raises:
            ValueError: (on a call inside) a KV cache is used; call with ``use_cache=False``.
        """
        self._check_live()
        with self._recording("dense_recorder") as records:
            yield records

    @contextlib.contextmanager
    def override_visibility(self, visibility: Callable[[int, Any], torch.Tensor]) -> Iterator[None]:  # fmt: skip
        """Context in which every routed Focus layer (not those in ``dense_layers``; dense
        heads stay dense) attends under the mask ``visibility(layer_idx, call)`` returns
        instead of its routing's, for diagnostics: ``call`` is the layer's
        :class:`~focus_attention.hf.layer_call.LayerCall` (``query [B, H, Nq, D]``, ``key``
        ``[B, H_kv, Nk, D]`` past and new, ``sinks`` and ``real`` bool ``[B, Nk]`` or None),
        the mask bool ``[B, Nq, Nk]``, ``[B, H_kv, Nq, Nk]`` or ``[B, H, Nq, Nk]``, True =
        visible. The routers still route (a cache keeps its groups). The attention is the
        dense masked one (``O(Nq * Nk)``). The switch belongs to the calling thread.

        Raises:
            ValueError: (on a call inside) a static KV cache or soft routing.
        """
        self._check_live()
        with self._runtime.switched(visibility=visibility):
            yield

    @contextlib.contextmanager
    def _recording(self, attr: str) -> Iterator[list[dict[str, Any]]]:
        """A fresh list in the runtime's recorder ``attr`` for the context, in the calling
        thread only; the previous recorder is back on exit."""
        records: list[dict[str, Any]] = []
        with self._runtime.switched(**{attr: records}):
            yield records

    @torch.no_grad()
    def calibrate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        reset: bool = False,
    ) -> None:
        """Feed one batch through soft routing to update every router's ``routing_bias``
        (the causal top-k bias, docs/method.md §4) without training; base model and modes
        are restored. ``reset=True`` first forgets the bias collected so far (zero bias, no
        updates), so the batch alone sets it; later calls average in as in training."""
        self._check_live()
        if reset:
            with torch.no_grad():
                for router in self.routers.values():
                    router.routing_bias.zero_()
                    router.bias_updates.zero_()
        was = {name: m.training for name, m in self.named_modules()}
        try:
            self.base_model.eval()
            self.routers.train()
            with self._runtime.switched(routing="soft"):
                self.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)  # fmt: skip
        finally:
            for name, m in self.named_modules():
                m.training = was[name]

    # --- parameters and state ------------------------------------------------------------

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """``(trainable parameters, all parameters)`` counted over base model and routers."""
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        return trainable, total

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """``PreTrainedModel.num_parameters`` of the base model plus the routers' parameters
        (those with ``requires_grad`` when ``only_trainable``)."""
        base = self.base_model.num_parameters(
            only_trainable=only_trainable, exclude_embeddings=exclude_embeddings
        )
        routers = self.routers.parameters()
        return base + sum(p.numel() for p in routers if p.requires_grad or not only_trainable)

    def get_memory_footprint(self, return_buffers: bool = True) -> int:
        """Bytes of the base model's parameters (and buffers) plus the routers'."""
        tensors = list(self.routers.parameters())
        if return_buffers:
            tensors += list(self.routers.buffers())
        own = sum(t.numel() * t.element_size() for t in tensors)
        return self.base_model.get_memory_footprint(return_buffers=return_buffers) + own

    def print_trainable_parameters(self) -> None:
        """Print ``trainable params: N || all params: M || trainable%: P`` (PEFT's format)."""
        trainable, total = self.get_nb_trainable_parameters()
        pct = 100 * trainable / total if total else 0.0
        print(
            f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {pct:.4f}"
        )

    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars: bool = False):
        """The Focus state only: ``routers.{i}.proj`` / ``.centroids`` / ``.routing_bias`` /
        ``.bias_updates`` and ``focus_config`` (the config document of
        :data:`CONFIG_NAME`, base-model fingerprint included, as a 1-D uint8 tensor).

        The base model is frozen and saved with the base (``model.base_model.state_dict()``).
        This is what ``transformers.Trainer`` writes to ``model.safetensors`` for a model
        that is not a ``PreTrainedModel``: its checkpoints and ``save_model`` output are Focus
        adapters that :meth:`from_pretrained` loads and ``resume_from_checkpoint`` restores.
        """
        return save_and_load.state_dict(
            self, *args, destination=destination, prefix=prefix, keep_vars=keep_vars
        )

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        """How a FocusModel inside another module (``torch.compile``, DDP, an EMA copy, a
        parent ``nn.Module``) loads its :meth:`state_dict`: the config entry takes effect as
        in :meth:`load_state_dict` (never dropped, also with ``strict=False``) and the base
        model's weights, which the state does not hold, are not reported missing."""
        save_and_load.load_from_state_dict(
            self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a :meth:`state_dict` (router tensors and, when present, the config, whose
        settings then take effect as if assigned to :attr:`focus_config`).

        Returns:
            ``(missing_keys, unexpected_keys)`` as ``nn.Module.load_state_dict`` does.

        Raises:
            ValueError: with ``strict``, missing or unexpected keys (named); a config that
                differs in ``num_groups``, ``group_dim`` or ``layers``; shape mismatches;
                router values that are NaN or infinite (nothing is loaded then).
        """
        return save_and_load.load_state_dict(self, state_dict, strict=strict, assign=assign)

    def focus_state_dict(self) -> dict[str, torch.Tensor]:
        """Only the Focus tensors in the adapter file's layout: ``layer.{i}.proj``,
        ``.centroids``, ``.routing_bias``, ``.bias_updates`` (detached, CPU, contiguous)."""
        return save_and_load.focus_state_dict(self)

    def load_focus_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load :meth:`focus_state_dict` output strictly.

        Raises:
            ValueError: missing or unexpected keys, a shape mismatch, or NaN or infinite
                values (names them).
        """
        save_and_load.load_focus_state_dict(self, tensors)

    def load_routers(self, directory: str | os.PathLike) -> FocusModel:
        """Load the router weights of a saved adapter (projections, centroids, routing bias
        and its update count) into this model, keeping this model's :class:`FocusConfig`:
        to continue training an adapter under other settings, for example at another
        ``window`` or block length (``focus train --init-adapter``, docs/method.md §6).

        Args:
            directory: a folder written by :meth:`save_pretrained`.

        Returns:
            this model.

        Raises:
            FileNotFoundError: no adapter files in ``directory`` (a Trainer output folder is
                not read here: load it with :meth:`from_pretrained`).
            UnreadableFileError: a damaged or unreadable file (a ``ValueError``; the message
                names the file and what was expected).
            ValueError: config and weights that do not belong together (an interrupted
                save); another ``num_groups``, ``group_dim`` or set of Focus layers than
                this model's (the message names the field and both values).

        Warns:
            FocusBaseMismatchWarning: the adapter was saved on a base model with other weights.
        """
        return save_and_load.load_routers(self, directory)

    # --- files ---------------------------------------------------------------------------

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        state_dict: dict[str, torch.Tensor] | None = None,
        safe_serialization: bool = True,
        is_main_process: bool = True,
        model_card: bool = True,
    ) -> None:
        """Write :data:`CONFIG_NAME` and :data:`WEIGHTS_NAME` into ``save_directory``
        (created if needed; other files there are left alone) all-or-nothing: both are
        written to temporary files first and renamed into place together, and a failure
        at any step leaves the previous adapter there as it was (docs/method.md §8, "Files
        and failures"). They hold only the Focus tensors (float32), the config and a
        fingerprint of the base model (:func:`base_model_fingerprint`); the weights file's
        metadata carries a copy of the config, which every load checks. A model card,
        ``README.md`` (the base model, the settings, the training and ``focus eval``
        records found beside the adapter; docs/deploy.md), is part of the same write,
        unless the folder holds a ``README.md`` this package did not write.

        Args:
            save_directory: the folder.
            state_dict: a :meth:`state_dict` to write instead of the model's own (as
                ``PreTrainedModel.save_pretrained`` takes one).
            safe_serialization: must be True (safetensors is the only format).
            is_main_process: False writes nothing (the other ranks of a distributed run).
            model_card: False writes no ``README.md``.

        Raises:
            ValueError: ``safe_serialization=False``; a ``state_dict`` without the config.
            OSError: a write failed (the folder's previous adapter is left as it was).
        """
        save_and_load.save_pretrained(
            self, save_directory, state_dict, safe_serialization, is_main_process, model_card
        )

    @classmethod
    def from_pretrained(
        cls,
        base_model: nn.Module,
        directory: str | os.PathLike,
        is_trainable: bool = False,
        *,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> FocusModel:
        """Attach saved Focus routers to ``base_model``.

        Args:
            base_model: the base model (any dtype/device; the routers are float32 on the
                devices of their layers).
            directory: a folder written by :meth:`save_pretrained`, the output /
                checkpoint folder of a ``transformers.Trainer`` that trained a FocusModel
                (``model.safetensors``), or a Hugging Face hub repo id (``org/name``, not
                an existing path) holding an adapter, fetched with
                ``huggingface_hub.snapshot_download`` (which honours ``HF_HUB_OFFLINE`` and
                the hub cache; docs/deploy.md).
            is_trainable: False (default): routers frozen (``requires_grad`` False) and the
                model in ``eval()`` (top-k) mode; True: routers trainable.
            revision, token, cache_dir: for a hub repo id, the branch, tag or commit, the
                access token and the cache folder (``snapshot_download``'s).

        Raises:
            FileNotFoundError: a file is missing; a repo id the hub (or, offline, its
                cache) cannot provide (the message says why).
            UnreadableFileError: an empty, truncated, garbage or unreadable file, an invalid
                config or another format version (a ``ValueError``; the message names the
                file and what was expected).
            ValueError: config and weights that do not belong together (an interrupted
                save; the message names both files); a base model with another type, layer
                count or hidden size; missing or extra tensors; shape mismatches.

        Warns:
            FocusBaseMismatchWarning: same structure but different parameter shapes or
                weights than the base the adapter was saved with.
        """
        return save_and_load.from_pretrained(
            cls,
            base_model,
            directory,
            is_trainable,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
        )

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        commit_message: str | None = None,
        create_pr: bool = False,
    ) -> Any:
        """Upload the adapter (:meth:`save_pretrained` output, model card included) to the
        Hugging Face hub repo ``repo_id``, created if needed (docs/deploy.md).

        Returns:
            ``huggingface_hub.CommitInfo`` of the upload.

        Raises:
            ValueError: a ``repo_id`` that is not ``name`` or ``org/name``.
            huggingface_hub errors: authentication, network (as ``HfApi`` raises them).
        """
        return save_and_load.push_to_hub(
            self,
            repo_id,
            private=private,
            token=token,
            revision=revision,
            commit_message=commit_message,
            create_pr=create_pr,
        )

    # --- teardown ------------------------------------------------------------------------

    def unload(self) -> nn.Module:
        """Remove Focus completely and return the base model as it was: hooks and handles
        removed, attention implementation and ``requires_grad`` flags restored. This
        FocusModel is unusable afterwards; the base model can be wrapped again."""
        if self._unloaded:
            raise ValueError("this FocusModel was unloaded; wrap the base model again")
        base = self.base_model
        for handle in self._handles.values():
            handle.hook.remove()
        for module in self._modules_by_layer.values():
            module.__dict__.pop(HANDLE_ATTR, None)
        for hook in self._model_hooks:
            hook.remove()
        for part in _pretrained_parts(base):
            part.__dict__.pop(RUNTIME_ATTR, None)
        base.config._attn_implementation = self._runtime.base_impl
        base.__dict__.pop("create_masks_for_generate", None)
        for name, p in base.named_parameters():
            p.requires_grad_(self._requires_grad.get(name, p.requires_grad))
        self._handles = {}
        self._unloaded = True
        return base


#: PEFT's methods that fold an adapter into the base weights; a FocusModel has none of them
#: (``hasattr`` stays False, as tools that detect PEFT models expect)
PEFT_MERGE_METHODS = ("merge_and_unload", "merge_adapter", "unmerge_adapter")


#: PEFT's attributes a FocusModel has not (its base model neither), each with what to use
#: instead: asked of a FocusModel, each is one AttributeError saying so (``hasattr`` stays
#: False, as tools that detect PEFT models by ``peft_config`` expect)
PEFT_EQUIVALENTS = {
    "peft_config": "its settings are focus_config, a FocusConfig (model.focus_config)",
    "peft_type": "a FocusModel is not a PEFT model; its settings are model.focus_config",
    "active_adapter": "a FocusModel holds one adapter, always on; disable_focus() (or "
    "disable_adapter()) turns it off in a with block",
    "disable_adapter_layers": "Focus is turned off in a with block: disable_focus() (or "
    "disable_adapter()); unload() removes it",
    "enable_adapter_layers": "Focus is on except inside disable_focus() (or disable_adapter())",
}


def _no_merge_message(name: str) -> str:
    """The AttributeError message of a PEFT merge method ``name`` asked of a FocusModel."""
    return (
        f"FocusModel has no {name}(): Focus cannot be merged into the base weights (it "
        "changes which keys each query attends to, not the weights); unload() returns the "
        "base model without Focus, and focus export (focus_attention.export_model) writes "
        "the model with Focus as one directory that transformers loads "
        "(trust_remote_code=True)"
    )


@eager_only
def _forward_eagerly(model: FocusModel, kwargs: dict[str, Any]) -> Any:
    """:meth:`FocusModel.forward`'s base-model call, eagerly (a graph break under
    ``torch.compile``, with nothing below it compiled)."""
    return model.base_model(**model._cache_defaults(kwargs))


def get_focus_model(model: nn.Module, config: FocusConfig | None = None) -> FocusModel:
    """Retrofit Focus onto a Hugging Face causal LM (docs/method.md §8).

    Adds one router (``proj [d_model, d_g]``, ``centroids [K, d_g]``, float32) per chosen
    layer, freezes every base parameter, routes from the hidden state entering each
    attention module, and registers the ``"focus"`` attention and mask functions with
    transformers.

    Args:
        model: a supported transformers model (see :data:`SUPPORTED_MODEL_TYPES`), modified
            in place (use :meth:`FocusModel.unload` to undo).
        config: :class:`FocusConfig`; default ``FocusConfig()``.

    Returns:
        the :class:`FocusModel` wrapping ``model``.

    Raises:
        ValueError: see :class:`FocusModel`.

    Warns:
        FocusSlidingWindowWarning: Focus layers replace a sliding-window attention.
    """
    return FocusModel(model, config)
