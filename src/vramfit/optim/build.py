"""Build the optimizer and learning-rate schedule a TrainConfig asks for.

vramfit's own optimizers (optim/base.py): Adafactor with a fixed learning rate and conv kernels
factored as matrices (optim/adafactor.py), AdamW, and AdamW with torchao's 8-bit block-quantized
moments (optim/adamw.py), and Lion (optim/lion.py). They update one parameter, or one pack of them
(optim/base.py), at a time, so the same object serves a normal step and a step inside backward
(optim/in_backward.py). Prodigy, schedule-free AdamW and CAME come from pytorch-optimizer, and
train.optimizer = "custom" takes any torch.optim-style class by its dotted path
(train.optimizer_class, with train.optimizer_args): these step all parameters at once behind
optim/wrapped.py. All of them write bf16 weights back with stochastic rounding when
train.stochastic_rounding is on, from generators seeded with train.seed.

Schedules are diffusers' (diffusers.optimization.get_scheduler): a LambdaLR whose step count is its
resumable state; each has train.warmup_steps of linear warm-up.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from diffusers.optimization import get_polynomial_decay_schedule_with_warmup, get_scheduler

from vramfit.config.schema import TrainConfig
from vramfit.optim.adafactor import Adafactor
from vramfit.optim.adamw import AdamW, AdamW8bit
from vramfit.optim.base import ParamOptimizer, RoundingGenerators
from vramfit.optim.lion import DEFAULT_BETAS as LION_BETAS, Lion
from vramfit.optim.wrapped import ScheduleFree, WrappedOptimizer, import_class

# train.optimizer -> the pytorch-optimizer class a WrappedOptimizer steps (imported when built)
WRAPPED = {"prodigy": "pytorch_optimizer.Prodigy", "came": "pytorch_optimizer.CAME",
           "schedulefree_adamw": "pytorch_optimizer.ScheduleFreeAdamW"}


def optimizer_class(name: str) -> type[ParamOptimizer]:
    """The class of train.optimizer `name` (the wrapper, for one vramfit does not step itself)."""
    if name == "adafactor":
        return Adafactor
    if name == "lion":
        return Lion
    if name == "schedulefree_adamw":
        return ScheduleFree
    if name in WRAPPED or name == "custom":
        return WrappedOptimizer
    return AdamW8bit if name == "adamw8bit" else AdamW


def other_state_bytes(name: str, numel: int, shape: tuple, dtype_bytes: int) -> Optional[int]:
    """Optimizer state of one trained tensor for the optimizers fit/model_facts.py does not count, as
    they allocate it (None for the others): Lion one moment in the weight's dtype; from an fp32 shadow
    (optim/wrapped.py) Prodigy s, p0 and two moments, schedule-free z and the second moment, CAME the
    first moment and row and column factors (over the last two dimensions, the others kept) of the
    second moment and of the residual; a custom class is counted as AdamW's two fp32 moments."""
    if name == "lion":
        return numel * dtype_bytes
    if name == "came":
        if len(shape) >= 2:
            return 4 * (numel + 2 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]))
        return 4 * 2 * numel
    values = {"prodigy": 4, "schedulefree_adamw": 2, "custom": 2}.get(name)
    return None if values is None else 4 * values * numel


def steps_streamed_on_device(streamed: bool, mode: str, in_backward: bool, optimizer: type) -> bool:
    """The rule of where streamed weights step (memory/offload/grads.py): on the device inside backward
    for a streamed full fine-tune with the step in backward and an optimizer class with compact
    state; otherwise in CPU memory. The planner asks it of a config (`streamed_step_on_device`),
    the training loop of the run's live streamer and optimizer."""
    return streamed and mode == "full" and in_backward and getattr(optimizer, "compact_state", False)


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> ParamOptimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    rounding = RoundingGenerators(cfg.seed) if cfg.stochastic_rounding else None
    cls = optimizer_class(cfg.optimizer)
    if cfg.optimizer == "adafactor":
        return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay, rounding=rounding)
    if cfg.optimizer == "lion":
        betas = cfg.betas if "betas" in cfg.model_fields_set else LION_BETAS
        return cls(params, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay, rounding=rounding)
    if issubclass(cls, WrappedOptimizer):
        wrapped = import_class(cfg.optimizer_class) if cfg.optimizer == "custom" else import_class(
            WRAPPED[cfg.optimizer], "train.optimizer")
        args = {"lr": cfg.lr, **_common_args(cfg), **cfg.optimizer_args}
        return cls(params, wrapped, args, rounding=rounding)
    return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, rounding=rounding)


def _common_args(cfg: TrainConfig) -> dict:
    """The train keys a pytorch-optimizer class takes as arguments (a custom class: only those set)."""
    if cfg.optimizer == "custom":
        return {k: getattr(cfg, k) for k in ("betas", "eps", "weight_decay") if k in cfg.model_fields_set}
    args = {"weight_decay": cfg.weight_decay, "foreach": False}  # foreach: temporaries of all tensors at once
    if cfg.optimizer == "came":  # its three betas and two eps are its own; train.betas sets the first two
        if "betas" in cfg.model_fields_set:
            args["betas"] = (*cfg.betas, 0.9999)
        return args
    return {**args, "betas": cfg.betas, "eps": cfg.eps}


# train.lr_scheduler -> diffusers' name
SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear",
             "cosine_with_restarts": "cosine_with_restarts", "polynomial": "polynomial"}


def build_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig):
    """train.lr_scheduler, after train.warmup_steps of linear warm-up; cosine_with_restarts falls to 0
    train.lr_cycles times, polynomial falls as (1 - progress) ** train.lr_power to 0 at train.steps."""
    if cfg.lr_scheduler == "polynomial":  # get_scheduler's end of 1e-7 would refuse a smaller train.lr
        return get_polynomial_decay_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.steps, lr_end=0.0,
                                                         power=cfg.lr_power)
    extra = {"num_cycles": cfg.lr_cycles} if cfg.lr_scheduler == "cosine_with_restarts" else {}
    return get_scheduler(SCHEDULES[cfg.lr_scheduler], optimizer, num_warmup_steps=cfg.warmup_steps,
                         num_training_steps=cfg.steps, **extra)
