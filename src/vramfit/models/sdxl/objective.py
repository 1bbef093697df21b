"""The SDXL family's objective: epsilon prediction on SDXL's DDPM schedule, with offset noise and
min-SNR weights.

All random draws come from the generator passed in (a seeded CPU generator), so a run is
reproducible whatever the device.
"""
from __future__ import annotations

import torch


def epsilon_draws(shape: torch.Size, scheduler, generator: torch.Generator, noise_offset: float,
                  at: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The random draws of `epsilon_inputs`, on the CPU, in the order SDXL's training scripts
    draw them: the noise, the offset noise (with noise_offset > 0), the timesteps; `at` (positions
    in [0, 1], one per sample) fixes the timesteps instead (the validation loss)."""
    draws = {"noise": torch.randn(shape, generator=generator, dtype=torch.float32)}
    if noise_offset > 0:
        draws["offset_noise"] = torch.randn(tuple(shape[:2]) + (1, 1), generator=generator,
                                            dtype=torch.float32)
    last = scheduler.config.num_train_timesteps - 1
    draws["timesteps"] = (torch.randint(0, last + 1, (shape[0],), generator=generator) if at is None
                          else (at * last).round().long())
    return draws


def epsilon_inputs(latents: torch.Tensor, scheduler, draws: dict[str, torch.Tensor], noise_offset: float):
    """Noisy latents, the noise to predict, and the timesteps, on the latents' device, from
    `epsilon_draws` (on the CPU or already there)."""
    noise = draws["noise"].to(latents.device)
    if noise_offset > 0:
        noise = noise + noise_offset * draws["offset_noise"].to(latents.device)
    timesteps = draws["timesteps"].to(latents.device)
    noisy = scheduler.add_noise(latents.float(), noise, timesteps)
    return noisy, noise, timesteps


def min_snr_weights(scheduler, timesteps: torch.Tensor, gamma: float) -> torch.Tensor:
    """min(SNR, gamma) / SNR per sample (epsilon prediction); all ones when gamma is 0."""
    if gamma <= 0:
        return torch.ones(timesteps.shape[0], device=timesteps.device)
    alphas = scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
    snr = alphas / (1.0 - alphas)
    return torch.clamp(snr, max=gamma) / snr
