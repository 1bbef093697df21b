"""The one training loop: micro-batches, accumulation, clipping, step, schedule, logs, saves."""
from __future__ import annotations

import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from vramfit.config.schema import TrainConfig
from vramfit.models.adapter import Family, ModelBundle
from vramfit.train.data import TrainingData


@dataclass
class LoopResult:
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    skipped: int = 0

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


def run_loop(family: Family, bundle: ModelBundle, data: TrainingData, optimizer, schedule,
             cfg: TrainConfig, device: torch.device, *, start_step: int = 0,
             on_step: Optional[Callable[[int, float, float], None]] = None,
             on_save: Optional[Callable[[int], None]] = None, save_every: int = 0,
             shuffle: bool = True) -> LoopResult:
    """Train `bundle.denoiser` from `start_step` to cfg.steps; returns losses and step times."""
    unet = bundle.denoiser
    dtype = next(unet.parameters()).dtype if cfg.precision != "mixed_bf16" else torch.float32
    generator = torch.Generator().manual_seed(cfg.seed)
    batches = _endless(data, cfg.batch_size, generator, shuffle)
    params = [p for p in unet.parameters() if p.requires_grad]
    result = LoopResult()
    unet.train()
    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for _ in range(cfg.grad_accum):
            batch = data.batch(next(batches))
            loss = micro_step_loss(family, bundle, batch, cfg, generator, device, dtype)
            (loss / cfg.grad_accum).backward()
            total += loss.detach() / cfg.grad_accum
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        value = float(total)  # one host sync per optimizer step, for the log and the NaN check
        if math.isfinite(value):
            optimizer.step()
        else:
            result.skipped += 1
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result.step_seconds.append(time.perf_counter() - t0)
        result.losses.append(value)
        if on_step is not None:
            on_step(step + 1, value, schedule.get_last_lr()[0])
        if on_save is not None and save_every and (step + 1) % save_every == 0 and step + 1 < cfg.steps:
            on_save(step + 1)
    return result


def _endless(data: TrainingData, batch_size: int, generator: torch.Generator, shuffle: bool):
    while True:
        yielded = False
        for group in data.batches(batch_size, generator, shuffle):
            yielded = True
            yield group
        if not yielded:
            raise ValueError("the dataset has no usable items")
