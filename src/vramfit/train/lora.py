"""LoRA on the denoiser through peft: which modules, which precision, which tensors to save.

The base weights stay frozen in the training precision (bf16 for full_bf16) and the LoRA
matrices train in fp32 over them, as the SD3 DreamBooth recipe does. Cost: the LoRA parameters
and their optimizer state only; the base needs no gradients or optimizer state. With
lora.base_quantization the frozen linears are stored int8/fp8/nf4 (memory/quantize.py) under
the adapter, which is unchanged: the exported LoRA has the same keys and shapes.
"""
from __future__ import annotations

import logging

import torch

from vramfit.config.schema import LoraSettings
from vramfit.memory.quantize import quantize_base

log = logging.getLogger("vramfit")

ALL_LINEAR = "all_linear"


def target_modules(denoiser: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """Full names of the modules to adapt; every configured target must match something."""
    names = [n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)]
    if settings.targets == [ALL_LINEAR]:
        found = [n for n in names if "transformer_blocks." in n]
    else:
        found, unmatched = [], []
        for target in settings.targets:
            hits = [n for n in names if n == target or n.endswith("." + target)]
            if not hits:
                unmatched.append(target)
            found += hits
        if unmatched:
            raise ValueError(f"lora.targets {unmatched} match no linear layer of this model "
                             f"(examples of names: {names[:3]}); or use [\"{ALL_LINEAR}\"]")
    return sorted(set(found))


def apply_lora(denoiser: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """Freeze the denoiser and add a trainable fp32 LoRA adapter; returns the adapted modules."""
    # heavy: peft (~1.7 s, pulls transformers); `vramfit plan` imports this module
    from peft import LoraConfig

    targets = target_modules(denoiser, settings)
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=settings.rank, lora_alpha=settings.alpha or settings.rank,
                                    lora_dropout=settings.dropout, target_modules=targets,
                                    init_lora_weights="gaussian"))
    for p in denoiser.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return targets


def lora_state(denoiser: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained LoRA tensors in peft naming (`<module>.lora_A.weight`), on the CPU in fp32."""
    # heavy: peft (~1.7 s, pulls transformers); `vramfit plan` imports this module
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in get_peft_model_state_dict(denoiser).items()}


def quantize_frozen_base(denoiser: torch.nn.Module, settings: LoraSettings, device: torch.device):
    """Store the adapted denoiser's frozen linears as settings.base_quantization asks, then move
    the whole model to `device` (each linear arrives there quantized). None when "none"."""
    if settings.base_quantization == "none":
        return None

    summary = quantize_base(denoiser, settings.base_quantization, device)
    denoiser.to(device)
    log.info("frozen base: %d linear layers stored %s (%.1f MiB -> %.1f MiB)%s", summary.layers,
             summary.method, summary.bytes_before / 2**20, summary.bytes_after / 2**20,
             f"; {len(summary.kept)} kept unquantized (shape)" if summary.kept else "")
    return summary
