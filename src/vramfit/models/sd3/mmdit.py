"""SAI single-file MMDiT (``model.diffusion_model.``) <-> diffusers ``SD3Transformer2DModel`` names.

Stability's files keep the SD3 / SD3.5 transformer in the reference naming:
``joint_blocks.{i}.{x_block,context_block}.{attn.qkv, attn.proj, adaLN_modulation.1, mlp.fc1, mlp.fc2}``
with q, k and v fused in one ``qkv`` tensor, plus ``pos_embed``, ``x_embedder``, ``t_embedder``,
``y_embedder``, ``context_embedder`` and ``final_layer``. diffusers splits q/k/v into three
Linear layers and orders the two halves of an adaLN-continuous modulation (scale, shift) where
SAI orders them (shift, scale): ``norm_out.linear`` and the last block's ``norm1_context.linear``
are swapped on the way in and out (the swap is its own inverse).

SD3.5 adds RMS q/k norms (``attn.ln_q`` / ``attn.ln_k``) and, in some blocks, a second image-only
attention (``x_block.attn2``); both are read from the keys. The map is built from the layout, so
both directions account for every tensor or raise. Keys are given without the
``model.diffusion_model.`` prefix. Only fused/split q,k,v and the two swapped modulations are new
tensors; everything else is passed through as-is. Everything here works on meta tensors.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from vramfit.formats.keys import UnmappedKeysError
from vramfit.models.parts import apply_plan, first_part, stacked_parts, swap_halves, swapped_part

SAI_PREFIX = "model.diffusion_model."
HEAD_DIM = 64  # every released SD3/SD3.5 transformer uses 64 channels per head
DEFAULT_SAMPLE_SIZE = 128  # not stored in the weights; SD3's value (it only seeds the unused default grid)
_WB = ("weight", "bias")
_BLOCK_RE = re.compile(r"^joint_blocks\.(\d+)\.")
_DIFF_BLOCK_RE = re.compile(r"^transformer_blocks\.(\d+)\.")


@dataclass(frozen=True)
class _Layout:
    num_layers: int
    dual: tuple[int, ...]
    qk_norm: Optional[str]  # None | "rms_norm" | "layer_norm"


def _need(sd: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in sd:
        raise ValueError(f"not an SD3 MMDiT state dict: missing key {key!r}")
    return sd[key]


def _strip(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix(SAI_PREFIX): v for k, v in sd.items()}


def _contiguous_count(indices: set[int], what: str) -> int:
    if not indices or indices != set(range(len(indices))):
        raise ValueError(f"SD3 MMDiT {what} numbering is not contiguous from 0: {sorted(indices)[:10]}")
    return len(indices)


def _norm_kind(keys, norm_suffix_w: str, norm_suffix_b: str) -> Optional[str]:
    if not any(k.endswith(norm_suffix_w) for k in keys):
        return None
    return "layer_norm" if any(k.endswith(norm_suffix_b) for k in keys) else "rms_norm"


def _sai_layout(sd: Mapping[str, torch.Tensor]) -> _Layout:
    blocks = {int(m.group(1)) for k in sd if (m := _BLOCK_RE.match(k))}
    dual = tuple(sorted({int(m.group(1)) for k in sd if (m := _BLOCK_RE.match(k)) and ".x_block.attn2." in k}))
    return _Layout(_contiguous_count(blocks, "joint_blocks"), dual,
                   _norm_kind(sd, ".attn.ln_q.weight", ".attn.ln_q.bias"))


def _diffusers_layout(sd: Mapping[str, torch.Tensor]) -> _Layout:
    blocks = {int(m.group(1)) for k in sd if (m := _DIFF_BLOCK_RE.match(k))}
    dual = tuple(sorted({int(m.group(1)) for k in sd if (m := _DIFF_BLOCK_RE.match(k)) and ".attn2." in k}))
    return _Layout(_contiguous_count(blocks, "transformer_blocks"), dual,
                   _norm_kind(sd, ".attn.norm_q.weight", ".attn.norm_q.bias"))


def _tables(layout: _Layout):
    """(1:1 module pairs with their leaves, fused qkv groups, diffusers modules whose halves swap)."""
    norm_leaves = ("weight",) if layout.qk_norm == "rms_norm" else _WB
    pairs: list[tuple[str, str, tuple[str, ...]]] = [
        ("pos_embed", "pos_embed.pos_embed", ("",)),
        ("x_embedder.proj", "pos_embed.proj", _WB),
        ("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1", _WB),
        ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2", _WB),
        ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1", _WB),
        ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2", _WB),
        ("context_embedder", "context_embedder", _WB),
        ("final_layer.linear", "proj_out", _WB),
        ("final_layer.adaLN_modulation.1", "norm_out.linear", _WB),
    ]
    fused: list[tuple[str, tuple[str, str, str]]] = []
    last = layout.num_layers - 1
    for i in range(layout.num_layers):
        s, d = f"joint_blocks.{i}", f"transformer_blocks.{i}"
        x, c = f"{s}.x_block", f"{s}.context_block"
        fused.append((f"{x}.attn.qkv", tuple(f"{d}.attn.to_{n}" for n in "qkv")))
        fused.append((f"{c}.attn.qkv", tuple(f"{d}.attn.add_{n}_proj" for n in "qkv")))
        pairs += [(f"{x}.attn.proj", f"{d}.attn.to_out.0", _WB),
                  (f"{x}.adaLN_modulation.1", f"{d}.norm1.linear", _WB),
                  (f"{x}.mlp.fc1", f"{d}.ff.net.0.proj", _WB),
                  (f"{x}.mlp.fc2", f"{d}.ff.net.2", _WB),
                  (f"{c}.adaLN_modulation.1", f"{d}.norm1_context.linear", _WB)]
        if i != last:  # the last context block only feeds the image stream (context_pre_only)
            pairs += [(f"{c}.attn.proj", f"{d}.attn.to_add_out", _WB),
                      (f"{c}.mlp.fc1", f"{d}.ff_context.net.0.proj", _WB),
                      (f"{c}.mlp.fc2", f"{d}.ff_context.net.2", _WB)]
        if layout.qk_norm:
            pairs += [(f"{x}.attn.ln_q", f"{d}.attn.norm_q", norm_leaves),
                      (f"{x}.attn.ln_k", f"{d}.attn.norm_k", norm_leaves),
                      (f"{c}.attn.ln_q", f"{d}.attn.norm_added_q", norm_leaves),
                      (f"{c}.attn.ln_k", f"{d}.attn.norm_added_k", norm_leaves)]
        if i in layout.dual:
            fused.append((f"{x}.attn2.qkv", tuple(f"{d}.attn2.to_{n}" for n in "qkv")))
            pairs.append((f"{x}.attn2.proj", f"{d}.attn2.to_out.0", _WB))
            if layout.qk_norm:
                pairs += [(f"{x}.attn2.ln_q", f"{d}.attn2.norm_q", norm_leaves),
                          (f"{x}.attn2.ln_k", f"{d}.attn2.norm_k", norm_leaves)]
    swapped = {"norm_out.linear", f"transformer_blocks.{last}.norm1_context.linear"}
    return pairs, fused, swapped


def _leaf(module: str, leaf: str) -> str:
    return f"{module}.{leaf}" if leaf else module


def sai_to_diffusers_mmdit(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SAI MMDiT state dict (``model.diffusion_model.`` stripped or not) -> ``SD3Transformer2DModel`` keys."""
    sd = _strip(sd)
    pairs, fused, swapped = _tables(_sai_layout(sd))
    rename = {_leaf(s, leaf): (_leaf(d, leaf), d in swapped) for s, d, leaves in pairs for leaf in leaves}
    split = {f"{s}.{leaf}": [f"{d}.{leaf}" for d in ds] for s, ds in fused for leaf in _WB}
    unmapped = [k for k in sd if k not in rename and k not in split]
    missing = [k for k in [*rename, *split] if k not in sd]
    if unmapped or missing:
        raise UnmappedKeysError("SAI -> diffusers SD3 MMDiT", unmapped, missing)
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        if key in split:
            if t.shape[0] % 3:
                raise ValueError(f"{key} has {t.shape[0]} rows, not a multiple of 3")
            for name, part in zip(split[key], t.chunk(3, dim=0)):
                out[name] = part.clone()  # own storage: views of one tensor cannot be saved apart
        else:
            name, swap = rename[key]
            out[name] = swap_halves(t) if swap else t
    return out


def diffusers_to_sai_mmdit(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``SD3Transformer2DModel`` state dict -> SAI MMDiT keys (without ``model.diffusion_model.``)."""
    return apply_plan(sd, sai_plan(sd))


def sai_plan(sd: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[str, ...], Callable]]:
    """{SAI key: (the diffusers keys it is made of, how: a function of their tensors)} for an
    ``SD3Transformer2DModel`` state dict (meta tensors suffice): a single file is written a tensor
    at a time from it (`diffusers_to_sai_mmdit` applies it whole)."""
    pairs, fused, swapped = _tables(_diffusers_layout(sd))
    rename = {_leaf(d, leaf): (_leaf(s, leaf), d in swapped) for s, d, leaves in pairs for leaf in leaves}
    joined = {f"{s}.{leaf}": [f"{d}.{leaf}" for d in ds] for s, ds in fused for leaf in _WB}
    parts = {p for names in joined.values() for p in names}
    unmapped = [k for k in sd if k not in rename and k not in parts]
    missing = [k for k in [*rename, *parts] if k not in sd]
    if unmapped or missing:
        raise UnmappedKeysError("diffusers -> SAI SD3 MMDiT", unmapped, missing)
    plan: dict[str, tuple[tuple[str, ...], Callable]] = {}
    for key in sd:
        if key in rename:
            name, swap = rename[key]
            plan[name] = ((key,), swapped_part if swap else first_part)
    for name, sources in joined.items():
        plan[name] = (tuple(sources), stacked_parts)
    return plan


def sai_names(diffusers_keys: Iterable[str]) -> dict[str, str]:
    """{diffusers key: the SAI key it is read from} for an ``SD3Transformer2DModel``'s keys, to name
    a file's tensor in messages; a part of a fused q/k/v tensor is named with its rows, e.g.
    ``joint_blocks.0.x_block.attn.qkv.weight (q rows)``."""
    pairs, fused, _ = _tables(_diffusers_layout(dict.fromkeys(diffusers_keys)))
    out = {_leaf(d, leaf): _leaf(s, leaf) for s, d, leaves in pairs for leaf in leaves}
    for s, ds in fused:
        for d, part in zip(ds, "qkv"):
            out.update({f"{d}.{leaf}": f"{s}.{leaf} ({part} rows)" for leaf in _WB})
    return out


def sd3_config_from_keys(sd: Mapping[str, torch.Tensor], *, sample_size: int = DEFAULT_SAMPLE_SIZE) -> dict:
    """``SD3Transformer2DModel`` kwargs read from SAI MMDiT keys and shapes (meta tensors suffice).

    Heads follow the 64-channels-per-head convention of every released SD3/SD3.5 model.
    ``sample_size`` is not in the weights (the persistent ``pos_embed`` grid is what is used).
    """
    sd = _strip(sd)
    layout = _sai_layout(sd)
    context = _need(sd, "context_embedder.weight")
    patch = _need(sd, "x_embedder.proj.weight")
    hidden, in_channels, patch_size = int(patch.shape[0]), int(patch.shape[1]), int(patch.shape[2])
    caption_dim = int(context.shape[0])
    if hidden != caption_dim:
        raise ValueError(f"SD3 MMDiT hidden size {hidden} differs from caption projection {caption_dim}")
    if caption_dim % HEAD_DIM:
        raise ValueError(f"SD3 MMDiT width {caption_dim} is not a multiple of {HEAD_DIM} (head size)")
    n_pos = int(_need(sd, "pos_embed").shape[1])
    side = math.isqrt(n_pos)
    if side * side != n_pos:
        raise ValueError(f"SD3 MMDiT pos_embed holds {n_pos} positions, not a square grid")
    out_features = int(_need(sd, "final_layer.linear.weight").shape[0])
    return {
        "sample_size": sample_size,
        "patch_size": patch_size,
        "in_channels": in_channels,
        "num_layers": layout.num_layers,
        "attention_head_dim": HEAD_DIM,
        "num_attention_heads": caption_dim // HEAD_DIM,
        "joint_attention_dim": int(context.shape[1]),
        "caption_projection_dim": caption_dim,
        "pooled_projection_dim": int(_need(sd, "y_embedder.mlp.0.weight").shape[1]),
        "out_channels": out_features // (patch_size * patch_size),
        "pos_embed_max_size": side,
        "dual_attention_layers": layout.dual,
        "qk_norm": layout.qk_norm,
    }
