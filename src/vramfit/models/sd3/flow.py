"""Rectified-flow (flow-matching) training math of SD3, as diffusers' SD3 training script does it.

* timestep density: ``u`` in [0, 1) drawn from a logit-normal, the "mode" density with heavy
  tails, or uniformly (diffusers ``compute_density_for_timestep_sampling``);
* sigma lookup: ``u`` picks an index into the *shifted* sigma table of
  ``FlowMatchEulerDiscreteScheduler(shift=3.0)`` (so the shift applies on top of the density);
  the model receives ``sigma * 1000`` as its timestep;
* forward process and target: ``noisy = (1 - sigma) * x + sigma * noise``, ``target = noise - x``;
* loss weighting per sample (diffusers ``compute_loss_weighting_for_sd3``): ``cosmap`` weights
  ``2 / (pi * (1 - 2 sigma + 2 sigma^2))``, the others weight every sample 1.

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
DEFAULT_SHIFT = 3.0
NUM_TRAIN_TIMESTEPS = 1000


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


def shifted_sigmas(num_train_timesteps: int = NUM_TRAIN_TIMESTEPS, shift: float = DEFAULT_SHIFT) -> torch.Tensor:
    """The sigma table of ``FlowMatchEulerDiscreteScheduler(shift=...)``, from 1 down to ~1/n (shifted),
    computed with the same float32 operations so the values match it bit for bit."""
    t = torch.linspace(1, num_train_timesteps, num_train_timesteps, dtype=torch.float32).flip(0)
    s = t / num_train_timesteps
    return shift * s / (1 + (shift - 1) * s)


def lookup_sigmas(u: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas, model timesteps = sigma * n) at index ``floor(u * n)`` of the table.

    The index is clamped into the table: ``u`` of exactly 1 (a sigmoid that rounds up, or the
    mode density at u=0) would otherwise fall one past its end.
    """
    n = table.shape[0]
    idx = (u * n).long().clamp(0, n - 1)
    sigmas = table[idx]
    return sigmas, sigmas * n


def loss_weighting(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weights of SD3 training for `scheme`."""
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
