"""The SDXL family's objective: epsilon or v prediction on SDXL's DDPM schedule (optionally
rescaled to zero terminal SNR), with offset noise and input perturbation.

* epsilon: the model predicts the noise; v_prediction: it predicts
  ``v = sqrt(alpha_bar) * noise - sqrt(1 - alpha_bar) * x0`` (diffusers' get_velocity);
* zero terminal SNR (Lin et al., "Common Diffusion Noise Schedules and Sample Steps are Flawed"):
  the betas are rescaled so that the last timestep is pure noise (alpha_bar = 0); it needs v
  prediction (an epsilon model would learn nothing there) and sampling from the last timestep
  ("trailing" timestep spacing);
* offset noise adds one normal draw per sample and channel, times train.noise_offset, to the noise;
  input perturbation (diffusers' train_text_to_image) noises the input with
  ``noise + input_perturbation * another normal draw`` while the target keeps the noise.

A checkpoint says which it is: single files by the `v_pred` and `ztsnr` keys that v-prediction
SDXL files carry (ComfyUI reads them), diffusers folders by their scheduler config.
All random draws come from the generator passed in (a seeded CPU generator), so a run is
reproducible whatever the device.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from vramfit.models.objectives import min_snr_weights as snr_weights
from vramfit.models.objectives import objective_terms
from vramfit.models.parts import shipped_config

V_PRED_KEY, ZTSNR_KEY = "v_pred", "ztsnr"  # single-file markers (empty tensors) of v-prediction models
PREDICTION_TYPES = ("epsilon", "v_prediction")


def noise_scheduler(prediction_type: str = "epsilon", zero_snr: bool = False):
    """SDXL's DDPM training scheduler with this prediction type, its betas rescaled to zero
    terminal SNR with `zero_snr`."""
    # heavy: diffusers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
    from diffusers import DDPMScheduler

    return DDPMScheduler.from_config({**shipped_config("sdxl_scheduler"), "prediction_type": prediction_type,
                                      "rescale_betas_zero_snr": zero_snr})


def scheduler_settings(scheduler) -> tuple[str, bool]:
    """(prediction type, zero terminal SNR) of a diffusers scheduler."""
    config = scheduler.config
    return config.get("prediction_type", "epsilon"), bool(config.get("rescale_betas_zero_snr", False))


def sampling_config(scheduler) -> dict:
    """The config of SDXL's Euler sampler for a model trained on `scheduler`: its prediction type,
    and with zero terminal SNR the rescaled betas and "trailing" spacing (the first step at pure noise)."""
    prediction, zero_snr = scheduler_settings(scheduler)
    config = {**shipped_config("sdxl_scheduler"), "prediction_type": prediction}
    if zero_snr:
        config.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
    return config


def single_file_settings(keys) -> tuple[str, bool]:
    """(prediction type, zero terminal SNR) a single file's keys declare (`ztsnr` counts beside
    `v_pred` only, as ComfyUI reads it)."""
    v = V_PRED_KEY in keys
    return ("v_prediction" if v else "epsilon"), v and ZTSNR_KEY in keys


def single_file_markers(scheduler) -> dict[str, torch.Tensor]:
    """The marker tensors a single file of a model trained on `scheduler` carries."""
    prediction, zero_snr = scheduler_settings(scheduler)
    marks = {V_PRED_KEY: torch.tensor([])} if prediction == "v_prediction" else {}
    if zero_snr:
        marks[ZTSNR_KEY] = torch.tensor([])
    return marks


def folder_settings(folder: Path) -> tuple[str, bool]:
    """(prediction type, zero terminal SNR) of a diffusers folder's scheduler config (epsilon
    without one)."""
    path = folder / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        return "epsilon", False
    config = json.loads(path.read_text())
    prediction = config.get("prediction_type") or "epsilon"
    if prediction not in PREDICTION_TYPES:
        raise ValueError(f"{path}: prediction_type {prediction!r} is not one vramfit trains "
                         f"({', '.join(PREDICTION_TYPES)})")
    return prediction, bool(config.get("rescale_betas_zero_snr", False))


def wanted_settings(scheduler, cfg: Any) -> tuple[str, bool]:
    """(prediction type, zero terminal SNR) of a run: train.prediction_type and
    train.zero_terminal_snr, each "auto" taking what the checkpoint's `scheduler` says."""
    prediction, zero_snr = scheduler_settings(scheduler)
    asked = getattr(cfg, "prediction_type", "auto")
    prediction = prediction if asked == "auto" else asked
    asked_snr = getattr(cfg, "zero_terminal_snr", "auto")
    zero_snr = zero_snr if asked_snr == "auto" else bool(asked_snr)
    if zero_snr and prediction == "epsilon":
        raise ValueError("train.zero_terminal_snr: zero terminal SNR with epsilon prediction (\"auto\" took "
                         "one of them from the checkpoint): zero terminal SNR needs v-prediction (at the "
                         "last timestep the input is pure noise, which an epsilon model reproduces without "
                         "learning the image); set train.prediction_type = \"v_prediction\" or "
                         "train.zero_terminal_snr = false")
    return prediction, zero_snr


def train_scheduler(bundle, cfg: Any):
    """The bundle's noise scheduler, replaced once by one with the run's prediction type and
    zero-SNR setting where they differ from the checkpoint's, so that sample grids and the saved
    files (which read it) follow what is trained."""
    wanted = wanted_settings(bundle.noise_scheduler, cfg)
    if scheduler_settings(bundle.noise_scheduler) != wanted:
        bundle.noise_scheduler = noise_scheduler(*wanted)
    return bundle.noise_scheduler


def ddpm_draws(shape: torch.Size, scheduler, generator: torch.Generator, noise_offset: float,
               at: Optional[torch.Tensor] = None, input_perturbation: float = 0.0) -> dict[str, torch.Tensor]:
    """The random draws of `ddpm_inputs`, on the CPU, in the order SDXL's training scripts
    draw them: the noise, the offset noise (with noise_offset > 0), the timesteps, then the
    perturbation (with input_perturbation > 0); `at` (positions in [0, 1], one per sample) fixes the
    timesteps instead (the validation loss)."""
    draws = {"noise": torch.randn(shape, generator=generator, dtype=torch.float32)}
    if noise_offset > 0:
        draws["offset_noise"] = torch.randn(tuple(shape[:2]) + (1, 1), generator=generator,
                                            dtype=torch.float32)
    last = scheduler.config.num_train_timesteps - 1
    draws["timesteps"] = (torch.randint(0, last + 1, (shape[0],), generator=generator) if at is None
                          else (at * last).round().long())
    if input_perturbation > 0:
        draws["perturbation"] = torch.randn(shape, generator=generator, dtype=torch.float32)
    return draws


def ddpm_inputs(latents: torch.Tensor, scheduler, draws: dict[str, torch.Tensor], noise_offset: float,
                input_perturbation: float = 0.0):
    """Noisy latents, the target (the noise, or v for a v-prediction scheduler) and the timesteps,
    on the latents' device, from `ddpm_draws` (on the CPU or already there)."""
    noise = draws["noise"].to(latents.device)
    if noise_offset > 0:
        noise = noise + noise_offset * draws["offset_noise"].to(latents.device)
    timesteps = draws["timesteps"].to(latents.device)
    noised = noise
    if input_perturbation > 0:
        noised = noise + input_perturbation * draws["perturbation"].to(latents.device)
    noisy = scheduler.add_noise(latents.float(), noised, timesteps)
    if scheduler_settings(scheduler)[0] == "v_prediction":
        return noisy, scheduler.get_velocity(latents.float(), noise, timesteps), timesteps
    return noisy, noise, timesteps


def snr(scheduler, timesteps: torch.Tensor) -> torch.Tensor:
    """alpha_bar / (1 - alpha_bar) per sample, on the CPU (0 at a zero-SNR schedule's last step).
    alpha_bar is the cumulative product of the betas (on the CPU), as the scheduler computes it: its
    own alphas_cumprod moves to the GPU with the first add_noise, and reading it back would wait."""
    alphas = torch.cumprod(1.0 - scheduler.betas, dim=0)[timesteps.cpu()].float()
    return alphas / (1.0 - alphas)


def ddpm_terms(scheduler, timesteps: torch.Tensor, cfg: Any) -> dict[str, torch.Tensor]:
    """The loss weights (min-SNR, debiased estimation) and Huber thresholds of these timesteps."""
    return objective_terms(snr(scheduler, timesteps), scheduler_settings(scheduler)[0], cfg)


def min_snr_weights(scheduler, timesteps: torch.Tensor, gamma: float) -> torch.Tensor:
    """min-SNR-gamma weight per sample for the scheduler's prediction type; all ones when gamma is 0."""
    return snr_weights(snr(scheduler, timesteps), scheduler_settings(scheduler)[0], gamma)
