"""Flux.1 transformer tensors read from a file, float8-stored ones widened as they are read.

flux1-dev-fp8 files store the transformer in float8_e4m3fn: the stored number is the value.
ComfyUI's "scaled fp8" files store each linear weight as weight / scale in float8 with its scale
beside it: ``<module>.scale_weight`` (older files, marked by a ``scaled_fp8`` key, with
``scale_input`` beside it) or ``<module>.weight_scale`` (newer ones, with ``input_scale`` and a
``comfy_quant`` tensor holding the layer's format as JSON). Both are widened to bfloat16 one tensor
at a time (the value times its scale for scaled weights; e4m3 values are exact in bfloat16), so
the fp8 file is never in memory beside its widened copy. Where asked (`fp8_scales`), each
float8_e4m3fn weight's scale per row is given beside it (1 for flux1-dev-fp8's), so that an fp8
LoRA base can keep the file's own codes rather than round the widened values again. Input scales
serve fp8 matmuls, which training does not use: they are dropped. Other quantized formats (nvfp4,
int8 with scales) are refused naming the file and the tensor.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from vramfit.formats.safetensors_io import CheckpointError, read_tensors

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
WIDENED = torch.bfloat16
WEIGHT_SCALES = (".scale_weight", ".weight_scale")
INPUT_SCALES = (".scale_input", ".input_scale")
MARKER = "scaled_fp8"  # an empty tensor older ComfyUI files carry to say their weights are scaled
QUANT_CONF = ".comfy_quant"
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")


def _quant_format(tensor: torch.Tensor) -> Optional[str]:
    try:
        return json.loads(bytes(tensor.to(torch.uint8).tolist()).decode("utf-8")).get("format")
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None


def load_widened(path: Path, prefix: str, exclude: tuple[str, ...] = (),
                 fp8_scales: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` (and not under `exclude`), prefix stripped, float8 ones widened
    to bfloat16 (times their scale where the file stores one); scale and marker tensors dropped.
    Read a tensor at a time without a memory map (`read_tensors`): the scales and format records
    first (a few bytes each), then each weight, widened before the next is read. `fp8_scales`,
    where given, receives {name: fp32 scale per row} of each 2-D float8_e4m3fn tensor."""
    def ours(key: str) -> bool:
        return key.startswith(prefix) and not (exclude and key.startswith(exclude))

    small = dict(read_tensors(path, lambda k: ours(k) and k.endswith((*WEIGHT_SCALES, QUANT_CONF))))
    for key, t in small.items():
        if key.endswith(QUANT_CONF):
            fmt = _quant_format(t)
            if fmt not in FP8_FORMATS:
                raise CheckpointError(
                    f"{path}: tensor {key[:-len(QUANT_CONF)]}.weight is stored as "
                    f"{fmt or 'an unknown format'}, a quantized format this version does not read "
                    "(fp8 scaled files are read); use a bf16, fp16 or fp8 file of the model")
    out: dict[str, torch.Tensor] = {}
    for key, t in read_tensors(path, lambda k: ours(k) and not is_stored_extra(k[len(prefix):])):
        name = key[len(prefix):]
        module = key[:-len(".weight")] if name.endswith(".weight") else None
        scale_key = next((module + s for s in WEIGHT_SCALES if module and module + s in small), None)
        if scale_key is not None:
            if t.dtype not in FP8:
                raise CheckpointError(
                    f"{path}: tensor {key} is stored as {str(t.dtype).removeprefix('torch.')} with a "
                    f"scale ({scale_key}), a quantized format this version does not read "
                    "(fp8 scaled files are read); use a bf16, fp16 or fp8 file of the model")
            widened = _scaled(t, small[scale_key], path, key)  # checks the scale's shape
            if fp8_scales is not None and t.dtype == torch.float8_e4m3fn and t.ndim == 2:
                fp8_scales[name] = _row_scale(small[scale_key], t.shape[0])
            t = widened
        elif t.dtype in FP8:
            if fp8_scales is not None and t.dtype == torch.float8_e4m3fn and t.ndim == 2:
                fp8_scales[name] = torch.ones(t.shape[0])
            t = t.to(WIDENED)
        out[name] = t
    return out


def _scaled(weight: torch.Tensor, scale: torch.Tensor, path: Path, key: str) -> torch.Tensor:
    """weight * scale in float32, as bfloat16: one scale for the tensor, or one per output row."""
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return (weight.to(torch.float32) * scale.reshape(())).to(WIDENED)
    if scale.numel() == weight.shape[0]:
        return (weight.to(torch.float32) * scale.reshape(-1, *[1] * (weight.ndim - 1))).to(WIDENED)
    raise CheckpointError(f"{path}: tensor {key} has a scale of shape {list(scale.shape)}, neither one "
                          f"value nor one per row of its {list(weight.shape)}; the file is damaged or "
                          "in a quantized layout this version does not read")


def _row_scale(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A weight's scale (one value, or one per row: `_scaled` has checked it) as fp32, one per row."""
    return scale.to(torch.float32).reshape(-1).expand(rows).clone()


def is_stored_extra(name: str) -> bool:
    """Whether a key (prefix stripped) is one of the scale or marker tensors `load_widened` drops."""
    return name == MARKER or name.endswith((*WEIGHT_SCALES, *INPUT_SCALES, QUANT_CONF))
