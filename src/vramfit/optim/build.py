"""Build the optimizer and learning-rate schedule a TrainConfig asks for.

Every optimizer is vramfit's own (optim/base.py): Adafactor with a fixed learning rate and conv
kernels factored as matrices (optim/adafactor.py), AdamW, and AdamW with torchao's 8-bit block-
quantized moments (optim/adamw.py). All of them update one parameter, or one pack of them
(optim/base.py), at a time, so the same object serves a normal step and a step inside backward
(optim/in_backward.py), and all write bf16
weights back with stochastic rounding when train.stochastic_rounding is on, from generators
seeded with train.seed.
"""
from __future__ import annotations

from typing import Iterable

import torch
from diffusers.optimization import get_scheduler

from vramfit.config.schema import TrainConfig
from vramfit.optim.adafactor import Adafactor
from vramfit.optim.adamw import AdamW, AdamW8bit
from vramfit.optim.base import ParamOptimizer, RoundingGenerators


def optimizer_class(name: str) -> type[ParamOptimizer]:
    """The class of train.optimizer `name`."""
    if name == "adafactor":
        return Adafactor

    return AdamW8bit if name == "adamw8bit" else AdamW


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
    return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, rounding=rounding)


def build_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig):
    name = "constant_with_warmup" if cfg.lr_scheduler == "constant" else "cosine"
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.steps)
