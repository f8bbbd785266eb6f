"""Data-parallel and sharded ``focus train`` across processes (docs/method.md §6,
"Distributed training").

``focus train`` needs no code of its own to run on several processes: ``torchrun`` or
``accelerate launch`` start the same command once per process and set ``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK`` and the rendezvous address; :func:`setup` then joins the process
group (``torch.distributed``: NCCL on GPU, one device per local rank; gloo on CPU). Without
a launcher (or with one process) :func:`setup` returns a :class:`Distributed` whose every
method is the identity, so a single-process run is exactly what it is without this module.

What each process does with world size ``W`` and ``grad_accum`` ``G`` (rank ``r``):

- data: an optimizer step consumes ``W * G`` micro-batches, those a one-process run with
  ``grad_accum = W * G`` would take; rank ``r`` takes micro-batches ``r * G ... r * G + G - 1``
  (:meth:`Distributed.local_micro_batches`), so ``W`` processes with ``grad_accum`` ``G``
  train on the same blocks, in the same steps, as one process with ``W * G``.
- gradients: every rank back-propagates ``loss / (W * G)``; the routers' gradients are then
  summed over ranks (one ``all_reduce``, :meth:`Distributed.reduce_gradients`), so every rank
  holds the one-process gradient up to the order of the float additions (exact for ``W = 2,
  G = 1``: ``a + b`` is rounded once whichever rank adds). Clipping and AdamW then run on
  identical gradients and give identical routers everywhere.
- routing statistics: the Sinkhorn column biases each rank folds into ``routing_bias``
  (:meth:`FocusRouter.update_bias`) are recorded, gathered from every rank and folded again,
  from the step's starting value, in the one-process order (rank 0's micro-batches first),
  on every rank (:meth:`Distributed.begin_step`, :meth:`Distributed.end_step`):
  ``routing_bias`` and ``bias_updates`` end bit-for-bit as in the one-process run. The top-k
  diagnostics a micro-batch logs use the bias that rank sees during the step, so on ranks
  ``r > 0`` they can differ slightly from the one-process log; the trained tensors do not.
- metrics: the per-micro-batch losses and dominance values are gathered in the same order,
  so rank 0 logs the one-process step record.
- files: only rank 0 writes (log, checkpoints, adapter, plot, results); every rank reads a
  checkpoint to resume, so ``--out`` must be on a file system every node sees.
- sharding: under ``accelerate launch`` with an FSDP configuration file
  (``distributed_type: FSDP``, ``fsdp_version: 2``), the frozen base model is sharded with
  PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) over the layer classes the file
  names (or the model's ``_no_split_modules``): each rank keeps ``1 / W`` of the base weights
  and gathers a layer's weights while it runs. The routers (the only trained tensors, a few
  MB) stay whole on every rank and are reduced as above.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Distributed",
    "RankZeroSaver",
    "ShardedWeights",
    "fsdp_requested",
    "setup",
]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value.strip() else default
    except ValueError as err:
        raise ValueError(f"environment variable {name}={value!r}: expected an integer") from err


def fsdp_requested() -> bool:
    """Whether ``accelerate launch`` was given an FSDP configuration (it sets
    ``ACCELERATE_USE_FSDP=true`` in every process)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").strip().lower() in ("1", "true")


@dataclass
class Distributed:
    """The process's place in a distributed run and the collective steps of training.

    Attributes:
        rank: global rank (0 writes the files); world_size: number of processes.
        local_rank: rank on this node (the CUDA device index on GPU).
        device: where the model and batches live (``cpu`` unless NCCL on CUDA).
        sharded: whether the base model is sharded with FSDP2 (see the module docstring);
        sharded_layers: how many of its modules were sharded (layers, then the model).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sharded: bool = False
    sharded_layers: int = 0
    _open_step: int = field(default=-1, repr=False)
    _saved_config: torch.Tensor | None = field(default=None, repr=False)
    _routers: dict[str, Any] = field(default_factory=dict, repr=False)
    _start: dict[str, Any] = field(default_factory=dict, repr=False)
    _calls: dict[str, list[Any]] = field(default_factory=dict, repr=False)

    @property
    def active(self) -> bool:
        """More than one process: the collectives below run."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes the run's files."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op in one process)."""
        if self.active:
            torch.distributed.barrier()

    def main_value(self, fn: Any) -> Any:
        """``fn()`` computed on rank 0 and sent to every rank (a picklable value)."""
        if not self.active:
            return fn()
        box = [fn() if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def global_accum(self, grad_accum: int) -> int:
        """Micro-batches per optimizer step over all ranks: ``world_size * grad_accum``."""
        return self.world_size * grad_accum

    def local_micro_batches(self, grad_accum: int) -> range:
        """The global micro-batch indices (``0 ... world_size * grad_accum - 1``) this rank
        runs in each step: ``rank * grad_accum ... rank * grad_accum + grad_accum - 1``."""
        return range(self.rank * grad_accum, (self.rank + 1) * grad_accum)

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on :attr:`device` (the tensor itself when already there)."""
        return x if x.device == self.device else x.to(self.device)

    def gather_in_order(self, items: list[Any]) -> list[Any]:
        """Every rank's ``items`` (picklable), concatenated in rank order, on every rank."""
        if not self.active:
            return items
        boxes: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(boxes, items)
        return [x for box in boxes for x in box]

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the ``.grad`` of ``params`` over ranks, in place (one flat ``all_reduce``).

        A parameter without a gradient on some rank counts as zero there; one without a
        gradient on every rank keeps ``grad = None`` (AdamW skips it, as in one process).
        """
        if not self.active or not params:
            return
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        has = has.to(self.device)
        torch.distributed.all_reduce(has)
        live = [p for p, h in zip(params, has.tolist(), strict=True) if h]
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not live:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in live])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p in live:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the body first (filling caches), the other ranks after it."""
        if not self.active:
            yield
            return
        if not self.is_main:
            torch.distributed.barrier()
        yield
        if self.is_main:
            torch.distributed.barrier()

    def begin_step(self, routers: Mapping[str, Any], step: int) -> None:
        """Before the micro-batches of step ``step`` (0-based): record every ``update_bias``
        call of the ``routers`` (``{name: FocusRouter}``) from the step's starting
        ``routing_bias`` and ``bias_updates``; each call still folds its batch into this
        rank's bias at once."""
        if not self.active:
            return
        self._open_step = step
        self._routers = dict(routers.items())
        self._start = {k: (r.routing_bias.clone(), r.bias_updates.clone())
                       for k, r in self._routers.items()}  # fmt: skip
        self._calls = {k: [] for k in self._routers}
        for key, router in self._routers.items():
            router.sync_statistics = False  # this layer gathers and replays them itself
            router.update_bias = self._recorder(key, router.update_bias)

    def _recorder(self, key: str, update_bias: Any) -> Any:
        def record(column_bias: torch.Tensor, real: torch.Tensor | None) -> None:
            keep = None if real is None else real.detach().cpu()
            self._calls[key].append((column_bias.detach().cpu(), keep))
            update_bias(column_bias, real)

        return record

    def end_step(self, params: list[torch.nn.Parameter]) -> None:
        """After the micro-batches of a step, on every rank: sum the gradients of ``params``
        over ranks (:meth:`reduce_gradients`), then set each router's ``routing_bias`` and
        ``bias_updates`` to the one-process result: from the step's starting values, fold
        every rank's recorded ``(column_bias [B, K] float32, real [B, N] bool or None)``
        with :meth:`FocusRouter.update_bias`, rank 0's calls first, each rank's in the
        order it made them (the order of the global micro-batches)."""
        if not self.active:
            return
        self.reduce_gradients(params)
        self._stop_recording()
        everyone = self.gather_in_order([self._calls])
        for key, router in self._routers.items():
            bias, updates = self._start[key]
            with torch.no_grad():
                router.routing_bias.copy_(bias)
                router.bias_updates.copy_(updates)
            for rank_calls in everyone:
                for column_bias, real in rank_calls[key]:
                    router.update_bias(column_bias, real)
            router.sync_statistics = True
        self._calls = {}

    def _stop_recording(self) -> None:
        for router in self._routers.values():
            router.__dict__.pop("update_bias", None)  # the class's method again

    def abort_step(self, completed_steps: int) -> None:
        """After an interruption (Ctrl-C): if the step begun by :meth:`begin_step` did not
        complete (``completed_steps`` is still its index), put the routers' ``routing_bias``
        and ``bias_updates`` back to the step's starting values, so the checkpoint of the
        last completed step holds that step's statistics and a resumed run folds the
        interrupted step's batches once."""
        if not self.active or not self._routers:
            return
        self._stop_recording()
        for router in self._routers.values():
            router.sync_statistics = True
        if completed_steps == self._open_step:
            with torch.no_grad():
                for key, router in self._routers.items():
                    router.routing_bias.copy_(self._start[key][0])
                    router.bias_updates.copy_(self._start[key][1])
        self._routers, self._start, self._calls = {}, {}, {}

    def check_method(self, method: str) -> None:
        """Refuse sharding for a method other than ``focus``: FSDP2 shards the frozen base
        model, and every other method trains base or LoRA tensors that sharding would split.

        Raises:
            ValueError: an FSDP configuration with ``method`` other than ``focus``.
        """
        if self.sharded and method != "focus":
            raise ValueError(
                f"focus train --method {method}: sharding (an accelerate FSDP configuration) "
                "is supported for --method focus only, whose base model is frozen; run "
                f"--method {method} data-parallel (configs/accelerate/ddp.yaml or torchrun)"
            )

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint records of the run's layout (nothing in one process)."""
        return {"world_size": self.world_size} if self.active else {}

    def check_resume(self, state: dict[str, Any] | None, grad_accum: int) -> None:
        """Refuse to resume a checkpoint written with another number of processes: the data
        order and the micro-batches of a step depend on ``world_size * grad_accum``.

        Raises:
            ValueError: the checkpoint's world size differs from this run's.
        """
        if state is None:
            return
        saved = int(state.get("world_size", 1))
        if saved != self.world_size:
            raise ValueError(
                f"--resume: the checkpoint was written by {saved} processes, this run has "
                f"{self.world_size}; resume with {saved} processes (grad_accum {grad_accum}) so "
                "each step takes the same micro-batches"
            )

    def open_log(self, path: Path) -> Any:
        """The step log opened for appending on rank 0, a sink elsewhere."""
        return open(path, "a") if self.is_main else open(os.devnull, "w")  # noqa: SIM115

    def place(self, model: Any) -> Any:
        """Move ``model`` to :attr:`device` and, when sharding was asked for, shard its
        frozen base model (FSDP2); returns the model. Identity in one process."""
        if not self.active:
            return model
        if self.device.type != "cpu":
            model.to(self.device)
        if self.sharded:
            from ..hf import STATE_CONFIG_KEY

            self._saved_config = model.state_dict()[STATE_CONFIG_KEY]  # reads base weights
            self.sharded_layers = shard_base_model(model.base_model)
        return model

    def describe(self) -> dict[str, Any]:
        """What a run's results record of the layout: ``{"distributed": {world_size,
        backend, sharded, sharded_layers}}``, nothing in one process."""
        if not self.active:
            return {}
        info = {"world_size": self.world_size, "backend": torch.distributed.get_backend(),
                "sharded": self.sharded, "sharded_layers": self.sharded_layers}  # fmt: skip
        return {"distributed": info}

    def saver(self, model: Any) -> Any:
        """What the checkpoint and adapter saves call ``save_pretrained`` on: the model
        itself, or (sharded base) a :class:`RankZeroSaver` that needs no collective."""
        if self.sharded and self._saved_config is not None:
            return RankZeroSaver(model, self._saved_config)
        return model

    def weights_view(self, module: Any) -> Any:
        """What ``utils.env.weights_sha256`` hashes: the module, or (sharded) a
        :class:`ShardedWeights` view that gathers one whole tensor at a time (every rank
        must hash together)."""
        return ShardedWeights(module) if self.sharded else module


class ShardedWeights:
    """A module's ``state_dict()`` with every sharded tensor (``DTensor``) gathered whole,
    one at a time when read, on the CPU: the same names, dtypes, shapes and values as before
    sharding. Reading a value is a collective (every rank reads the same keys in order)."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        state = self.module.state_dict()

        class _Whole(Mapping):
            def __getitem__(self, key: str) -> torch.Tensor:
                t = state[key]
                return (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu()

            def __iter__(self) -> Iterator[str]:
                return iter(state)

            def __len__(self) -> int:
                return len(state)

        return _Whole()


class RankZeroSaver:
    """``save_pretrained`` of a :class:`~focus_attention.hf.FocusModel` whose base model is
    sharded: the routers are whole on every rank and the base-model fingerprint (which
    reads base weights) is taken once, before sharding, so saving on rank 0 alone needs no
    other rank."""

    def __init__(self, model: Any, config_tensor: torch.Tensor) -> None:
        self.model, self.config_tensor = model, config_tensor

    def save_pretrained(self, directory: Any) -> None:
        """``FocusModel.save_pretrained(directory)`` with the fingerprint taken before
        sharding."""
        from ..hf import STATE_CONFIG_KEY

        state = self.model.routers.state_dict(prefix="routers.")
        state[STATE_CONFIG_KEY] = self.config_tensor
        self.model.save_pretrained(directory, state_dict=state)


def shard_base_model(base_model: torch.nn.Module) -> int:
    """Shard a frozen base model in place with FSDP2 (``fully_shard``): every module whose
    class is named in the accelerate configuration's ``fsdp_transformer_layer_cls_to_wrap``
    (default: the model's ``_no_split_modules``), then the model itself; the configuration's
    ``fsdp_reshard_after_forward`` and ``fsdp_offload_params`` apply. Returns how many
    modules were sharded.

    Raises:
        ValueError: an FSDP configuration of version 1 (FSDP1 wraps the model in a new
            module; Focus needs FSDP2's in-place sharding), with activation checkpointing or
            CPU-RAM-efficient loading, or no layer class to shard.
    """
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise ValueError(
            f"focus train: the accelerate FSDP configuration has fsdp_version "
            f"{plugin.fsdp_version}; set fsdp_version: 2 (configs/accelerate/fsdp.yaml)"
        )
    unsupported = [name for name in ("activation_checkpointing", "cpu_ram_efficient_loading")
                   if getattr(plugin, name, False)]  # fmt: skip
    if unsupported:
        raise ValueError(
            f"focus train: the accelerate FSDP settings {['fsdp_' + n for n in unsupported]} "
            "are not supported (the frozen base is loaded whole on every process, then "
            "sharded); set them to false"
        )
    names = set(plugin.transformer_cls_names_to_wrap or [])
    names = names or set(getattr(base_model, "_no_split_modules", None) or [])
    layers = [m for m in base_model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"focus train: FSDP found no layer of the classes {sorted(names)} in "
            f"{type(base_model).__name__}; name its decoder layer class in "
            "fsdp_transformer_layer_cls_to_wrap"
        )
    kwargs: dict[str, Any] = {"reshard_after_forward": bool(plugin.reshard_after_forward)}
    if isinstance(plugin.cpu_offload, OffloadPolicy):  # CPUOffloadPolicy with offload_params
        kwargs["offload_policy"] = plugin.cpu_offload
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(base_model, **kwargs)
    return len(layers) + 1


def _join_group(world_size: int, local_rank: int) -> torch.device:
    """Join the default process group (env:// rendezvous set by the launcher) unless the
    caller already did; destroys it at exit when joined here. Returns the device."""
    dist = torch.distributed
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
        atexit.register(dist.destroy_process_group)
    if dist.get_world_size() != world_size:
        raise RuntimeError(
            f"the process group has {dist.get_world_size()} processes but WORLD_SIZE is "
            f"{world_size}"
        )
    return device


def setup() -> Distributed:
    """This process's :class:`Distributed`, from the launcher's environment (``WORLD_SIZE``,
    ``RANK``, ``LOCAL_RANK``, as ``torchrun`` and ``accelerate launch`` set them); joins the
    process group when there is more than one process.

    Raises:
        ValueError: a malformed ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``, or an accelerate
            configuration asking for mixed precision.
        RuntimeError: the process group cannot be joined (the launcher's rendezvous failed).
    """
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Distributed()
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if precision not in ("", "no"):
        raise ValueError(
            f"focus train: the accelerate configuration asks for mixed_precision "
            f"{precision!r}; focus train runs the model in its own dtype with float32 "
            "routers: set mixed_precision: 'no'"
        )
    rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank}: expected 0 <= RANK < WORLD_SIZE={world}")
    device = _join_group(world, local)
    return Distributed(rank, world, local, device, sharded=fsdp_requested())
