"""``get_focus_model`` / ``FocusModel``: the PEFT-like Focus adapter (issue 3 section 2)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..utils.io import atomic_write
from .architectures import (
    attention_modules,
    get_architecture,
    hidden_size,
    layer_types,
)
from .attention import (
    ATTN_IMPLEMENTATION,
    FocusRuntime,
    LayerHandle,
    check_dynamic_cache,
    focus_pre_hook,
    register_focus_attention,
    register_runtime,
    unregister_runtime,
)
from .config import ROUTINGS, FocusConfig, read_config_file
from .router import FocusRouter

CONFIG_NAME = "focus_config.json"
WEIGHTS_NAME = "focus_model.safetensors"
_ROUTER_TENSORS = ("proj", "centroids", "routing_bias", "bias_updates")
#: elements sampled from each of a few base tensors for the weight fingerprint.
_FINGERPRINT_SAMPLE = 4096
#: FocusConfig fields fixed once a FocusModel is built: they set the routers' parameter
#: shapes (num_groups, group_dim), which layers have routers (layers), or only the routers'
#: initialisation (seed).
FIXED_CONFIG_FIELDS = ("num_groups", "group_dim", "layers", "seed")


class FocusBaseMismatchWarning(UserWarning):
    """The base model differs from the one a Focus adapter was saved with (same structure)."""


# --------------------------------------------------------------------------------------------
# fingerprint
# --------------------------------------------------------------------------------------------


def base_model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Identity of a base model, recorded next to saved Focus parameters (issue 3 section 2).

    Returns:
        JSON-able dict: ``model_type``, ``num_hidden_layers``, ``hidden_size``,
        ``num_parameters``, ``parameter_shapes_sha256`` (names and shapes of every
        parameter), ``weights_sha256`` (the first 4096 values of four parameters spread over
        the model, rounded to bfloat16 so a bf16 copy of the same weights matches; None on the
        meta device) and ``sampled_parameters`` (their names).
    """
    cfg = model.config
    named = list(model.named_parameters())
    shapes = hashlib.sha256()
    for name, p in named:
        shapes.update(f"{name}:{tuple(p.shape)}\n".encode())
    picks = sorted({0, len(named) // 3, (2 * len(named)) // 3, len(named) - 1}) if named else []
    sampled = [named[i][0] for i in picks]
    weights: str | None = None
    if all(named[i][1].device.type != "meta" for i in picks):
        digest = hashlib.sha256()
        for i in picks:
            name, p = named[i]
            vals = p.detach().reshape(-1)[:_FINGERPRINT_SAMPLE].to(torch.bfloat16).float().cpu()
            digest.update(name.encode())
            digest.update(vals.numpy().tobytes())
        weights = digest.hexdigest()
    return {
        "model_type": cfg.model_type,
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "hidden_size": hidden_size(cfg),
        "num_parameters": int(sum(p.numel() for _, p in named)),
        "parameter_shapes_sha256": shapes.hexdigest(),
        "weights_sha256": weights,
        "sampled_parameters": sampled,
    }


def _compare_fingerprints(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Raise on a structural mismatch, warn on same-structure differences (C13)."""
    for key in ("model_type", "num_hidden_layers", "hidden_size"):
        if saved.get(key) != current.get(key):
            raise ValueError(
                f"{where}: the Focus adapter was saved for a base model with {key}="
                f"{saved.get(key)!r}, this base model has {key}={current.get(key)!r}"
            )
    if saved.get("parameter_shapes_sha256") != current.get("parameter_shapes_sha256"):
        warnings.warn(
            f"{where}: the base model's parameter names/shapes differ from those the adapter was "
            f"saved with (parameter_shapes_sha256 {saved.get('parameter_shapes_sha256')} vs "
            f"{current.get('parameter_shapes_sha256')}; num_parameters "
            f"{saved.get('num_parameters')} vs {current.get('num_parameters')})",
            FocusBaseMismatchWarning,
            stacklevel=3,
        )
    elif (
        saved.get("weights_sha256") is not None
        and current.get("weights_sha256") is not None
        and saved["weights_sha256"] != current["weights_sha256"]
    ):
        warnings.warn(
            f"{where}: the base model has the same shapes but different weights than the one the "
            f"adapter was saved with (weights_sha256 of sampled parameters "
            f"{saved.get('sampled_parameters')}: saved {saved['weights_sha256']}, this base "
            f"{current['weights_sha256']})",
            FocusBaseMismatchWarning,
            stacklevel=3,
        )


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


# --------------------------------------------------------------------------------------------
# the adapter
# --------------------------------------------------------------------------------------------


class FocusModel(nn.Module):
    """A Hugging Face causal LM with Focus routers on its attention layers (issue 3).

    Build it with :func:`get_focus_model`. Every base parameter is frozen; one
    :class:`FocusRouter` per Focus layer holds the only trainable parameters
    (``d_model * d_g + K * d_g`` per layer). ``forward`` and ``generate`` are the wrapped
    model's; unknown attributes are looked up on the base model.

    Routing: ``train()`` uses soft Sinkhorn routing with the soft gate, ``eval()`` hard top-k
    routing through exact sparse attention; :meth:`set_routing` overrides. KV-cache decoding
    works in top-k mode with causal inference routing (the default).

    Settings: :attr:`focus_config` is the (immutable) config in use; assign a new one, e.g.
    ``model.focus_config = model.focus_config.replace(top_k=1, window=64)``, or call
    :meth:`set_top_k`, to change settings from the next forward on. The fields in
    :data:`FIXED_CONFIG_FIELDS` cannot change.

    Args:
        base_model: a supported transformers causal LM (``gpt2``, ``llama``, ``mistral``,
            ``qwen2``, ``gemma2``, ``gemma3_text``, ``olmo2``).
        config: the :class:`FocusConfig` (default ``FocusConfig()``).

    Raises:
        ValueError: unsupported model type (the message lists the supported ones), a model
            that already has Focus, layer indices that do not exist, a model without any
            full-attention layer and no explicit ``layers``.
    """

    def __init__(self, base_model: nn.Module, config: FocusConfig | None = None) -> None:
        super().__init__()
        config = FocusConfig() if config is None else config
        if not isinstance(config, FocusConfig):
            raise ValueError(f"config: received {type(config).__name__}, expected a FocusConfig")
        arch = get_architecture(base_model)
        model_config = base_model.config
        base_impl = model_config._attn_implementation or "eager"
        if base_impl == ATTN_IMPLEMENTATION:
            raise ValueError("this model already uses the 'focus' attention implementation")
        modules = attention_modules(base_model, arch)
        layers = _resolve_layers(model_config, modules, config.layers)
        self.architecture = arch
        runtime = FocusRuntime(config.replace(layers=layers), base_impl, routing=config.routing)
        register_runtime(model_config, runtime)

        object.__setattr__(self, "_runtime", runtime)
        self.base_model = base_model
        ref = next(base_model.parameters(), None)
        device = ref.device if ref is not None else torch.device("cpu")
        d_model = hidden_size(model_config)
        routers = {}
        for i in layers:
            router = FocusRouter(
                d_model,
                config.num_groups,
                config.group_dim,
                config.temperature,
                layer_idx=i,
                seed=config.seed,
                bias_momentum=config.bias_momentum,
            )
            routers[str(i)] = router.to(device)
        self.routers = nn.ModuleDict(routers)
        self._requires_grad = {n: p.requires_grad for n, p in base_model.named_parameters()}
        for p in base_model.parameters():
            p.requires_grad_(False)
        self._handles: dict[int, LayerHandle] = {}
        for i in layers:
            module = modules[i]
            handle = LayerHandle(i, self.routers[str(i)], runtime)
            handle.hook = module.register_forward_pre_hook(focus_pre_hook, with_kwargs=True)
            module.__dict__["_focus_handle"] = handle
            self._handles[i] = handle
        self._modules_by_layer = modules
        register_focus_attention()
        model_config._attn_implementation = ATTN_IMPLEMENTATION
        self._unloaded = False
        self.train(base_model.training)

    # --- delegation ----------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("base_model", "routers", "_runtime") or name.startswith("__"):
                raise
            return getattr(self.base_model, name)

    @property
    def focus_config(self) -> FocusConfig:
        """The :class:`FocusConfig` in use (immutable; ``layers`` resolved to this model's
        Focus layers).

        Assigning a config makes the next forward use it: ``top_k``, ``window``,
        ``temperature``, ``sinkhorn_iters``, ``gate``, ``gate_sharpness``, ``sink_tokens``,
        ``inference_routing`` and ``bias_momentum`` take effect; ``routing``, when it differs
        from the current config's, acts like :meth:`set_routing`. ``layers=None`` means this
        model's default layers. A KV cache filled earlier keeps the groups it was filled with.

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
        if self._unloaded:
            raise ValueError("this FocusModel was unloaded; wrap the base model again")

    def _sequence_topk(self) -> bool:
        return (
            self.focus_config.inference_routing == "sequence"
            and self._runtime.enabled
            and self.routing_mode == "topk"
        )

    def _cache_defaults(self, kwargs: dict, args: tuple = (), *, generate: bool = False) -> dict:
        if self._runtime.enabled:
            impl = None
            if generate:  # generate(inputs, generation_config, ...)
                gen_cfg = args[1] if len(args) > 1 else kwargs.get("generation_config")
                gen_cfg = gen_cfg or getattr(self.base_model, "generation_config", None)
                impl = getattr(gen_cfg, "cache_implementation", None)
                impl = kwargs.get("cache_implementation", impl)
            check_dynamic_cache(kwargs.get("past_key_values", kwargs.get("cache")), impl)
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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The base model's forward (same arguments and outputs). With
        ``inference_routing="sequence"`` in top-k mode, ``use_cache`` defaults to False."""
        self._check_live()
        return self.base_model(*args, **self._cache_defaults(kwargs))

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The base model's ``generate``. KV-cache decoding needs top-k routing with
        ``inference_routing="causal"``; with ``"sequence"`` it runs without a cache
        (``use_cache=True`` raises ``ValueError``). Only the dynamic cache (the default) works:
        a static, quantized or other ``cache_implementation`` raises ``ValueError``."""
        self._check_live()
        return self.base_model.generate(*args, **self._cache_defaults(kwargs, args, generate=True))

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

    @contextlib.contextmanager
    def disable_focus(self) -> Iterator[None]:
        """Context in which the model is exactly the base model (its own attention
        implementation, masks and caches); Focus comes back on exit."""
        self._check_live()
        runtime = self._runtime
        cfg = self.base_model.config
        previous = runtime.enabled
        runtime.enabled = False
        cfg._attn_implementation = runtime.base_impl
        try:
            yield
        finally:
            runtime.enabled = previous
            cfg._attn_implementation = ATTN_IMPLEMENTATION if previous else runtime.base_impl

    @contextlib.contextmanager
    def record_routing(self) -> Iterator[list[dict[str, Any]]]:
        """Collect one record per Focus-layer call: ``layer``, ``mode``, ``query_groups``
        bool ``[B, Nq, K]``, ``key_groups`` bool ``[B, Nk, K]`` (top-k; sinks included),
        ``key_padding`` bool ``[B, Nk]`` or None, ``sinks``, ``num_keys`` and, in soft mode,
        ``probs`` ``[B, N, K]``. For tests and analysis."""
        records: list[dict[str, Any]] = []
        previous = self._runtime.recorder
        self._runtime.recorder = records
        try:
            yield records
        finally:
            self._runtime.recorder = previous

    @torch.no_grad()
    def calibrate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> None:
        """Feed one batch through soft routing to update every router's ``routing_bias``
        (the causal top-k bias) without training; base model and modes are restored."""
        self._check_live()
        was = {name: m.training for name, m in self.named_modules()}
        routing = self._runtime.routing
        try:
            self.base_model.eval()
            self.routers.train()
            self._runtime.routing = "soft"
            self.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            self._runtime.routing = routing
            for name, m in self.named_modules():
                m.training = was[name]

    # --- parameters ----------------------------------------------------------------------

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """``(trainable parameters, all parameters)`` counted over base model and routers."""
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        return trainable, total

    def print_trainable_parameters(self) -> None:
        """Print ``trainable params: N || all params: M || trainable%: P`` (PEFT's format)."""
        trainable, total = self.get_nb_trainable_parameters()
        pct = 100 * trainable / total if total else 0.0
        print(
            f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {pct:.4f}"
        )

    def focus_state_dict(self) -> dict[str, torch.Tensor]:
        """Only the Focus tensors: ``layer.{i}.proj``, ``.centroids``, ``.routing_bias``,
        ``.bias_updates`` (detached, CPU, contiguous)."""
        out = {}
        for i, router in self.routers.items():
            for name in _ROUTER_TENSORS:
                t = getattr(router, name).detach().cpu().contiguous()
                out[f"layer.{i}.{name}"] = t.reshape(1) if t.ndim == 0 else t
        return out

    @torch.no_grad()
    def load_focus_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load :meth:`focus_state_dict` output strictly.

        Raises:
            ValueError: missing or unexpected keys, or a shape mismatch (names them).
        """
        expected = {f"layer.{i}.{n}" for i in self.routers for n in _ROUTER_TENSORS}
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        if missing or extra:
            raise ValueError(
                f"Focus weights do not match this adapter: missing keys {missing}, "
                f"unexpected keys {extra}"
            )
        for i, router in self.routers.items():
            for name in _ROUTER_TENSORS:
                dst = getattr(router, name)
                src = tensors[f"layer.{i}.{name}"]
                if src.numel() != dst.numel() or (
                    dst.ndim and tuple(src.shape) != tuple(dst.shape)
                ):
                    raise ValueError(
                        f"Focus weights: layer.{i}.{name} has shape {tuple(src.shape)}, "
                        f"this adapter expects {tuple(dst.shape)}"
                    )
                dst.copy_(src.reshape(dst.shape).to(dtype=dst.dtype, device=dst.device))

    # --- files ---------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write ``focus_config.json`` and ``focus_model.safetensors`` into
        ``save_directory`` (created if needed), each atomically (temporary file, fsync,
        rename; the config last). They hold only the Focus tensors, the config and a
        fingerprint of the base model (:func:`base_model_fingerprint`)."""
        self._check_live()
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        fingerprint = base_model_fingerprint(self.base_model)
        tensors = self.focus_state_dict()
        meta = {"format": "pt", "focus_config": self.focus_config.to_json_string()}
        atomic_write(directory / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata=meta))
        doc = self.focus_config.to_dict()
        doc["base_model_fingerprint"] = fingerprint
        doc["library"] = "focus_attention"
        text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
        atomic_write(directory / CONFIG_NAME, lambda p: Path(p).write_text(text))

    @classmethod
    def from_pretrained(
        cls,
        base_model: nn.Module,
        directory: str | os.PathLike,
        is_trainable: bool = False,
    ) -> FocusModel:
        """Attach saved Focus routers to ``base_model``.

        Args:
            base_model: the base model (any dtype/device).
            directory: a folder written by :meth:`save_pretrained`.
            is_trainable: False (default): routers frozen (``requires_grad`` False) and the
                model in ``eval()`` (top-k) mode; True: routers trainable.

        Raises:
            FileNotFoundError: a file is missing.
            ValueError: a corrupt or invalid ``focus_config.json`` (the message names it); a
                base model with another type, layer count or hidden size; missing or extra
                tensors; shape mismatches.

        Warns:
            FocusBaseMismatchWarning: same structure but different parameter shapes or
                weights than the base the adapter was saved with.
        """
        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory / name} not found")
        config, extra = read_config_file(directory / CONFIG_NAME)
        saved_fp = extra.get("base_model_fingerprint") or {}
        _compare_fingerprints(
            saved_fp, base_model_fingerprint(base_model), "FocusModel.from_pretrained"
        )
        model = cls(base_model, config)
        try:
            model.load_focus_state_dict(load_file(str(directory / WEIGHTS_NAME)))
        except Exception:
            model.unload()
            raise
        if not is_trainable:
            for p in model.routers.parameters():
                p.requires_grad_(False)
            model.eval()
        return model

    # --- teardown ------------------------------------------------------------------------

    def unload(self) -> nn.Module:
        """Remove Focus completely and return the base model as it was: hooks removed,
        attention implementation and ``requires_grad`` flags restored. This FocusModel is
        unusable afterwards."""
        self._check_live()
        base = self.base_model
        for i, handle in self._handles.items():
            handle.hook.remove()
            self._modules_by_layer[i].__dict__.pop("_focus_handle", None)
        base.config._attn_implementation = self._runtime.base_impl
        unregister_runtime(base.config)
        for name, p in base.named_parameters():
            p.requires_grad_(self._requires_grad.get(name, p.requires_grad))
        self._handles = {}
        self._unloaded = True
        return base


def get_focus_model(model: nn.Module, config: FocusConfig | None = None) -> FocusModel:
    """Retrofit Focus onto a Hugging Face causal LM (issue 3 section 2).

    Adds one router (``proj [d_model, d_g]``, ``centroids [K, d_g]``) per chosen layer,
    freezes every base parameter, routes from the hidden state entering each attention
    module, and registers the ``"focus"`` attention and mask functions with transformers.

    Args:
        model: a supported transformers model (see :data:`SUPPORTED_MODEL_TYPES`), modified
            in place (use :meth:`FocusModel.unload` to undo).
        config: :class:`FocusConfig`; default ``FocusConfig()``.

    Returns:
        the :class:`FocusModel` wrapping ``model``.

    Raises:
        ValueError: see :class:`FocusModel`.
    """
    return FocusModel(model, config)
