"""Flux.1's two released variants and what each samples with unless told otherwise.

dev is guidance-distilled: its transformer has a guidance embedding (``guidance_in`` keys) that
takes the guidance scale. schnell is timestep-distilled to a few steps and has none. The numbers
are those of BFL's model cards and diffusers' FluxPipeline examples: dev guidance 3.5, about 28
steps, 512 T5 tokens; schnell guidance 0 (not used), 4 steps, 256 T5 tokens.
"""
from __future__ import annotations

from typing import Mapping

VARIANT_DEFAULTS = {"dev": {"guidance": 3.5, "steps": 28, "t5_tokens": 512},
                    "schnell": {"guidance": 0.0, "steps": 4, "t5_tokens": 256}}


def variant(config: Mapping) -> str:
    """dev (a guidance embedding) or schnell (none), from a transformer config."""
    return "dev" if config.get("guidance_embeds") else "schnell"


def variant_of_keys(keys) -> str:
    """dev or schnell from a single file's keys (BFL's, with or without a prefix)."""
    return "dev" if any(k.endswith("guidance_in.in_layer.weight") for k in keys) else "schnell"


def default_t5_tokens(config: Mapping) -> int:
    """T5 tokens per caption where model.max_sequence_length is not set: the variant's."""
    return VARIANT_DEFAULTS[variant(config)]["t5_tokens"]
