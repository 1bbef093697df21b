"""Training objectives. SDXL family: epsilon prediction on SDXL's DDPM schedule.

All random draws come from the generator passed in (a seeded CPU generator), so a run is
reproducible whatever the device.
"""
from __future__ import annotations

import torch


def _draw(shape, generator: torch.Generator, device, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device, dtype)


def epsilon_inputs(latents: torch.Tensor, scheduler, generator: torch.Generator, noise_offset: float):
    """Noisy latents, the noise to predict, and the timesteps, as SDXL's training scripts draw them."""
    b, c = latents.shape[:2]
    noise = _draw(latents.shape, generator, latents.device)
    if noise_offset > 0:
        noise = noise + noise_offset * _draw((b, c, 1, 1), generator, latents.device)
    n = scheduler.config.num_train_timesteps
    timesteps = torch.randint(0, n, (b,), generator=generator).to(latents.device)
    noisy = scheduler.add_noise(latents.float(), noise, timesteps)
    return noisy, noise, timesteps


def min_snr_weights(scheduler, timesteps: torch.Tensor, gamma: float) -> torch.Tensor:
    """min(SNR, gamma) / SNR per sample (epsilon prediction); all ones when gamma is 0."""
    if gamma <= 0:
        return torch.ones(timesteps.shape[0], device=timesteps.device)
    alphas = scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
    snr = alphas / (1.0 - alphas)
    return torch.clamp(snr, max=gamma) / snr


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
                 sample_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the batch of each sample's weighted MSE; `sample_weight` (summing to the
    batch's total weight, e.g. DreamBooth's instance + prior terms) replaces the plain mean."""
    per_sample = (pred.float() - target.float()).pow(2).mean(dim=tuple(range(1, pred.ndim))) * weights
    if sample_weight is None:
        return per_sample.mean()
    return (per_sample * sample_weight.to(per_sample.device)).sum()
