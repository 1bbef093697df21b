"""The SD3 family's memory profile: the planner's activation model of an MMDiT and the fit probe's
synthetic batch. The fitted constants per element (fit/calibration.json, under the family's name)
turn the model's element counts into bytes (fit/planner.py).
"""
from __future__ import annotations

import torch

from vramfit.models.adapter import ActivationShape


def mmdit_activations(config: dict, latent_h: int, latent_w: int, t5_tokens: int) -> ActivationShape:
    """SD3's MMDiT: each joint block is checkpointed; its inputs are the image tokens, the text
    tokens and the conditioning vector, all `caption_projection_dim` wide."""
    width = int(config["caption_projection_dim"])
    patch = int(config["patch_size"])
    tokens = (latent_h // patch) * (latent_w // patch) + 77 + t5_tokens  # CLIP's 77, then T5's (or zeros)
    layers = int(config["num_layers"])
    per_block = tokens * width
    return ActivationShape(saved=layers * (per_block + width), work=per_block, resnet_inputs=0,
                           blocks=[("block", per_block)] * layers,
                           fixed=layers * width)


def mmdit_batch(config: dict, batch: int, side: tuple[int, int], cfg) -> dict[str, torch.Tensor]:
    """The fit probe's batch of `batch` items of `side` (width, height): the shapes of a cached
    batch (latent distribution, CLIP and T5 states of model.max_sequence_length tokens, pooled
    vector) for the transformer `config`."""
    w, h = side
    return {"mean": torch.zeros(batch, config["in_channels"], h // 8, w // 8),
            "logvar": torch.full((batch, config["in_channels"], h // 8, w // 8), -10.0),
            "prompt_embeds": torch.zeros(batch, 77 + (cfg.model.max_sequence_length or 77),  # SD3's default
                                         config["joint_attention_dim"]),
            "pooled": torch.zeros(batch, config["pooled_projection_dim"])}
