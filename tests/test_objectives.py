"""SDXL's epsilon objective: noise schedule, noise offset, min-SNR weighting."""
from __future__ import annotations

import torch
from diffusers import DDPMScheduler

from vramfit.models.objectives import weighted_mse
from vramfit.models.parts import shipped_config
from vramfit.models.sdxl.objective import epsilon_draws, epsilon_inputs, min_snr_weights


def _sched():
    return DDPMScheduler.from_config(shipped_config("sdxl_scheduler"))


def _inputs(x, sched, seed: int, offset: float):
    draws = epsilon_draws(x.shape, sched, torch.Generator().manual_seed(seed), offset)
    return epsilon_inputs(x, sched, draws, offset)


def test_noisy_latents_follow_the_ddpm_schedule_and_are_seeded():
    sched = _sched()
    x = torch.randn(3, 4, 8, 8)
    a = _inputs(x, sched, 0, 0.0)
    b = _inputs(x, sched, 0, 0.0)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    noisy, noise, t = a
    ab = sched.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(noisy, ab.sqrt() * x + (1 - ab).sqrt() * noise)
    assert sched.config.prediction_type == "epsilon" and sched.config.beta_schedule == "scaled_linear"


def test_noise_offset_adds_a_per_channel_constant():
    sched = _sched()
    x = torch.zeros(2, 4, 16, 16)
    _, plain, _ = _inputs(x, sched, 0, 0.0)
    _, offset, _ = _inputs(x, sched, 0, 0.5)
    diff = offset - plain
    assert diff.abs().max() > 0.01
    # the same shift over every pixel of a channel
    torch.testing.assert_close(diff, diff[:, :, :1, :1].expand_as(diff))


def test_min_snr_weights():
    sched = _sched()
    t = torch.tensor([0, 500, 999])
    assert torch.equal(min_snr_weights(sched, t, 0.0), torch.ones(3))
    w = min_snr_weights(sched, t, 5.0)
    ab = sched.alphas_cumprod[t]
    snr = ab / (1 - ab)
    torch.testing.assert_close(w, torch.clamp(snr, max=5.0) / snr)
    assert w[0] < 0.01 and w[2] == 1.0


def test_weighted_mse_weights_each_sample():
    pred, target = torch.ones(2, 1, 2, 2), torch.zeros(2, 1, 2, 2)
    assert weighted_mse(pred, target, torch.tensor([1.0, 0.0])).item() == 0.5
