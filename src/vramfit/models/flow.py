"""Rectified-flow (flow-matching) math the flow families share, as diffusers' SD3 and Flux training
scripts do it.

* timestep density: ``u`` in [0, 1) drawn from a logit-normal, the "mode" density with heavy
  tails, or uniformly (diffusers ``compute_density_for_timestep_sampling``);
* forward process and target: ``noisy = (1 - sigma) * x + sigma * noise``, ``target = noise - x``;
* loss weighting per sample (diffusers ``compute_loss_weighting_for_sd3``): ``cosmap`` weights
  ``2 / (pi * (1 - 2 sigma + 2 sigma^2))``, the others weight every sample 1.

How ``u`` becomes a sigma is each family's (a shifted table, a resolution-dependent shift).
All random draws come from the CPU generator passed in, so runs reproduce on any device.
"""
from __future__ import annotations

import math

import torch

WEIGHTING_SCHEMES = ("logit_normal", "mode", "cosmap", "uniform")
# diffusers examples/dreambooth/train_dreambooth_lora_sd3.py defaults
DEFAULT_SCHEME = "logit_normal"
DEFAULT_LOGIT_MEAN = 0.0
DEFAULT_LOGIT_STD = 1.0
DEFAULT_MODE_SCALE = 1.29


def _check(scheme: str) -> None:
    if scheme not in WEIGHTING_SCHEMES:
        raise ValueError(f"weighting_scheme {scheme!r} is not one of {', '.join(WEIGHTING_SCHEMES)}")


def sample_density(scheme: str, batch_size: int, generator: torch.Generator, *,
                   logit_mean: float = DEFAULT_LOGIT_MEAN, logit_std: float = DEFAULT_LOGIT_STD,
                   mode_scale: float = DEFAULT_MODE_SCALE) -> torch.Tensor:
    """``u`` per sample, on the CPU, from the density of `scheme` (cosmap/uniform: uniform)."""
    _check(scheme)
    if scheme == "logit_normal":
        z = torch.normal(mean=logit_mean, std=logit_std, size=(batch_size,), generator=generator)
        return torch.sigmoid(z)
    u = torch.rand((batch_size,), generator=generator, dtype=torch.float32)
    if scheme == "mode":
        u = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def density_from(cfg, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """sample_density with the train section's weighting_scheme, logit_mean, logit_std, mode_scale."""
    return sample_density(getattr(cfg, "weighting_scheme", DEFAULT_SCHEME), batch_size, generator,
                          logit_mean=getattr(cfg, "logit_mean", DEFAULT_LOGIT_MEAN),
                          logit_std=getattr(cfg, "logit_std", DEFAULT_LOGIT_STD),
                          mode_scale=getattr(cfg, "mode_scale", DEFAULT_MODE_SCALE))


def loss_weighting(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weights of flow-matching training for `scheme`."""
    _check(scheme)
    if scheme == "cosmap":
        bot = 1 - 2 * sigmas + 2 * sigmas ** 2
        return 2 / (math.pi * bot)
    return torch.ones_like(sigmas)


def flow_inputs(latents: torch.Tensor, noise: torch.Tensor,
                sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(noisy input, velocity target) of the rectified-flow forward process; sigmas per sample."""
    s = sigmas.to(latents.device, latents.dtype).reshape(-1, *([1] * (latents.ndim - 1)))
    return (1.0 - s) * latents + s * noise, noise - latents
