"""The one training loop: micro-batches, accumulation, clipping, step, schedule, logs, saves.

Everything the loop's future depends on lives in `Progress` and the noise generator, both saved
in a training state, and the data order of an epoch is a function of (seed, epoch) alone, so a
run resumed at any optimizer-step boundary continues exactly as if it had never stopped.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from vramfit.config.schema import TrainConfig
from vramfit.models.adapter import Family, ModelBundle
from vramfit.memory.offload import streamer_of
from vramfit.optim.build import steps_streamed_on_device
from vramfit.optim.in_backward import BackwardSteps, optional_steps
from vramfit.train import graphs
from vramfit.train.data import CacheEntriesLost, Draw, TrainingData
from vramfit.train.distributed import DataParallel, micro_batch_generator
from vramfit.train.graphs import GraphedDenoiser
from vramfit.train.state import Progress


class NonFiniteLoss(RuntimeError):
    """A NaN/inf loss or gradient under train.nonfinite = "stop"."""


@dataclass
class StopFlag:
    """Set from a signal handler; the loop stops at the next optimizer-step boundary."""

    requested: Optional[str] = None


@dataclass
class LoopHooks:
    on_step: Optional[Callable[[int, float, float], None]] = None
    on_save: Optional[Callable[[Progress], None]] = None  # checkpoint every save_every steps
    on_state: Optional[Callable[[Progress], None]] = None  # resumable state every state_every
    save_at: Optional[Callable[[Progress], bool]] = None  # a checkpoint too where it says so (epochs)
    save_every: int = 0
    state_every: int = 0


@dataclass
class LoopResult:
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    interrupted: Optional[str] = None

    @property
    def median_step(self) -> Optional[float]:
        times = self.step_seconds[1:] or self.step_seconds
        return statistics.median(times) if times else None


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


class Feeder:
    """The micro-batches of a run with their loss inputs, made one ahead.

    What a micro-batch's loss needs from the host (its batch from the cache and every random draw:
    `Family.loss_inputs`) is made on the CPU and, on a GPU, put in pinned memory and copied to the
    device without holding the host up; the conditioning is cast to the training's dtype first, as
    the loss would cast it on the device (the same values, fewer bytes). The loop calls `ahead()`
    before it waits for the GPU, after the step's launches (the step after backward) or the last
    backward's (the step inside it), so the next step's inputs are made while the GPU still works
    on this one, in memory those launches have let go of (the step's peak does not grow by them),
    and its kernels follow at once, instead of the GPU waiting for the host at every step's start.
    Where the device has no room for them yet, they stay in pinned memory and the loss copies
    them. Each micro-batch draws from its own generator (`micro_batch_generator`), so when its
    draws are made changes none of them. Making one ahead leaves `progress` as it was: the
    micro-batch counts as taken only in `take()`, so a state saved in between resumes with it; an
    error in making them (an unreadable cache entry) is raised there too, where it was met before."""

    def __init__(self, family: Family, bundle: ModelBundle, data: TrainingData, cfg: TrainConfig,
                 batches: Iterator[tuple[int, list[Draw]]], progress: Progress, device: torch.device,
                 dtype: Optional[torch.dtype] = None):
        self.family, self.bundle, self.data, self.cfg = family, bundle, data, cfg
        self.batches, self.progress, self.device, self.dtype = batches, progress, device, dtype
        self._next: Optional[tuple[int, list[Draw], dict, tuple]] = None
        self._failed: Optional[tuple[Exception, Optional[tuple]]] = None  # (error, position after the take)

    def take(self) -> tuple[int, list[Draw], dict]:
        """(global index, records, loss inputs on the device) of the next micro-batch."""
        self.ahead()
        if self._failed is not None:
            error, position = self._failed
            self._failed = None
            if position is not None:
                self._place(position)
            raise error
        index, group, inputs, position = self._next
        self._next = None
        self._place(position)
        return index, group, inputs

    def ahead(self) -> None:
        """Make the next micro-batch's inputs now (nothing when they are made already)."""
        if self._next is not None or self._failed is not None:
            return
        before, after = self._position(), None
        try:
            batch = None
            while batch is None:  # None: a micro-batch with an unusable cache entry, skipped (train/data.py)
                index, group = next(self.batches)
                after = self._position()
                batch = self.data.batch(group)
            inputs = self.family.loss_inputs(self.bundle, batch, self.cfg,
                                             micro_batch_generator(self.cfg.seed, index), self.dtype)
            if self.device.type == "cuda":
                inputs = {k: v.pin_memory() for k, v in inputs.items()}
                try:
                    inputs = {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}
                except torch.OutOfMemoryError:  # no room yet: `loss_from` copies them when they are used
                    pass
        except Exception as error:  # noqa: BLE001 - raised again by `take`
            self._failed = (error, after)
            return
        finally:
            self._place(before)
        self._next = (index, group, inputs, after)

    def _position(self) -> tuple[int, int, int]:
        p = self.progress
        return p.epoch, p.batch_in_epoch, p.micro_batches

    def _place(self, position: tuple[int, int, int]) -> None:
        self.progress.epoch, self.progress.batch_in_epoch, self.progress.micro_batches = position


def epoch_batches(data: TrainingData, cfg: TrainConfig, progress: Progress, shuffle: bool) -> Iterator[list[Draw]]:
    """Micro-batches from the current position on, advancing `progress` as they are taken."""
    if not data.trained:
        raise ValueError("the datasets hold no image to train (every one is held out for validation)")
    while True:
        order_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + progress.epoch)
        # an epoch of a dataset with a small weight may hold no image of it: it is then empty
        order = list(data.batches(cfg.batch_size, order_gen, shuffle, progress.epoch))
        while progress.batch_in_epoch < len(order):
            group = order[progress.batch_in_epoch]
            progress.batch_in_epoch += 1
            progress.micro_batches += 1
            yield group
        progress.epoch += 1
        progress.batch_in_epoch = 0


def training_dtype(bundle: ModelBundle, cfg: TrainConfig) -> torch.dtype:
    """The dtype the denoiser's inputs take: its weights' (under LoRA the frozen base's; its
    trainable fp32 matrices cast for themselves), fp32 under mixed_bf16's autocast."""
    params = bundle.denoiser.parameters()
    base = next((p for p in bundle.denoiser.parameters() if not p.requires_grad), next(params))
    return base.dtype if cfg.precision != "mixed_bf16" else torch.float32


def run_loop(family: Family, bundle: ModelBundle, data: TrainingData, optimizer, schedule,
             cfg: TrainConfig, device: torch.device, progress: Progress, generator: torch.Generator,
             hooks: Optional[LoopHooks] = None, stop: Optional[StopFlag] = None,
             shuffle: bool = True, ranks: Optional[DataParallel] = None) -> LoopResult:
    """Train `bundle.denoiser` from progress.step to cfg.steps; returns losses and step times.

    Each micro-batch draws from its own generator, seeded by (seed, global micro-batch index), so
    its noise does not depend on which rank or how many processes train it (train/distributed.py);
    `generator` is kept for the training state's format."""
    hooks, stop = hooks or LoopHooks(), stop or StopFlag()  # fresh per call: a set flag never leaks
    ranks = ranks or DataParallel()
    unet = bundle.denoiser
    dtype = training_dtype(bundle, cfg)
    batches = ranks.micro_batches(epoch_batches(data, cfg, progress, shuffle), progress)
    loss_bundle = ranks.forward_bundle(bundle)
    feed = Feeder(family, loss_bundle, data, cfg, batches, progress, device, dtype)
    params = [p for p in unet.parameters() if p.requires_grad]

    def forward(inputs: dict) -> torch.Tensor:
        return inputs_loss(family, loss_bundle, inputs, cfg, device, dtype)

    grad_hooks = optional_steps(params, optimizer, in_backward=cfg.optimizer_in_backward,
                                round_sums=cfg.stochastic_rounding, grad_accum=cfg.grad_accum,
                                max_grad_norm=cfg.max_grad_norm, device=device)
    # train/graphs.py: record the denoiser per input signature, replay after. RunConfig decides "auto"
    # when it loads; a TrainConfig built alone that still says so trains without graphs
    if cfg.cuda_graphs is True:
        graphs.check_device(device)
        # with the step inside backward, the recorded backward steps the weights too; else it may
        # sum bf16 gradients of several micro-batches with stochastic rounding
        stepping = grad_hooks if cfg.optimizer_in_backward else None
        summing = None if cfg.optimizer_in_backward else grad_hooks
        loss_bundle = dataclasses.replace(loss_bundle, denoiser=GraphedDenoiser(loss_bundle.denoiser, steps=stepping,
                                                                                sums=summing, warm_each=cfg.compile))
    # streamed weights whose optimizer state is small step on the device in backward (memory/offload.py)
    streamer = streamer_of(unet)
    if grad_hooks is not None and steps_streamed_on_device(streamer is not None, cfg.mode, grad_hooks.in_backward,
                                                           type(optimizer)):
        streamer.step_on_device(grad_hooks)
    result = LoopResult()
    unet.train()
    try:
        while progress.step < cfg.steps:
            t0 = time.perf_counter()
            at = (progress.epoch, progress.batch_in_epoch, progress.micro_batches)
            try:
                if cfg.optimizer_in_backward:
                    value = _step_in_backward(forward, feed, optimizer, grad_hooks, cfg, progress, device)
                else:
                    value = _step_after_backward(forward, feed, optimizer, params, grad_hooks, cfg, progress,
                                                 device, ranks)
            except CacheEntriesLost as exc:  # the step did not happen: save the state of the last one
                progress.epoch, progress.batch_in_epoch, progress.micro_batches = at
                if hooks.on_state is None:
                    raise
                hooks.on_state(progress)
                saved = f"The training state at step {progress.step} is saved"
                raise CacheEntriesLost(f"{exc}. {saved}: run again with --resume latest, which rebuilds the "
                                       "entries first") from None
            schedule.step()
            progress.step += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            result.step_seconds.append(time.perf_counter() - t0)
            result.losses.append(value)
            _after_step(hooks, progress, value, schedule, cfg)
            requested = ranks.any_stop(stop.requested, device)
            if requested and progress.step < cfg.steps:
                result.interrupted = requested
                break
    finally:
        if grad_hooks is not None:
            grad_hooks.remove()
        if streamer is not None:
            streamer.step_on_device(None)
            # the recordings that copy into the slots (train.cuda_graphs) end with this loop
            streamer.free_slots()
    return result


def _accumulate(forward, feed: Feeder, grad_hooks: Optional[BackwardSteps], cfg: TrainConfig,
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


def _step_after_backward(forward, feed: Feeder, optimizer, params: list[torch.nn.Parameter],
                         grad_hooks: Optional[BackwardSteps], cfg: TrainConfig, progress: Progress,
                         device: torch.device, ranks: Optional[DataParallel] = None) -> float:
    more = progress.step + 1 < cfg.steps
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


def _step_in_backward(forward, feed: Feeder, optimizer, grad_hooks: BackwardSteps, cfg: TrainConfig,
                      progress: Progress, device: torch.device) -> float:
    """Each parameter steps in its gradient hook during the last backward (optim/in_backward.py).
    A non-finite loss is caught before that backward, so nothing of the step is applied; a
    non-finite gradient tensor is held back while the finite ones are applied."""
    total, used, complete = _accumulate(forward, feed, grad_hooks, cfg, device, check_last=True)
    if complete and progress.step + 1 < cfg.steps:
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


def _after_step(hooks: LoopHooks, progress: Progress, value: float, schedule, cfg: TrainConfig) -> None:
    if hooks.on_step is not None:
        hooks.on_step(progress.step, value, schedule.get_last_lr()[0])
    last = progress.step >= cfg.steps
    due = (hooks.save_every and progress.step % hooks.save_every == 0) or (
        hooks.save_at is not None and hooks.save_at(progress))
    if hooks.on_save is not None and due and not last:
        hooks.on_save(progress)
    if hooks.on_state is not None and hooks.state_every and progress.step % hooks.state_every == 0 and not last:
        hooks.on_state(progress)
