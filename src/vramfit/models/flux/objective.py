"""Flux.1's rectified-flow objective: the flow families' shared math (models/flow.py) with Flux's
resolution-dependent timestep shift, its 2x2 latent packing and its position ids.

* shift: a draw ``u`` of the density becomes ``sigma = e^mu / (e^mu + 1/u - 1)``, where ``mu``
  grows linearly with the image's token count from the scheduler's base_shift (at
  base_image_seq_len tokens) to max_shift (at max_image_seq_len), as Flux's sampler shifts its
  schedule (the pipeline's calculate_shift): larger images train at noisier timesteps;
* the transformer takes ``sigma`` itself as its timestep (the pipeline passes t / 1000);
* latents (16 channels) are packed into 2x2 patches of 64 channels, one token each; image ids are
  (0, row, column) per token, text ids zeros.
"""
from __future__ import annotations

import math

import torch

# FluxPipeline's scheduler config (black-forest-labs/FLUX.1-dev scheduler_config.json)
BASE_SHIFT, MAX_SHIFT = 0.5, 1.15
BASE_SEQ_LEN, MAX_SEQ_LEN = 256, 4096
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
             "base_shift": BASE_SHIFT, "max_shift": MAX_SHIFT, "base_image_seq_len": BASE_SEQ_LEN,
             "max_image_seq_len": MAX_SEQ_LEN}
_EPS = 1e-5  # keeps u off 0 and 1, where the shift divides by zero


def mu_for(tokens: int, sched) -> float:
    """The shift exponent of an image of `tokens` packed tokens (the pipeline's calculate_shift)."""
    base_len = getattr(sched, "base_image_seq_len", BASE_SEQ_LEN)
    max_len = getattr(sched, "max_image_seq_len", MAX_SEQ_LEN)
    base, top = getattr(sched, "base_shift", BASE_SHIFT), getattr(sched, "max_shift", MAX_SHIFT)
    m = (top - base) / (max_len - base_len)
    return tokens * m + base - m * base_len


def shifted(u: torch.Tensor, mu: float) -> torch.Tensor:
    """Sigmas of density draws `u` under the exponent `mu` (FlowMatchEulerDiscreteScheduler's
    exponential time shift with sigma 1)."""
    u = u.clamp(_EPS, 1 - _EPS)
    return math.exp(mu) / (math.exp(mu) + (1 / u - 1))


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C]: each 2x2 patch one token (FluxPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack` for latents of `h` x `w`."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def image_ids(h: int, w: int) -> torch.Tensor:
    """[H/2 * W/2, 3] position ids of the packed tokens of `h` x `w` latents: (0, row, column)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)
