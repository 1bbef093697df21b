"""Count the activations a training forward saves for backward, on the meta device: no GPU, no compute.

Without gradient checkpointing every activation autograd saves lives until backward frees it, so
the training peak holds all of them. This builds the shipped denoisers on the meta device with
their weights in bf16 (train.precision = "full_bf16"), runs one forward under a saved-tensors hook
and adds the bytes of each storage saved, once, to the checkpointable block that was running:
a UNet's resnets and transformer blocks, SD3's joint blocks, Flux.1's double-stream and
single-stream blocks; the rest (the layers between blocks, the embeddings) under "other". Weights
are left out. Attention is counted as the fused kernel saves it on a GPU: query, key, value,
output and an fp32 log-sum-exp per query.

It prints, per kind, bytes per element of the blocks' inputs as fit/planner.py counts them
(each family's `activations`): the planner's full-bf16 constants for blocks kept without checkpointing.
For SD3-M and Flux.1 dev it counts a LoRA's too ("_lora"): only the default lora.targets' linears
train, so a frozen linear saves no input. Mixed precision (autocast) cannot run on the meta
device; its constants stay fitted.

usage: python bench/count_train_memory.py [--size 1024]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from count_sample_memory import denoiser_call, shipped

GIB = 2**30


class FusedAttention(torch.autograd.Function):
    """What a flash or memory-efficient kernel saves: its inputs, its output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("counting only")


def saved_bytes(model: torch.nn.Module, kinds: dict[type, str], call) -> dict[str, int]:
    """{kind: bytes saved for backward while a module of that kind ran}, "other" for what ran
    outside them."""
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    running, seen = ["other"], set()
    saved: dict[str, int] = {}

    def leave(*_) -> None:  # a forward hook's return value would replace the module's output
        running.pop()

    for module in model.modules():
        kind = next((k for cls, k in kinds.items() if isinstance(module, cls)), None)
        if kind:
            module.register_forward_pre_hook(lambda *_, kind=kind: running.append(kind))
            module.register_forward_hook(leave)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in weights and key not in seen:
            seen.add(key)
            saved[running[-1]] = saved.get(running[-1], 0) + t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return saved


MODELS = ("ssd1b", "sdxl", "sd3m", "flux1_dev")


def count(size: int, models=MODELS) -> dict:
    """{model: its counted figures} of `models` at `size` x `size` pixels, batch 1."""
    sdpa = F.scaled_dot_product_attention
    # by torch's names too: diffusers' attention dispatch (Flux) passes query, key and value so
    F.scaled_dot_product_attention = lambda query, key, value, *_, **__: FusedAttention.apply(
        query, key, value)
    try:
        return _count(size // 8, torch.bfloat16, models)
    finally:
        F.scaled_dot_product_attention = sdpa


def _count(lat: int, dtype: torch.dtype, models) -> dict:
    from diffusers.models.attention import BasicTransformerBlock, JointTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_flux import (FluxSingleTransformerBlock,
                                                                FluxTransformerBlock)

    from vramfit.models.flux.variants import default_t5_tokens
    from vramfit.models.registry import FAMILIES

    results = {}
    with torch.device("meta"):
        for name in (m for m in ("ssd1b", "sdxl") if m in models):
            unet, call, _ = denoiser_call(f"{name}_unet", 1, lat, dtype)
            saved = saved_bytes(unet, {ResnetBlock2D: "resnet", BasicTransformerBlock: "block"}, call)
            shape = FAMILIES["sdxl"].activations(shipped(f"{name}_unet"), lat, lat, 0)
            blocks = sum(n for kind, n in shape.blocks if kind == "block")
            results[name] = dict(total_gib=sum(saved.values()) / GIB, other_gib=saved.get("other", 0) / GIB,
                                 bytes_per_resnet_input=saved["resnet"] / shape.resnet_inputs,
                                 bytes_per_block_input=saved["block"] / blocks,
                                 bytes_per_fixed_input=saved.get("other", 0) / shape.fixed)
        joint = {JointTransformerBlock: "block"}
        flux = {FluxTransformerBlock: "double", FluxSingleTransformerBlock: "single"}
        flux_tokens = default_t5_tokens(shipped("flux1_dev_transformer"))
        for key, name, family, tokens, kinds in (
                ("sd3m", "sd3_medium_transformer", "sd3", 77, joint),
                ("flux1_dev", "flux1_dev_transformer", "flux", flux_tokens, flux)):
            if key in models:
                results[key] = _transformer(name, FAMILIES[family], tokens, kinds, lat, dtype)
    return results


def _transformer(name: str, family, tokens: int, kinds: dict[type, str], lat: int,
                 dtype: torch.dtype) -> dict:
    """An MMDiT's figures: a full fine-tune's and a LoRA's (the default lora.targets train, each
    saving its input; the rank-r products, kilobytes, left out) bytes per element of its blocks'
    inputs, by block kind where it has more than one."""
    from vramfit.config.schema import LoraSettings
    from vramfit.train.lora import target_modules

    shape = family.activations(shipped(name), lat, lat, tokens)  # `tokens`: the text tokens it counts
    figures = {}
    for mode in ("full", "lora"):
        model, call, _ = denoiser_call(name, 1, lat, dtype)
        if mode == "lora":
            model.requires_grad_(False)
            for target in target_modules(model, LoraSettings()):
                model.get_submodule(target).weight.requires_grad_(True)
        saved = saved_bytes(model, kinds, call)
        blocks = {kind: saved.get(kind, 0) for kind in dict.fromkeys(kinds.values())}
        suffix = "" if mode == "full" else "_lora"
        figures[f"total{suffix}_gib"] = sum(saved.values()) / GIB
        figures[f"other{suffix}_gib"] = saved.get("other", 0) / GIB
        if shape.fixed:  # the planner charges the layers outside the blocks `saved` per element of `fixed`
            figures[f"bytes_per_fixed_input{suffix}"] = saved.get("other", 0) / shape.fixed
        figures[f"bytes_per_block_input{suffix}"] = sum(blocks.values()) / sum(n for _, n in shape.blocks)
        if len(blocks) > 1:  # every block's input is as large (tokens x inner): per kind, over its count
            per_block = shape.blocks[0][1]
            counts = {kind: sum(isinstance(m, cls) for m in model.modules()) for cls, kind in kinds.items()}
            figures.update({f"bytes_per_{kind}_block_input{suffix}": blocks[kind] / (counts[kind] * per_block)
                            for kind in blocks})
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    args = ap.parse_args()
    print(json.dumps(dict(size=args.size, dtype="bf16", **count(args.size)), indent=1))


if __name__ == "__main__":
    main()
