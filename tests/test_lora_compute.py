"""fp32 LoRA over a bf16 base multiplied in bf16 (memory/lora_compute.py): same result, saves."""
from __future__ import annotations

import copy

import pytest
import torch

from vramfit.config.schema import LoraSettings
from vramfit.memory.accounting import tensor_bytes
from vramfit.memory.lora_compute import BaseDtypeLinear, lora_in_base_dtype
from vramfit.train.lora import apply_lora, lora_state


def _adapted(seed: int = 0) -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel

    from vramfit.models.parts import shipped_config

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**shipped_config("tiny_sd3_transformer")).to(torch.bfloat16)
    apply_lora(model, LoraSettings(rank=4))
    for name, p in model.named_parameters():  # lora_B starts at zero; make the adapter act
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _step(model: torch.nn.Module):
    """Loss, LoRA gradients and the bytes autograd saved for backward during forward."""
    torch.manual_seed(1)
    cfg = model.config
    hidden = torch.randn(2, cfg.in_channels, 16, 16, dtype=torch.bfloat16)
    text = torch.randn(2, 12, cfg.joint_attention_dim, dtype=torch.bfloat16)
    pooled = torch.randn(2, cfg.pooled_projection_dim, dtype=torch.bfloat16)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(hidden_states=hidden, timestep=torch.tensor([500.0, 20.0]), encoder_hidden_states=text,
                    pooled_projections=pooled, return_dict=False)[0]
    loss = out.float().pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    unique = {t.untyped_storage().data_ptr(): t for t in saved if t.device.type != "meta"}
    return float(loss), grads, sum(tensor_bytes(t) for t in unique.values())


def test_lora_in_base_dtype_matches_and_saves():
    ref_model = _adapted()
    model = copy.deepcopy(ref_model)
    before = lora_state(model)
    n = lora_in_base_dtype(model)
    lora_layers = sum(1 for _, m in model.named_modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A"))
    assert n == 2 * lora_layers > 0
    assert all(isinstance(m, BaseDtypeLinear) for layer in model.modules() if hasattr(layer, "lora_A")
               for m in layer.lora_A.values())
    after = lora_state(model)  # parameters, names and fp32 storage unchanged
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)

    loss_ref, grads_ref, saved_ref = _step(ref_model)
    loss, grads, saved = _step(model)
    assert loss == pytest.approx(loss_ref, rel=2e-2)  # bf16 products instead of fp32 ones
    for name, g in grads.items():
        assert g.dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(g.flatten(), grads_ref[name].flatten(), dim=0)
        assert cos > 0.98, name
    # it saves: the fp32 copies of every adapted layer's input are no longer kept for backward
    assert saved < 0.85 * saved_ref, (saved, saved_ref)
