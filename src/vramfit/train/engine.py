"""The denoiser's training step, built once per run: what owns the step's machinery.

Setup (vramfit/run.py, fit/probe.py) builds one StepEngine over the placed denoiser and its
optimizer: it takes the run's WeightStreamer (memory/offload/; given, not looked up), registers
the backward hooks (optim/in_backward.py: the step inside backward, stochastically rounded bf16
sums), wraps the denoiser for CUDA graph recordings (train/graphs.py) and turns on the streamed
weights' step on the device where it applies. It exposes what the loop and the sampler need: one
optimizer `step` of accumulated micro-batches, `release_for_sampling` (the recordings' memory
for a sample grid), `train_mode` and `close`. The loop (train/loop.py) never touches the hooks,
the recordings or the streamer.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from contextlib import nullcontext
from typing import Optional

import torch

from vramfit.config.schema import TrainConfig
from vramfit.memory.offload import WeightStreamer
from vramfit.models.adapter import Family, ModelBundle
from vramfit.optim.build import steps_streamed_on_device
from vramfit.optim.in_backward import BackwardSteps, optional_steps
from vramfit.train import graphs
from vramfit.train.data import Draw
from vramfit.train.distributed import DataParallel
from vramfit.train.graphs import GraphedDenoiser
from vramfit.train.state import Progress


class NonFiniteLoss(RuntimeError):
    """A NaN/inf loss or gradient under train.nonfinite = "stop"."""


def training_dtype(bundle: ModelBundle, cfg: TrainConfig) -> torch.dtype:
    """The dtype the denoiser's inputs take: its weights' (under LoRA the frozen base's; its
    trainable fp32 matrices cast for themselves), fp32 under mixed_bf16's autocast."""
    params = bundle.denoiser.parameters()
    base = next((p for p in bundle.denoiser.parameters() if not p.requires_grad), next(params))
    return base.dtype if cfg.precision != "mixed_bf16" else torch.float32


def micro_step_loss(family: Family, bundle: ModelBundle, batch: dict, cfg: TrainConfig,
                    generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Loss of one micro-batch (not yet divided by the accumulation count)."""
    return inputs_loss(family, bundle, family.loss_inputs(bundle, batch, cfg, generator), cfg, device, dtype)


def inputs_loss(family: Family, bundle: ModelBundle, inputs: dict, cfg: TrainConfig, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
    """Loss of one micro-batch from its `Family.loss_inputs`."""
    # CUDA graphs record the casts themselves; autocast's cache of cast weights cannot be recorded
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cfg.cuda_graphs is not True)
                if cfg.precision == "mixed_bf16" else nullcontext())
    with autocast:
        return family.loss_from(bundle, inputs, cfg, device, dtype)


class StepEngine:
    """One optimizer step of the denoiser, with everything that acts on it inside the step."""

    def __init__(self, family: Family, bundle: ModelBundle, optimizer, cfg: TrainConfig, device: torch.device, *,
                 streamer: Optional[WeightStreamer] = None, ranks: Optional[DataParallel] = None):
        self.family, self.optimizer, self.cfg, self.device = family, optimizer, cfg, device
        self.ranks = ranks or DataParallel()
        self.denoiser, self.streamer = bundle.denoiser, streamer
        self.dtype = training_dtype(bundle, cfg)
        self.params = [p for p in bundle.denoiser.parameters() if p.requires_grad]
        # the optimizer's further groups (trained text encoders): clipped and checked with the denoiser's
        self.params += [p for group in optimizer.param_groups[1:] for p in group["params"]]
        self.loss_bundle = self.ranks.forward_bundle(bundle)
        self.hooks = optional_steps(self.params, optimizer, in_backward=cfg.optimizer_in_backward,
                                    round_sums=cfg.stochastic_rounding, grad_accum=cfg.grad_accum,
                                    max_grad_norm=cfg.max_grad_norm, device=device)
        self.graphed: Optional[GraphedDenoiser] = None
        # train/graphs.py: record the denoiser per input signature, replay after. fit/resolve.py decides
        # "auto"; a TrainConfig built alone that still says so trains without graphs
        if cfg.cuda_graphs is True:
            graphs.check_device(device)
            # with the step inside backward, the recorded backward steps the weights too; else it may
            # sum bf16 gradients of several micro-batches with stochastic rounding
            stepping = self.hooks if cfg.optimizer_in_backward else None
            summing = None if cfg.optimizer_in_backward else self.hooks
            self.graphed = GraphedDenoiser(self.loss_bundle.denoiser, steps=stepping, sums=summing,
                                           warm_each=cfg.compile, streamer=streamer)
            self.loss_bundle = dataclasses.replace(self.loss_bundle, denoiser=self.graphed)
        # streamed weights whose optimizer state is small step on the device in backward
        # (memory/offload/grads.py)
        if self.hooks is not None and steps_streamed_on_device(streamer is not None, cfg.mode,
                                                               self.hooks.in_backward, type(optimizer)):
            streamer.step_on_device(self.hooks)

    def forward(self, inputs: dict) -> torch.Tensor:
        return inputs_loss(self.family, self.loss_bundle, inputs, self.cfg, self.device, self.dtype)

    def train_mode(self) -> None:
        self.denoiser.train()

    def step(self, feed, progress: Progress, more: bool) -> float:
        """One optimizer step over grad_accum micro-batches of `feed` (train/loop.py Feeder); `more`:
        another step follows (its inputs are made while the GPU works on this one). The loss."""
        if self.cfg.optimizer_in_backward:
            return _step_in_backward(self.forward, feed, self.optimizer, self.hooks, self.cfg, progress,
                                     self.device, more)
        return _step_after_backward(self.forward, feed, self.optimizer, self.params, self.hooks, self.cfg,
                                    progress, self.device, self.ranks, more)

    def release_for_sampling(self) -> bool:
        """Drop the CUDA graph recordings (their pool and gradient buffers) so a sample grid gets their
        memory; the next step records again. Whether there were any."""
        if self.graphed is None:
            return False
        held = bool(self.graphed.captures)
        if held:
            self.graphed.release()
        # compiled blocks run each signature once more before it records: the grid may compile anew
        self.graphed.forget_eager_calls()
        return held

    def close(self) -> None:
        """Remove the hooks and end the streamed step on the device; drop the recordings (their pool
        and buffers go back for saving and the final sample grid) and free the streamer's slots."""
        if self.hooks is not None:
            self.hooks.remove()
        if self.graphed is not None and self.graphed.captures:
            self.graphed.release()
        if self.streamer is not None:
            self.streamer.step_on_device(None)
            self.streamer.free_slots()


def _accumulate(forward, feed, grad_hooks: Optional[BackwardSteps], cfg: TrainConfig,
                device: torch.device, check_last: bool,
                ranks: Optional[DataParallel] = None) -> tuple[torch.Tensor, list[Draw], bool]:
    """Forward and backward of one optimizer step's micro-batches: (mean loss, records, whether
    every backward ran). With `check_last` the mean loss is read (one host sync) before the last
    backward, which is skipped when the loss is not finite. Over several ranks each rank runs
    its share of the micro-batches and only the last backward averages gradients across them."""
    ranks = ranks or DataParallel()
    total = torch.zeros((), device=device)
    used: list[Draw] = []
    for i in range(cfg.grad_accum):
        last = i == cfg.grad_accum - 1
        _, group, inputs = feed.take()
        used += group
        with ranks.sync(last):
            loss = forward(inputs)
            del inputs
            total += loss.detach() / cfg.grad_accum
            if last and check_last and not math.isfinite(float(total)):
                return total, used, False
            if grad_hooks is not None:
                grad_hooks.begin(last)
            (loss / cfg.grad_accum).backward()
            del loss  # its graph too: a recording (train.cuda_graphs) must not meet nodes of an eager step
    return total, used, True


def _step_after_backward(forward, feed, optimizer, params: list[torch.nn.Parameter],
                         grad_hooks: Optional[BackwardSteps], cfg: TrainConfig, progress: Progress,
                         device: torch.device, ranks: Optional[DataParallel] = None, more: bool = False) -> float:
    total, used, _ = _accumulate(forward, feed, grad_hooks, cfg, device, check_last=False, ranks=ranks)
    total = (ranks or DataParallel()).mean(total)  # every rank logs and decides on the same value
    if grad_hooks is not None:
        grad_hooks.finish()  # stochastically rounded sums become p.grad
    # The global gradient norm doubles as the check: it is inf/NaN when any gradient is.
    if cfg.max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if hasattr(norm, "full_tensor"):  # FSDP's DTensor gradients give a DTensor norm
        norm = norm.full_tensor()
    # The check stays on the device: the step launches at once and changes nothing where the flag
    # is False, so the host's one sync a step comes after the step's launches, not before them
    # (the GPU would idle while they are made).
    finite = torch.isfinite(norm) & torch.isfinite(total)
    optimizer.step(finite=finite)
    optimizer.zero_grad(set_to_none=True)
    if more:  # while the GPU works on this step, in memory its launches have let go of
        feed.ahead()
    value = float(total)  # the host sync
    if not bool(finite):
        optimizer.take_back()  # the step counts the host advanced
        _nonfinite(cfg, progress, value, used)
    return value


def _step_in_backward(forward, feed, optimizer, grad_hooks: BackwardSteps, cfg: TrainConfig,
                      progress: Progress, device: torch.device, more: bool = False) -> float:
    """Each parameter steps in its gradient hook during the last backward (optim/in_backward.py).
    A non-finite loss is caught before that backward, so nothing of the step is applied; a
    non-finite gradient tensor is held back while the finite ones are applied."""
    total, used, complete = _accumulate(forward, feed, grad_hooks, cfg, device, check_last=True)
    if complete and more:
        # while the GPU runs the backward (and its steps); its activations, freed as its launches
        # were made, give the room, so the step's peak does not grow by the inputs
        feed.ahead()
    value = float(total)
    if not complete:
        grad_hooks.discard()
        optimizer.zero_grad(set_to_none=True)
        _nonfinite(cfg, progress, value, used)
        return value
    held = grad_hooks.finish()  # a second host sync: the count of held-back tensors
    optimizer.step()  # finds no gradients left; keeps torch's step hooks and the schedule's order check
    if held:
        _nonfinite(cfg, progress, value, used, held_back=held)
    return value


def _nonfinite(cfg: TrainConfig, progress: Progress, value: float, used: list[Draw], held_back: int = 0) -> None:
    files = ", ".join(r.item.key for r in used)
    what = (f"{held_back} gradient tensors are not finite and were not applied (the optimizer steps "
            "in backward, so the finite ones were)" if held_back else
            f"loss {value} or its gradient is not finite")
    if cfg.nonfinite == "stop":
        applied = "" if held_back else " Nothing of this step was applied"
        raise NonFiniteLoss(f"step {progress.step + 1}: {what}; the batch held {files}.{applied} "
                            "(train.nonfinite = \"skip\" skips such steps instead)")
    progress.nonfinite_skipped += 1

    logging.getLogger("vramfit").warning("step %d: %s; step skipped (batch: %s)", progress.step + 1, what, files)
