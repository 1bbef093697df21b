"""AdamW, and AdamW with 8-bit block-quantized moments, stepped one parameter or pack at a time.

The math is decoupled weight decay Adam (Loshchilov & Hutter), in fp32 for each parameter:

    p    <- p * (1 - lr * wd)
    m    <- m + (1 - b1) * (g - m)
    v    <- b2 * v + (1 - b2) * g^2
    p    <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

State: `AdamW` keeps m and v in the parameter's dtype (fp32 for fp32 weights, bf16 for bf16
weights, as torch's AdamW does), written back with stochastic rounding under bf16 so the
moments' small per-step changes (v moves by 0.1% a step) are not lost to round-to-nearest.
`AdamW8bit` keeps m and v of every tensor of 4096 values or more (and a multiple of the block)
as torchao's `OptimState8bit`: one byte per value plus an fp32 scale per 256-value block,
quantized with the dynamic maps of 8-bit optimizers (Dettmers et al.), a quarter of fp32
moments; smaller tensors keep moments in the parameter's dtype, as torchao's AdamW8bit does.

Cost: fp32 temporaries of one parameter or pack at a time (about 21 bytes per value of a bf16
weight alone, 27 in a pack; fp32 weights in place: none with torch's fused kernel, 4 with the
foreach fallback); for AdamW8bit also a dequantize and a
quantize (an 8-step search in a 256-entry map) per moment and step.

Inside backward (optim/in_backward.py) `AdamW` steps a bf16 tensor of more than MIN_PACK_NUMEL
values in row chunks read from its bf16 gradient (`step_chunked`: a pass for the norm, then the update
chunk by chunk), so its temporaries are those of one chunk, not of the tensor (SDXL's largest
kernel has 29.5 M values: about 0.7 GB at the planner's 24 bytes a value, not measured on a GPU);
`AdamW8bit`'s block-quantized moments step whole.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from vramfit.optim.base import ChunkedGrad, ParamOptimizer, RoundingGenerators, fp32, norm_checks

QUANTIZED_MIN_NUMEL = 4096
BLOCK = 256


class AdamW(ParamOptimizer):
    elementwise = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, rounding: Optional[RoundingGenerators] = None):
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must lie in [0, 1): {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), rounding)

    def _moment(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        return torch.zeros_like(p, memory_format=torch.preserve_format)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        return {"step": 0, "exp_avg": self._moment(p, True), "exp_avg_sq": self._moment(p, False)}

    def scalars(self, group: dict, step: int) -> dict[str, float]:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        return {"keep": 1 - lr * group["weight_decay"], "bias2": math.sqrt(1 - beta2 ** step),
                "minus_step": -lr / (1 - beta1 ** step)}

    def _update(self, p32, grad, state, group, hyper, finite, batch_dims):
        beta1, beta2 = group["betas"]
        exp_avg = fp32(state["exp_avg"]).lerp(grad, 1 - beta1)
        exp_avg_sq = fp32(state["exp_avg_sq"]).mul(beta2).addcmul_(grad, grad, value=1 - beta2)
        self._store(state["exp_avg"], exp_avg, finite)
        self._store(state["exp_avg_sq"], exp_avg_sq, finite)
        new = p32 * hyper["keep"] if group["weight_decay"] else p32.clone()
        denom = exp_avg_sq.sqrt_().div_(hyper["bias2"]).add_(group["eps"])
        if torch.is_tensor(hyper["minus_step"]):  # a recorded step: the step size is read on the device
            return new.addcmul_(exp_avg.div_(denom), hyper["minus_step"])
        return new.addcdiv_(exp_avg, denom, value=hyper["minus_step"])

    @classmethod
    def chunks_weights_of(cls, dtype: torch.dtype) -> bool:
        # elementwise: any rows; moments of the parameter's dtype and layout (8-bit moments: no).
        # An fp32 weight steps in place (torch's fused kernel, no temporaries): never chunked.
        return cls._moment is AdamW._moment and dtype != torch.float32

    def chunks(self, p: torch.Tensor) -> bool:
        return self.chunks_weights_of(p.dtype) and self._chunkable(p)

    @torch.no_grad()
    def step_chunked(self, p: torch.Tensor, grad: ChunkedGrad, max_norm: float = 0.0) -> torch.Tensor:
        """Two passes over row chunks: the gradient's norm (the finite check and the clipping),
        then `_update` on each chunk with its slices of the moments, written back as it goes."""
        group, state, hyper, spans = self._begin_chunked(p, grad)
        rows, cols = grad.shape
        square_sum = torch.zeros((), dtype=torch.float32, device=p.device)
        for start, stop in spans:
            flat = grad.rows(start, stop).view(-1)
            square_sum.add_(torch.dot(flat, flat))
            del flat
        finite, scale = norm_checks(square_sum.sqrt_(), max_norm)
        matrix, moments = p.view(rows, cols), {k: state[k].view(rows, cols) for k in ("exp_avg", "exp_avg_sq")}
        for start, stop in spans:
            g = grad.rows(start, stop)
            if scale is not None:
                g.mul_(scale)
            old = matrix[start:stop]
            part = {k: v[start:stop] for k, v in moments.items()}
            self._store(old, self._update(old.float(), g, part, group, hyper, finite, 0), finite)
            del g
        return finite

    # torch's fused AdamW kernel (one pass over each tensor's memory for the whole update, as
    # torch.optim.AdamW(fused=True) runs it) where this torch has it; else the foreach ops below
    fused = True

    def _in_place_kind(self, device, finite):
        if self.fused and getattr(torch, "_fused_adamw_", None) is not None and device.type in ("cuda", "cpu"):
            return "fused"
        # the foreach ops cannot be held back on the device: with a flag, the pack's update runs
        return "foreach" if finite is None else None

    def _update_in_place(self, params, grads, states, group, hyper, finite=None):
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        step = states[0]["step"]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        if self._in_place_kind(params[0].device, finite) == "fused":
            # The same math as _update; the kernel reads the step count from a tensor on the device
            # (a fill, not a host-to-device copy) and does not change it. It skips the whole update
            # where `found_inf` is 1: the device-side form of `finite`.
            count = torch.full((), float(step), device=params[0].device)
            found_inf = None if finite is None else finite.logical_not().float()
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [count] * len(params), lr=lr,
                                beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
                                found_inf=found_inf)
            return
        # The same operations as _update, in the same order, on lists of tensors.
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, math.sqrt(1 - beta2 ** step))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / (1 - beta1 ** step))


class AdamW8bit(AdamW):
    def _moment(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        if p.numel() < QUANTIZED_MIN_NUMEL or p.numel() % BLOCK:
            return super()._moment(p, signed)
        # heavy: torchao (~0.25 s, prints kernel-load warnings); `vramfit plan` imports this module
        from torchao.optim.subclass_8bit import OptimState8bit

        return OptimState8bit.zeros(p.shape, signed, BLOCK, p.device, dtype=p.dtype)
