"""Adafactor whose second-moment factors cover conv kernels as whole matrices.

transformers' Adafactor factors a tensor's second moment over its last two dimensions. For a
conv kernel [out, in, kh, kw] those are the 3x3 kernel dims, so it keeps two fp32 tensors of
out*in*kh values: for SSD-1B's UNet that is 0.83 GiB of optimizer state, 2/3 of a bf16 copy of
every conv weight. Viewing each kernel as the [out, in*kh*kw] matrix it acts as (Adafactor's
paper factors weight matrices) shrinks that to out + in*kh*kw values per kernel, about 0.02 GiB
for SSD-1B. Tensors of one or two dimensions are updated exactly as transformers does.
Cost: none; the reshapes are views of the same storage.
"""
from __future__ import annotations

import torch
from transformers.optimization import Adafactor


class MatrixAdafactor(Adafactor):
    @torch.no_grad()
    def step(self, closure=None):
        flattened = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.ndim > 2:
                    shape = p.shape
                    grad = p.grad.reshape(shape[0], -1)
                    p.data = p.data.view(shape[0], -1)
                    p.grad = grad
                    flattened.append((p, shape))
        try:
            return super().step(closure)
        finally:
            for p, shape in flattened:
                p.data = p.data.view(shape)
                if p.grad is not None:
                    p.grad = p.grad.view(shape)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in optimizer state tensors (for the it-saves tests and the planner)."""
    from vramfit.memory.accounting import tensor_bytes

    return sum(tensor_bytes(v) for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v))
