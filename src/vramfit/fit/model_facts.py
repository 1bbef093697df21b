"""What the memory planner knows about a model, read without loading any weights.

From a checkpoint's safetensors header(s) (a single file, each component folder of a diffusers
folder, or the tiny:* file): the family, the denoiser's config (the denoiser is rebuilt on the
meta device, so every parameter, buffer and nn.Linear is known exactly), the VAE's parameter
count and tile side, and per text encoder its size, stored dtype and projection weights.
`facts_for_layout` gives the same for a released layout from the shipped configs (the names each
family lists in `shipped_layouts`), for planning before the checkpoint is downloaded.
Also the exact bytes of a quantized linear, an optimizer's state and an encoder on the GPU.
Cost: header reads and one meta-device construction (about a second for SDXL's UNet).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from vramfit.config.schema import MemoryConfig, ModelConfig, RunConfig
from vramfit.formats.ldm_vae import vae_config_from_ldm
from vramfit.formats.safetensors_io import meta_tensors, read_header
from vramfit.memory.encoder_stream import WINDOW
from vramfit.memory.quantize import NF4_BLOCK
from vramfit.memory.vae_tiling import vae_tile
from vramfit.models.parts import encoder_file_prefix, shipped_config
from vramfit.models.registry import FAMILIES, detect_family
from vramfit.models.sources import resolve_source
from vramfit.optim.adamw import BLOCK as ADAM8_BLOCK, QUANTIZED_MIN_NUMEL as ADAM8_MIN_NUMEL


# ---- what the checkpoint holds -------------------------------------------------------------------

@dataclass
class EncoderFacts:
    """One text encoder as its header describes it."""

    name: str
    kind: str  # "clip" | "t5"
    params: int
    stored_bytes: int  # as stored in the file
    linear_numel: int  # elements of its 2-D projection weights (what quantization stores)
    linear_rows: int  # their output rows (one scale each)
    largest_linear: int
    layers: int
    hidden: int
    embedding_numel: int = 0  # the token table (tied copies counted once)


@dataclass
class ModelFacts:
    """What the planner knows about a model: its family, the denoiser on the meta device, the
    VAE's size and each text encoder's."""

    family: str
    config: dict
    denoiser: torch.nn.Module  # meta device, float32
    vae_params: int
    vae_tile: int  # the side in pixels of the tiles cache.vae_tiling encodes (memory/vae_tiling.py `vae_tile`)
    encoders: list[EncoderFacts] = field(default_factory=list)
    layout: str = ""  # the shipped layout the facts were built from, without a checkpoint; "" when read
    # bytes of the denoiser as loaded into CPU memory (fit/host.py): a single file's as stored (float8
    # widened to bf16), a diffusers folder's in fp32 (from_pretrained); 0 unknown (a shipped layout)
    loaded_bytes: int = 0
    # a single file's largest tensors (fit/host.py, saving one a tensor at a time): the denoiser's in
    # values as the file holds it (q/k/v joined where the layout joins them), the other parts' in
    # bytes as stored; 0 where the source is not a single file
    largest_denoiser_values: int = 0
    largest_part_bytes: int = 0
    vae_stored_bytes: int = 0  # a diffusers folder's VAE as its files store it; 0 where not read


_ELEMENT_SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                 "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
_NOT_LINEAR = ("embed", "shared", "relative_attention_bias", "position")


def encoder_facts(name: str, kind: str, header: dict, prefix: str = "") -> Optional[EncoderFacts]:
    """Sizes of one encoder from the header entries under `prefix`; None when it is absent."""
    entries = {k[len(prefix):]: v for k, v in header.items()
               if k.startswith(prefix) and not k.endswith("position_ids")}  # an int buffer, rebuilt
    if not entries:
        return None
    if "shared.weight" in entries:  # T5's token table, tied: files may carry it under both names
        entries.pop("encoder.embed_tokens.weight", None)
    params = stored = linear = rows = largest = hidden = embedding = 0
    layers: set[str] = set()
    for key, info in entries.items():
        n = math.prod(info["shape"])
        params += n
        stored += n * _ELEMENT_SIZE.get(info["dtype"], 4)
        parts = key.split(".")
        for marker in ("layers", "block", "resblocks"):
            if marker in parts and parts.index(marker) + 1 < len(parts):
                layers.add(parts[parts.index(marker) + 1])
        if len(info["shape"]) == 2 and key.endswith("weight") and not any(m in key for m in _NOT_LINEAR):
            linear += n
            rows += info["shape"][0]
            largest = max(largest, n)
        if any(m in key for m in ("token_embedding.weight", "shared.weight", "embed_tokens.weight")):
            hidden = info["shape"][1]
            embedding = max(embedding, n)
    return EncoderFacts(name, kind, params, stored, linear, rows, largest, len(layers), hidden, embedding)


def _headers(folder: Path) -> dict:
    merged: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        merged.update(read_header(f)[0])
    return merged


def _own_file_facts(name: str, kind: str, path: Path, prefix: str) -> Optional[EncoderFacts]:
    """An encoder's sizes from a file of its own, read as models/parts.py reads it."""
    header = read_header(path)[0]
    found = encoder_file_prefix(header, prefix)
    return None if found is None else encoder_facts(name, kind, header, found)


def read_facts(cfg: RunConfig, cache_root: Optional[Path] = None) -> ModelFacts:
    """Everything the planner needs from cfg.model, from headers and configs only."""
    source = resolve_source(cfg.model, cache_root)
    family = detect_family(source, cfg.model.family)
    files = family.files  # where its parts are in single files and diffusers folders
    encoders: list[EncoderFacts] = []
    if source.kind == "single_file":
        header, meta = read_header(source.path)
        # a denoiser-only file (BFL's flux1-dev) keeps its keys bare
        prefix = files.denoiser_prefix if any(k.startswith(files.denoiser_prefix) for k in header) else ""
        config = family.denoiser_config(meta_tensors(header, prefix))
        loaded = sum(math.prod(v["shape"]) * max(_ELEMENT_SIZE.get(v["dtype"], 4), 2)
                     for k, v in header.items() if k.startswith(prefix) and v["dtype"] in _FLOATS)
        own = family.encoder_files(source, header, meta)  # parts kept in files of their own
        found = [_own_file_facts(n, kind, own[part], prefix) if part in own
                 else encoder_facts(n, kind, header, prefix) for n, prefix, _, kind, part in files.encoders]
        vae_header, vae_prefix = header, files.vae_prefix
        if "vae" in own:  # BFL's ae.safetensors: bare LDM keys, or the single file's prefix
            vae_header = read_header(own["vae"])[0]
            vae_prefix = files.vae_prefix if any(k.startswith(files.vae_prefix) for k in vae_header) else ""
        vae_params = sum(math.prod(v["shape"]) for k, v in vae_header.items() if k.startswith(vae_prefix))
        vae_stored = 0  # copied a tensor at a time when saved
        sizes = {k: (math.prod(v["shape"]), _ELEMENT_SIZE.get(v["dtype"], 4)) for k, v in header.items()}
        largest = (max((n for k, (n, _) in sizes.items() if k.startswith(prefix)), default=0),
                   max((n * item for k, (n, item) in sizes.items() if not k.startswith(prefix)), default=0))
        # the VAE is built from its keys as the family loads it (formats/ldm_vae.py)
        vae_keys = meta_tensors(vae_header, vae_prefix)
        tile = vae_tile(vae_config_from_ldm(vae_keys)["sample_size"] if vae_keys else 1024)
    else:
        config = json.loads((source.path / files.denoiser_folder / "config.json").read_text())
        loaded = 0  # fp32, counted from the model below
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        vae_header = _headers(source.path / "vae")
        vae_params = sum(math.prod(v["shape"]) for v in vae_header.values())
        vae_stored = sum(math.prod(v["shape"]) * _ELEMENT_SIZE.get(v["dtype"], 4) for v in vae_header.values())
        vae_cfg = source.path / "vae" / "config.json"
        sample_size = json.loads(vae_cfg.read_text()).get("sample_size", 1024) if vae_cfg.is_file() else 1024
        tile = vae_tile(sample_size)
        found = [encoder_facts(n, kind, _headers(source.path / sub)) if (source.path / sub).is_dir() else None
                 for n, _, sub, kind, _ in files.encoders]
        largest = (0, 0)
    encoders = [e for e in found if e is not None]
    cls = family.denoiser_class()
    with torch.device("meta"):
        denoiser = cls.from_config(config)
    loaded = loaded or 4 * sum(p.numel() for p in denoiser.parameters())
    return ModelFacts(family.name, dict(denoiser.config), denoiser, vae_params, tile, encoders,
                      loaded_bytes=loaded, largest_denoiser_values=largest[0], largest_part_bytes=largest[1],
                      vae_stored_bytes=vae_stored)


# ---- bytes of what vramfit allocates, exactly -------------------------------------------------------

def quantized_linear_bytes(out_features: int, in_features: int, method: str) -> Optional[int]:
    """Bytes of one frozen linear weight stored by memory/quantize.py (torchao layouts); None
    when the shape cannot be quantized (nf4 needs whole blocks of 64)."""
    n = out_features * in_features
    if method == "int8":  # int8 values, an fp32 scale and an int8 zero point per row
        return n + 5 * out_features
    if method == "fp8":  # e4m3 values and an fp32 scale per row
        return n + 4 * out_features
    if n % NF4_BLOCK:
        return None
    blocks = n // NF4_BLOCK  # 4-bit codes, an int8 absmax per block, bf16 factors per group of them
    return n // 2 + blocks + 2 * (blocks // math.gcd(blocks, 256)) + 2 + 32


def state_bytes(optimizer: str, numel: int, shape: tuple, dtype_bytes: int) -> int:
    """Optimizer state of one trained tensor, exactly as optim/ allocates it."""
    if optimizer == "adafactor":  # fp32; a matrix (conv kernels as [out, rest]) keeps a row and a column
        if len(shape) >= 2:
            return 4 * (shape[0] + math.prod(shape[1:]))
        return 4 * numel
    if optimizer == "adamw8bit" and numel >= ADAM8_MIN_NUMEL and numel % ADAM8_BLOCK == 0:
        return 2 * (numel + 4 * (numel // ADAM8_BLOCK) + 4 * 256)  # codes, block scales, the 256-entry map
    return 2 * numel * dtype_bytes  # AdamW: two moments in the parameter's dtype


def encoder_bytes(enc: EncoderFacts, t5_precision: str) -> tuple[int, int]:
    """(bytes on the GPU, bytes of its widened largest linear while it runs)."""
    stored = max(enc.stored_bytes, 2 * enc.params) if enc.kind == "t5" else enc.stored_bytes  # fp8 T5 is widened
    if enc.kind != "t5" or t5_precision == "bf16":
        return (2 * enc.params if enc.kind == "t5" else stored), 0
    rest = 2 * (enc.params - enc.linear_numel)
    linear = {"int8": enc.linear_numel + 5 * enc.linear_rows, "fp8": enc.linear_numel + 4 * enc.linear_rows,
              # torchao's NF4 (memory/quantize.py): 4-bit codes, an int8 absmax per block of 64 and
              # bf16 factors per group of 256 blocks (quantized_linear_bytes, summed over the linears)
              "nf4": enc.linear_numel // 2 + enc.linear_numel // NF4_BLOCK + enc.linear_numel // 8192}[t5_precision]
    return rest + linear, 2 * enc.largest_linear



# T5 v1.1 XXL, the encoder of SD3's `t5xxl` files (model-facts.md: 4,762,310,656 parameters)
T5_XXL = {"d_ff": 10240, "d_kv": 64, "d_model": 4096, "feed_forward_proj": "gated-gelu", "num_heads": 64,
          "num_layers": 24, "vocab_size": 32128, "is_encoder_decoder": False, "tie_word_embeddings": False}


class UnknownLayout(ValueError):
    """A layout name no family ships; the message lists the known ones."""


def caches_frozen_text(facts: ModelFacts, cfg: RunConfig) -> bool:
    """Whether the caption phase caches only the outputs of the encoders that never train (T5)
    while the CLIP encoders train (train/data.py TrainingData's "frozen text")."""
    return (cfg.text_encoder_training is not None and not cfg.cache.text and cfg.model.t5_precision != "none"
            and any(e.kind == "t5" for e in facts.encoders))


def weight_item_bytes(cfg: RunConfig) -> int:
    """Bytes a value of the denoiser's weights as training holds them (and a sample grid's models):
    bf16 under full_bf16, fp32 otherwise."""
    return 2 if cfg.train.precision == "full_bf16" else 4


def sampled_encoder_bytes(enc: EncoderFacts, t5_precision: str, item: int) -> int:
    """An encoder's bytes while a sample grid encodes: the CLIPs cast to the grid's dtype (`item`
    bytes a value); T5 as the grid reloads it, stored as model.t5_precision asks while it loads
    (train/samples.py), its other weights in bf16: no cast."""
    if enc.kind != "t5":
        return item * enc.params
    return encoder_bytes(enc, t5_precision)[0]


def shipped_layouts() -> dict[str, tuple[str, tuple]]:
    """{name: (family, (denoiser, VAE, encoder configs))} of every family's shipped layouts."""
    return {name: (family, parts) for family, fam in FAMILIES.items()
            for name, parts in fam.shipped_layouts.items()}


def facts_for_layout(layout: str, *, t5: bool = True) -> ModelFacts:
    """ModelFacts of a released layout from the shipped configs, as the single files store it
    (CLIPs fp16, T5 fp8; `t5=False`: a file without T5), for planning without the checkpoint at
    hand (`vramfit plan --model`, tests, bench/plan_check.py). Every model is built on the meta
    device: no weights are read or allocated. Built once per layout and shared (read-only): a
    second call costs nothing, where building takes about a second."""
    known = shipped_layouts()
    aliases = {alias: name for family in FAMILIES.values() for alias, name in family.shipped_aliases.items()}
    if aliases.get(layout, layout) not in known:
        raise UnknownLayout(f"unknown model architecture {layout!r}; the shipped ones are {', '.join(known)} "
                            "(or give model.path: a checkpoint, a diffusers folder or a repo id)")
    return _layout_facts(aliases.get(layout, layout), t5)


@functools.lru_cache(maxsize=None)
def _layout_facts(layout: str, t5: bool) -> ModelFacts:
    # heavy: diffusers/transformers classes (~2 s); `vramfit plan` reads a model's facts from headers
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    family, (denoiser_cfg, vae_cfg, encoder_cfgs) = shipped_layouts()[layout]
    names = [row[0] for row in FAMILIES[family].files.encoders]  # as read_facts names them
    with torch.device("meta"):
        denoiser = FAMILIES[family].denoiser_class()(**shipped_config(denoiser_cfg))
        vae = AutoencoderKL(**shipped_config(vae_cfg))
        models = []
        for name, enc in zip(names, encoder_cfgs):
            if enc == "t5xxl":
                if t5:
                    models.append((name, "t5", "F8_E4M3", T5EncoderModel(T5Config(**T5_XXL))))
            else:
                clip = CLIPTextModelWithProjection(CLIPTextConfig(**shipped_config(enc)))
                models.append((name, "clip", "F16", clip))
    encoders = []
    for name, kind, dtype, model in models:
        header = {k: {"dtype": dtype, "shape": list(v.shape)} for k, v in model.state_dict().items()
                  if k != "encoder.embed_tokens.weight"}
        encoders.append(encoder_facts(name, kind, header))
    return ModelFacts(family, dict(denoiser.config), denoiser, sum(p.numel() for p in vae.parameters()),
                      vae_tile(vae.config.sample_size), encoders, layout=layout)


def encoder_device_bytes(enc, model: ModelConfig, memory: MemoryConfig, window: int = WINDOW) -> tuple[int, int]:
    """(bytes of the encoder `enc` (EncoderFacts) on the device while it encodes (as
    memory/encoder_stream.py runs it), bytes of its widened largest linear when quantized), for the planner. Whole: all
    of it but T5's token table (encoder_on keeps that in CPU memory). With
    memory.stream_encoders: the resident part and `window` layers; every tensor that is not a
    linear weight (embeddings, norms, biases) is counted as resident, a small overestimate."""
    whole, widened = encoder_bytes(enc, model.t5_precision)
    if not memory.stream_encoders or enc.layers == 0:
        if enc.kind == "t5":  # its token table stays in CPU memory (HostLookup), bf16 as T5 runs
            whole -= 2 * enc.embedding_numel
        return whole, widened
    per_element = 2 if enc.kind == "t5" else enc.stored_bytes / max(enc.params, 1)  # T5 is widened to bf16
    resident = int(per_element * (enc.params - enc.linear_numel))
    layer = (whole - resident) // enc.layers
    return resident + min(window, enc.layers) * layer, widened
