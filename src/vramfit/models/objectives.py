"""What every family's objective shares: a draw from a cached latent distribution, the loss
weights that follow from each sample's signal-to-noise ratio, and the weighted loss of a
prediction. Each family's own objective lives in its folder (models/<family>/).

SNR weightings (train.min_snr_gamma, train.debiased_estimation) are defined on the loss of the
clean latent x0 and carried over to what the model predicts, so one setting means the same
across prediction types. Per sample, with x0-error = e:

* epsilon (VP schedule): |eps error|^2 = snr * e^2;
* v_prediction (VP): |v error|^2 = (snr + 1) * e^2;
* flow (velocity ``noise - x0``, ``x_t = (1 - sigma) x0 + sigma noise``, snr = ((1 - sigma) / sigma)^2):
  |velocity error|^2 = e^2 / sigma^2 = (sqrt(snr) + 1)^2 * e^2.

min-SNR-gamma weights x0's loss by min(snr, gamma): min(snr, gamma) / snr for epsilon,
min(snr, gamma) / (snr + 1) for v and min(snr, gamma) * sigma^2 for flow. Debiased estimation
weights epsilon's loss by 1 / sqrt(snr) (x0: sqrt(snr)), v's by 1 / (snr + 1) (kohya's forms,
snr capped at 1000) and flow's by sqrt(snr) * sigma^2 = sigma * (1 - sigma) (x0: sqrt(snr), as
epsilon's). The loss itself is the MSE, or kohya's pseudo-Huber ("huber": 2c (sqrt(d^2 + c^2) - c);
"smooth_l1": 2 (sqrt(d^2 + c^2) - c)) with a threshold c per sample, constant or following the
SNR (kohya's "snr" schedule: c + (1 - c) / (1 + 1 / sqrt(snr))^2).

All random draws come from the generator passed in (a seeded CPU generator), so a run is
reproducible whatever the device; the weights are computed on the host with the draws.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

PREDICTIONS = ("epsilon", "v_prediction", "flow")
LOSSES = ("mse", "huber", "smooth_l1")
HUBER_SCHEDULES = ("constant", "snr")
DEBIASED_SNR_CAP = 1000.0  # kohya's: snr is infinite at timestep 0


def sample_latent(encoded: dict[str, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
    """One draw from a cached latent distribution (mean, log-variance), as diffusers' sample()."""
    mean = encoded["mean"].float()
    eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device="cpu").to(mean.device)
    std = torch.exp(0.5 * encoded["logvar"].float().clamp(-30.0, 20.0))
    return mean + std * eps


def min_snr_weights(snr: torch.Tensor, prediction: str, gamma: float) -> torch.Tensor:
    """min-SNR-gamma weight per sample of the `prediction`'s loss; all ones when gamma is 0."""
    _check(prediction)
    if gamma <= 0:
        return torch.ones_like(snr)
    if prediction == "epsilon":  # min(snr, gamma) / snr, written so that snr = 0 gives 1
        return torch.clamp(gamma / snr, max=1.0)
    if prediction == "v_prediction":
        return torch.clamp(snr, max=gamma) / (snr + 1)
    return torch.clamp(snr, max=gamma) * flow_sigma_squared(snr)


def debiased_weights(snr: torch.Tensor, prediction: str) -> torch.Tensor:
    """Debiased estimation's weight per sample (kohya's forms; flow: sigma * (1 - sigma))."""
    _check(prediction)
    snr = torch.clamp(snr, max=DEBIASED_SNR_CAP)
    if prediction == "epsilon":
        return 1 / torch.sqrt(snr)
    if prediction == "v_prediction":
        return 1 / (snr + 1)
    return torch.sqrt(snr) * flow_sigma_squared(snr)


def flow_sigma_squared(snr: torch.Tensor) -> torch.Tensor:
    """sigma^2 of a rectified-flow sample of `snr` = ((1 - sigma) / sigma)^2."""
    return 1 / (torch.sqrt(snr) + 1) ** 2


def huber_thresholds(snr: torch.Tensor, c: float, schedule: str) -> torch.Tensor:
    """The pseudo-Huber threshold per sample: `c`, or kohya's "snr" schedule (c at pure noise, 1 at none)."""
    if schedule not in HUBER_SCHEDULES:
        raise ValueError(f"train.huber_schedule {schedule!r} is not one of {', '.join(HUBER_SCHEDULES)}")
    if schedule == "constant":
        return torch.full_like(snr, c)
    return (1 - c) / (1 + 1 / torch.sqrt(snr)) ** 2 + c


def objective_terms(snr: torch.Tensor, prediction: str, cfg: Any,
                    weights: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """The loss terms of `loss_inputs` that follow from each sample's SNR and the train section:
    "weights" (`weights`, default ones, times min-SNR's and debiased estimation's) and, for a
    Huber loss, "huber_c". On the host, with the draws (no device work, nothing to wait for)."""
    w = torch.ones_like(snr) if weights is None else weights
    gamma = float(getattr(cfg, "min_snr_gamma", 0.0))
    if gamma > 0:
        w = w * min_snr_weights(snr, prediction, gamma)
    if getattr(cfg, "debiased_estimation", False):
        w = w * debiased_weights(snr, prediction)
    terms = {"weights": w}
    loss = getattr(cfg, "loss", "mse")
    if loss != "mse":
        terms["huber_c"] = huber_thresholds(snr, float(getattr(cfg, "huber_c", 0.1)),
                                            getattr(cfg, "huber_schedule", "snr"))
    return terms


def _check(prediction: str) -> None:
    if prediction not in PREDICTIONS:
        raise ValueError(f"prediction type {prediction!r} is not one of {', '.join(PREDICTIONS)}")


def elementwise_loss(pred: torch.Tensor, target: torch.Tensor, loss: str = "mse",
                     huber_c: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The loss of each element in fp32: squared error, or pseudo-Huber with a threshold per sample."""
    if loss not in LOSSES:
        raise ValueError(f"train.loss {loss!r} is not one of {', '.join(LOSSES)}")
    error = (pred.float() - target.float()).pow(2)
    if loss == "mse":
        return error
    c = huber_c.to(error.device, error.dtype).reshape(-1, *([1] * (error.ndim - 1)))
    soft = torch.sqrt(error + c * c) - c
    return 2 * c * soft if loss == "huber" else 2 * soft


def weighted_loss(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
                  sample_weight: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                  loss: str = "mse", huber_c: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the batch of each sample's weighted loss (`elementwise_loss`); `sample_weight`
    (summing to the batch's total weight, e.g. DreamBooth's instance + prior terms) replaces the
    plain mean. `loss_mask` ([B, 1, h, w] on the latent grid) weights each element before the mean
    (masked loss: a masked-out element counts by its weight, not at all at 0)."""
    error = elementwise_loss(pred, target, loss, huber_c)
    if loss_mask is not None:
        error = error * loss_mask.to(error.device, error.dtype)
    per_sample = error.mean(dim=tuple(range(1, pred.ndim))) * weights
    if sample_weight is None:
        return per_sample.mean()
    return (per_sample * sample_weight.to(per_sample.device)).sum()


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
                 sample_weight: torch.Tensor | None = None,
                 loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`weighted_loss` with the squared error."""
    return weighted_loss(pred, target, weights, sample_weight, loss_mask)


def loss_of(pred: torch.Tensor, target: torch.Tensor, inputs: dict, cfg: Any) -> torch.Tensor:
    """The weighted loss of a family's `loss_from`: `inputs`' weights, sample weights, mask and
    Huber thresholds, with the train section's train.loss."""
    weights = inputs["weights"].to(pred.device)
    return weighted_loss(pred, target, weights, inputs.get("sample_weight"), inputs.get("loss_mask"),
                         getattr(cfg, "loss", "mse"), inputs.get("huber_c"))
