"""Lower-precision storage for frozen text encoders (SD3's T5-XXL: 9.1 GiB in bf16).

Modes, each applied to every nn.Linear of the module (embeddings and norms stay as they are):
- "int8": torchao int8 weight-only quantization (per-channel scales); about half of bf16.
- "fp8": weights stored as float8_e4m3fn with a per-output-channel scale, widened to the input's
  dtype inside each forward; about half of bf16, no extra dependency, any device.
- "nf4": bitsandbytes 4-bit NormalFloat (CUDA only); about a quarter of bf16.
Cost: a small rounding error in the encoder's output (the tests state the tolerance), and for
fp8 one widening of each weight per forward.
"""
from __future__ import annotations

import torch

MODES = ("bf16", "int8", "fp8", "nf4")


class Fp8Linear(torch.nn.Module):
    """A frozen Linear whose weight is stored in float8_e4m3fn with per-row scales."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        self.register_buffer("weight_fp8", (w / scale).to(torch.float8_e4m3fn))
        self.register_buffer("scale", scale.to(torch.float32))
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype

    @property
    def weight(self) -> torch.Tensor:
        # Models such as T5 read `layer.weight.dtype` to choose their activations' dtype; answer
        # with the precision the weight had before it was stored in fp8.
        return torch.empty(0, dtype=self.compute_dtype, device=self.scale.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = (self.weight_fp8.to(torch.float32) * self.scale).to(x.dtype)
        return torch.nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def _swap_linears(module: torch.nn.Module, make) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, make(child))
        else:
            _swap_linears(child, make)


def quantize_encoder(module: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Store `module`'s linear weights in `mode`; returns the (same) module, frozen."""
    module.requires_grad_(False)
    if mode == "bf16":
        return module.to(torch.bfloat16)
    if mode == "fp8":
        _swap_linears(module, Fp8Linear)
        return module
    if mode == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(module, Int8WeightOnlyConfig())
        return module
    if mode == "nf4":
        if not torch.cuda.is_available():
            raise ValueError("nf4 needs a CUDA GPU (bitsandbytes); use int8 or fp8 on this machine")
        import bitsandbytes as bnb

        def nf4(linear: torch.nn.Linear):
            q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=torch.bfloat16, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(linear.weight.detach().cpu(), requires_grad=False, quant_type="nf4")
            if linear.bias is not None:
                q.bias = torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
            return q

        _swap_linears(module, nf4)
        return module
    raise ValueError(f"unknown precision {mode!r}; choose one of {MODES}")


def storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameter and buffer storage, counting quantized tensors by their real storage."""
    from vramfit.memory.accounting import tensor_bytes

    return sum(tensor_bytes(t) for t in [*module.parameters(), *module.buffers()])
