"""The one training loop: micro-batches, accumulation, clipping, step, schedule, logs, saves.

Everything the loop's future depends on lives in `Progress` and the noise generator, both saved
in a training state, and the data order of an epoch is a function of (seed, epoch) alone, so a
run resumed at any optimizer-step boundary continues exactly as if it had never stopped.
"""
from __future__ import annotations

import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from vramfit.config.schema import TrainConfig
from vramfit.models.adapter import Family, ModelBundle
from vramfit.train.data import Record, TrainingData
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
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.precision == "mixed_bf16"
                else nullcontext())
    with autocast:
        return family.training_loss(bundle, batch, cfg, generator, device, dtype)


def epoch_batches(data: TrainingData, cfg: TrainConfig, progress: Progress, shuffle: bool) -> Iterator[list[Record]]:
    """Micro-batches from the current position on, advancing `progress` as they are taken."""
    while True:
        order_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + progress.epoch)
        order = list(data.batches(cfg.batch_size, order_gen, shuffle))
        if not order:
            raise ValueError("the dataset has no usable items")
        while progress.batch_in_epoch < len(order):
            group = order[progress.batch_in_epoch]
            progress.batch_in_epoch += 1
            progress.micro_batches += 1
            yield group
        progress.epoch += 1
        progress.batch_in_epoch = 0


def run_loop(family: Family, bundle: ModelBundle, data: TrainingData, optimizer, schedule,
             cfg: TrainConfig, device: torch.device, progress: Progress, generator: torch.Generator,
             hooks: Optional[LoopHooks] = None, stop: Optional[StopFlag] = None,
             shuffle: bool = True) -> LoopResult:
    """Train `bundle.denoiser` from progress.step to cfg.steps; returns losses and step times."""
    hooks, stop = hooks or LoopHooks(), stop or StopFlag()  # fresh per call: a set flag never leaks
    unet = bundle.denoiser
    # Inputs follow the frozen base under LoRA (its trainable fp32 matrices cast for themselves).
    base = next((p for p in unet.parameters() if not p.requires_grad), next(unet.parameters()))
    dtype = base.dtype if cfg.precision != "mixed_bf16" else torch.float32
    batches = epoch_batches(data, cfg, progress, shuffle)
    params = [p for p in unet.parameters() if p.requires_grad]
    result = LoopResult()
    unet.train()
    while progress.step < cfg.steps:
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        used: list[Record] = []
        for _ in range(cfg.grad_accum):
            group = next(batches)
            used += group
            loss = micro_step_loss(family, bundle, data.batch(group), cfg, generator, device, dtype)
            (loss / cfg.grad_accum).backward()
            total += loss.detach() / cfg.grad_accum
        # The global gradient norm doubles as the check: it is inf/NaN when any gradient is.
        if cfg.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        value, finite = float(total), bool(torch.isfinite(norm))  # one host sync per step
        if math.isfinite(value) and finite:
            optimizer.step()
        else:
            _nonfinite(cfg, progress, value, used)
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        progress.step += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result.step_seconds.append(time.perf_counter() - t0)
        result.losses.append(value)
        _after_step(hooks, progress, value, schedule, cfg)
        if stop.requested and progress.step < cfg.steps:
            result.interrupted = stop.requested
            break
    return result


def _nonfinite(cfg: TrainConfig, progress: Progress, value: float, used: list[Record]) -> None:
    files = ", ".join(r.item.key for r in used)
    if cfg.nonfinite == "stop":
        raise NonFiniteLoss(f"step {progress.step + 1}: loss {value} or its gradient is not finite; "
                            f"the batch held {files}. Nothing of this step was applied "
                            "(train.nonfinite = \"skip\" skips such steps instead)")
    progress.nonfinite_skipped += 1
    import logging

    logging.getLogger("vramfit").warning("step %d: non-finite loss or gradient, step skipped (batch: %s)",
                                         progress.step + 1, files)


def _after_step(hooks: LoopHooks, progress: Progress, value: float, schedule, cfg: TrainConfig) -> None:
    if hooks.on_step is not None:
        hooks.on_step(progress.step, value, schedule.get_last_lr()[0])
    last = progress.step >= cfg.steps
    if hooks.on_save is not None and hooks.save_every and progress.step % hooks.save_every == 0 and not last:
        hooks.on_save(progress)
    if hooks.on_state is not None and hooks.state_every and progress.step % hooks.state_every == 0 and not last:
        hooks.on_state(progress)
