"""The validation loss: the held-out images scored at fixed timesteps with fixed noise, no gradient.

Every evaluation sees the same images, timesteps, noise and latent samples (from generators of
its own, seeded by validation.seed), so the loss moves only with the weights; it draws nothing from
the training's generators, runs the denoiser in eval mode (no dropout draws) and changes no state
the training reads, so computing it leaves the training trajectory, and an exact resume, as they
were.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from vramfit.config.schema import RunConfig
from vramfit.models.adapter import Family, ModelBundle
from vramfit.train.data import TrainingData
from vramfit.train.engine import inputs_loss

log = logging.getLogger("vramfit")


class Validation:
    """Computes the validation loss of a run's held-out images; `enabled` when it has some."""

    def __init__(self, family: Family, bundle: ModelBundle, data: TrainingData, cfg: RunConfig,
                 device: torch.device, dtype: torch.dtype):
        self.family, self.bundle, self.data, self.device, self.dtype = family, bundle, data, device, dtype
        self.cfg = cfg
        self.batches = data.validation_batches(cfg.validation.batch_size or cfg.train.batch_size)
        n = cfg.validation.timesteps
        self.positions = [(i + 0.5) / n for i in range(n)]  # spread evenly over the noise schedule

    @property
    def enabled(self) -> bool:
        return bool(self.batches)

    @property
    def images(self) -> int:
        return sum(len(b) for b in self.batches)

    def due(self, step: int) -> bool:
        every = self.cfg.validation.every_steps
        return self.enabled and (step >= self.cfg.train.steps or (every > 0 and step % every == 0))

    def loss(self) -> Optional[float]:
        """The mean loss over the held-out images and the fixed timesteps (None: no batch usable)."""
        denoiser = self.bundle.denoiser
        was_training = denoiser.training
        denoiser.eval()
        total, count = 0.0, 0
        try:
            with torch.no_grad():
                for b, draws in enumerate(self.batches):
                    batch = self.data.batch(draws)
                    if batch is None:  # an unusable cache entry (named by TrainingData)
                        continue
                    for j, position in enumerate(self.positions):
                        generator = torch.Generator().manual_seed(
                            self.cfg.validation.seed * 1_000_003 + b * len(self.positions) + j)
                        at = torch.full((len(draws),), position)
                        inputs = self.family.loss_inputs(self.bundle, batch, self.cfg.train, generator, self.dtype,
                                                         at=at)
                        loss = inputs_loss(self.family, self.bundle, inputs, self.cfg.train, self.device, self.dtype)
                        total += float(loss) * len(draws)
                        count += len(draws)
        finally:
            denoiser.train(was_training)
        return total / count if count else None
