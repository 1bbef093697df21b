"""The Flux family's memory profile: the planner's activation model of the transformer and the fit
probe's synthetic batch.

Counted, not measured: the element counts below are the model's own (tokens times width at each
block's input); the bytes per element the planner gives them (fit/calibration.json, "flux") come
from counts on the meta device (bench/count_train_memory.py, bench/count_sample_memory.py): the
full-bf16 block's and the sampling's as counted, the recompute's, autocast's and a LoRA's scaled
by SD3-M's fitted over counted figure. No Flux.1 run has been measured on a GPU: they stay
estimates until one fits them.
"""
from __future__ import annotations

import torch

from vramfit.models.adapter import ActivationShape
from vramfit.models.flux.variants import default_t5_tokens


def flux_activations(config: dict, latent_h: int, latent_w: int, t5_tokens: int) -> ActivationShape:
    """Each double-stream and single-stream block is checkpointed; its inputs are the image
    tokens (2x2 latent patches) and the T5 tokens, `inner` wide, and the conditioning vector."""
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    tokens = (latent_h // 2) * (latent_w // 2) + t5_tokens
    layers = int(config["num_layers"]) + int(config["num_single_layers"])
    per_block = tokens * inner
    return ActivationShape(saved=layers * (per_block + inner), work=per_block, resnet_inputs=0,
                           blocks=[("block", per_block)] * layers, fixed=layers * inner)


def flux_batch(config: dict, batch: int, side: tuple[int, int], cfg) -> dict[str, torch.Tensor]:
    """The fit probe's batch of `batch` items of `side` (width, height): a cached batch's shapes
    (16-channel latent distribution, T5 states of model.max_sequence_length tokens, else the
    variant's default, CLIP-L's pooled vector) for the transformer `config`."""
    w, h = side
    channels = int(config["in_channels"]) // 4  # packed 2x2
    return {"mean": torch.zeros(batch, channels, h // 8, w // 8),
            "logvar": torch.full((batch, channels, h // 8, w // 8), -10.0),
            "prompt_embeds": torch.zeros(batch, cfg.model.max_sequence_length or default_t5_tokens(config),
                                         config["joint_attention_dim"]),
            "pooled": torch.zeros(batch, config["pooled_projection_dim"])}
