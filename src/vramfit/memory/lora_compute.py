"""LoRA matrices stored in fp32 but multiplied in the base's bf16, as under bf16 autocast.

peft casts a layer's input to its adapter's dtype before the LoRA matmuls. With fp32 adapters
over a bf16 base (train.precision = "full_bf16") every adapted linear therefore makes an fp32
copy of its input and keeps it for backward: on SD3-M with the DreamBooth targets that is four
fp32 copies of the [batch, tokens, 1536] block activations (to_q, to_k and to_v each make their
own), about 100 MB per block at 512x512 batch 4, alive while the block's backward runs. Here
the input stays bf16 (one tensor shared by q, k and v) and each adapter's weight is cast to bf16
for its matmul; gradients flow back through that cast into the fp32 weights, which the optimizer
updates in fp32. This is what diffusers' DreamBooth script computes under bf16 autocast.
Cost: a bf16 copy of each rank-r matrix per forward (kilobytes); LoRA products in bf16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class BaseDtypeLinear(torch.nn.Linear):
    """A linear layer whose (fp32) parameters are cast to the input's dtype for the product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


def lora_in_base_dtype(model: torch.nn.Module) -> int:
    """Make every peft LoRA layer of `model` compute in its input's dtype; returns how many
    adapter matrices now do. The parameters (and so state dicts and exports) are unchanged."""
    # heavy: peft (~1.3 s, pulls transformers); `vramfit plan` imports this module via train/setup.py
    from peft.tuners.lora import LoraLayer

    swapped = 0
    for layer in model.modules():
        if not isinstance(layer, LoraLayer) or type(layer.get_base_layer()) is not torch.nn.Linear:
            continue  # a conv's adapter (lora.conv_rank) keeps peft's cast of its input to fp32
        layer.cast_input_dtype_enabled = False
        for adapters in (layer.lora_A, layer.lora_B):
            for name, old in list(adapters.items()):
                if type(old) is not torch.nn.Linear:
                    continue
                new = BaseDtypeLinear(old.in_features, old.out_features, bias=old.bias is not None,
                                      device="meta")
                new.weight = old.weight  # the same Parameter: optimizer and state dict see no change
                if old.bias is not None:
                    new.bias = old.bias
                adapters[name] = new
                swapped += 1
    return swapped
