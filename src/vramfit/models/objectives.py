"""What every family's objective shares: a draw from a cached latent distribution and the
weighted MSE of a prediction. Each family's own objective lives in its folder (models/<family>/).

All random draws come from the generator passed in (a seeded CPU generator), so a run is
reproducible whatever the device.
"""
from __future__ import annotations

import torch


def sample_latent(encoded: dict[str, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
    """One draw from a cached latent distribution (mean, log-variance), as diffusers' sample()."""
    mean = encoded["mean"].float()
    eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device="cpu").to(mean.device)
    std = torch.exp(0.5 * encoded["logvar"].float().clamp(-30.0, 20.0))
    return mean + std * eps


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
                 sample_weight: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the batch of each sample's weighted MSE; `sample_weight` (summing to the
    batch's total weight, e.g. DreamBooth's instance + prior terms) replaces the plain mean.
    `loss_mask` ([B, 1, h, w] on the latent grid) weights each element before the mean (masked
    loss: a masked-out element counts by its weight, not at all at 0)."""
    error = (pred.float() - target.float()).pow(2)
    if loss_mask is not None:
        error = error * loss_mask.to(error.device, error.dtype)
    per_sample = error.mean(dim=tuple(range(1, pred.ndim))) * weights
    if sample_weight is None:
        return per_sample.mean()
    return (per_sample * sample_weight.to(per_sample.device)).sum()
