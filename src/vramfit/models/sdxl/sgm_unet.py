"""SGM (generative-models / ComfyUI / A1111) <-> diffusers names for SDXL-family UNets.

A single-file SDXL checkpoint stores its UNet under ``model.diffusion_model.`` in the layout of
Stability's ``sgm`` ``openaimodel.UNetModel``; diffusers' ``UNet2DConditionModel`` holds the same
tensors under other names. This module

* reads the architecture from SGM keys and shapes only (so it works on meta tensors, and on SDXL,
  SSD-1B, Segmind-Vega or any other depth pattern without a table of model names),
* builds one complete diffusers -> SGM name map from a diffusers config, and uses it for both
  directions, so a conversion either accounts for every tensor or fails loudly.

Keys are given without the ``model.diffusion_model.`` prefix. Tensors are passed through untouched
(same objects): the two layouts differ only in names, so conversion costs no memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from vramfit.formats.keys import rename_exact

SGM_UNET_PREFIX = "model.diffusion_model."
_WB = ("weight", "bias")
_HEAD_CHANNELS = 64  # SDXL-family convention: every attention head has 64 channels
_TRANSFORMER_RE = re.compile(r"^(input_blocks\.\d+|output_blocks\.\d+|middle_block)\.1\.transformer_blocks\.(\d+)\.")
_REQUIRED_SGM_KEYS = (
    "input_blocks.0.0.weight",
    "input_blocks.1.0.in_layers.0.weight",
    "time_embed.0.weight",
    "label_emb.0.0.weight",
    "middle_block.0.in_layers.0.weight",
    "out.2.weight",
)


@dataclass(frozen=True)
class _Layout:
    """The part of the architecture that decides key names.

    ``down[l][j]`` / ``up[u][j]``: transformer blocks after resnet ``j`` of a level (0: no attention).
    ``mid``: transformer blocks of the mid attention, or None for a resnet-only mid block (SSD-1B).
    """

    channels: tuple[int, ...]
    layers: int
    down: tuple[tuple[int, ...], ...]
    up: tuple[tuple[int, ...], ...]
    mid: int | None


# ----------------------------------------------------------------------------- config -> layout
def _per_layer(value: int | list[int], n: int, where: str) -> tuple[int, ...]:
    depths = (value,) * n if isinstance(value, int) else tuple(value)
    if len(depths) != n or min(depths) < 1:
        raise ValueError(f"{where}: expected {n} transformer depths >= 1, got {value!r}")
    return depths


def _check_supported(config: Mapping) -> None:
    """Reject config features that add or rename modules this map does not know about."""
    expected = {
        "class_embed_type": None, "encoder_hid_dim_type": None, "time_cond_proj_dim": None,
        "addition_embed_type": "text_time", "attention_type": "default", "dual_cross_attention": False,
        "time_embedding_type": "positional", "num_attention_heads": None,
    }
    for name, want in expected.items():
        if config.get(name, want) != want:
            raise ValueError(f"unet config {name}={config[name]!r} is not an SDXL-family setting ({want!r})")
    if config.get("norm_num_groups", 32) is None:
        raise ValueError("unet config norm_num_groups=None is not an SDXL-family setting")
    if not isinstance(config.get("layers_per_block", 2), int):
        raise ValueError("unet config layers_per_block must be one int for SGM layouts")


def _layout_from_config(config: Mapping) -> _Layout:
    _check_supported(config)
    channels = tuple(config["block_out_channels"])
    n, layers = len(channels), config.get("layers_per_block", 2)
    per_level = config.get("transformer_layers_per_block", 1)
    per_level = [per_level] * n if isinstance(per_level, int) else list(per_level)
    reverse = config.get("reverse_transformer_layers_per_block") or list(reversed(per_level))
    down, up = [], []
    for lvl, kind in enumerate(config["down_block_types"]):
        if kind not in ("DownBlock2D", "CrossAttnDownBlock2D"):
            raise ValueError(f"unet config down block {kind!r} has no SGM layout")
        cross = kind == "CrossAttnDownBlock2D"
        down.append(_per_layer(per_level[lvl], layers, f"down level {lvl}") if cross else (0,) * layers)
    for lvl, kind in enumerate(config["up_block_types"]):
        if kind not in ("UpBlock2D", "CrossAttnUpBlock2D"):
            raise ValueError(f"unet config up block {kind!r} has no SGM layout")
        cross = kind == "CrossAttnUpBlock2D"
        up.append(_per_layer(reverse[lvl], layers + 1, f"up level {lvl}") if cross else (0,) * (layers + 1))
    mid_type = config.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    if mid_type == "UNetMidBlock2DCrossAttn":
        # diffusers gives the single mid transformer the depth of the last down level (first entry).
        mid = _per_layer(per_level[-1], 1, "mid block")[0]
    elif mid_type == "UNetMidBlock2D":
        mid = None
    else:
        raise ValueError(f"unet config mid_block_type {mid_type!r} has no SGM layout")
    if len(down) != n or len(up) != n:
        raise ValueError("unet config: block type lists and block_out_channels differ in length")
    return _Layout(channels, layers, tuple(down), tuple(up), mid)


# ----------------------------------------------------------------------------- layout -> key map
def _resnet_leaves(has_shortcut: bool) -> list[tuple[str, str]]:
    names = [("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb_layers.1"),
             ("norm2", "out_layers.0"), ("conv2", "out_layers.3")]
    if has_shortcut:  # diffusers adds the 1x1 shortcut exactly when in != out channels, as SGM does
        names.append(("conv_shortcut", "skip_connection"))
    return [(f"{d}.{p}", f"{s}.{p}") for d, s in names for p in _WB]


def _transformer_leaves(depth: int) -> list[tuple[str, str]]:
    # SpatialTransformer and Transformer2DModel use identical names below the block prefix.
    leaves = [f"{n}.{p}" for n in ("norm", "proj_in", "proj_out") for p in _WB]
    for b in range(depth):
        blk = f"transformer_blocks.{b}"
        parts = ("norm1", "norm2", "norm3", "attn1.to_out.0", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")
        leaves += [f"{blk}.{n}.{p}" for n in parts for p in _WB]
        leaves += [f"{blk}.attn{a}.to_{x}.weight" for a in (1, 2) for x in "qkv"]
    return [(leaf, leaf) for leaf in leaves]


def _add(out: dict[str, str], diffusers_prefix: str, sgm_prefix: str, leaves: Iterable[tuple[str, str]]) -> None:
    for d_leaf, s_leaf in leaves:
        out[f"{diffusers_prefix}.{d_leaf}"] = f"{sgm_prefix}.{s_leaf}"


def _add_down_blocks(out: dict[str, str], lay: _Layout) -> None:
    idx = 1  # input_blocks.0 is conv_in
    for lvl, depths in enumerate(lay.down):
        c_out, c_in = lay.channels[lvl], lay.channels[max(lvl - 1, 0)]
        for j, depth in enumerate(depths):
            base = f"down_blocks.{lvl}"
            shortcut = (c_in if j == 0 else c_out) != c_out
            _add(out, f"{base}.resnets.{j}", f"input_blocks.{idx}.0", _resnet_leaves(shortcut))
            if depth:
                _add(out, f"{base}.attentions.{j}", f"input_blocks.{idx}.1", _transformer_leaves(depth))
            idx += 1
        if lvl < len(lay.down) - 1:  # the downsampler is an input block of its own
            _add(out, f"down_blocks.{lvl}.downsamplers.0.conv", f"input_blocks.{idx}.0.op", zip(_WB, _WB))
            idx += 1


def _add_up_blocks(out: dict[str, str], lay: _Layout) -> None:
    rev = list(reversed(lay.channels))
    n, idx = len(rev), 0
    for u, depths in enumerate(lay.up):
        c_out, prev, skip_last = rev[u], rev[max(u - 1, 0)], rev[min(u + 1, n - 1)]
        for j, depth in enumerate(depths):
            last = j == len(depths) - 1
            c_in = (prev if j == 0 else c_out) + (skip_last if last else c_out)  # concat with skip
            _add(out, f"up_blocks.{u}.resnets.{j}", f"output_blocks.{idx}.0", _resnet_leaves(c_in != c_out))
            if depth:
                _add(out, f"up_blocks.{u}.attentions.{j}", f"output_blocks.{idx}.1", _transformer_leaves(depth))
            if last and u < n - 1:  # the upsampler sits after the attention, if there is one
                slot = 2 if depth else 1
                _add(out, f"up_blocks.{u}.upsamplers.0.conv", f"output_blocks.{idx}.{slot}.conv", zip(_WB, _WB))
            idx += 1


def unet_key_map(config: Mapping) -> dict[str, str]:
    """Map every parameter name of ``UNet2DConditionModel(**config)`` to its SGM name.

    Built from the config alone (no model is instantiated). Raises ``ValueError`` for configs with
    modules that have no SGM counterpart (class embeddings, encoder_hid_proj, ...).
    """
    lay = _layout_from_config(config)
    same = list(zip(_WB, _WB))
    out: dict[str, str] = {}
    _add(out, "conv_in", "input_blocks.0.0", same)
    _add(out, "time_embedding.linear_1", "time_embed.0", same)
    _add(out, "time_embedding.linear_2", "time_embed.2", same)
    _add(out, "add_embedding.linear_1", "label_emb.0.0", same)
    _add(out, "add_embedding.linear_2", "label_emb.0.2", same)
    _add_down_blocks(out, lay)
    _add(out, "mid_block.resnets.0", "middle_block.0", _resnet_leaves(False))
    if lay.mid is not None:
        _add(out, "mid_block.attentions.0", "middle_block.1", _transformer_leaves(lay.mid))
        _add(out, "mid_block.resnets.1", "middle_block.2", _resnet_leaves(False))
    _add_up_blocks(out, lay)
    _add(out, "conv_norm_out", "out.0", same)
    _add(out, "conv_out", "out.2", same)
    return out


def sgm_to_diffusers_unet(
    sd: Mapping[str, torch.Tensor], config: Mapping, *, strict: bool = True
) -> dict[str, torch.Tensor]:
    """SGM UNet state dict (prefix stripped) -> diffusers names. ``strict=False`` allows a subset."""
    inverse = {s: d for d, s in unet_key_map(config).items()}
    return rename_exact(sd, inverse, what="SGM -> diffusers UNet", strict=strict)


def diffusers_to_sgm_unet(
    sd: Mapping[str, torch.Tensor], config: Mapping, *, strict: bool = True
) -> dict[str, torch.Tensor]:
    """diffusers UNet state dict -> SGM names (without prefix). ``strict=False`` allows a subset."""
    return rename_exact(sd, unet_key_map(config), what="diffusers -> SGM UNet", strict=strict)


# ----------------------------------------------------------------------------- SGM keys -> config
def _need(sd: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in sd:
        hint = ""
        if any(k.startswith(SGM_UNET_PREFIX) for k in sd):
            hint = f" (keys still carry the {SGM_UNET_PREFIX!r} prefix; strip it first)"
        raise ValueError(f"not an SDXL-family SGM UNet state dict: missing key {key!r}{hint}")
    return sd[key]


def _block_indices(keys: Iterable[str], name: str) -> list[int]:
    pattern = re.compile(rf"^{name}\.(\d+)\.")
    return sorted({int(m.group(1)) for k in keys if (m := pattern.match(k))})


def _transformer_depths(keys: Iterable[str]) -> dict[str, int]:
    depths: dict[str, int] = {}
    for k in keys:
        if m := _TRANSFORMER_RE.match(k):
            depths[m.group(1)] = max(depths.get(m.group(1), 0), int(m.group(2)) + 1)
    return depths


def _level_grid(sd: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """Return (levels, resnets per down level) from the input/output block numbering."""
    inputs, outputs = _block_indices(sd, "input_blocks"), _block_indices(sd, "output_blocks")
    ops = [i for i in inputs if f"input_blocks.{i}.0.op.weight" in sd]
    layers = ops[0] - 1 if ops else inputs[-1]
    levels = (inputs[-1] + 1) // (layers + 1)
    want_ops = [(lvl + 1) * (layers + 1) for lvl in range(levels - 1)]
    grid = list(range(levels * (layers + 1)))
    if layers < 1 or inputs != grid or outputs != grid or ops != want_ops:
        raise ValueError(
            f"SGM UNet block numbering is not a regular SDXL-family grid: input_blocks {inputs}, "
            f"output_blocks {outputs}, downsamplers at {ops}"
        )
    return levels, layers


def _layout_from_sgm(sd: Mapping[str, torch.Tensor]) -> _Layout:
    for key in _REQUIRED_SGM_KEYS:
        _need(sd, key)
    levels, layers = _level_grid(sd)
    first_in = [1 + lvl * (layers + 1) for lvl in range(levels)]  # input block of each level's resnet 0
    channels = tuple(int(_need(sd, f"input_blocks.{i}.0.out_layers.3.weight").shape[0]) for i in first_in)
    depths = _transformer_depths(sd)
    down = tuple(tuple(depths.get(f"input_blocks.{i + j}", 0) for j in range(layers)) for i in first_in)
    up = tuple(
        tuple(depths.get(f"output_blocks.{u * (layers + 1) + j}", 0) for j in range(layers + 1)) for u in range(levels)
    )
    for where, level in [*(("input", d) for d in down), *(("output", u) for u in up)]:
        if 0 in level and any(level):
            raise ValueError(f"SGM UNet has {where} blocks with and without attention in one level: {level}")
    mid = None
    if any(k.startswith("middle_block.1.") for k in sd):
        _need(sd, "middle_block.2.in_layers.0.weight")
        mid = depths.get("middle_block", 0)
    return _Layout(channels, layers, down, up, mid)


def _depth_fields(lay: _Layout) -> tuple[list, list | None]:
    """(transformer_layers_per_block, reverse_transformer_layers_per_block) as diffusers wants them."""
    uniform = all(len(set(d)) == 1 for d in lay.down)
    mirrored = uniform and all(
        up == (lay.down[len(lay.down) - 1 - u][0],) * (lay.layers + 1) for u, up in enumerate(lay.up)
    )
    if mirrored:
        # Levels without attention get 1: DownBlock2D ignores it and it matches published configs.
        return [d[0] or 1 for d in lay.down], None
    return [list(d) if d[0] else 1 for d in lay.down], [list(u) if u[0] else 1 for u in lay.up]


def _base_unet_config() -> dict:
    """Every field of the published SDXL base UNet config that is not read from the weights."""
    return {
        "act_fn": "silu", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
        "addition_time_embed_dim": 256, "attention_type": "default", "center_input_sample": False,
        "class_embed_type": None, "class_embeddings_concat": False, "conv_in_kernel": 3, "conv_out_kernel": 3,
        "cross_attention_norm": None, "downsample_padding": 1, "dropout": 0.0, "dual_cross_attention": False,
        "encoder_hid_dim": None, "encoder_hid_dim_type": None, "flip_sin_to_cos": True, "freq_shift": 0,
        "mid_block_only_cross_attention": None, "mid_block_scale_factor": 1, "norm_eps": 1e-05,
        "norm_num_groups": 32, "num_attention_heads": None, "num_class_embeds": None,
        "only_cross_attention": False, "resnet_out_scale_factor": 1.0, "resnet_skip_time_act": False,
        "resnet_time_scale_shift": "default", "sample_size": 128, "time_cond_proj_dim": None,
        "time_embedding_act_fn": None, "time_embedding_dim": None, "time_embedding_type": "positional",
        "timestep_post_act": None, "upcast_attention": None,
    }


_GROUP_NORM_RE = re.compile(
    r"^((input|output)_blocks\.\d+\.0\.(in|out)_layers\.0|middle_block\.[02]\.(in|out)_layers\.0"
    r"|(input_blocks|output_blocks)\.\d+\.1\.norm|middle_block\.1\.norm|out\.0)\.weight$")
TIME_IDS = 6  # SDXL's size conditioning: original size, crop corner, target size


def check_group_norms(sd: Mapping[str, torch.Tensor], groups: int) -> None:
    """Raise ValueError naming the first GroupNorm whose channel count ``groups`` does not divide.

    The group count is not stored in a single file (a GroupNorm's weights are per channel), so it is
    taken from the config (SDXL's 32); a file that cannot have been trained with it is refused here
    rather than failing inside diffusers."""
    for key in sorted(sd):
        if _GROUP_NORM_RE.match(key) and int(sd[key].shape[0]) % groups:
            raise ValueError(
                f"{key} normalises {int(sd[key].shape[0])} channels, which {groups} group-norm groups "
                f"(SDXL's count; single files do not store it) do not divide: this UNet was built with "
                f"another group count, which vramfit cannot read from the file")


def text_time_dim(label_width: int, pooled_dim: int) -> int:
    """``addition_time_embed_dim`` from the size-embedding input width (label_emb.0.0's inputs =
    pooled text embedding + 6 size numbers x addition_time_embed_dim); ValueError if no whole
    width fits."""
    rest = label_width - pooled_dim
    if rest <= 0 or rest % TIME_IDS:
        raise ValueError(
            f"label_emb.0.0.weight takes {label_width} inputs; with the {pooled_dim}-wide pooled text "
            f"embedding of the second text encoder that leaves {rest} for the {TIME_IDS} size numbers, "
            f"not a whole positive width for each (SDXL: 2816 = 1280 + 6 x 256)")
    return rest // TIME_IDS


def check_text_time(config: Mapping, pooled_dim: int | None) -> None:
    """Raise ValueError when a diffusers UNet config's size embedding does not fit SDXL's
    conditioning: projection_class_embeddings_input_dim = pooled + 6 x addition_time_embed_dim."""
    if config.get("addition_embed_type") != "text_time" or not isinstance(pooled_dim, int):
        raise ValueError("not an SDXL-family UNet config (addition_embed_type 'text_time' with a "
                         "projection_dim on text_encoder_2)")
    width = config.get("projection_class_embeddings_input_dim")
    time_dim = config.get("addition_time_embed_dim")
    if not isinstance(width, int) or text_time_dim(width, pooled_dim) != time_dim:
        raise ValueError(f"projection_class_embeddings_input_dim {width} is not text_encoder_2's "
                         f"projection_dim {pooled_dim} + {TIME_IDS} x addition_time_embed_dim {time_dim}")


def unet_config_from_sgm(sd: Mapping[str, torch.Tensor], pooled_dim: int | None = None) -> dict:
    """Full ``UNet2DConditionModel`` config read from SGM UNet keys and shapes (prefix stripped).

    Reproduces the published SDXL config, the SSD-1B config (asymmetric depths, resnet-only mid
    block) and Segmind-Vega. Raises ``ValueError`` naming a missing key for non-SDXL-family dicts.
    ``pooled_dim`` (the second text encoder's projection width) gives ``addition_time_embed_dim``
    from the size-embedding width; without it SDXL's 256 is assumed. The group-norm count is SDXL's
    32 (not stored in the file), checked against every normalised channel count.
    """
    lay = _layout_from_sgm(sd)
    per_level, reverse = _depth_fields(lay)
    if lay.mid is not None:
        last = per_level[-1] if isinstance(per_level[-1], int) else per_level[-1][0]
        if lay.mid != last:  # diffusers cannot give the mid block its own depth
            raise ValueError(f"middle_block.1 has {lay.mid} transformer blocks; diffusers would build {last}")
    conv_in = _need(sd, "input_blocks.0.0.weight")
    attn2_k = next((sd[k] for k in sd if k.endswith(".attn2.to_k.weight")), None)
    proj_in = next((sd[k] for k in sd if k.endswith(".proj_in.weight")), None)
    if attn2_k is None or proj_in is None:
        raise ValueError("not an SDXL-family SGM UNet state dict: no cross-attention (missing '*.attn2.to_k.weight')")
    cfg = _base_unet_config()
    cfg.update(
        in_channels=int(conv_in.shape[1]),
        out_channels=int(_need(sd, "out.2.weight").shape[0]),
        block_out_channels=list(lay.channels),
        layers_per_block=lay.layers,
        down_block_types=["CrossAttnDownBlock2D" if d[0] else "DownBlock2D" for d in lay.down],
        up_block_types=["CrossAttnUpBlock2D" if u[0] else "UpBlock2D" for u in lay.up],
        mid_block_type="UNetMidBlock2D" if lay.mid is None else "UNetMidBlock2DCrossAttn",
        transformer_layers_per_block=per_level,
        reverse_transformer_layers_per_block=reverse,
        attention_head_dim=[max(1, c // _HEAD_CHANNELS) for c in lay.channels],
        cross_attention_dim=int(attn2_k.shape[1]),
        use_linear_projection=proj_in.ndim == 2,
        projection_class_embeddings_input_dim=int(_need(sd, "label_emb.0.0.weight").shape[1]),
        conv_in_kernel=int(conv_in.shape[-1]),
        conv_out_kernel=int(sd["out.2.weight"].shape[-1]),
    )
    time_dim = int(_need(sd, "time_embed.0.weight").shape[0])
    if time_dim != 4 * lay.channels[0]:
        cfg["time_embedding_dim"] = time_dim
    if pooled_dim is not None:
        width = cfg["projection_class_embeddings_input_dim"]
        cfg["addition_time_embed_dim"] = text_time_dim(width, pooled_dim)
    check_group_norms(sd, cfg["norm_num_groups"])
    return cfg
