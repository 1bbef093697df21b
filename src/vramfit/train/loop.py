"""The one training loop: micro-batches in, one step of the StepEngine (train/engine.py: the
accumulation, clipping and optimizer step with its hooks and recordings) each time, the schedule,
logs and saves.

Everything the loop's future depends on lives in `Progress` and the noise generator, both saved
in a training state, and the data order of an epoch is a function of (seed, epoch) alone, so a
run resumed at any optimizer-step boundary continues exactly as if it had never stopped.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from vramfit.config.schema import TrainConfig
from vramfit.models.adapter import Family, ModelBundle
from vramfit.train.data import CacheEntriesLost, Draw, TrainingData
from vramfit.train.distributed import micro_batch_generator
from vramfit.train.engine import StepEngine
from vramfit.train.state import Progress


@dataclass
class StopFlag:
    """Set from a signal handler; the loop stops at the next optimizer-step boundary."""

    requested: Optional[str] = None


@dataclass
class LoopHooks:
    on_step: Optional[Callable[[int, float, float], None]] = None
    # after each optimizer step, outside the recorded step, before the saves (the EMA: memory/ema.py)
    on_update: Optional[Callable[[int], None]] = None
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
                # (a trained text encoder's embeddings carry its graph: copied as they are)
                inputs = {k: v if v.requires_grad else v.pin_memory() for k, v in inputs.items()}
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


def run_loop(engine: StepEngine, data: TrainingData, schedule, cfg: TrainConfig, progress: Progress,
             hooks: Optional[LoopHooks] = None, stop: Optional[StopFlag] = None, shuffle: bool = True) -> LoopResult:
    """Train the engine's denoiser from progress.step to cfg.steps; returns losses and step times.
    The engine (train/engine.py) owns the step; the loop takes micro-batches, counts, logs and saves.
    Each micro-batch draws from its own generator, seeded by (seed, global micro-batch index), so
    its noise does not depend on which rank or how many processes train it (train/distributed.py)."""
    hooks, stop = hooks or LoopHooks(), stop or StopFlag()  # fresh per call: a set flag never leaks
    ranks, device = engine.ranks, engine.device
    batches = ranks.micro_batches(epoch_batches(data, cfg, progress, shuffle), progress)
    feed = Feeder(engine.family, engine.loss_bundle, data, cfg, batches, progress, device, engine.dtype)
    result = LoopResult()
    engine.train_mode()
    try:
        while progress.step < cfg.steps:
            t0 = time.perf_counter()
            at = (progress.epoch, progress.batch_in_epoch, progress.micro_batches)
            try:
                value = engine.step(feed, progress, more=progress.step + 1 < cfg.steps)
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
            if hooks.on_update is not None:
                hooks.on_update(progress.step)
            result.step_seconds.append(time.perf_counter() - t0)
            result.losses.append(value)
            _after_step(hooks, progress, value, schedule, cfg)
            requested = ranks.any_stop(stop.requested, device)
            if requested and progress.step < cfg.steps:
                result.interrupted = requested
                break
    finally:
        engine.close()
    return result


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
