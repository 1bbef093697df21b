"""Rectified-flow (flow-matching) math the flow families share, as diffusers' SD3 and Flux training
scripts do it.

* timestep density: ``u`` in [0, 1) drawn from a logit-normal, the "mode" density with heavy
  tails, or uniformly (diffusers ``compute_density_for_timestep_sampling``);
* forward process and target: ``noisy = (1 - sigma) * x + sigma * noise``, ``target = noise - x``;
* loss weighting per sample (diffusers ``compute_loss_weighting_for_sd3``): ``cosmap`` weights
  ``2 / (pi * (1 - 2 sigma + 2 sigma^2))``, the others weight every sample 1.

* timestep shift (train.flow_shift, train.flow_shift_mode): a fixed shift ``s`` maps ``u`` to
  ``s u / (1 + (s - 1) u)``; the resolution-dependent one to ``e^mu / (e^mu + 1/u - 1)``, where ``mu``
  grows linearly with the image's token count from the scheduler's base_shift (at
  base_image_seq_len tokens) to max_shift (at max_image_seq_len), as Flux's sampler shifts its
  schedule (the pipeline's calculate_shift): larger images train at noisier timesteps;
* signal-to-noise ratio of a sample: ``((1 - sigma) / sigma)^2`` (models/objectives.py weights by it).

How ``u`` becomes a sigma is each family's (a shifted table, a continuous shift), with its default
shift mode. All random draws come from the CPU generator passed in, so runs reproduce on any device.
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
SHIFT_MODES = ("fixed", "resolution")
# train keys of the UNet (DDPM) objective, which the flow families refuse when set
DDPM_KEYS = ("noise_offset", "input_perturbation", "prediction_type", "zero_terminal_snr")
# FlowMatchEulerDiscreteScheduler's dynamic-shift defaults (FLUX.1-dev's scheduler_config.json)
BASE_SHIFT, MAX_SHIFT = 0.5, 1.15
BASE_SEQ_LEN, MAX_SEQ_LEN = 256, 4096
_EPS = 1e-5  # keeps u off 0 and 1, where the shifts divide by zero


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


def shift_mode(cfg, default: str) -> str:
    """train.flow_shift_mode, "auto" resolved: fixed where train.flow_shift is set, else `default`."""
    mode = getattr(cfg, "flow_shift_mode", "auto")
    if mode == "auto":
        mode = "fixed" if getattr(cfg, "flow_shift", None) is not None else default
    if mode not in SHIFT_MODES:
        raise ValueError(f"train.flow_shift_mode {mode!r} is not one of auto, {', '.join(SHIFT_MODES)}")
    return mode


def fixed_shift(cfg, sched) -> float:
    """train.flow_shift, or the scheduler config's shift where it is not set."""
    shift = getattr(cfg, "flow_shift", None)
    return float(shift if shift is not None else getattr(sched, "shift", 1.0))


def time_shift(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Sigmas of density draws `u` under a fixed shift (FlowMatchEulerDiscreteScheduler's ``shift``)."""
    u = u.clamp(_EPS, 1 - _EPS)
    return shift * u / (1 + (shift - 1) * u)


def mu_for(tokens: int, sched) -> float:
    """The shift exponent of an image of `tokens` tokens (the Flux pipeline's calculate_shift)."""
    base_len = getattr(sched, "base_image_seq_len", None) or BASE_SEQ_LEN
    max_len = getattr(sched, "max_image_seq_len", None) or MAX_SEQ_LEN
    base = getattr(sched, "base_shift", None) or BASE_SHIFT
    top = getattr(sched, "max_shift", None) or MAX_SHIFT
    m = (top - base) / (max_len - base_len)
    return tokens * m + base - m * base_len


def shifted(u: torch.Tensor, mu: float) -> torch.Tensor:
    """Sigmas of density draws `u` under the exponent `mu` (FlowMatchEulerDiscreteScheduler's
    exponential time shift with sigma 1)."""
    u = u.clamp(_EPS, 1 - _EPS)
    return math.exp(mu) / (math.exp(mu) + (1 / u - 1))


def flow_snr(sigmas: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio ((1 - sigma) / sigma)^2 of rectified-flow samples."""
    return ((1 - sigmas) / sigmas) ** 2


def decoder_input(latents: torch.Tensor, vae_config) -> torch.Tensor:
    """Latents as the flow families' VAE decodes them: scaled back by its factor and shifted back."""
    return latents / vae_config.scaling_factor + (getattr(vae_config, "shift_factor", None) or 0.0)
