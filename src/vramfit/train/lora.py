"""LoRA on the denoiser through peft: which modules, which precision, which tensors to save.

The base weights stay frozen in the training precision (bf16 for full_bf16) and the LoRA
matrices train in fp32 over them, as the SD3 DreamBooth recipe does. Cost: the LoRA parameters
and their optimizer state only; the base needs no gradients or optimizer state.
"""
from __future__ import annotations

import torch

from vramfit.config.schema import LoraSettings

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
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in get_peft_model_state_dict(denoiser).items()}
