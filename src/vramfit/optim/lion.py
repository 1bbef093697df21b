"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms"), stepped a parameter or pack at a time.

Written here as a ParamOptimizer rather than wrapped from a package: its update is elementwise and
small, and as vramfit's own it packs (optim/base.py), steps inside backward (optim/in_backward.py)
and writes bf16 weights and its bf16 moment back with stochastic rounding inside the step, with no
fp32 copy of the weights, which a wrapped torch optimizer needs (optim/wrapped.py). The math, in fp32:

    p <- p * (1 - lr * wd)
    p <- p - lr * sign(b1 * m + (1 - b1) * g)
    m <- b2 * m + (1 - b2) * g

State: the moment m in the parameter's dtype (as AdamW's), half of AdamW's state. Cost: fp32
temporaries of one pack (the parameter, the gradient, the moment, the interpolation and the new
value: about 20 bytes per value). Lion wants a learning rate 3-10x below AdamW's.
"""
from __future__ import annotations

from typing import Optional

import torch

from vramfit.optim.base import ParamOptimizer, RoundingGenerators, fp32, scaled_

DEFAULT_BETAS = (0.9, 0.99)


class Lion(ParamOptimizer):
    elementwise = True

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = DEFAULT_BETAS,
                 weight_decay: float = 0.0, rounding: Optional[RoundingGenerators] = None):
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must lie in [0, 1): {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), rounding)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        return {"step": 0, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def scalars(self, group: dict, step: int) -> dict[str, float]:
        lr = group["lr"]
        return {"keep": 1 - lr * group["weight_decay"], "minus_lr": -lr}

    def _update(self, p32, grad, state, group, hyper, finite, batch_dims):
        beta1, beta2 = group["betas"]
        moment = fp32(state["exp_avg"])  # the state itself where fp32: read only, written through _store
        direction = moment.lerp(grad, 1 - beta1).sign_()
        self._store(state["exp_avg"], moment.lerp(grad, 1 - beta2), finite)
        new = p32 * hyper["keep"] if group["weight_decay"] else p32.clone()
        return scaled_(new, direction, hyper["minus_lr"])
