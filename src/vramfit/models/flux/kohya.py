"""kohya's Flux.1 LoRA names (lora_unet_double_blocks_N_img_attn_qkv, lora_unet_single_blocks_N_linear1,
...): the BFL module each diffusers module belongs to, "." -> "_".

BFL fuses what diffusers keeps apart (models/flux/bfl.py): a double block's img_attn.qkv is
to_q, to_k and to_v, a single block's linear1 is to_q, to_k, to_v and proj_mlp. A LoRA trained
on the parts is written exactly for the fused module: lora_down stacks the parts' lora_A, lora_up
is block-diagonal (each part's lora_B, scaled by its alpha / rank, in its rows), alpha is the
fused rank (scale 1). Its update is the parts' updates stacked, which is what kohya, ComfyUI and
diffusers' kohya reader apply (they split lora_up back by rows with the same lora_down).
"""
from __future__ import annotations

from typing import Mapping

import torch

from vramfit.formats.lora import Alpha, alpha_for, kohya_name, peft_modules
from vramfit.models.flux.bfl import (
    D_DOUBLE, D_SINGLE, DOUBLE, DOUBLE_FUSED, DOUBLE_NAMES, SINGLE, SINGLE_FUSED, SINGLE_NAMES, SWAPPED,
    TOP_NAMES,
)


def _target(module: str) -> tuple[str, tuple[str, ...], str]:
    """(BFL module, the diffusers parts fused into it in order, this module's block prefix)."""
    if module in TOP_NAMES:
        return TOP_NAMES[module], (module,), ""
    if module == SWAPPED[0]:
        return SWAPPED[1], (module,), ""
    for src, dst, plain, fused in ((D_DOUBLE, DOUBLE, DOUBLE_NAMES, DOUBLE_FUSED),
                                   (D_SINGLE, SINGLE, SINGLE_NAMES, {"linear1": SINGLE_FUSED})):
        if module.startswith(src):
            i, rest = module[len(src):].split(".", 1)
            if rest in plain:
                return f"{dst}{i}.{plain[rest]}", (rest,), f"{src}{i}."
            for b, parts in fused.items():
                if rest in parts:
                    return f"{dst}{i}.{b}", parts, f"{src}{i}."
    raise ValueError(f"LoRA module {module!r} is not a module of a Flux.1 transformer")


def to_kohya_flux(peft_state: Mapping[str, torch.Tensor], config: Mapping, alpha: Alpha) -> dict:
    """kohya / ComfyUI layout of a Flux.1 transformer LoRA (peft names of FluxTransformer2DModel
    `config`, trained with `alpha`): fused modules as the module docstring says, the others
    passed through with their alpha; the final layer's modulation with its halves swapped as BFL
    stores them."""
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    modules = peft_modules(peft_state, "to_kohya_flux")
    groups: dict[str, tuple[tuple[str, ...], str, dict[str, dict]]] = {}
    for module, pair in modules.items():
        bfl, parts, prefix = _target(module)
        entry = {"pair": pair, "module": module}
        groups.setdefault(bfl, (parts, prefix, {}))[2][module[len(prefix):]] = entry
    out: dict[str, torch.Tensor] = {}
    for bfl, (parts, prefix, found) in groups.items():
        name = kohya_name(bfl)
        if len(parts) == 1:
            entry = found[parts[0]]
            a, b = entry["pair"]["A"], entry["pair"]["B"]
            if bfl == SWAPPED[1]:
                b = torch.cat(b.chunk(2, dim=0)[::-1], dim=0)
            out[f"{name}.lora_down.weight"], out[f"{name}.lora_up.weight"] = a, b
            out[f"{name}.alpha"] = torch.tensor(alpha_for(alpha, entry["module"], int(a.shape[0])),
                                                dtype=torch.float32)
            continue
        some = next(iter(found.values()))["pair"]
        rows = [inner] * len(parts)
        if len(parts) == len(SINGLE_FUSED):  # linear1's MLP rows: FluxSingleTransformerBlock's ratio 4
            rows[-1] = int(found["proj_mlp"]["pair"]["B"].shape[0]) if "proj_mlp" in found else 4 * inner
        downs = []
        total = sum(int(found[p]["pair"]["A"].shape[0]) for p in parts if p in found)
        col = 0
        up = torch.zeros(sum(rows), total, dtype=some["B"].dtype)
        row = 0
        for part, height in zip(parts, rows):
            if part in found:
                a, b = found[part]["pair"]["A"], found[part]["pair"]["B"]
                r = int(a.shape[0])
                scale = alpha_for(alpha, found[part]["module"], r) / r
                downs.append(a)
                up[row:row + height, col:col + r] = (b.to(torch.float32) * scale).to(b.dtype)
                col += r
            row += height
        out[f"{name}.lora_down.weight"] = torch.cat(downs, dim=0)
        out[f"{name}.lora_up.weight"] = up
        out[f"{name}.alpha"] = torch.tensor(float(total), dtype=torch.float32)
    return out


def from_kohya_flux(kohya_state: Mapping[str, torch.Tensor], config: Mapping) -> dict[str, torch.Tensor]:
    """A kohya Flux.1 LoRA (BFL names) as diffusers keys (``transformer.<module>.lora_A/B``) for a
    transformer of `config`, with each module's alpha / rank folded into lora_B: a fused module's
    lora_up is split by rows over its parts, each part keeping the whole lora_down (the same update;
    this reads files of any width, where diffusers' own reader assumes the released one)."""
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    plain = {kohya_name(b): d for d, b in [*TOP_NAMES.items(), SWAPPED]}
    out: dict[str, torch.Tensor] = {}
    for key in kohya_state:
        if not key.endswith(".lora_down.weight"):
            continue
        name = key[:-len(".lora_down.weight")]
        down, up = kohya_state[key], kohya_state[f"{name}.lora_up.weight"]
        alpha = kohya_state.get(f"{name}.alpha")
        scale = (float(alpha) if alpha is not None else down.shape[0]) / down.shape[0]
        up = (up.to(torch.float32) * scale).to(up.dtype)
        targets = _modules_of(name, plain, inner, int(up.shape[0]))
        if targets is None:
            raise ValueError(f"kohya LoRA module {name!r} is not a module of a Flux.1 transformer")
        if targets and targets[0][0] == SWAPPED[0]:
            up = torch.cat(up.chunk(2, dim=0)[::-1], dim=0)
        row = 0
        for module, height in targets:
            out[f"transformer.{module}.lora_A.weight"] = down
            out[f"transformer.{module}.lora_B.weight"] = up[row:row + height]
            row += height
    return out


def _modules_of(name: str, plain: dict, inner: int, rows: int):
    """[(diffusers module, rows of lora_up)] of kohya module `name`; None if it names none."""
    if name in plain:
        return [(plain[name], rows)]
    for src, dst, names, fused in ((D_DOUBLE, DOUBLE, DOUBLE_NAMES, DOUBLE_FUSED),
                                   (D_SINGLE, SINGLE, SINGLE_NAMES, {"linear1": SINGLE_FUSED})):
        head = kohya_name(dst)
        if not name.startswith(head):
            continue
        i, _, rest = name[len(head):].partition("_")
        for d, b in names.items():
            if kohya_name(b) == "lora_unet_" + rest:
                return [(f"{src}{i}.{d}", rows)]
        for b, parts in fused.items():
            if kohya_name(b) == "lora_unet_" + rest:
                heights = [inner] * len(parts)
                heights[-1] = rows - inner * (len(parts) - 1)
                return [(f"{src}{i}.{p}", h) for p, h in zip(parts, heights)]
    return None


_WIDE_INPUTS = ("_qkv", "_linear1", "_attn_proj", "_mod_lin", "_modulation_lin", "_mlp_0",
                "final_layer_linear")


def kohya_width(kohya_state: Mapping[str, torch.Tensor]) -> int:
    """The transformer's width (heads x head size) a kohya Flux.1 LoRA was trained for: the inputs
    of a module that takes the width (attention, modulation, linear1, the MLPs' first layer)."""
    for key, t in sorted(kohya_state.items()):
        if key.endswith(".lora_down.weight") and key[:-len(".lora_down.weight")].endswith(_WIDE_INPUTS):
            return int(t.shape[1])
    raise ValueError("the kohya Flux.1 LoRA adapts no module whose inputs give the transformer's width "
                     "(attention, modulation, linear1, MLP); load it with the model's config")
