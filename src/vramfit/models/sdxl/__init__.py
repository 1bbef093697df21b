"""The SDXL family (SDXL, SSD-1B, Segmind-Vega and other SDXL-shaped UNets): loading and layouts,
SGM key maps, text encoding, the epsilon objective, LoRA formats, tiny models and memory profile."""
from vramfit.models.sdxl.family import SDXLFamily

__all__ = ["SDXLFamily"]
