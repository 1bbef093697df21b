"""The Stable Diffusion 3 family (SD3 and SD3.5 MMDiTs): loading and layouts, SAI key maps, text
encoding with T5, the rectified-flow objective, LoRA format, tiny model and memory profile."""
from vramfit.models.sd3.family import SD3Family

__all__ = ["SD3Family"]
