"""``FocusTrainer``: ``transformers.Trainer`` training a ``focus train`` method with an
objective (docs/method.md §6, "Methods" and "Objectives").

The method (:func:`~.methods.build_trainee`) decides what trains and its AdamW parameter
groups (one learning rate per group: the routers', LoRA's or the base weights'); the
objective (:func:`~.methods.step_loss`) computes each micro-batch's loss; everything else
(gradient accumulation, clipping, data order, checkpoints, ``resume_from_checkpoint``, DDP
under ``torchrun`` or ``accelerate launch``) is the Trainer's. The routers combine the ranks'
routing statistics themselves (:meth:`~focus_attention.hf.router.FocusRouter.update_bias`).
Two-phase training is two Trainer runs, each with its phase's trainee, a fresh AdamW and its
own warm-up and cosine schedule (:func:`~.methods.phase_schedule`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

from ..ops import dominance
from .methods import Trainee, phase_schedule, step_loss
from .outputs import write_run_state
from .schedule import EpochPermutations
from .validation import base_perplexity, validation_perplexities

__all__ = ["FocusTrainer", "routing_dominance", "sharding"]


def routing_dominance(records: list[dict[str, Any]]) -> dict[str, float]:
    """Dominance of the recorded routing (docs/method.md §2), over layers: ``dominance``
    (mean) and ``dominance_max`` (worst layer) of the tokens' largest Sinkhorn weights, and
    ``dominance_topk`` (mean) of the causal top-k memberships."""
    soft, hard = [], []
    for r in records:
        probs = r.get("probs")
        if probs is not None:
            onehot = torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).bool()
            soft.append(dominance(onehot, r.get("key_padding")))
        if r.get("query_groups") is not None:
            pad = r.get("key_padding")
            if pad is not None:
                pad = pad[:, pad.shape[1] - r["query_groups"].shape[1] :]
            hard.append(dominance(r["query_groups"], pad))
    out: dict[str, float] = {}
    if soft:
        out["dominance"] = sum(soft) / len(soft)
        out["dominance_max"] = max(soft)
    if hard:
        out["dominance_topk"] = sum(hard) / len(hard)
    return out


def sharding(trainer: Any) -> dict[str, Any]:
    """How the Trainer's processes hold the model: ``world_size``, ``requested`` (the launch
    asked for FSDP: ``ACCELERATE_USE_FSDP``, set by ``accelerate launch`` with an FSDP
    configuration file) and ``sharded`` (the Trainer shards the model with FSDP).

    accelerate enables FSDP only on accelerators (GPUs and the like): processes on CPUs
    train data-parallel with the whole model on every rank. A requested but unsharded run
    warns (``UserWarning``) and records ``sharded: false``; its results are the
    data-parallel ones."""
    requested = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    sharded = bool(getattr(trainer, "is_fsdp_enabled", False))
    if requested and not sharded:
        warnings.warn(
            "focus train/pretrain: the launch asked for FSDP, but accelerate enables FSDP only on "
            "accelerators; these CPU processes train data-parallel, each with the whole model",
            stacklevel=2,
        )
    return {"world_size": trainer.args.world_size, "requested": requested, "sharded": sharded}


class FocusTrainer(Trainer):
    """``transformers.Trainer`` for a :class:`~.methods.Trainee` and a
    :class:`~.config.TrainConfig` (its ``objective``, ``betas``, ``weight_decay``,
    ``warmup_steps``, ``steps`` / ``phase1_steps`` and ``seed``).

    * the model is ``trainee.model`` (the :class:`~focus_attention.hf.FocusModel` or, for
      the dense methods, the transformers model with LoRA in place); every micro-batch runs
      in the trainee's training mode (routers soft, base model in ``eval()``, LoRA dropout
      on) whatever mode the Trainer set;
    * ``compute_loss``: :func:`~.methods.step_loss` on ``inputs["input_ids"]`` (int64
      ``[B, N]``), the gradient-carrying forward through the model as the Trainer wrapped
      it (DDP); the loss is a per-micro-batch mean, so the Trainer divides it by the
      accumulation steps (``loss_is_scaled_for_ga = False``);
    * the coverage objective's query sample is drawn from a generator seeded by the run's
      seed and the micro-batch's global index (``step * W * G + m * W + rank``, the order
      in which the Trainer hands the ranks their micro-batches), so it does not depend on
      the number of processes;
    * ``create_optimizer``: AdamW over the trainee's groups (:meth:`Trainee.optimizer`);
      ``create_scheduler``: ``LambdaLR`` of :func:`~.methods.phase_schedule`;
    * every log entry with the training ``loss`` also gets the means, over the micro-batches
      this process ran since the last entry, of the objective's metrics (``lm_loss``,
      ``distill_kl``, ``coverage_soft``...; the objective's ``loss`` as ``objective_loss``)
      and the routing dominance (:func:`routing_dominance`; ``dominance_max``: the worst);
    * ``evaluate``: validation perplexity of ``val_blocks`` (``LongTensor [n, seq_len]``,
      keyword argument) by :func:`~.validation.validation_perplexities`, the function
      ``focus pretrain`` validates with, under the ``focus train`` log keys; at the run's
      first step also ``val_ppl_base``, the base model's;
    * the data order is :class:`~.schedule.EpochPermutations` (one seeded permutation of
      the rows per epoch), which does not depend on the number of processes;
    * checkpoints (and ``save_model``) hold every trained part, as ``focus train`` writes
      its output: the Focus adapter, ``lora/`` (peft) and ``model/`` (transformers), which
      ``resume_from_checkpoint`` loads back in place, and the run state
      (:func:`~.outputs.write_run_state`: world size, phase, ``step_offset``, the steps of
      the phases before this Trainer's, and ``data``, the fingerprint of the training data,
      :func:`~.outputs.data_fingerprint`).

    Raises:
        ValueError: the coverage objective with more than one process (its gradient reaches
            the routers outside the model's forward, which DDP does not synchronise).
    """

    #: the objectives return per-micro-batch means; the Trainer divides by the accumulation
    loss_is_scaled_for_ga = False

    def __init__(self, *args: Any, trainee: Trainee, config: Any,
                 val_blocks: torch.Tensor | None = None, step_offset: int = 0,
                 data: dict[str, Any] | None = None, **kwargs: Any) -> None:  # fmt: skip
        kwargs.setdefault("model", trainee.model)
        super().__init__(*args, **kwargs)
        if config.objective == "coverage" and trainee.focus is not None and self.args.world_size > 1:  # fmt: skip
            raise ValueError(
                f"TrainConfig.objective: 'coverage' runs in one process only (world size "
                f"{self.args.world_size}); use 'lm', 'distill' or 'mix' under torchrun"
            )
        self.trainee, self.train_config, self.val_blocks = trainee, config, val_blocks
        self.step_offset, self.data_fingerprint = step_offset, data
        self.step_metrics: list[dict[str, float]] = []
        self._micro = (-1, 0)  # (optimizer step, micro-batches of it run so far)

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        """Checkpoints and ``save_model``, on the main process: the trainee's parts
        (:meth:`Trainee.save_pretrained`: the Focus adapter, ``lora/``, ``model/``), the
        arguments and the run state."""
        if not self.args.should_save:  # the Trainer calls this on every process
            return
        out = Path(output_dir or self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.trainee.save_pretrained(out)
        torch.save(self.args, out / TRAINING_ARGS_NAME)
        write_run_state(out, world_size=self.args.world_size, phase=self.trainee.phase,
                        step_offset=self.step_offset, data=self.data_fingerprint)  # fmt: skip

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """The data order: :class:`~.schedule.EpochPermutations` of the training rows,
        seeded by the run's ``seed``, in whole optimizer steps of every process."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        args = self.args
        step_blocks = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size  # fmt: skip
        return EpochPermutations(len(dataset), self.train_config.seed, step_blocks)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """``resume_from_checkpoint``: the trainee's parts back in place
        (:meth:`Trainee.load_checkpoint`); the Trainer restores the optimizer, schedule,
        RNG and data position."""
        self.trainee.load_checkpoint(resume_from_checkpoint)

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """AdamW over the trainee's parameter groups, each with its learning rate."""
        if self.optimizer is None:
            self.optimizer = self.trainee.optimizer(self.train_config)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """Warm-up and cosine decay over the trainee's phase (:func:`phase_schedule`)."""
        if self.lr_scheduler is None:
            schedule = phase_schedule(self.train_config, self.trainee.phase)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer or self.optimizer, schedule
            )
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def micro_batch_generator(self) -> torch.Generator:
        """The CPU generator of the next micro-batch (class docstring)."""
        step = self.state.global_step
        last, count = self._micro
        count = count + 1 if last == step else 0
        self._micro = (step, count)
        world = self.args.world_size
        index = (step * self.args.gradient_accumulation_steps + count) * world + self.args.process_index  # fmt: skip
        seed = (self.train_config.seed * 1_000_003 + index) % (2**63 - 1)
        return torch.Generator().manual_seed(seed)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:  # fmt: skip
        """The objective's loss of ``inputs["input_ids"]`` (class docstring)."""
        self.trainee.train_mode()
        step = step_loss(self.trainee, inputs["input_ids"], self.train_config,
                         self.micro_batch_generator(), forward=model)  # fmt: skip
        metrics = {("objective_loss" if k == "loss" else k): v for k, v in step.metrics.items()}
        self.step_metrics.append({**metrics, **routing_dominance(step.records)})
        return (step.loss, None) if return_outputs else step.loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log entry; one with a training ``loss`` also gets the objective's
        metrics, ``tokens`` (training tokens of the run so far, every process and phase),
        with two parameter groups ``base_lr`` (the second group's rate) and, in two-phase
        runs, ``phase``."""
        if "loss" in logs:
            for key in dict.fromkeys(k for m in self.step_metrics for k in m):
                values = [m[key] for m in self.step_metrics if key in m]
                logs[key] = max(values) if key.endswith("max") else sum(values) / len(values)
            self.step_metrics = []
            cfg = self.train_config
            per_step = cfg.seq_len * cfg.batch_size * cfg.grad_accum * self.args.world_size
            logs["tokens"] = (self.state.global_step + self.step_offset) * per_step
            if cfg.method == "two-phase":
                logs["phase"] = self.trainee.phase
            groups = self.trainee.groups
            if "learning_rate" in logs and len(groups) > 1:  # the base side's, same schedule
                logs["base_lr"] = logs["learning_rate"] * groups[1]["lr"] / groups[0]["lr"]
        super().log(logs, start_time)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None,
                 metric_key_prefix: str = "val") -> dict[str, float]:  # fmt: skip
        """Validation perplexity of ``val_blocks``, every rank scoring all of them: with
        Focus ``<prefix>_ppl_topk`` (causal top-k routing with the run's ``top_k``, the
        inference-time model) and ``<prefix>_ppl_soft`` (Sinkhorn routing), for the dense
        methods ``<prefix>_ppl``; and ``<prefix>_tokens``. Logged and passed to the
        callbacks' ``on_evaluate``.

        Raises:
            ValueError: the trainer was built without ``val_blocks``.
        """
        if self.val_blocks is None:
            raise ValueError("FocusTrainer.evaluate: no val_blocks were given to the trainer")
        focus = self.trainee.focus
        top_k = focus.focus_config.top_k if focus is not None else 1
        values = validation_perplexities(self.trainee.model, focus, self.val_blocks, (top_k,), top_k)  # fmt: skip
        if focus is None:
            named = {"ppl": values["ppl"]}
        else:
            named = {"ppl_topk": values[f"ppl_top{top_k}"]}
            if focus.focus_config.router_input != "query_key":  # no soft routing to score
                named["ppl_soft"] = values["ppl"]
        if self.state.global_step == 0 and self.step_offset == 0:  # the untrained start
            named["ppl_base"] = named["ppl"] if focus is None else base_perplexity(focus, self.val_blocks)  # fmt: skip
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in named.items()}
        metrics[f"{metric_key_prefix}_tokens"] = int(values["tokens"])
        self.log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(
            self.args, self.state, self.control, metrics
        )
        return metrics
