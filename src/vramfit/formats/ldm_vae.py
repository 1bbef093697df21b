"""LDM (``first_stage_model.``) <-> diffusers ``AutoencoderKL`` names for SDXL/SD3-style VAEs.

Single-file checkpoints keep the VAE in the CompVis LDM layout: ``encoder.down.{i}.block.{j}``,
``decoder.up.{i}`` numbered from the *lowest* resolution up (diffusers numbers its ``up_blocks`` in
the order they run, so the decoder index is reversed), ``mid.block_{1,2}`` and a mid attention built
from 1x1 convolutions where diffusers uses Linear layers. The map is built from a config, so both
directions account for every tensor or raise.

Keys are given without the ``first_stage_model.`` prefix. Only the four mid-attention projection
weights per attention change shape (a view, no copy); every other tensor is passed through as-is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from vramfit.formats.keys import rename_exact

LDM_VAE_PREFIX = "first_stage_model."
_WB = ("weight", "bias")
# diffusers mid attention name -> LDM name; the weights of the four projections differ in shape.
_ATTN_NAMES = (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out"))
_ATTN_PROJ_WEIGHTS = tuple(f"mid_block.attentions.0.{d}.weight" for d, _ in _ATTN_NAMES[1:])


def _need(sd: Mapping[str, torch.Tensor], key: str, what: str) -> torch.Tensor:
    if key not in sd:
        raise ValueError(f"not an {what} VAE state dict: missing key {key!r}")
    return sd[key]


def _count(keys: Iterable[str], pattern: str) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    if found != set(range(len(found))):
        raise ValueError(f"VAE block numbering has gaps for {pattern!r}: {sorted(found)}")
    return len(found)


def _vae_config(
    *, in_channels: int, out_channels: int, latent_channels: int, channels: list[int], layers: int,
    quant: bool, post_quant: bool, mid_attention: bool, scaling_factor: float, shift_factor: float | None,
) -> dict:
    n = len(channels)
    return {
        "act_fn": "silu", "block_out_channels": channels, "down_block_types": ["DownEncoderBlock2D"] * n,
        "force_upcast": True, "in_channels": in_channels, "latent_channels": latent_channels,
        "latents_mean": None, "latents_std": None, "layers_per_block": layers,
        "mid_block_add_attention": mid_attention, "norm_num_groups": 32, "out_channels": out_channels,
        "sample_size": 1024, "scaling_factor": scaling_factor, "shift_factor": shift_factor,
        "up_block_types": ["UpDecoderBlock2D"] * n, "use_post_quant_conv": post_quant, "use_quant_conv": quant,
    }


def vae_config_from_ldm(
    sd: Mapping[str, torch.Tensor], *, scaling_factor: float = 0.13025, shift_factor: float | None = None
) -> dict:
    """``AutoencoderKL`` config read from LDM VAE keys and shapes (prefix stripped).

    The latent scaling is not stored in the weights, hence the keyword arguments (SDXL: 0.13025 and
    no shift; SD3: 1.5305 and 0.0609). ``sample_size`` and ``force_upcast`` are SDXL's values.
    """
    what = "LDM"
    levels = _count(sd, r"^encoder\.down\.(\d+)\.")
    layers = _count(sd, r"^encoder\.down\.0\.block\.(\d+)\.")
    if levels == 0 or layers == 0:
        _need(sd, "encoder.down.0.block.0.conv1.weight", what)
    if _count(sd, r"^decoder\.up\.0\.block\.(\d+)\.") != layers + 1:
        raise ValueError(f"LDM VAE decoder levels must hold layers_per_block + 1 = {layers + 1} resnets")
    return _vae_config(
        in_channels=int(_need(sd, "encoder.conv_in.weight", what).shape[1]),
        out_channels=int(_need(sd, "decoder.conv_out.weight", what).shape[0]),
        latent_channels=int(_need(sd, "decoder.conv_in.weight", what).shape[1]),
        channels=[int(_need(sd, f"encoder.down.{i}.block.0.conv1.weight", what).shape[0]) for i in range(levels)],
        layers=layers,
        quant="quant_conv.weight" in sd,
        post_quant="post_quant_conv.weight" in sd,
        mid_attention="encoder.mid.attn_1.q.weight" in sd,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )


def _vae_config_from_diffusers(sd: Mapping[str, torch.Tensor]) -> dict:
    what = "AutoencoderKL"
    levels = _count(sd, r"^encoder\.down_blocks\.(\d+)\.")
    layers = _count(sd, r"^encoder\.down_blocks\.0\.resnets\.(\d+)\.")
    if levels == 0 or layers == 0:
        _need(sd, "encoder.down_blocks.0.resnets.0.conv1.weight", what)
    return _vae_config(
        in_channels=int(_need(sd, "encoder.conv_in.weight", what).shape[1]),
        out_channels=int(_need(sd, "decoder.conv_out.weight", what).shape[0]),
        latent_channels=int(_need(sd, "decoder.conv_in.weight", what).shape[1]),
        channels=[
            int(_need(sd, f"encoder.down_blocks.{i}.resnets.0.conv1.weight", what).shape[0]) for i in range(levels)
        ],
        layers=layers,
        quant="quant_conv.weight" in sd,
        post_quant="post_quant_conv.weight" in sd,
        mid_attention="encoder.mid_block.attentions.0.to_q.weight" in sd,
        scaling_factor=0.13025,
        shift_factor=None,
    )


def _add(out: dict[str, str], d_prefix: str, l_prefix: str, names: Iterable[tuple[str, str]]) -> None:
    for d_name, l_name in names:
        for p in _WB:
            out[f"{d_prefix}.{d_name}.{p}"] = f"{l_prefix}.{l_name}.{p}"


def _resnet(out: dict[str, str], d_prefix: str, l_prefix: str, c_in: int, c_out: int) -> None:
    names = [("norm1", "norm1"), ("conv1", "conv1"), ("norm2", "norm2"), ("conv2", "conv2")]
    if c_in != c_out:  # both sides add the 1x1 shortcut only when the width changes
        names.append(("conv_shortcut", "nin_shortcut"))
    _add(out, d_prefix, l_prefix, names)


def _mid(out: dict[str, str], side: str, width: int, attention: bool) -> None:
    _resnet(out, f"{side}.mid_block.resnets.0", f"{side}.mid.block_1", width, width)
    _resnet(out, f"{side}.mid_block.resnets.1", f"{side}.mid.block_2", width, width)
    if attention:
        _add(out, f"{side}.mid_block.attentions.0", f"{side}.mid.attn_1", _ATTN_NAMES)


def vae_key_map(config: Mapping) -> dict[str, str]:
    """Map every parameter name of ``AutoencoderKL(**config)`` to its LDM name."""
    ch = list(config["block_out_channels"])
    n, layers = len(ch), config.get("layers_per_block", 1)
    attn = config.get("mid_block_add_attention", True)
    out: dict[str, str] = {}
    io = [("conv_in", "conv_in"), ("conv_norm_out", "norm_out"), ("conv_out", "conv_out")]
    _add(out, "encoder", "encoder", io)
    _add(out, "decoder", "decoder", io)
    for i in range(n):
        for j in range(layers):
            c_in = (ch[max(i - 1, 0)] if j == 0 else ch[i])
            _resnet(out, f"encoder.down_blocks.{i}.resnets.{j}", f"encoder.down.{i}.block.{j}", c_in, ch[i])
        if i < n - 1:
            _add(out, f"encoder.down_blocks.{i}.downsamplers.0", f"encoder.down.{i}.downsample", [("conv", "conv")])
    _mid(out, "encoder", ch[-1], attn)
    _mid(out, "decoder", ch[-1], attn)
    rev = list(reversed(ch))
    for i in range(n):
        ldm = n - 1 - i  # LDM numbers decoder levels from the lowest resolution
        for j in range(layers + 1):
            c_in = rev[max(i - 1, 0)] if j == 0 else rev[i]
            _resnet(out, f"decoder.up_blocks.{i}.resnets.{j}", f"decoder.up.{ldm}.block.{j}", c_in, rev[i])
        if i < n - 1:
            _add(out, f"decoder.up_blocks.{i}.upsamplers.0", f"decoder.up.{ldm}.upsample", [("conv", "conv")])
    for name, present in (("quant_conv", config.get("use_quant_conv", True)),
                          ("post_quant_conv", config.get("use_post_quant_conv", True))):
        if present:
            out.update({f"{name}.{p}": f"{name}.{p}" for p in _WB})
    return out


def _is_attn_projection(diffusers_key: str) -> bool:
    return diffusers_key.endswith(_ATTN_PROJ_WEIGHTS)


def ldm_to_diffusers_vae(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LDM VAE state dict (prefix stripped) -> ``AutoencoderKL`` names and shapes."""
    inverse = {ldm: d for d, ldm in vae_key_map(vae_config_from_ldm(sd)).items()}
    out = rename_exact(sd, inverse, what="LDM -> diffusers VAE")
    for key, t in out.items():
        if _is_attn_projection(key) and t.ndim > 2:  # 1x1 conv [C, C, 1(, 1)] -> Linear [C, C]
            out[key] = t.reshape(t.shape[0], t.shape[1])
    return out


def diffusers_to_ldm_vae(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``AutoencoderKL`` state dict -> LDM names and shapes (without prefix)."""
    name_map = vae_key_map(_vae_config_from_diffusers(sd))
    out = rename_exact(sd, name_map, what="diffusers -> LDM VAE")
    for key, t in sd.items():
        if _is_attn_projection(key) and t.ndim == 2:  # Linear [C, C] -> 1x1 conv [C, C, 1, 1]
            out[name_map[key]] = t.reshape(*t.shape, 1, 1)
    return out
