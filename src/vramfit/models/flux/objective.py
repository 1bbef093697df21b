"""Flux.1's rectified-flow objective: the flow families' shared math (models/flow.py) with Flux's
resolution-dependent timestep shift (by default; train.flow_shift_mode), its 2x2 latent packing and
its position ids.

* shift: a draw ``u`` of the density becomes ``sigma = e^mu / (e^mu + 1/u - 1)``, where ``mu``
  grows linearly with the image's token count (models/flow.py mu_for, shifted), as Flux's sampler
  shifts its schedule; with a fixed shift, ``s u / (1 + (s - 1) u)``;
* the transformer takes ``sigma`` itself as its timestep (the pipeline passes t / 1000);
* latents (16 channels) are packed into 2x2 patches of 64 channels, one token each; image ids are
  (0, row, column) per token, text ids zeros.
"""
from __future__ import annotations

import torch

from vramfit.models.flow import (  # Flux's shift, re-exported (__all__)
    BASE_SEQ_LEN, BASE_SHIFT, MAX_SEQ_LEN, MAX_SHIFT, fixed_shift, mu_for, shift_mode, shifted, time_shift,
)

__all__ = ["BASE_SEQ_LEN", "BASE_SHIFT", "MAX_SEQ_LEN", "MAX_SHIFT", "SCHEDULER", "mu_for", "shifted",
           "flux_sigmas", "pack", "unpack", "image_ids"]

# FluxPipeline's scheduler config (black-forest-labs/FLUX.1-dev scheduler_config.json)
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
             "base_shift": BASE_SHIFT, "max_shift": MAX_SHIFT, "base_image_seq_len": BASE_SEQ_LEN,
             "max_image_seq_len": MAX_SEQ_LEN}


def flux_sigmas(u: torch.Tensor, tokens: int, sched, cfg) -> torch.Tensor:
    """Sigmas of density draws `u` for an image of `tokens` packed tokens: the resolution-dependent
    shift (the default), or a fixed one (train.flow_shift_mode, train.flow_shift)."""
    if shift_mode(cfg, "resolution") == "resolution":
        return shifted(u.float(), mu_for(tokens, sched))
    return time_shift(u.float(), fixed_shift(cfg, sched))


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
