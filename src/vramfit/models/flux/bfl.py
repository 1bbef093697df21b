"""Black Forest Labs' single-file key layout of the Flux.1 transformer, both ways.

BFL's files (flux1-dev.safetensors, and ComfyUI's all-in-one checkpoints under
``model.diffusion_model.``) fuse what diffusers' FluxTransformer2DModel keeps apart: a double
block's ``img_attn.qkv`` is diffusers' to_q, to_k and to_v stacked on the output axis
(``txt_attn.qkv``: add_q/k/v_proj), a single block's ``linear1`` is to_q, to_k, to_v and proj_mlp
stacked. The final layer's modulation holds (shift, scale) where diffusers' norm_out holds
(scale, shift). The config (block counts, widths, the guidance embedding) is read from the keys.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from vramfit.models.parts import apply_plan, first_part, stacked_parts, swap_halves, swapped_part

# whole-tensor renames: diffusers module -> BFL module (each with .weight and .bias where present)
TOP_NAMES = {
    "x_embedder": "img_in", "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "proj_out": "final_layer.linear",
}
SWAPPED = ("norm_out.linear", "final_layer.adaLN_modulation.1")  # halves (scale, shift) <-> (shift, scale)
DOUBLE_NAMES = {
    "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
    "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
}
DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
SINGLE_NAMES = {"norm.linear": "modulation.lin", "proj_out": "linear2",
           "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}
SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
DOUBLE, SINGLE = "double_blocks.", "single_blocks."
D_DOUBLE, D_SINGLE = "transformer_blocks.", "single_transformer_blocks."


def _param(bfl_module: str, suffix: str) -> str:
    """BFL stores RMSNorm weights as `.scale`."""
    return bfl_module + (".scale" if bfl_module.endswith("_norm") and suffix == "weight" else "." + suffix)


def _blocks(keys, prefix: str) -> list[int]:
    found = sorted({int(k[len(prefix):].split(".")[0]) for k in keys if k.startswith(prefix)})
    if found != list(range(len(found))):
        raise ValueError(f"{prefix}* blocks are not numbered 0..{len(found) - 1}: {found[:10]}")
    return found


def diffusers_to_bfl(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A FluxTransformer2DModel state dict in BFL keys; every tensor is used once."""
    return apply_plan(sd, bfl_plan(sd))


def bfl_plan(sd: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[str, ...], Callable]]:
    """{BFL key: (the diffusers keys it is made of, how: a function of their tensors)} for a
    FluxTransformer2DModel state dict (any values: only its keys are read): a single file is
    written a tensor at a time from it (`diffusers_to_bfl` applies it whole)."""
    out: dict[str, tuple[tuple[str, ...], Callable]] = {}
    used: set[str] = set()

    def take(*keys: str) -> tuple[str, ...]:
        used.update(keys)
        return keys

    for d, b in [*TOP_NAMES.items(), SWAPPED]:
        for suffix in ("weight", "bias"):
            if f"{d}.{suffix}" in sd:
                out[f"{b}.{suffix}"] = (take(f"{d}.{suffix}"), swapped_part if d == SWAPPED[0] else first_part)
    for i in _blocks(sd, D_DOUBLE):
        src, dst = f"{D_DOUBLE}{i}.", f"{DOUBLE}{i}."
        for d, b in DOUBLE_NAMES.items():
            for suffix in ("weight", "bias"):
                if src + f"{d}.{suffix}" in sd:
                    out[dst + _param(b, suffix)] = (take(src + f"{d}.{suffix}"), first_part)
        for b, parts in DOUBLE_FUSED.items():
            for suffix in ("weight", "bias"):
                out[f"{dst}{b}.{suffix}"] = (take(*(f"{src}{p}.{suffix}" for p in parts)), stacked_parts)
    for i in _blocks(sd, D_SINGLE):
        src, dst = f"{D_SINGLE}{i}.", f"{SINGLE}{i}."
        for d, b in SINGLE_NAMES.items():
            for suffix in ("weight", "bias"):
                if src + f"{d}.{suffix}" in sd:
                    out[dst + _param(b, suffix)] = (take(src + f"{d}.{suffix}"), first_part)
        for suffix in ("weight", "bias"):
            out[f"{dst}linear1.{suffix}"] = (take(*(f"{src}{p}.{suffix}" for p in SINGLE_FUSED)), stacked_parts)
    left = sorted(set(sd) - used)
    if left:
        raise ValueError(f"Flux transformer keys with no BFL name: {left[:5]}")
    return out


def bfl_names(keys) -> dict[str, str]:
    """{diffusers key: the BFL key it comes from}, for messages (a split tensor names its fused source)."""
    return {k: next(iter(_provenance(k))) for k in keys}


def _provenance(key: str) -> dict[str, str]:
    """{BFL key: key} for one diffusers key."""
    module, suffix = key.rsplit(".", 1)
    if module in TOP_NAMES:
        return {f"{TOP_NAMES[module]}.{suffix}": key}
    if module == SWAPPED[0]:
        return {f"{SWAPPED[1]}.{suffix}": key}
    for src, dst, plain, fused in ((D_DOUBLE, DOUBLE, DOUBLE_NAMES, DOUBLE_FUSED),
                                   (D_SINGLE, SINGLE, SINGLE_NAMES, {"linear1": SINGLE_FUSED})):
        if module.startswith(src):
            i, rest = module[len(src):].split(".", 1)
            if rest in plain:
                return {dst + i + "." + _param(plain[rest], suffix): key}
            for b, parts in fused.items():
                if rest in parts:
                    return {f"{dst}{i}.{b}.{suffix}": key}
    return {key: key}


def bfl_to_diffusers(sd: Mapping[str, torch.Tensor], config: Mapping) -> dict[str, torch.Tensor]:
    """BFL keys to a FluxTransformer2DModel state dict of `config` (flux_config_from_keys); keys it
    does not know are kept as they are (the shape check then names them)."""
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        used.add(key)
        return sd[key]

    for d, b in [*TOP_NAMES.items(), SWAPPED]:
        for suffix in ("weight", "bias"):
            if f"{b}.{suffix}" in sd:
                t = take(f"{b}.{suffix}")
                out[f"{d}.{suffix}"] = swap_halves(t) if d == SWAPPED[0] else t
    for i in _blocks(sd, DOUBLE):
        src, dst = f"{DOUBLE}{i}.", f"{D_DOUBLE}{i}."
        for d, b in DOUBLE_NAMES.items():
            for suffix in ("weight", "bias"):
                if src + _param(b, suffix) in sd:
                    out[f"{dst}{d}.{suffix}"] = take(src + _param(b, suffix))
        for b, parts in DOUBLE_FUSED.items():
            for suffix in ("weight", "bias"):
                if f"{src}{b}.{suffix}" in sd:
                    for p, t in zip(parts, take(f"{src}{b}.{suffix}").split(inner, dim=0)):
                        out[f"{dst}{p}.{suffix}"] = t
    for i in _blocks(sd, SINGLE):
        src, dst = f"{SINGLE}{i}.", f"{D_SINGLE}{i}."
        for d, b in SINGLE_NAMES.items():
            for suffix in ("weight", "bias"):
                if src + _param(b, suffix) in sd:
                    out[f"{dst}{d}.{suffix}"] = take(src + _param(b, suffix))
        for suffix in ("weight", "bias"):
            if f"{src}linear1.{suffix}" in sd:
                t = take(f"{src}linear1.{suffix}")
                sizes = [inner, inner, inner, t.shape[0] - 3 * inner]
                for p, part in zip(SINGLE_FUSED, t.split(sizes, dim=0)):
                    out[f"{dst}{p}.{suffix}"] = part
    out.update({k: v for k, v in sd.items() if k not in used})
    return out


def flux_config_from_keys(sd: Mapping[str, torch.Tensor]) -> dict:
    """FluxTransformer2DModel kwargs read from BFL keys and shapes (meta tensors do)."""
    def need(key: str) -> torch.Tensor:
        if key not in sd:
            raise ValueError(f"not a Flux transformer: missing key {key!r}")
        return sd[key]

    img_in = need("img_in.weight")
    inner = int(img_in.shape[0])
    head = int(need(f"{DOUBLE}0.img_attn.norm.query_norm.scale").shape[0])
    if inner % head or head % 16:
        raise ValueError(f"a Flux transformer {inner} wide with {head}-wide heads is not one this "
                         "version reads (heads must divide the width and be a multiple of 16)")
    # rotary axes (index, height, width): BFL's 16/56/56 of 128-wide heads, in proportion
    axes = [head // 8, head * 7 // 16, head * 7 // 16]
    return {"patch_size": 1, "in_channels": int(img_in.shape[1]),
            "out_channels": int(need("final_layer.linear.weight").shape[0]),
            "num_layers": len(_blocks(sd, DOUBLE)), "num_single_layers": len(_blocks(sd, SINGLE)),
            "attention_head_dim": head, "num_attention_heads": inner // head,
            "joint_attention_dim": int(need("txt_in.weight").shape[1]),
            "pooled_projection_dim": int(need("vector_in.in_layer.weight").shape[1]),
            "guidance_embeds": "guidance_in.in_layer.weight" in sd, "axes_dims_rope": axes}
