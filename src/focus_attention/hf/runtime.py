"""State shared by the Focus layers of one wrapped model, and the hook that opens every call.

Everything a Focus layer needs is reachable from the modules it runs in (no global registry):
each attention module of a wrapped model carries a handle in ``module._focus_handle`` and each
``PreTrainedModel`` of it carries the shared :class:`FocusRuntime` in ``module._focus_runtime``.
Copies (``copy.deepcopy``, pickling) therefore carry their own, independent Focus state.

Settings (``set_routing``, ``focus_config``, ``train()``/``eval()``) are model-wide. The
switches a context turns on for a while (``disable_focus()``, the top-k routing of
``generate()``, the routing recorders) belong to the calling thread, or asyncio task: they
are :class:`contextvars.ContextVar` overrides (:meth:`FocusRuntime.switched`), so another
thread calling the same model meanwhile is not affected (docs/method.md §8).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..utils.compile import eager_only

ATTN_IMPLEMENTATION = "focus"
#: attribute (in ``module.__dict__``) holding the runtime on the hooked PreTrainedModels
RUNTIME_ATTR = "_focus_runtime"
#: the switches a context may override (see :meth:`FocusRuntime.switched`)
SWITCHES = ("enabled", "routing", "recorder", "dense_recorder", "visibility")
#: the overrides active in this thread / task: ``((runtime, {switch: value}), ...)``, innermost last
_OVERRIDES: contextvars.ContextVar[tuple] = contextvars.ContextVar("focus_overrides", default=())
#: how many :meth:`FocusRuntime.switched` contexts are open, in every thread: while none is,
#: :meth:`FocusRuntime.current` reads the fields without the context lookup, which dynamo
#: cannot trace (a compiled model then has no graph break there)
_open_switches = 0
_switches_lock = threading.Lock()


@dataclass(eq=False)
class FocusRuntime:
    """State shared by the Focus layers of one wrapped model (docs/method.md §8).

    Attributes:
        focus_config: the :class:`FocusConfig` in use, read by every Focus-layer call (replaced
            as a whole when ``FocusModel.focus_config`` is assigned).
        base_impl: the model's attention implementation before Focus (``"sdpa"``, ``"eager"``...).
        enabled: whether Focus is on, model-wide (True; ``disable_focus()`` overrides it in
            its own thread, see :meth:`current`).
        routing: ``"auto"``, ``"soft"`` or ``"topk"`` (see :class:`FocusConfig`), model-wide
            (``generate()`` overrides it in its own thread).
        recorder: list receiving one record per Focus-layer call while recording, else None
            (set by ``FocusModel.record_routing()`` for its own thread).
        dense_recorder: list receiving, per Focus-layer call, the dense attention's inputs
            while ``FocusModel.record_dense_attention()`` is active (Focus layers then run
            the base implementation), else None (set for its own thread).
        visibility: while ``FocusModel.override_visibility()`` is active, the function
            giving each routed Focus layer's attention mask in place of its routing's, else
            None (set for its own thread).
        calls: number of model calls so far (the routing bias is updated once per call);
            a compiled inference call traced without the eager hook is not counted
            (see :func:`traced_model_call`: training always counts).
        want_attentions: the threads whose current call asked for attention maps (True;
            read it with :meth:`wants_attentions`).
        focus_layers: indices of the Focus layers; num_layers: attention layers of the model.
        routers: the routers of the Focus layers, keyed by layer index.
        warned: warnings already given for this model (each is given once).
        model_config: the wrapped model's ``PretrainedConfig`` (its mask function finds the
            runtime through it, see :func:`disabled_base_impl`).
        head_gates: a :class:`~focus_attention.hf.head_gates.HeadGates` mixing every routed
            Focus layer's heads with their dense outputs, or None (the default).
    """

    focus_config: Any
    base_impl: str
    enabled: bool = True
    routing: str = "auto"
    recorder: list | None = None
    dense_recorder: list | None = None
    visibility: Any = None
    calls: int = 0
    want_attentions: dict = field(default_factory=dict)
    focus_layers: tuple[int, ...] = ()
    num_layers: int = 0
    routers: dict = field(default_factory=dict)
    warned: set = field(default_factory=set)
    model_config: Any = field(default=None, repr=False)
    head_gates: Any = field(default=None, repr=False)

    def current(self, name: str) -> Any:
        """The value of the switch ``name`` (one of :data:`SWITCHES`) for the calling thread or
        task: the innermost :meth:`switched` override of this runtime, else the field."""
        if not _open_switches:
            return getattr(self, name)
        for runtime, overrides in reversed(_OVERRIDES.get()):
            if runtime is self and name in overrides:
                return overrides[name]
        return getattr(self, name)

    @contextlib.contextmanager
    def switched(self, **overrides: Any) -> Iterator[None]:
        """Context in which :meth:`current` returns ``overrides`` in the calling thread (or
        asyncio task) only; other threads keep seeing the model-wide fields. Nests.

        Raises:
            ValueError: a name that is not one of :data:`SWITCHES`.
        """
        unknown = sorted(set(overrides) - set(SWITCHES))
        if unknown:
            raise ValueError(f"FocusRuntime.switched: unknown switches {unknown}; expected some of {SWITCHES}")  # fmt: skip
        global _open_switches
        token = _OVERRIDES.set((*_OVERRIDES.get(), (self, overrides)))
        with _switches_lock:
            _open_switches += 1
        try:
            yield
        finally:
            with _switches_lock:
                _open_switches -= 1
            _OVERRIDES.reset(token)

    def wants_attentions(self) -> bool:
        """Whether the current call of this thread asked for attention maps."""
        return self.want_attentions.get(threading.get_ident(), False)

    def mode(self, router: torch.nn.Module) -> str:
        """``"soft"`` or ``"topk"`` for ``router`` under the current settings (this thread's
        routing override, else the model-wide ``routing``)."""
        routing = self.current("routing")
        if routing == "auto":
            return "soft" if router.training else "topk"
        return routing


def overrides_open() -> bool:
    """Whether a :meth:`FocusRuntime.switched` context is open in any thread. Under
    ``torch.compile`` dynamo guards on it: while none is, every switch is its model-wide field
    and a compiled Focus layer reads the fields; while one is, it runs eagerly."""
    return _open_switches > 0


def disabled_base_impl(model_config: Any) -> str | None:
    """The base attention implementation of the model whose config is ``model_config`` when
    the calling thread runs it inside ``disable_focus()``, else None: its mask function then
    builds the base implementation's mask, as the base model would."""
    if not _open_switches:
        return None
    for runtime, _ in _OVERRIDES.get():
        if runtime.model_config is model_config and not runtime.current("enabled"):
            return runtime.base_impl
    return None


def runtime_of(module: torch.nn.Module) -> FocusRuntime | None:
    """The :class:`FocusRuntime` attached to a wrapped model (or one of its PreTrainedModel
    parts), or None."""
    return module.__dict__.get(RUNTIME_ATTR)


def switched_implementation_error(current: Any) -> ValueError:
    """The error for a model whose attention implementation was switched away from Focus."""
    return ValueError(
        f"this model has Focus attached but its attention implementation was switched to "
        f"{current!r} (set_attn_implementation or config._attn_implementation): Focus layers "
        "would silently run dense attention. Use `with focus_model.disable_focus():` to run the "
        "base model, or focus_model.unload() to remove Focus"
    )


def attention_maps_error(runtime: FocusRuntime) -> ValueError | None:
    """Why this call cannot return one attention map per layer, or None when it can."""
    dense = set(runtime.focus_config.dense_layers)
    soft = [i for i, r in runtime.routers.items() if runtime.mode(r) == "soft" and i not in dense]
    if soft:
        return ValueError(
            "output_attentions=True: soft-routed (training-mode) Focus layers compute a gated "
            f"dense attention whose maps are not exposed (layers {soft}); call the model in "
            "eval() or with set_routing('topk') to get the top-k layers' maps"
        )
    others = sorted(set(range(runtime.num_layers)) - set(runtime.focus_layers) | dense)
    if runtime.base_impl != "eager" and others:
        return ValueError(
            f"output_attentions=True: layers {others} run the base implementation "
            f"{runtime.base_impl!r}, which returns no attention maps, so the maps would not "
            "line up with the layers; load the base model with attn_implementation='eager'"
        )
    return None


def model_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """Forward pre-hook on every ``PreTrainedModel`` of a wrapped model: counts calls, notes
    whether attention maps are asked for, and refuses a model whose attention implementation
    was switched away from Focus while Focus is on.

    Under ``torch.compile`` a call that :func:`traced_model_call` accepts is traced (nothing
    to count or note; the arguments may be given an all-ones mask, see
    :func:`unpacked_call`); any other runs :func:`eager_model_pre_hook` behind a graph break.

    Raises:
        ValueError: a switched implementation (the message names ``disable_focus()``), or
            attention maps that cannot be returned one per layer.
    """
    if torch.compiler.is_compiling() and traced_model_call(module, kwargs):
        return unpacked_call(args, kwargs)
    eager_model_pre_hook(module, args, kwargs)
    return None


def unpacked_call(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The arguments of a traced model call, with an all-ones ``attention_mask`` ``[B, N]``
    (int64) when the call has neither ``attention_mask`` nor ``position_ids`` nor a cache,
    else None (unchanged).

    Such a call is one sequence per row, but under ``torch.compile`` transformers cannot
    check the positions it makes up for packed sequences and hands every layer a mask
    function that only an eager check could accept; with the all-ones mask, which says the
    same, the mask is plain causal and the Focus layers stay traced (docs/method.md §8)."""
    if any(kwargs.get(k) is not None for k in ("attention_mask", "position_ids",
                                                "past_key_values", "cache")):  # fmt: skip
        return None
    tokens = args[0] if args else kwargs.get("input_ids")
    if tokens is None:
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            return None
        tokens = embeds[..., 0]
    if len(args) > 1 or tokens.dim() != 2:
        return None
    ones = torch.ones(tokens.shape, dtype=torch.long, device=tokens.device)
    return args, {**kwargs, "attention_mask": ones}


def traced_model_call(module: torch.nn.Module, kwargs: dict) -> bool:
    """Whether a compiled call of ``module`` (a ``PreTrainedModel`` of a wrapped model) may
    skip :func:`eager_model_pre_hook`: no switch open in any thread, no thread's latest call
    asking for attention maps, the attention implementation still ``"focus"``, no maps asked
    for and no router in training mode (training counts calls for its routing bias). Reads
    only values dynamo guards on (docs/method.md §8, "torch.compile")."""
    runtime = runtime_of(module)
    if runtime is None:
        return True
    if overrides_open() or runtime.want_attentions:
        return False
    if not runtime.enabled:
        return True
    if module.config._attn_implementation != ATTN_IMPLEMENTATION:
        return False
    want = kwargs.get("output_attentions")
    if want is None:
        want = getattr(module.config, "output_attentions", False)
    return not want and not any(r.training for r in runtime.routers.values())


@eager_only
def eager_model_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """:func:`model_pre_hook`'s eager body (a graph break under ``torch.compile``)."""
    runtime = runtime_of(module)
    if runtime is None or not runtime.current("enabled"):
        return
    current = module.config._attn_implementation
    if current != ATTN_IMPLEMENTATION:
        raise switched_implementation_error(current)
    runtime.calls += 1
    want = kwargs.get("output_attentions")
    if want is None:
        want = getattr(module.config, "output_attentions", False)
    if want:
        runtime.want_attentions[threading.get_ident()] = True
    else:  # only the threads whose latest call wants maps are kept (see traced_model_call)
        runtime.want_attentions.pop(threading.get_ident(), None)
    if want:
        err = attention_maps_error(runtime)
        if err is not None:
            raise err
