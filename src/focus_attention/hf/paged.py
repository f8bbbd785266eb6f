"""Focus layers under transformers' continuous batching (docs/method.md §5 and §8).

transformers' continuous batching (``generate_batch``, ``init_continuous_batching`` and the
``ContinuousBatchingManager`` behind ``transformers serve``) packs requests of different
lengths into one row (``[1, N_total]``, boundaries in ``cu_seq_lens_q`` / ``cu_seq_lens_k``)
and keeps their keys and values in a paged cache (``PagedAttentionCache``): each layer writes
the new keys at the physical slots ``write_index`` and reads every key of the packed
sequences back through ``read_index``.

Here a Focus layer runs each packed sequence exactly as that request alone
(:func:`run_packed`; heads are never looped over): the same routing code, the same exact
sparse op, and a :class:`~focus_attention.hf.masks.FocusMask` of that sequence alone. A
sequence that prefills is one layer call; the sequences that decode one token are one call
each on the CPU, and padded batches of them on other devices (:func:`batches_decoding`),
each row masked as its sequence alone (the padding invisible). Inference routing is causal
(a token's groups depend on its own hidden state and the calibrated routing bias only), so
the groups of every written key are kept beside it, in a per-layer bool tensor indexed by
the same physical slots (:class:`PagedGroups`); a sequence reads its keys' groups back
through its ``read_index``, and cache blocks copied for a forked request
(``num_return_sequences``) carry their groups. Layers without routing (non-Focus layers,
``dense_layers``) run the base implementation the same way, under the mask their layer type
gives each sequence alone (causal or sliding-window).

Not causal, hence refused: soft (Sinkhorn) routing and ``inference_routing="sequence"``.
Also refused: Focus layers that the paged cache keeps in its sliding-window group (it keeps
only the last ``sliding_window`` keys there), CPU offloading of cache blocks
(``cpu_offload_space``: the groups of the offloaded keys would not follow them), and CUDA
graphs, ``torch.compile`` and the flash block-table decode path (the packed batch is split on
the host, which reads the sequence boundaries).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import (
    PagedAttentionCache,
    group_layers_by_attn_type,
)
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousMixin,
)
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

from .focus_cache import KeyGroups
from .layer_call import CACHE_LAYER, HIDDEN_STATES
from .masks import FocusMask
from .runtime import runtime_of

#: keyword arguments of a continuous-batching forward that only the packed call reads (they
#: are not passed on to the per-sequence calls)
PAGED_KWARGS = (
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "read_index",
    "write_index",
    "block_table",
    "k_cache",
    "v_cache",
    "is_causal",
    "position_ids",
)
FULL_ATTENTION = "full_attention"


def is_paged_cache(cache: Any) -> bool:
    """Whether ``cache`` is transformers' continuous-batching ``PagedAttentionCache``."""
    return isinstance(cache, PagedAttentionCache)


def is_paged_call(kwargs: dict) -> bool:
    """Whether an attention call's keyword arguments come from continuous batching (a packed
    batch over a paged cache: ``read_index`` and ``write_index`` are present)."""
    return "read_index" in kwargs and "write_index" in kwargs


# --------------------------------------------------------------------------------------------
# the groups of the cached keys, by physical slot
# --------------------------------------------------------------------------------------------


class PagedGroups:
    """The groups whose queries see each cached key of one Focus layer, by physical slot of
    the paged cache: bool ``[slots, K]`` (a key's ``top_k`` memberships, every group for one
    of the first ``sink_tokens`` tokens of its sequence; docs/method.md §3 and §5), or
    ``[slots, H_kv, K]`` for a routing per key-value head (query-key routers). Written at
    ``write_index`` when the layer writes the key, read through ``read_index``; a freed slot
    is always written again before it is read. The tensor grows to the highest slot used."""

    def __init__(self) -> None:
        self.storage: torch.Tensor | None = None
        self.sink_tokens: int | None = None

    def write(self, slots: torch.Tensor, groups: torch.Tensor, sink_tokens: int) -> None:
        """Store ``groups`` bool ``[n, K]`` (or ``[n, H_kv, K]``) at ``slots`` int ``[n]``.

        Raises:
            ValueError: groups stored earlier were computed with another ``sink_tokens``.
        """
        if self.sink_tokens is not None and self.sink_tokens != sink_tokens:
            raise ValueError(
                f"the paged KV cache holds Focus groups computed with sink_tokens="
                f"{self.sink_tokens}, this call has sink_tokens={sink_tokens}; start a new "
                "continuous-batching manager after changing sink_tokens"
            )
        self.sink_tokens = sink_tokens
        if slots.numel() == 0:
            return
        self._reserve(int(slots.max()) + 1, groups)
        self.storage[slots.to(self.storage.device)] = groups.to(self.storage.device)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The groups bool ``[n, K]`` (or ``[n, H_kv, K]``) stored at ``slots`` int ``[n]``."""
        return self.storage.index_select(0, slots.to(self.storage.device))

    def copy_blocks(self, source: list[int], dest: list[int], stride: int, page: int) -> None:
        """Copy the groups of the keys of cache blocks ``source`` to blocks ``dest`` (what
        the paged cache does with their keys and values when it forks a request): block
        ``b`` holds this layer's keys at slots ``b * stride + [0, page)``."""
        if not source or self.storage is None:
            return
        rows = torch.arange(page, device=self.storage.device)
        src = (torch.tensor(source, device=rows.device)[:, None] * stride + rows).flatten()
        dst = (torch.tensor(dest, device=rows.device)[:, None] * stride + rows).flatten()
        self._reserve(int(max(src.max(), dst.max())) + 1, self.storage)
        self.storage[dst] = self.storage[src]

    def _reserve(self, rows: int, like: torch.Tensor) -> None:
        if self.storage is not None and self.storage.shape[0] >= rows:
            return
        held = 0 if self.storage is None else len(self.storage)
        grown = like.new_zeros(max(rows, 2 * held), *like.shape[1:])
        if held:
            grown[:held] = self.storage
        self.storage = grown


#: attribute (in the paged cache's ``__dict__``) holding the :class:`PagedGroups` of each
#: Focus layer, by layer index: they live and die with the cache
GROUPS_ATTR = "focus_groups"


def groups_of_cache(cache: PagedAttentionCache) -> dict[int, PagedGroups]:
    """The :class:`PagedGroups` kept on ``cache``, by Focus layer index."""
    return cache.__dict__.setdefault(GROUPS_ATTR, {})


def paged_groups(cache: PagedAttentionCache, layer_idx: int) -> PagedGroups:
    """The :class:`PagedGroups` of Focus layer ``layer_idx`` in ``cache`` (created empty).

    Raises:
        ValueError: the cache keeps the layer in its sliding-window group (only the last
            ``sliding_window`` keys of each request), where a Focus layer needs every key.
    """
    allocator = cache.layer_to_allocator[layer_idx]
    if allocator.layer_type != FULL_ATTENTION:
        raise ValueError(sliding_error([layer_idx], getattr(cache.config, "sliding_window", None)))
    return groups_of_cache(cache).setdefault(layer_idx, PagedGroups())


def copy_groups_with_blocks(cache: PagedAttentionCache) -> None:
    """Make ``cache``'s block copies (a request forked into ``num_return_sequences``
    children) copy the Focus groups of the copied keys too (:meth:`PagedGroups.copy_blocks`)."""
    copy_kv = cache.perform_cache_copy
    if getattr(copy_kv, "copies_focus_groups", False):
        return

    def perform_cache_copy(copy_src_and_dst: dict) -> None:
        copy_kv(copy_src_and_dst)
        for layer_idx, store in groups_of_cache(cache).items():
            allocator = cache.layer_to_allocator[layer_idx]
            source, dest = copy_src_and_dst.get(allocator.layer_type, ([], []))
            store.copy_blocks(source, dest, allocator.block_physical_stride, allocator.tokens_per_page)  # fmt: skip

    perform_cache_copy.copies_focus_groups = True
    cache.perform_cache_copy = perform_cache_copy


def sliding_error(layers: list[int], window: Any) -> str:
    """The message refusing Focus layers in the paged cache's sliding-window group."""
    return (
        f"continuous batching: the paged KV cache keeps layers {layers} in its sliding-window "
        f"group (sliding_window={window}), which holds only the last sliding_window keys of "
        "each request, and Focus layers need every key. Load a model with a model-wide "
        "window (Mistral) with sliding_window=None (Focus layers replace the window anyway), "
        "choose FocusConfig.layers among the full-attention layers, or put these layers in "
        "FocusConfig.dense_layers"
    )


@dataclass
class SequenceGroups(KeyGroups):
    """The :class:`~focus_attention.hf.focus_cache.FocusCache` of packed sequences of a Focus
    layer, for one sequence or a batch of decoding steps: ``group_length`` keys before this
    call; :meth:`store_groups` stores the new keys' groups in the paged storage (at
    ``write_slots`` int ``[B * N_new]``) and sets ``groups`` bool ``[B, Nk, K]`` (``[B, Nk,
    H_kv, K]`` per key-value head) to the groups of every key (read at ``read_slots`` int
    ``[B, Nk]``, or None when the sequence reads no cache)."""

    store: PagedGroups
    write_slots: torch.Tensor
    read_slots: torch.Tensor | None
    group_length: int
    groups: torch.Tensor | None = None

    def store_groups(self, groups: torch.Tensor, sink_tokens: int = 0) -> None:
        """Store the new keys' groups bool ``[B, N_new, K]`` or ``[B, N_new, H_kv, K]`` (sinks
        included) at their slots."""
        self.store.write(self.write_slots, groups.flatten(0, 1), sink_tokens)
        if self.read_slots is None:
            self.groups = groups
        else:
            read = self.store.read(self.read_slots.flatten())
            self.groups = read.view(*self.read_slots.shape, *read.shape[1:])


# --------------------------------------------------------------------------------------------
# the packed batch: one call per prefilling sequence, one per batch of decoding steps
# --------------------------------------------------------------------------------------------

#: a batch of decoding steps is padded to its longest sequence's keys; sequences join a
#: batch while the padded keys stay within this multiple of the keys they hold
MAX_PADDING_FACTOR = 2


def batches_decoding(device: torch.device) -> bool:
    """Whether the sequences of a packed call that decode one token run as padded batches on
    ``device`` (one layer call per batch) rather than one call per sequence: on accelerators,
    where a call's many small operations cost more than gathering the padded keys; not on
    the CPU, where the gather costs more than the calls it saves (docs/integration.md,
    "Continuous batching")."""
    return device.type != "cpu"


@dataclass
class PackedSequence:
    """One call of a packed batch: one sequence, or a batch of sequences that each decode one
    token. Its queries ``[B, H, Nq, D]``, keys and values ``[B, H_kv, Nk, D]`` (earlier keys
    first; a batch is left-padded to its longest sequence), the rows ``q_rows`` of its
    queries in the packed batch (a slice for one sequence, row indices int ``[B]`` for a
    batch), its key slots (``write_slots`` of the new keys, int ``[B * Nq]``; ``read_slots``
    of every key, int ``[B, Nk]``, None when the batch reads no cache), its
    :class:`FocusMask` (with the batch's padding) and the keyword arguments of its call."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    q_rows: slice | torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor | None
    mask: FocusMask
    kwargs: dict

    def rows(self, packed: torch.Tensor) -> torch.Tensor:
        """This call's rows ``[B, Nq, ...]`` of a packed ``[1, N_total, ...]`` tensor."""
        if isinstance(self.q_rows, slice):
            return packed[:, self.q_rows]
        return packed[0, self.q_rows].unsqueeze(1)

    def place(self, packed: torch.Tensor, rows: torch.Tensor) -> None:
        """Write this call's output rows ``[B, Nq, ...]`` into ``packed [1, N_total, ...]``."""
        if isinstance(self.q_rows, slice):
            packed[:, self.q_rows] = rows
        else:
            packed[0, self.q_rows] = rows[:, 0]

    def groups(self, store: PagedGroups) -> SequenceGroups:
        """This call's cache layer over ``store``."""
        past = self.key.shape[2] - self.query.shape[2]
        return SequenceGroups(store, self.write_slots, self.read_slots, past)


def layer_window(config: Any, layer_idx: int, routed: bool) -> int | None:
    """The sliding window of layer ``layer_idx`` under continuous batching: the model's
    ``sliding_window`` on the layers its paged cache keeps in the sliding-window group, None
    on the others and on routed Focus layers (they replace the window)."""
    if routed:
        return None
    groups = group_layers_by_attn_type(config)
    if layer_idx in groups.get(FULL_ATTENTION, ()):
        return None
    return getattr(config, "sliding_window", None)


def sequence_mask(config: Any, nq: int, nk: int, window: int | None, query: torch.Tensor,
                  padding: torch.Tensor | None = None) -> FocusMask:  # fmt: skip
    """The :class:`FocusMask` of one call of a packed batch: ``nq`` queries bottom-right
    aligned on ``nk`` keys, causal, or sliding-window causal over ``window`` tokens, under the
    2-D ``padding`` bool ``[B, nk]`` (True = real token; None: one sequence, no padding)."""
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return FocusMask(
        dict(
            batch_size=1 if padding is None else padding.shape[0], q_length=nq, kv_length=nk,
            q_offset=nk - nq, kv_offset=0, mask_function=fn, attention_mask=padding,
            allow_is_causal_skip=True, dtype=query.dtype, config=config, use_vmap=False,
            device=query.device, local_size=window,
        )
    )  # fmt: skip


def packed_sequences(module: torch.nn.Module, query, key, value, kwargs: dict,
                     routed: bool) -> list[PackedSequence]:  # fmt: skip
    """Split a packed continuous-batching call into the calls that run it: one per sequence,
    except that on a device where :func:`batches_decoding` holds, the sequences that decode
    one token from the cache run as padded batches (:func:`decoding_batches`).

    Args:
        module: the attention module (``layer_idx``, ``config``).
        query: ``[1, H, N_total, D]``; key, value: ``[1, H_kv, Nk_total, D]`` as the paged
            cache returned them (each sequence's keys contiguous, earlier keys first).
        kwargs: the call's keyword arguments (``cu_seq_lens_q``, ``cu_seq_lens_k`` of this
            layer's type, ``read_index``, ``write_index``).
        routed: whether the layer routes (Focus) this call.

    Raises:
        ValueError: the flash block-table decode path (``block_table``), or a batch that is
            not one packed row.
    """
    if kwargs.get("block_table") is not None:
        raise ValueError(
            "continuous batching: the block-table decode path writes the cache inside flash "
            "attention; Focus layers need the index-based path (max_blocks_per_request=0)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"continuous batching: expected one packed row, received batch {query.shape[0]}")  # fmt: skip
    cu_q, cu_k = kwargs["cu_seq_lens_q"].tolist(), kwargs["cu_seq_lens_k"].tolist()
    index = _allocator_index(module)
    read, write = kwargs["read_index"][index], kwargs["write_index"][index]
    read = read if read.numel() else None
    packed = Packed(query, key, value, read, write, module.config,
                    layer_window(module.config, module.layer_idx, routed),
                    {k: v for k, v in kwargs.items() if k not in PAGED_KWARGS})  # fmt: skip
    spans = [(cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]) for s in range(len(cu_q) - 1)]
    spans = [span for span in spans if span[1] > span[0]]  # no empty (padding) sequence
    batched = read is not None and batches_decoding(query.device)
    steps: list[tuple[int, int, int, int]] = []  # sequences decoding one token, to batch
    out: list[PackedSequence] = []
    for span in spans:
        if batched and span[1] - span[0] == 1:
            steps.append(span)
        else:
            out.append(packed.one(span))
    for batch in decoding_batches([k1 - k0 for _, _, k0, k1 in steps]):
        chosen = [steps[i] for i in batch]
        out.append(packed.one(chosen[0]) if len(chosen) == 1 else packed.decoding(chosen))
    return out


def decoding_batches(lengths: list[int]) -> list[list[int]]:
    """Batches (lists of indices into ``lengths``) of the sequences that decode one token,
    each sequence holding ``lengths[i]`` keys: the sequences in order of length, a batch
    growing while its padded keys (batch size x longest) stay within
    :data:`MAX_PADDING_FACTOR` times the keys its sequences hold."""
    batches: list[list[int]] = []
    held = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]
        if batches and (len(batches[-1]) + 1) * n <= MAX_PADDING_FACTOR * (held + n):
            batches[-1].append(i)
            held += n
        else:
            batches.append([i])
            held = n
    return batches


@dataclass
class Packed:
    """A packed continuous-batching call, cut into :class:`PackedSequence` calls."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    read: torch.Tensor | None
    write: torch.Tensor
    config: Any
    window: int | None
    kwargs: dict

    def one(self, span: tuple[int, int, int, int]) -> PackedSequence:
        """The call of the sequence with query rows ``q0:q1`` and keys ``k0:k1``."""
        q0, q1, k0, k1 = span
        mask = sequence_mask(self.config, q1 - q0, k1 - k0, self.window, self.query)
        return PackedSequence(
            self.query[:, :, q0:q1], self.key[:, :, k0:k1], self.value[:, :, k0:k1],
            slice(q0, q1), self.write[q0:q1],
            None if self.read is None else self.read[None, k0:k1], mask, dict(self.kwargs),
        )  # fmt: skip

    def decoding(self, spans: list[tuple[int, int, int, int]]) -> PackedSequence:
        """One call for sequences that each decode one token (query row ``q0``, keys
        ``k0:k1``): keys, values and key slots left-padded to the longest sequence, the
        padding masked (every padded position repeats its sequence's first key)."""
        device = self.query.device
        longest = max(k1 - k0 for _, _, k0, k1 in spans)
        pad = torch.tensor([longest - (k1 - k0) for _, _, k0, k1 in spans], device=device)
        first = torch.tensor([k0 for _, _, k0, _ in spans], device=device)
        offset = torch.arange(longest, device=device)[None, :] - pad[:, None]
        real = offset >= 0
        index = first[:, None] + offset.clamp(min=0)  # [B, longest] rows of the packed keys
        rows = torch.tensor([q0 for q0, _, _, _ in spans], device=device)
        mask = sequence_mask(self.config, 1, longest, self.window, self.query, real)
        return PackedSequence(
            self.query[0, :, rows].transpose(0, 1).unsqueeze(2),
            _gather_keys(self.key, index), _gather_keys(self.value, index), rows,
            self.write[rows], self.read[index], mask, dict(self.kwargs),
        )  # fmt: skip


def _gather_keys(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` int ``[B, L]`` of packed keys ``[1, H_kv, Nk_total, D]`` (whose rows the
    paged cache returns contiguous), as ``[B, H_kv, L, D]`` in the layout of a model's
    projected keys (one gather of whole rows)."""
    rows = packed[0].transpose(0, 1).index_select(0, index.flatten())  # [B * L, H_kv, D]
    return rows.view(*index.shape, *rows.shape[1:]).transpose(1, 2)


def _allocator_index(module: torch.nn.Module) -> int:
    """Which entry of ``read_index`` / ``write_index`` belongs to the layer of ``module``:
    the position of its layer type among the paged cache's groups."""
    groups = group_layers_by_attn_type(module.config)
    for i, layers in enumerate(groups.values()):
        if module.layer_idx in layers:
            return i
    raise ValueError(f"layer {module.layer_idx} is in no attention group of the paged cache")


def run_packed(attention: Callable[..., tuple], module: torch.nn.Module, query, key, value,
               dropout: float, scaling: float | None, kwargs: dict, hidden: torch.Tensor | None,
               store: PagedGroups | None) -> tuple[torch.Tensor, None]:  # fmt: skip
    """Run a packed continuous-batching call as one attention call per sequence and pack the
    outputs.

    Each sequence that prefills is one layer call, routed and masked exactly as alone; the
    sequences that decode one token run as padded batches (:func:`packed_sequences`), each
    of its rows routed and masked as that sequence alone (padding is invisible). Heads are
    never looped over.

    Args:
        attention: the ``"focus"`` attention function, run on each :class:`PackedSequence`.
        module, query, key, value, kwargs: as in :func:`packed_sequences`; dropout, scaling:
            the model's, passed on.
        hidden: the packed hidden state ``[1, N_total, d_model]`` of a routed Focus layer
            (its rows go with each sequence), or None for a layer that is not routed.
        store: the layer's :class:`PagedGroups` (with ``hidden``), or None.

    Returns:
        ``(out [1, N_total, H, D] in the query's dtype, None)``; query rows of no sequence
        (padding) are zeros.

    Raises:
        ValueError: see :func:`packed_sequences`.
    """
    bsz, heads, total, dim = query.shape
    out = query.new_zeros(bsz, total, heads, dim)
    routed = store is not None
    for seq in packed_sequences(module, query, key, value, kwargs, routed):
        inputs = {HIDDEN_STATES: seq.rows(hidden), CACHE_LAYER: seq.groups(store)} if routed else {}  # fmt: skip
        result = attention(module, seq.query, seq.key, seq.value, seq.mask, dropout, scaling,
                           **seq.kwargs, **inputs)  # fmt: skip
        seq.place(out, result[0].to(out.dtype))
    return out, None


def soft_routing_error() -> ValueError:
    """The error for soft routing under continuous batching."""
    return ValueError(
        "continuous batching with soft routing (set_routing('soft'), or routing='auto' in "
        "train() mode): soft (Sinkhorn) routing is not causal and cannot decode from a KV "
        "cache; call eval() or set_routing('topk')"
    )


def sequence_routing_error() -> ValueError:
    """The error for ``inference_routing="sequence"`` under continuous batching."""
    return ValueError(
        "continuous batching with inference_routing='sequence': the sequence-wide Sinkhorn "
        "is not causal (a token's groups depend on later tokens), so it cannot use a KV "
        "cache; use inference_routing='causal'"
    )


# --------------------------------------------------------------------------------------------
# the manager
# --------------------------------------------------------------------------------------------


def check_continuous_batching(model: Any) -> None:
    """Refuse a Focus model that continuous batching cannot run exactly (checked when the
    manager is built; the manager's thread checks the routing again at every call).

    Raises:
        ValueError: an unloaded model or a switched attention implementation; soft routing
            or ``inference_routing="sequence"``; a call inside
            ``disable_focus()`` (the manager's own thread would not see it); Focus layers
            the paged cache keeps in its sliding-window group.
    """
    model._check_live()
    runtime = runtime_of(model.base_model)
    if not runtime.current("enabled"):
        raise ValueError(
            "continuous batching inside disable_focus(): the manager runs the model in its own "
            "thread, where disable_focus() does not hold; use the base model (unload()) instead"
        )
    if runtime.current("routing") == "soft":
        raise soft_routing_error()
    if runtime.focus_config.inference_routing == "sequence":
        raise sequence_routing_error()
    dense = set(runtime.focus_config.dense_layers)
    config = model.config.get_text_config()
    full = set(group_layers_by_attn_type(config).get(FULL_ATTENTION, ()))
    sliding = [i for i in model.focus_layers if i not in full and i not in dense]
    if sliding:
        raise ValueError(sliding_error(sliding, getattr(config, "sliding_window", None)))


#: why each ``ContinuousBatchingConfig`` setting that Focus layers cannot run is refused
_EAGER_ONLY = (
    "Focus layers run eagerly, splitting the packed batch on the host, on the index-based "
    "paged cache"
)
_OFFLOAD = (
    "the paged cache's CPU offloading moves a request's keys and values to other cache blocks "
    "without the Focus groups kept beside them; evicted requests are then computed again "
    "instead, as by default"
)


def _eager_config(cb_config: ContinuousBatchingConfig | None) -> ContinuousBatchingConfig:
    """``cb_config`` (or the default) checked for what Focus layers cannot run: CUDA graphs,
    compile and input padding (they trace a fixed graph; Focus layers read the sequence
    boundaries on the host), the flash block-table decode path, and CPU offloading of cache
    blocks (``cpu_offload_space``; the groups of the offloaded keys would not follow them).

    Raises:
        ValueError: one of those asked for explicitly, naming it and why.
    """
    cfg = ContinuousBatchingConfig() if cb_config is None else cb_config
    asked = {
        "use_cuda_graph": cfg.use_cuda_graph not in (None, False, (False, False)),
        "varlen_compile_config": cfg.varlen_compile_config is not None,
        "decode_compile_config": cfg.decode_compile_config is not None,
        "default_compile_level": bool(cfg.default_compile_level),
        "q_padding_interval_size": bool(cfg.q_padding_interval_size),
        "kv_padding_interval_size": bool(cfg.kv_padding_interval_size),
        "max_blocks_per_request": bool(cfg.max_blocks_per_request),
        "cpu_offload_space": bool(cfg.cpu_offload_space),
    }
    bad = [name for name, on in asked.items() if on]
    if bad:
        why = {_OFFLOAD if name == "cpu_offload_space" else _EAGER_ONLY for name in bad}
        raise ValueError(
            f"continuous batching of a Focus model: ContinuousBatchingConfig {', '.join(bad)} "
            f"cannot be used ({'; '.join(sorted(why))}); leave them at their defaults"
        )
    return cfg


class FocusBatchingManager(ContinuousBatchingManager):
    """transformers' ``ContinuousBatchingManager`` for a :class:`~focus_attention.FocusModel`:
    the attention implementation stays ``"focus"`` (checked by
    :func:`check_continuous_batching`), and the manager runs eagerly on the index-based
    paged cache (no CUDA graphs, compile or block-table decode path).

    Raises:
        ValueError: see :func:`check_continuous_batching` and, for
            ``continuous_batching_config``, the settings Focus layers cannot run with.
    """

    def __init__(self, model: Any, generation_config: GenerationConfig,
                 continuous_batching_config: ContinuousBatchingConfig | None = None,
                 workload_hints: Any = None) -> None:  # fmt: skip
        cfg = _eager_config(continuous_batching_config)
        super().__init__(model, generation_config, cfg, workload_hints)
        resolved = self.continuous_batching_config
        resolved.use_cuda_graph = False
        resolved.varlen_compile_config = resolved.decode_compile_config = None
        resolved.max_blocks_per_request = 0

    def _create_batch_processor(self) -> Any:
        processor = super()._create_batch_processor()
        copy_groups_with_blocks(processor.cache)
        return processor

    def switch_to_cb_friendly_attn(self, model: Any, auto_switch_to_flash: bool = True) -> None:
        """Keep ``"focus"``: check the model instead of switching its implementation."""
        check_continuous_batching(model)


class FocusContinuousBatching:
    """Continuous batching for :class:`~focus_attention.FocusModel`: transformers'
    ``generate_batch`` and ``continuous_batching_context_manager`` over a
    :class:`FocusBatchingManager` (``init_continuous_batching``). Greedy tokens equal
    per-request ``generate``; see :mod:`focus_attention.hf.paged` for what is refused."""

    generate_batch = ContinuousMixin.generate_batch
    continuous_batching_context_manager = ContinuousMixin.continuous_batching_context_manager

    def init_continuous_batching(
        self,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        workload_hints: Any = None,
    ) -> FocusBatchingManager:
        """A :class:`FocusBatchingManager` for this model (transformers'
        ``init_continuous_batching``: ``add_request``, ``cancel_request``, ``get_result``,
        ``request_id_iter``; ``start()`` / ``stop()``). Its thread routes top-k (the manager
        puts the model in ``eval()``).

        Raises:
            ValueError: see :class:`FocusBatchingManager`; no generation config.
        """
        cached = self.__dict__.get("_cached_continuous_batching_manager")
        if isinstance(cached, FocusBatchingManager):
            check_continuous_batching(self)
            return cached
        gen_config = generation_config if generation_config is not None else self.generation_config
        if gen_config is None:
            raise ValueError(
                "init_continuous_batching: no generation_config given and none on the model"
            )
        if gen_config.eos_token_id is None:
            gen_config.eos_token_id = -1  # as transformers does: no end of sequence
        return FocusBatchingManager(self, gen_config, continuous_batching_config, workload_hints)

    def destroy_cached_continuous_batching_manager(self) -> None:
        """Destroy a manager kept with ``persistent_manager=True``."""
        cached = self.__dict__.pop("_cached_continuous_batching_manager", None)
        if cached is not None:
            cached.destroy()
