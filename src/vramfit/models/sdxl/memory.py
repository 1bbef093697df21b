"""The SDXL family's memory profile: the planner's activation model of an SDXL-family UNet and the
fit probe's synthetic batch. The fitted constants per element (fit/calibration.json, under the
family's name) turn the model's element counts into bytes (fit/planner.py).
"""
from __future__ import annotations

import torch

from vramfit.models.adapter import ActivationShape


def _per_layer(value, level: int, layers: int) -> list[int]:
    v = value[level] if isinstance(value, (list, tuple)) else value
    return list(v) if isinstance(v, (list, tuple)) else [int(v)] * layers


def unet_activations(config: dict, latent_h: int, latent_w: int, t5_tokens: int) -> ActivationShape:
    """The SDXL-family UNet: each resnet and transformer block is checkpointed (diffusers);
    per Transformer2DModel its norm, proj_in and proj_out save about 3 more inputs. Its text
    states (77 tokens, one shared tensor) are negligible; `t5_tokens` does not apply."""
    chans = list(config["block_out_channels"])
    lpb = int(config["layers_per_block"])
    down_types = config["down_block_types"]
    depths = config["transformer_layers_per_block"]
    reverse = config.get("reverse_transformer_layers_per_block")
    px = latent_h * latent_w
    out = ActivationShape()

    def add(kind: str, channels: int, level: int, depth: int = 0, checked: bool = True) -> None:
        elems = channels * px // 4**level
        if kind == "resnet":
            out.saved += elems
            out.resnet_inputs += elems
            out.work = max(out.work, elems)
            if checked:
                out.blocks.append(("resnet", elems))
            else:  # a resnet the model calls without its checkpointing function
                out.unchecked += elems
        elif depth:
            out.saved += (depth + 3) * elems  # the text states are one shared tensor
            out.work = max(out.work, elems)
            out.blocks += [("block", elems)] * depth
            out.fixed += 3 * elems
        else:  # a down/upsampler's conv input
            out.saved += elems
            out.fixed += elems
    for level, ch in enumerate(chans):
        attn = down_types[level].startswith("CrossAttn")
        for i, d in enumerate(_per_layer(depths, level, lpb)):
            add("resnet", chans[level - 1] if i == 0 and level else ch, level)
            if attn:
                add("block", ch, level, d)
        if level < len(chans) - 1:
            add("sampler", ch, level)
    top = len(chans) - 1
    # the mid block's first resnet runs without checkpointing; a cross-attention mid block then has
    # a (transformer, resnet) pair, checkpointed; SSD-1B's plain one (no layers) nothing more
    add("resnet", chans[top], top, checked=False)
    if config.get("mid_block_type") == "UNetMidBlock2DCrossAttn":
        add("block", chans[top], top, _per_layer(depths, top, 1)[-1])
        add("resnet", chans[top], top)
    prev = chans[top]
    for j, level in enumerate(reversed(range(len(chans)))):
        ch, below = chans[level], chans[max(level - 1, 0)]
        attn = config["up_block_types"][j].startswith("CrossAttn")
        layer_depths = (_per_layer(reverse, j, lpb + 1) if reverse else
                        list(reversed(_per_layer(depths, level, lpb))) + [_per_layer(depths, level, lpb)[0]])
        for k, d in enumerate(layer_depths[:lpb + 1]):
            # the skip connection is concatenated on: the level's own outputs, the last one the level below's
            add("resnet", (prev if k == 0 else ch) + (below if k == lpb else ch), level)
            if attn:
                add("block", ch, level, d)
        prev = ch
        if level > 0:
            add("sampler", 4 * ch, level)  # the conv after the 2x upsample sees 4x the pixels
    return out


def unet_batch(config: dict, batch: int, side: tuple[int, int], cfg) -> dict[str, torch.Tensor]:
    """The fit probe's batch of `batch` items of `side` (width, height): the shapes of a cached
    batch (latent distribution, CLIP states, pooled vector, size conditioning) for the UNet `config`."""
    w, h = side
    pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
    return {"mean": torch.zeros(batch, config["in_channels"], h // 8, w // 8),
            "logvar": torch.full((batch, config["in_channels"], h // 8, w // 8), -10.0),
            "prompt_embeds": torch.zeros(batch, 77, config["cross_attention_dim"]),
            "pooled": torch.zeros(batch, pooled),
            "time_ids": torch.tensor([[h, w, 0, 0, h, w]] * batch, dtype=torch.float32)}
