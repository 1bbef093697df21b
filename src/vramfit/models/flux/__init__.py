"""The Flux.1 family: loading and layouts, BFL key maps, text encoding with CLIP-L and T5, the
rectified-flow objective with Flux's shift and latent packing, LoRA format, tiny model and memory
profile."""
from vramfit.models.flux.family import FluxFamily

__all__ = ["FluxFamily"]
