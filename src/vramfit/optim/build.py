"""Build the optimizer and learning-rate schedule a TrainConfig asks for.

Adafactor is transformers' implementation with a fixed learning rate (relative_step off, no
parameter scaling), as the 8 GB SSD-1B recipe uses it, with conv kernels factored as matrices
(optim/adafactor.py: 0.8 GiB less state on SSD-1B); AdamW 8-bit is torchao's; AdamW is torch's, foreach on CPU and
fused on CUDA where the parameters allow it.
"""
from __future__ import annotations

from typing import Iterable

import torch

from vramfit.config.schema import TrainConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    if cfg.optimizer == "adafactor":
        from vramfit.optim.adafactor import MatrixAdafactor

        return MatrixAdafactor(params, lr=cfg.lr, scale_parameter=False, relative_step=False,
                         warmup_init=False, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    fused = all(p.is_cuda for p in params) and all(p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                                                   for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, fused=fused or None)


def build_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig):
    from diffusers.optimization import get_scheduler

    name = "constant_with_warmup" if cfg.lr_scheduler == "constant" else "cosine"
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.steps)
