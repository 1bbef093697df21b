"""The SDXL family's kohya LoRA names: ``lora_unet_<SGM module path, "." -> "_">``, as kohya-ss,
A1111 and ComfyUI name an SDXL-family UNet's modules.

SGM paths come from the UNet's config (sgm_unet.unet_key_map), so SSD-1B and other depth patterns
get their own correct names. Tensors are passed through unchanged (kohya's forward scales by
``alpha / r`` as peft does); the generic parts of the format are formats/lora.py's.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import torch

from vramfit.formats.lora import (
    DORA_PARTS, Alpha, alpha_for, from_kohya, kohya_lycoris, kohya_modules, kohya_name, lycoris_rank,
    module_kind, peft_modules, split_adapter_state,
)
from vramfit.models.parts import shipped_config
from vramfit.models.sdxl.sgm_unet import unet_key_map

# The shipped layouts a kohya file's names are tried against without the model: (name, UNet config)
SHIPPED_UNETS = (("SDXL", "sdxl_unet"), ("SSD-1B", "ssd1b_unet"))


def _module_map(unet_config: Mapping) -> dict[str, str]:
    """{diffusers module path: SGM module path} for every Linear/Conv-bearing module."""
    out: dict[str, str] = {}
    for d, s in unet_key_map(unet_config).items():
        for suffix in (".weight", ".bias"):
            if d.endswith(suffix) and s.endswith(suffix):
                out.setdefault(d[: -len(suffix)], s[: -len(suffix)])
    return out


def _config_dict(unet_config) -> dict:
    return {k: v for k, v in dict(unet_config).items() if not str(k).startswith("_")}


def kohya_unet_names(unet_config: Mapping) -> dict[str, str]:
    """{kohya module name: diffusers module path} for a UNet config.

    Holds the SGM-path names kohya, A1111 and ComfyUI use, and also the diffusers-path names
    (``lora_unet_down_blocks_1_...``) that diffusers' ``convert_state_dict_to_kohya`` writes.
    """
    out: dict[str, str] = {}
    for d, s in _module_map(_config_dict(unet_config)).items():
        name = kohya_name(s)
        if out.get(name, d) != d:
            raise ValueError(f"kohya name {name!r} is ambiguous ({out[name]!r} and {d!r})")
        out[name] = d
    for d in list(out.values()):
        out.setdefault(kohya_name(d), d)
    return out


def to_kohya_sdxl(peft_state: Mapping[str, torch.Tensor], unet_config: Mapping, alpha: Alpha) -> dict:
    """kohya / A1111 / ComfyUI layout of an SDXL-family UNet LoRA.

    ``alpha`` is the ``lora_alpha`` of training (a number, or {module: alpha} as
    :func:`from_kohya_sdxl` returns; ``None`` = rank). Weights are passed through (same tensors);
    each module gets ``.alpha`` as a float32 scalar.
    """
    to_sgm = _module_map(_config_dict(unet_config))
    peft_state, other = split_adapter_state(peft_state)
    modules = peft_modules(peft_state, "to_kohya_sdxl")
    lycoris = {m: p for m, p in other.items() if set(p) - set(DORA_PARTS)}
    unknown = sorted(m for m in {*modules, *other} if m not in to_sgm)
    if unknown:
        raise ValueError(f"to_kohya_sdxl: {len(unknown)} LoRA module(s) are not parameters of this UNet "
                         f"config (e.g. {unknown[0]!r}); is the state dict of the UNet, without prefix?")
    out: dict[str, torch.Tensor] = {}
    for module, pair in modules.items():
        name = kohya_name(to_sgm[module])
        out[f"{name}.lora_down.weight"] = pair["A"]
        out[f"{name}.lora_up.weight"] = pair["B"]
        out[f"{name}.alpha"] = torch.tensor(alpha_for(alpha, module, int(pair["A"].shape[0])),
                                            dtype=torch.float32)
        if "dora_scale" in other.get(module, {}):  # DoRA: ComfyUI's magnitude (train/lora.py)
            out[f"{name}.dora_scale"] = other[module]["dora_scale"]
    for module, parts in lycoris.items():
        rank = lycoris_rank(parts)
        out.update(kohya_lycoris(kohya_name(to_sgm[module]), parts,
                                 alpha_for(alpha, module, rank) if rank else 1.0))
    return out


def from_kohya_sdxl(kohya_state: Mapping[str, torch.Tensor], unet_config: Mapping
                    ) -> tuple[dict, dict[str, float]]:
    """kohya UNet LoRA -> (peft state, {module: alpha}). A module without ``.alpha`` gets alpha =
    rank (scale 1.0, as ComfyUI and diffusers read it). Text-encoder keys are refused here
    (:func:`load_lora` reads them)."""
    names = kohya_unet_names(unet_config)
    modules = kohya_modules(kohya_state, "from_kohya_sdxl")
    unknown = sorted(n for n in modules if n not in names)
    if unknown:
        raise ValueError(f"from_kohya_sdxl: {len(unknown)} kohya module(s) are not UNet modules of this "
                         f"config, e.g. {unknown[0]!r}")
    return from_kohya(modules, names.__getitem__, "from_kohya_sdxl")


@lru_cache(maxsize=1)
def shipped_kohya_names() -> dict[str, str]:
    """kohya names of the SDXL and SSD-1B layouts together (SGM block numbering is the same grid,
    so one SGM name means the same diffusers module in both)."""
    out: dict[str, str] = {}
    for _, name in SHIPPED_UNETS:
        for k, d in kohya_unet_names(shipped_config(name)).items():
            if out.setdefault(k, d) != d:
                raise AssertionError(f"{k}: {out[k]} vs {d}")
    return out


def _sdxl_layouts(names: set[str], kohya: bool) -> str:
    """Which shipped SDXL-family layouts have every module the LoRA adapts (by name)."""
    fits = []
    for layout, config in SHIPPED_UNETS:
        cfg = shipped_config(config)
        known = set(kohya_unet_names(cfg)) if kohya else set(_module_map(cfg))
        if names <= known:
            fits.append(layout)
    return " and ".join(fits) if fits else "another SDXL-family layout (neither SDXL's nor SSD-1B's blocks)"


def describe_target(modules: dict[str, dict], kohya: bool) -> str:
    """What describe_lora says an SDXL-family LoRA of `modules` is for: the shipped layouts whose
    module names it fits, and its text context width (from its attn2.to_k inputs)."""
    ctx = next((e["width"] for m, e in modules.items() if module_kind(m, e["ndim"]) == "attn2.to_k"), None)
    return (f"SDXL-family UNet, module names of {_sdxl_layouts(set(modules), kohya)}"
            + (f"; text context {ctx} wide (SDXL's is 2048)" if ctx else ""))
