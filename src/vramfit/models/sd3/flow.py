"""Rectified-flow (flow-matching) training math of SD3, as diffusers' SD3 training script does it.

The timestep density, the forward process, its target and the loss weighting are the flow
families' shared math (models/flow.py, re-exported here); SD3's own part is the sigma lookup:
``u`` picks an index into the *shifted* sigma table of ``FlowMatchEulerDiscreteScheduler(shift=3.0)``
(so the shift applies on top of the density); the model receives ``sigma * 1000`` as its timestep.
train.flow_shift sets another shift for the table; train.flow_shift_mode = "resolution" shifts
``u`` continuously by the image's token count instead, as Flux does (models/flow.py).
"""
from __future__ import annotations

import torch

from vramfit.models.flow import (  # SD3's objective, re-exported (__all__)
    DEFAULT_LOGIT_MEAN, DEFAULT_LOGIT_STD, DEFAULT_MODE_SCALE, DEFAULT_SCHEME, WEIGHTING_SCHEMES, fixed_shift,
    flow_inputs, loss_weighting, mu_for, sample_density, shift_mode, shifted,
)

__all__ = ["DEFAULT_LOGIT_MEAN", "DEFAULT_LOGIT_STD", "DEFAULT_MODE_SCALE", "DEFAULT_SCHEME", "WEIGHTING_SCHEMES",
           "flow_inputs", "loss_weighting", "sample_density", "DEFAULT_SHIFT", "NUM_TRAIN_TIMESTEPS",
           "shifted_sigmas", "lookup_sigmas", "sd3_sigmas"]

DEFAULT_SHIFT = 3.0
NUM_TRAIN_TIMESTEPS = 1000


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


def sd3_sigmas(u: torch.Tensor, tokens: int, sched, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas, model timesteps) of density draws `u` for an image of `tokens` patches: the
    shifted table (SD3's; shift train.flow_shift or the scheduler's), or with flow_shift_mode
    "resolution" the resolution-dependent shift, continuous."""
    n = sched.num_train_timesteps
    if shift_mode(cfg, "fixed") == "fixed":
        return lookup_sigmas(u, shifted_sigmas(n, fixed_shift(cfg, sched)))
    sigmas = shifted(u.float(), mu_for(tokens, sched))
    return sigmas, sigmas * n
