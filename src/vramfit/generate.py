"""Image generation: render prompts from a model (with any number of LoRAs), compare base vs fine-tuned.

The pipeline is the family's real diffusers pipeline (StableDiffusionXLPipeline,
StableDiffusion3Pipeline) built from the parts it loaded (nothing is downloaded). Every image has
its own CPU-seeded generator (seed + image index), so an image depends only on its prompt, seed and
settings: the same command gives the same pixels, and `--compare` renders the base model on exactly
the seeds of the fine-tuned images (`--compare --base B` renders another model B on them instead).
Memory stays low by default: on CUDA the models go to the GPU one at a time (diffusers' model CPU
offload), each prompt is encoded once, and images are rendered one by one. Width and height default
to the model's own size, so a tiny test model renders at its small size in seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import re
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from PIL import Image, ImageDraw, ImageFont
from PIL.PngImagePlugin import PngInfo
from safetensors.torch import load_file
from tqdm.auto import tqdm

from vramfit.config.load import cuda_problem, default_cache_root, folder_problem
from vramfit.config.schema import (
    DEVICE_CHOICES, DEVICE_PATTERN, ModelConfig, SkipLayerGuidance, skip_layer_problems,
)
from vramfit.formats.lora import KOHYA_UNET, LOHA_PARTS, LOKR_PARTS, lycoris_to_lora
from vramfit.formats.safetensors_io import CheckpointError, read_header
from vramfit.memory.accounting import pick_device
from vramfit.memory.encoder_stream import encoder_on
from vramfit.models.registry import FAMILIES, detect_family
from vramfit.models.parts import require_tokenizers
from vramfit.models.sources import PICKLE_SUFFIXES, SourceError, resolve_source

DEFAULT_STEPS = 30
DEFAULT_SIZE = 1024
VAE_FACTOR = 8  # every SDXL-family and SD3 VAE; read from the VAE where one is loaded
T5_MAX_TOKENS = 512  # the most T5 tokens diffusers' pipelines take
PIPELINE_T5_TOKENS = 256  # the T5 tokens diffusers' SD3 pipeline uses (--max-sequence-length's default)
SLG_FLAGS = ("--slg", "--slg", "--slg-scale")  # the flags of skip-layer guidance: on/off, blocks, scale
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
               "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


log = logging.getLogger(__name__)


class GenerateError(ValueError):
    """A `vramfit generate` flag or output that cannot be used; the message names it and what to do."""


# ---- pipeline -------------------------------------------------------------------------------

def decoder_pipeline(bundle, vae) -> Any:
    """A pipeline over the bundle's denoiser and `vae` alone, without text encoders: for prompts
    encoded before (`encode_prompts`)."""
    family = FAMILIES[bundle.family]
    tokenizers = list(bundle.tokenizers)
    pipe = family.pipeline(bundle, vae, [None] * len(tokenizers), tokenizers)
    pipe.vramfit_family = family
    return pipe


def build_pipeline(bundle) -> Any:
    """A diffusers pipeline over the bundle's own modules (shared, not copied).

    If the bundle's VAE and text encoders were dropped for training, they are loaded again from
    the source for the pipeline (the bundle itself is not changed).
    """
    family = FAMILIES[bundle.family]
    vae, encoders, tokenizers = bundle.vae, list(bundle.text_encoders), list(bundle.tokenizers)
    if vae is None or len(encoders) < 2:
        vae, encoders = family.load_encoders(bundle.source)
        encoders = list(encoders)
    pipe = family.pipeline(bundle, vae, encoders, tokenizers)
    pipe.vramfit_family = family
    return pipe


def _family(pipe):
    """The family (models/<family>/) whose pipeline `pipe` is (build_pipeline)."""
    return pipe.vramfit_family


def _denoiser(pipe) -> torch.nn.Module:
    return getattr(pipe, _family(pipe).denoiser_component)


def sampling_defaults(pipe) -> dict:
    """Guidance, steps and T5 tokens the model samples with where not told (its family's for its
    variant or layout, Family.sampling_defaults; generate's own defaults for what it leaves out)."""
    found = _family(pipe).sampling_defaults(_denoiser(pipe).config)
    return {"guidance": _family(pipe).default_guidance, "steps": DEFAULT_STEPS,
            "t5_tokens": PIPELINE_T5_TOKENS, **found}


def size_multiple(pipe) -> int:
    """Width and height must be multiples of this (VAE factor, times the patch size of a patched
    denoiser such as SD3's)."""
    return int(pipe.vae_scale_factor) * int(_denoiser(pipe).config.get("patch_size") or 1)


def native_size(bundle) -> tuple[int, int]:
    """(width, height) the model is made for: its single file's modelspec.resolution, else the
    denoiser's sample_size times the VAE's factor (for SD3, within the transformer's position grid).

    A tiny model's sample_size comes from its shipped config (a single file does not store it; it
    loads as SDXL's 128), found by the file's vramfit.tiny or vramfit.base_model metadata.
    """
    meta = read_header(bundle.source.path)[1] if bundle.source.kind == "single_file" else {}
    stated = _resolution(meta.get("modelspec.resolution"))
    if stated is not None:
        return stated
    config = dict(getattr(bundle.denoiser, "config", None) or {})
    base = meta.get("vramfit.base_model") or bundle.source.label or ""
    tiny = meta.get("vramfit.tiny") or (base.split(":", 1)[1] if base.startswith("tiny:") else None)
    if tiny:
        try:
            config["sample_size"] = FAMILIES[bundle.family].tiny_denoiser_config(tiny)["sample_size"]
        except FileNotFoundError:  # not a tiny model of this version: keep the loaded config
            pass
    side = config.get("sample_size") or DEFAULT_SIZE // VAE_FACTOR
    height, width = (side, side) if isinstance(side, int) else (int(side[0]), int(side[-1]))
    if config.get("pos_embed_max_size"):  # SD3 crops a grid of this many patches a side
        most = int(config["pos_embed_max_size"]) * int(config.get("patch_size") or 1)
        height, width = min(height, most), min(width, most)
    factor = 2 ** (len(bundle.vae.config.block_out_channels) - 1) if bundle.vae is not None else VAE_FACTOR
    return width * factor, height * factor


def _resolution(text: Optional[str]) -> Optional[tuple[int, int]]:
    """modelspec.resolution ("1024x1024", or one number) as (width, height); None if not usable."""
    parts = (text or "").lower().replace(" ", "").split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts) or len(parts) not in (1, 2):
        return None
    return int(parts[0]), int(parts[-1])


def _cast(pipe, dtype: torch.dtype) -> None:
    """Cast the models' floating parameters and buffers that are not in `dtype` yet.

    Quantized storage is left as it is: float8 buffers and tensor subclasses (torchao's int8,
    fp8 and nf4 weights), which `Module.to(dtype)` would widen back to full size."""
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            cast_floating(module, dtype)


WIDE_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def cast_floating(module: torch.nn.Module, dtype: torch.dtype, device=None) -> None:
    """Move `module` to `device` (None: stay) and cast its plain floating tensors to `dtype`,
    keeping quantized storage (float8 tensors, tensor subclasses) as it is."""
    if device is not None:
        module.to(device)
    with torch.no_grad():
        for sub in module.modules():
            for name, p in list(sub.named_parameters(recurse=False)):
                if type(p.data) is torch.Tensor and p.dtype in WIDE_FLOATS and p.dtype != dtype:
                    p.data = p.data.to(dtype)
            for name, b in list(sub.named_buffers(recurse=False)):
                if type(b) is torch.Tensor and b.dtype in WIDE_FLOATS and b.dtype != dtype:
                    setattr(sub, name, b.to(dtype))


def place(pipe, device, dtype: Optional[torch.dtype] = None, *, offload: bool = True) -> None:
    """Cast the pipeline's models to `dtype` (None: keep each one's) and put them on `device`.

    On CUDA with `offload`, diffusers' model CPU offload keeps every model on the CPU and moves
    each to the GPU only while it runs (peak: the largest model, not the sum). Otherwise all
    models go to `device`. Placing the same way twice does nothing.
    """
    device = torch.device(device)
    key = (str(device), dtype, bool(offload))
    if getattr(pipe, "_vramfit_placed", None) == key:
        return
    if getattr(pipe, "_vramfit_placed", None) is not None:
        pipe.remove_all_hooks()
    if dtype is not None:
        _cast(pipe, dtype)
    if device.type == "cuda" and offload:
        pipe.enable_model_cpu_offload(device=device)
    else:
        pipe.to(device)
    pipe._vramfit_placed = key


# ---- LoRAs ----------------------------------------------------------------------------------

def load_loras(pipe, loras: Sequence[tuple[Path, float]], allow_pickle: bool = False) -> list[str]:
    """Load each LoRA as adapter `lora<i>` and activate them all, each at its own scale.

    Files are read by diffusers' `load_lora_weights` (diffusers/peft keys with `unet.`,
    `transformer.`, `text_encoder.` prefixes, or kohya `lora_unet_*` / `lora_te*_*` keys).
    A file none of whose tensors fits the model is refused; so is a pickle file (.bin, .pt, .ckpt,
    .pth) unless `allow_pickle`, which reads it weights-only, and a scale that is not finite. A
    file only some of whose layers are in the model (a LoRA for another layout of the family) is
    loaded with a warning naming those left out. Returns the adapter names.
    """
    check_numbers(None, loras)
    names: list[str] = []
    try:
        for i, (path, _) in enumerate(loras):
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(f"--lora: {path} is not a file")
            name = f"lora{i}"
            weights = plain_lora(pipe, path, read_lora(path, allow_pickle))
            names.append(name)  # before loading, so that a half-loaded adapter is removed too
            try:
                pipe.load_lora_weights(weights, adapter_name=name)
            except (ValueError, KeyError, RuntimeError, OSError) as exc:
                raise ValueError(f"--lora {path}: diffusers could not load it into this "
                                 f"{_family(pipe).name} model: {exc}") from None
            if not any(name in found for found in pipe.get_list_adapters().values()):
                raise ValueError(f"--lora {path}: none of its tensors match a layer of this "
                                 f"{_family(pipe).name} model (is it a LoRA for another model family?)")
            _warn_unmatched(pipe, path, weights, name)
        if names:
            pipe.set_adapters(names, adapter_weights=[float(scale) for _, scale in loras])
    except BaseException:
        unload_loras(pipe, names)
        raise
    return names


# A LoRA layer's down (A) matrix, in every key style diffusers reads: peft `.lora_A.`, diffusers'
# older `.lora.down.` and `_lora.down.` (attention processors), kohya `.lora_down.`
_LORA_DOWN = re.compile(r"^(.+?)(?:\.lora_A|\.lora\.down|_lora\.down|\.lora_down)\.(?:[^.]+\.)?weight$")
_KOHYA_PARTS = (("lora_unet_", ("unet",)), ("lora_transformer_", ("transformer",)),
                ("lora_te1_", ("text_encoder",)), ("lora_te2_", ("text_encoder_2",)),
                ("lora_te3_", ("text_encoder_3",)), ("lora_te_", ("text_encoder",)))


def lora_layers(weights) -> list[str]:
    """The layers a LoRA file adapts, as its keys name them (one per down/A matrix)."""
    keys = read_header(Path(weights))[0] if isinstance(weights, str) else weights
    return sorted({m.group(1) for key in keys if (m := _LORA_DOWN.match(key))})


def _adapted(pipe, name: str) -> dict[str, set[str]]:
    """Per pipeline component, the names of its layers that carry adapter `name`."""
    found: dict[str, set[str]] = {}
    for part, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            found[part] = {n for n, m in module.named_modules()
                           if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)
                           and name in m.lora_A}
    return found


def _warn_unmatched(pipe, path: Path, weights, name: str) -> None:
    """Warn when some of a LoRA's layers are not in the model (diffusers leaves them out quietly):
    how many, and the first few names where the file's keys name them as the model does."""
    layers = lora_layers(weights)
    adapted = _adapted(pipe, name)
    missing = len(layers) - sum(len(found) for found in adapted.values())
    if missing <= 0:
        return
    kohya = {prefix + n.replace(".", "_") for prefix, parts in _KOHYA_PARTS
             for part in parts for n in adapted.get(part, ())}

    def in_model(layer: str) -> bool:
        part, _, rest = layer.partition(".")
        return rest in adapted.get(part, ()) or layer in kohya

    unknown = [layer for layer in layers if not in_model(layer)]
    names = ""
    if len(unknown) == missing:  # the file's names agree with the count: list them
        more = f" and {missing - 3} more" if missing > 3 else ""
        names = f": {', '.join(unknown[:3])}{more}"
    log.warning("--lora %s: %d of its %d layers are not in this %s model and are left out%s; "
                "it was probably trained for another model of the family", path, missing, len(layers),
                _family(pipe).name, names)


def plain_lora(pipe, path: Path, weights):
    """What diffusers is given for a LoRA file: a kohya LoHa / LoKr file as the exact LoRA of its
    weight updates (formats/lora.py lycoris_to_lora; SDXL family); any other file as it is. A
    kohya DoRA file is loaded with a warning: diffusers reads its dora_scale as peft's magnitude,
    which is ComfyUI's only approximately (vramfit writes the exact one beside it, -diffusers)."""
    keys = read_header(Path(weights))[0] if isinstance(weights, str) else weights
    parts = {k.rpartition(".")[2] for k in keys if k.startswith(KOHYA_UNET)}
    if "dora_scale" in parts:
        log.warning("--lora %s: a kohya DoRA file; diffusers applies its dora_scale as peft's magnitude, "
                    "ComfyUI against the frozen weight's norm, so the two differ slightly (a DoRA "
                    "trained by vramfit is exact here as its -diffusers.safetensors file)", path)
    if not parts & {*LOHA_PARTS, *LOKR_PARTS}:
        return weights
    family, denoiser = _family(pipe), _denoiser(pipe)
    kohya = getattr(family, "kohya_names", None)
    names = kohya(dict(denoiser.config)) if kohya else None
    if names is None:
        raise GenerateError(f"--lora {path}: a LoHa/LoKr file; vramfit reads those for SDXL-family UNets "
                            f"only, not {family.name} (ComfyUI loads LyCORIS files)")
    raw = load_file(weights) if isinstance(weights, str) else weights
    modules = dict(denoiser.named_modules())
    shapes = {}
    for module in set(names.values()):
        layer = modules.get(module)
        if layer is not None:
            base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
            shapes[module] = tuple(base.weight.shape)
    try:
        return lycoris_to_lora(raw, {k: v for k, v in names.items() if v in shapes}, shapes,
                               family.denoiser_component)
    except ValueError as exc:
        raise GenerateError(f"--lora {path}: {exc}") from None


def read_lora(path: Path, allow_pickle: bool = False):
    """What `load_lora_weights` is given for a LoRA file: the path of a .safetensors file, or the
    tensors of a pickle file, read with torch.load(weights_only=True) once allowed."""
    path = Path(path)
    if path.suffix.lower() not in PICKLE_SUFFIXES:
        return str(path)
    if not allow_pickle:
        raise GenerateError(
            f"--lora: {path} is a pickle file; pickle files can run code when loaded. Convert it to "
            ".safetensors, or give --allow-pickle to read it with torch.load(weights_only=True)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler's refusals and a damaged file come in many classes
        raise GenerateError(f"--lora: {path} could not be read as a weights-only pickle ({exc})") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else None
    if not state or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise GenerateError(f"--lora: {path} holds no LoRA tensors (expected a dict of named tensors)")
    return dict(state)


def unload_loras(pipe, names: Sequence[str]) -> None:
    """Delete the named adapters, leaving any other adapter (e.g. one being trained) in place."""
    loaded = {n for found in pipe.get_list_adapters().values() for n in found} if names else set()
    names = [n for n in names if n in loaded]
    if names:
        pipe.delete_adapters(names)


# ---- rendering ------------------------------------------------------------------------------

@torch.no_grad()
def _encode(pipe, prompt: str, negative: Optional[str], guidance: float,
            max_sequence_length: Optional[int], device=None) -> dict[str, Optional[torch.Tensor]]:
    """The prompt's embeddings, computed once for all of its images, in the denoiser's dtype (on
    `device`, default the pipeline's execution device)."""
    kwargs = dict(prompt=prompt, prompt_2=None, device=device or pipe._execution_device,
                  num_images_per_prompt=1,
                  do_classifier_free_guidance=guidance > 1.0, negative_prompt=negative)
    kwargs.update(_family(pipe).prompt_options(max_sequence_length or sampling_defaults(pipe)["t5_tokens"]))
    pe, npe, ppe, nppe = pipe.encode_prompt(**kwargs)
    dtype = _denoiser(pipe).dtype
    cast = (lambda t: None if t is None else t.to(dtype))
    return {"prompt_embeds": cast(pe), "negative_prompt_embeds": cast(npe),
            "pooled_prompt_embeds": cast(ppe), "negative_pooled_prompt_embeds": cast(nppe)}


@torch.no_grad()
def _decode(pipe, latents: torch.Tensor) -> list:
    """Latents to PIL images through the pipeline's VAE, whatever dtype the VAE is kept in."""
    vae = pipe.vae
    cfg = vae.config
    latents = _family(pipe).vae_input(latents, cfg)
    upcast = vae.dtype == torch.float16 and getattr(cfg, "force_upcast", False)
    if upcast:  # the SDXL VAE overflows in float16
        vae.to(torch.float32)
    try:
        device = pipe._execution_device if hasattr(vae, "_hf_hook") else next(vae.parameters()).device
        image = vae.decode(latents.to(device, vae.dtype), return_dict=False)[0]
    finally:
        if upcast:
            vae.to(torch.float16)
    return pipe.image_processor.postprocess(image.float(), output_type="pil")


def initial_noise(pipe, generator: torch.Generator, width: int, height: int) -> torch.Tensor:
    """The starting latents, always drawn in float32 on the CPU.

    torch's CPU sampler does not give the same numbers in every dtype and version, so drawing in
    float32 and casting after makes a seed give the same start in float32, bfloat16 and float16,
    on the CPU and on a GPU.
    """
    f = int(pipe.vae_scale_factor)
    shape = (1, int(_denoiser(pipe).config.in_channels), height // f, width // f)
    return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu")


def _render(pipe, prompt: str, seeds: Sequence[int], *, negative: Optional[str], steps: int,
            guidance: float, width: int, height: int, max_sequence_length: Optional[int],
            on_image: Optional[Callable[[Any], None]] = None, encoded: Optional[dict] = None) -> list:
    """One image per seed, each from its own CPU generator, one at a time (`on_image` is called
    with each as soon as it is decoded). `encoded`: the prompt's embeddings made before
    (`encode_prompts`), for a pipeline without text encoders."""
    if encoded is None:
        embeds = _encode(pipe, prompt, negative, guidance, max_sequence_length)
    else:
        device, dtype = pipe._execution_device, _denoiser(pipe).dtype
        embeds = {k: None if t is None else t.to(device, dtype) for k, t in encoded.items()}
    images = []
    for seed in seeds:
        generator = torch.Generator("cpu").manual_seed(int(seed))
        noise = initial_noise(pipe, generator, width, height).to(embeds["prompt_embeds"].dtype)
        latents = pipe(**embeds, latents=noise, num_inference_steps=steps, guidance_scale=guidance,
                       width=width, height=height, generator=generator, output_type="latent",
                       return_dict=False)[0]
        images += _decode(pipe, latents)
        if on_image is not None:
            on_image(images[-1])
    pipe.maybe_free_model_hooks()
    return images


def _check(pipe, prompts: Sequence[str], steps: int, width: int, height: int, count: int) -> None:
    if not prompts:
        raise ValueError("no prompt given (--prompt)")
    if steps < 1 or count < 1:
        raise ValueError(f"steps and count must be at least 1 (got steps={steps}, count={count})")
    m = size_multiple(pipe)
    if width < m or height < m or width % m or height % m:
        raise ValueError(f"width and height must be positive multiples of {m} for this "
                         f"{_family(pipe).name} model (got {width}x{height})")


def generate(pipe, prompts: Sequence[str], *, negative: Optional[str] = None, seed: int = 0,
             steps: Optional[int] = None, guidance: Optional[float] = None, width: int = DEFAULT_SIZE,
             height: int = DEFAULT_SIZE, count: int = 1, loras: Sequence[tuple[Path, float]] = (),
             device="cpu", dtype: Optional[torch.dtype] = torch.float32, offload: bool = True,
             max_sequence_length: Optional[int] = None, allow_pickle: bool = False,
             on_image: Optional[Callable[[Any], None]] = None) -> list:
    """`count` images per prompt, in order prompt 0 (images 0..count-1), prompt 1, ...

    Image i (over all prompts) uses seed + i. LoRAs are loaded as adapters lora0, lora1, ... each
    at its own scale, and removed again afterwards, so the pipeline is left as it was. `dtype`
    casts the pipeline's models (None: keep them as they are). `on_image` gets each image as
    soon as it is rendered. Steps and guidance default to the model's (`sampling_defaults`).
    """
    defaults = sampling_defaults(pipe)
    guidance = defaults["guidance"] if guidance is None else float(guidance)
    steps = defaults["steps"] if steps is None else steps
    _check(pipe, prompts, steps, width, height, count)
    check_numbers(guidance, loras)
    place(pipe, device, dtype, offload=offload)
    names = load_loras(pipe, loras, allow_pickle)
    try:
        images = []
        for p, prompt in enumerate(prompts):
            seeds = [seed + p * count + j for j in range(count)]
            images += _render(pipe, prompt, seeds, negative=negative, steps=steps, guidance=guidance,
                              width=width, height=height, max_sequence_length=max_sequence_length,
                              on_image=on_image)
        return images
    finally:
        unload_loras(pipe, names)


@contextmanager
def _visiting(pipe, device, dtype: Optional[torch.dtype], offload: bool,
              leave: Optional[torch.nn.Module] = None) -> Iterator[None]:
    """The pipeline's models in eval mode and placed as `place` does (with `device`; else cast to
    `dtype` where given), each back in its mode and on its device afterwards (offload hooks
    removed), so a training model is where it was. A cast is not undone. `leave`: a model used
    where it is, neither moved nor cast (a streamed denoiser, whose streamer brings each block to
    the GPU as it runs); the others then go to `device` whole, without offload hooks."""
    modules = {name: m for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    modes = {name: m.training for name, m in modules.items()}
    devices = {name: next(m.parameters()).device for name, m in modules.items()
               if next(m.parameters(), None) is not None}
    placed_before = getattr(pipe, "_vramfit_placed", None)
    try:
        for m in modules.values():
            m.eval()
        if device is not None and leave is not None:
            for m in modules.values():
                if m is not leave:
                    cast_floating(m, dtype, device) if dtype is not None else m.to(device)
        elif device is not None:
            place(pipe, device, dtype, offload=offload)
        elif dtype is not None:
            _cast(pipe, dtype)
        yield
    finally:
        for name, m in modules.items():
            m.train(modes[name])
        placed = getattr(pipe, "_vramfit_placed", None) != placed_before  # by `place`, with its hooks
        if device is not None and (placed or leave is not None):
            if placed:
                pipe.remove_all_hooks()
                pipe._vramfit_placed = placed_before
            for name, m in modules.items():
                if m is not leave and name in devices:
                    m.to(devices[name])


@torch.no_grad()
def encode_prompts(pipe, prompts: Sequence[str], *, negative: Optional[str] = None,
                   guidance: Optional[float] = None, device=None, max_sequence_length: Optional[int] = None,
                   stream: bool = False) -> dict[str, dict[str, Optional[torch.Tensor]]]:
    """Each prompt's embeddings (and the negative prompt's where `guidance` uses it), as a grid with
    the same settings would make them, in CPU memory: a later `sample_grid(encoded=...)` needs no
    text encoder. On CUDA each encoder visits the GPU only while it runs; with `stream`, layer by
    layer (memory/encoder_stream.py, as memory.stream_encoders encodes captions)."""
    guidance = sampling_defaults(pipe)["guidance"] if guidance is None else float(guidance)
    unique = list(dict.fromkeys(prompts))
    if stream and device is not None and torch.device(device).type == "cuda":
        with ExitStack() as stack:
            for name, m in pipe.components.items():
                if name.startswith("text_encoder") and isinstance(m, torch.nn.Module):
                    stack.enter_context(encoder_on(m.eval(), torch.device(device), True))
            encoded = [_encode(pipe, p, negative, guidance, max_sequence_length, device) for p in unique]
    else:
        with _visiting(pipe, device, None, True):
            encoded = [_encode(pipe, p, negative, guidance, max_sequence_length) for p in unique]
    return {p: {k: None if t is None else t.cpu() for k, t in e.items()} for p, e in zip(unique, encoded)}


def sample_grid(pipe, prompts: Sequence[str], seeds: Sequence[int], *, negative: Optional[str] = None,
                steps: int = 20, guidance: Optional[float] = None, width: int = DEFAULT_SIZE,
                height: int = DEFAULT_SIZE, device=None, dtype: Optional[torch.dtype] = None,
                offload: bool = True, max_sequence_length: Optional[int] = None, labels: bool = True,
                encoded: Optional[dict] = None, leave: Optional[torch.nn.Module] = None):
    """A grid of fixed prompts (rows) x fixed seeds (columns), for samples during training.

    Uses the adapters active on the pipeline's denoiser (e.g. the LoRA being trained) and loads
    none. Models are put in eval mode for the samples and back in their previous mode after.
    With `device`, the pipeline is placed as `place` does and afterwards every model goes back
    to the device it was on (offload hooks removed), so a training model is where it was;
    `dtype` (default None: none) casts the models, the denoiser included, and is not undone.
    `encoded`: {prompt: embeddings} from `encode_prompts`, for a pipeline without text encoders.
    `leave`: a model used where it is (a streamed denoiser: `_visiting`).
    """
    guidance = sampling_defaults(pipe)["guidance"] if guidance is None else float(guidance)
    _check(pipe, prompts, steps, width, height, max(1, len(seeds)))
    if not seeds:
        raise ValueError("sample_grid needs at least one seed")
    with _visiting(pipe, device, dtype, offload, leave):
        rows = [_render(pipe, prompt, seeds, negative=negative, steps=steps, guidance=guidance,
                        width=width, height=height, max_sequence_length=max_sequence_length,
                        encoded=None if encoded is None else encoded[prompt])
                for prompt in prompts]
    if not labels:
        return image_grid(rows)
    return image_grid(rows, [[f"seed {s}" for s in seeds] for _ in prompts],
                      row_labels=[_short(p) for p in prompts])


# ---- grids ----------------------------------------------------------------------------------

def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _label(image, text: str, *, top: bool = True) -> None:
    """Small text in a dark box at the top-left (or bottom-left) corner, drawn in place."""
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    try:
        draw.text((0, 0), text, font=font)
    except UnicodeEncodeError:  # the bitmap default font of old Pillow knows latin-1 only
        text = text.encode("latin-1", "replace").decode("latin-1")
    left, t, right, bottom = draw.textbbox((0, 0), text, font=font)
    w, h = right - left + 4, bottom - t + 4
    y = 0 if top else max(0, image.height - h)
    draw.rectangle([0, y, min(w, image.width), y + h], fill=(0, 0, 0))
    draw.text((2 - left, y + 2 - t), text, fill=(255, 255, 255), font=font)


def image_grid(rows: Sequence[Sequence[Any]], cell_labels: Optional[Sequence[Sequence[str]]] = None,
               row_labels: Optional[Sequence[str]] = None):
    """Rows of equally sized images pasted edge to edge: (rows x h) by (longest row x w) pixels.

    Labels are drawn onto copies of the images (row label at the top-left of the row's first
    image, cell labels at the bottom-left of each image); the grid has no margins.
    """
    cells = [im for row in rows for im in row]
    if not cells:
        raise ValueError("no images for the grid")
    w, h = cells[0].size
    if any(im.size != (w, h) for im in cells):
        raise ValueError("all images of a grid must have the same size")
    grid = Image.new("RGB", (w * max(len(r) for r in rows), h * len(rows)), (0, 0, 0))
    for r, row in enumerate(rows):
        for c, im in enumerate(row):
            cell = im.convert("RGB")  # a copy: the caller's images stay unlabelled
            if cell_labels is not None:
                _label(cell, cell_labels[r][c], top=False)
            if row_labels is not None and c == 0:
                _label(cell, row_labels[r])
            grid.paste(cell, (c * w, r * h))
    return grid


def compare_grid(base: Sequence[Any], tuned: Sequence[Any], labels=("base", "fine-tuned")):
    """Base images on the first row, the fine-tuned ones (same prompts and seeds) on the second."""
    if len(base) != len(tuned):
        raise ValueError(f"compare_grid: {len(base)} base images but {len(tuned)} fine-tuned ones")
    return image_grid([list(base), list(tuned)], row_labels=list(labels))


# ---- command line ---------------------------------------------------------------------------

def parse_lora(text: str) -> tuple[Path, float]:
    """`PATH[:SCALE]` (scale 1.0 when left out; a path that exists as written is taken whole)."""
    if Path(text).expanduser().exists():
        return Path(text).expanduser(), 1.0
    path, sep, scale = text.rpartition(":")
    if sep and path and "/" not in scale and "\\" not in scale:
        try:
            return Path(path).expanduser(), float(scale)
        except ValueError:
            pass
    return Path(text).expanduser(), 1.0


def parse_slg(text: str) -> tuple[int, ...]:
    """--slg: "off" as () or the transformer blocks to leave out, "7,8,9" as (7, 8, 9); ValueError
    for anything else."""
    if text.strip().lower() == "off":
        return ()
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise ValueError(f"{text!r} is neither off nor block numbers (expected e.g. 7,8,9 or off)")
    return tuple(int(part) for part in parts)


def _slg_arg(text: str) -> tuple[int, ...]:
    try:
        return parse_slg(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def asked_skip_layers(args) -> SkipLayerGuidance:
    """The skip-layer guidance --slg and --slg-scale ask for (neither: the model's default)."""
    layers, scale = getattr(args, "slg", None), getattr(args, "slg_scale", None)
    if isinstance(layers, str):  # a caller's Namespace, not parsed by argparse
        layers = parse_slg(layers)
    if layers is None:
        return SkipLayerGuidance(None, None, scale, SLG_FLAGS)
    return SkipLayerGuidance(bool(layers), tuple(layers) or None, scale, SLG_FLAGS)


def _lora_arg(text: str) -> tuple[Path, float]:
    path, scale = parse_lora(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path} is not a file (expected PATH[:SCALE])")
    return path, scale


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `generate` subcommand (sets func=run_generate)."""
    p = subparsers.add_parser(
        "generate", help="render images from a model, with LoRAs; --compare shows base vs fine-tuned",
        description="Render images from an SDXL-family, SD3, SD3.5 or Flux.1 model, optionally with LoRAs "
        "(each at its own scale). Image i is rendered with seed SEED+i, so the same command gives the same images. "
        "On CUDA the models are moved to the GPU one at a time to keep memory low.")
    p.add_argument("--model", required=True,
                   help="single-file .safetensors, diffusers folder, repo id or tiny:<name>")
    p.add_argument("--base", metavar="MODEL",
                   help="the model to compare --model with (e.g. the one a full fine-tune started from): "
                   "rendered on the same prompts and seeds, without the LoRAs, in the row above --model's "
                   "in compare.png; implies --compare")
    p.add_argument("--tokenizers", help="folder with tokenizer/ and tokenizer_2/ (and tokenizer_3/ for "
                   "SD3 with T5), when a single file has none beside it (--base uses it only where it "
                   "has none of its own)")
    p.add_argument("--prompt", action="append", required=True, help="prompt to render (repeatable)")
    p.add_argument("--negative", help="negative prompt for every image")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the first image; image i uses SEED+i (default 0)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"denoising steps per image (default: the model's: Flux.1 dev 28, schnell 4; "
                   f"{DEFAULT_STEPS} for SDXL and SD3)")
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance scale, 0 or more (default 5.0 for SDXL, 7.0 for SD3; "
                   "1 turns it off; Flux.1 dev: the distilled guidance, default 3.5; schnell takes none)")
    p.add_argument("--width", type=int, default=None,
                   help="image width (default: the model's own size: the modelspec.resolution of its file, "
                   "else its denoiser's sample size; 1024 for SDXL and SD3, 128 for tiny:ssd1b)")
    p.add_argument("--height", type=int, default=None, help="image height (default: the model's own size)")
    p.add_argument("--count", type=int, default=1, help="images per prompt (default 1)")
    p.add_argument("--lora", action="append", default=[], type=_lora_arg, metavar="PATH[:SCALE]",
                   help="LoRA .safetensors (diffusers or kohya keys) with its scale, default 1.0 "
                   "(repeatable; all are applied together, to --model only; a LoRA's layers that the "
                   "model does not have are left out with a warning)")
    p.add_argument("--compare", action="store_true",
                   help="also render the same prompts and seeds without the LoRAs (or with --base MODEL) "
                   "and write compare.png (that row above --model's)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read .bin/.pt/.ckpt/.pth model and LoRA files with torch.load(weights_only=True); "
                   "pickle files can run code when loaded, so they are refused without it")
    p.add_argument("--out", type=Path, default=Path("samples"), help="output folder (default samples)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                   help="model precision (auto: bfloat16 on CUDA where supported, else float16; "
                   "float32 on CPU)")
    p.add_argument("--no-offload", action="store_true",
                   help="keep all models on the GPU (faster, needs memory for all of them at once)")
    p.add_argument("--t5", default=None, choices=["bf16", "int8", "fp8", "nf4", "none"],
                   help="SD3: how T5-XXL is stored: bf16 (as loaded), int8 or nf4 (quantized, about 1/2 or "
                   "1/4 of the memory), fp8 (storage only), none (left out: zero embeddings, as SD3 "
                   "allows); default bf16")
    p.add_argument("--slg", type=_slg_arg, default=None, metavar="off|BLOCKS",
                   help="SD3 and SD3.5: skip-layer guidance, off or the transformer blocks its extra "
                   "prediction leaves out, e.g. 7,8,9 (default: the model's: blocks 7,8,9 for SD3.5 Medium, "
                   "off for the others); applies with --guidance above 1")
    p.add_argument("--slg-scale", type=float, default=None, metavar="SCALE",
                   help="SD3 and SD3.5: skip-layer guidance's scale, above 0 (default: the model's, 2.5 for "
                   "SD3.5 Medium; diffusers' 2.8 for --slg blocks on another model)")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help=f"SD3 and Flux.1: T5 tokens per prompt, 1 to {T5_MAX_TOKENS} (default "
                   f"{PIPELINE_T5_TOKENS} for SD3, as diffusers' pipeline; Flux.1 dev 512, schnell 256)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where tiny models and converted checkpoints are kept (default ~/.cache/vramfit)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_generate)
    return p


def generate_device(text: str) -> torch.device:
    """--device as a torch device; one that vramfit does not render on, or a GPU this machine does
    not show, is refused naming the flag, before anything loads."""
    if not re.fullmatch(DEVICE_PATTERN, text):
        raise GenerateError(f"--device {text!r} is not a device vramfit renders on; use {DEVICE_CHOICES}")
    problem = cuda_problem(text) if text.startswith("cuda") else None
    if problem and problem.startswith("no CUDA GPU"):
        raise GenerateError(f"--device {text}: {problem}; use --device cpu or auto (--device takes auto, cpu, "
                            "cuda or cuda:N)")
    if problem:
        raise GenerateError(f"--device {text}: {problem}; use one of them, or auto or cpu")
    return pick_device(text)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPE_NAMES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def save_png(image, path: Path, info: dict[str, str]) -> None:
    meta = PngInfo()
    for key, value in info.items():
        meta.add_itxt(key, value)
    tmp = path.with_name(f".{path.name}.tmp")
    image.save(tmp, format="PNG", pnginfo=meta)
    tmp.replace(path)


def run_generate(args) -> int:
    """The `vramfit generate` command: write <out>/<index>-<seed>.png (and compare.png), print paths.

    Flags are checked before any model loads where they can be; each image is written as soon as
    it is rendered. With --base, the two models are loaded one after the other, never together.
    """
    loras = [tuple(item) if not isinstance(item, str) else parse_lora(item) for item in (args.lora or [])]
    base_text = getattr(args, "base", None)
    compare = bool(args.compare or base_text)
    _check_flags(args, loras, compare)
    device = generate_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    problem = folder_problem("--out", str(args.out))  # now: not once the models have rendered
    if problem:
        raise GenerateError(problem)
    model = _resolve(args.model, "--model", args)
    base = _resolve(base_text, "--base", args) if base_text else None
    if base is not None and base[1].name != model[1].name:
        log.warning("--base %s is an %s model and --model %s an %s model: compare.png shows two model "
                    "families side by side, not a model and its fine-tune", base_text,
                    base[1].display_name, args.model, model[1].display_name)
    asked = asked_skip_layers(args)
    # (flag, family, model text) of each model named, for the checks before either loads
    named = [(flag, resolved[1], text) for flag, resolved, text in
             (("--model", model, args.model), ("--base", base, base_text)) if resolved is not None]
    if asked.given and asked.on is not False:  # off is what a family without it does already
        for flag, family, text in named:
            if not family.skip_layer_guidance:
                with_slg = " and ".join(f.display_name for f in FAMILIES.values() if f.skip_layer_guidance)
                raise GenerateError(f"{asked.key} applies to the skip-layer guidance of {with_slg} models; "
                                    f"{flag} {text} ({family.display_name}) samples without it: leave "
                                    f"{asked.key} out, or give --slg off")
            # both models' blocks before either loads: --base would otherwise fail once --model rendered
            problem = family.skip_layer_problem(ModelConfig(path=text), asked)
            if problem:
                raise GenerateError(f"{problem} (for {flag} {text})")
    if not any(family.has_t5 for _, family, _ in named):
        with_t5 = " and ".join(f.display_name for f in FAMILIES.values() if f.has_t5)
        for flag, value in (("--t5", args.t5), ("--max-sequence-length", args.max_sequence_length)):
            if value is not None:
                raise GenerateError(f"{flag} applies to {with_t5} models; {args.model} is an "
                                    f"{model[1].display_name} model")
    if args.t5 == "none":  # before any weight loads: the pipeline would refuse only after
        for flag, family, text in named:
            if family.has_t5 and not family.samples_without_t5:
                raise GenerateError(f"--t5 none: {family.display_name} samples with its T5 encoder ({flag} "
                                    f"{text}); store it smaller with --t5 int8 or --t5 nf4")
    out = _output_folder(Path(args.out))

    progress = not getattr(args, "no_progress", False)
    pipe, bundle = _pipeline(*model, args, progress, "--model")
    width, height = native_size(bundle)
    width, height = args.width or width, args.height or height
    _check_size(pipe, width, height, args.model)
    per_model = len(args.prompt) * args.count
    common = dict(negative=args.negative, seed=args.seed, steps=args.steps, guidance=args.guidance,
                  width=width, height=height, count=args.count, device=device, dtype=dtype,
                  offload=not args.no_offload, max_sequence_length=args.max_sequence_length,
                  allow_pickle=getattr(args, "allow_pickle", False))
    defaults = sampling_defaults(pipe)
    guidance = defaults["guidance"] if args.guidance is None else args.guidance
    steps = defaults["steps"] if args.steps is None else args.steps
    settings = {"model": args.model, "steps": str(steps), "guidance": str(guidance),
                "size": f"{width}x{height}", "loras": ", ".join(f"{Path(p).name}:{s:g}" for p, s in loras)}
    if args.negative:
        settings["negative"] = args.negative
    if asked.given:  # the flags as given; the model's default is not written out
        settings["skip-layer guidance"] = asked.text
    paths: list[Path] = []
    bar = tqdm(total=per_model * (2 if compare else 1), desc="images", unit="image", disable=not progress)

    def keep(image) -> None:  # written and printed at once: an error later loses none of them
        i = len(paths)
        path = out / f"{i}-{args.seed + i}.png"
        _write(image, path, {**settings, "prompt": args.prompt[i // args.count], "seed": str(args.seed + i)})
        paths.append(path)
        tqdm.write(str(path), file=sys.stdout)
        bar.update()

    try:
        images = generate(pipe, args.prompt, loras=loras, on_image=keep, **common)
        if base is not None:
            del pipe, bundle  # the model is done: free it before the base loads
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            pipe, bundle = _pipeline(*base, args, progress, "--base")
            _check_size(pipe, width, height, base_text)
        if compare:
            common["allow_pickle"] = False  # the comparison row renders no LoRA
            before = generate(pipe, args.prompt, loras=[], on_image=lambda image: bar.update(), **common)
            labels = (_short(base_text), _short(args.model)) if base else ("base", "fine-tuned")
            path = out / "compare.png"
            _write(compare_grid(before, images, labels), path,
                   {**settings, "base": base_text or f"{args.model} without LoRAs",
                    "prompts": " | ".join(args.prompt), "seeds": f"{args.seed}..{args.seed + per_model - 1}"})
            tqdm.write(str(path), file=sys.stdout)
    finally:
        bar.close()
    sys.stdout.flush()
    return 0


# Config keys the model loader's messages name, as generate's flags (model.path: the flag given)
_FLAG_NAMES = (("Set model.tokenizers to", "Give --tokenizers as"),
               ("set model.allow_pickle=true", "give --allow-pickle"),
               ("model.tokenizers", "--tokenizers"), ("model.allow_pickle", "--allow-pickle"))


def _flagged(exc: Exception, flag: str) -> Exception:
    """The loader's error with generate's flag names in place of the config keys it names."""
    text = str(exc)
    for key, option in (*_FLAG_NAMES, ("model.path", flag)):
        text = text.replace(key, option)
    return type(exc)(text)


def _check_flags(args, loras: Sequence[tuple[Path, float]], compare: bool) -> None:
    """Everything about the flags that can be checked before a model loads."""
    if args.compare and not loras and not getattr(args, "base", None):
        raise GenerateError("--compare renders the model with and without its LoRAs, or against --base "
                            "MODEL: give at least one --lora, or --base")
    if not args.prompt:
        raise GenerateError("no prompt given (--prompt, repeatable)")
    for flag, value in (("--steps", args.steps), ("--count", args.count)):
        if value is not None and value < 1:
            raise GenerateError(f"{flag} must be at least 1 (got {value})")
    for flag, value in (("--width", args.width), ("--height", args.height)):
        if value is not None and value < 1:
            raise GenerateError(f"{flag} must be a positive number of pixels (got {value})")
    last = args.seed + len(args.prompt) * args.count - 1
    if args.seed < 0 or last >= 2 ** 64:
        raise GenerateError(f"--seed must be from 0 to {2 ** 64 - 1} for every image "
                            f"(got {args.seed}..{last})")
    n = args.max_sequence_length
    if n is not None and not 1 <= n <= T5_MAX_TOKENS:
        raise GenerateError(f"--max-sequence-length must be from 1 to {T5_MAX_TOKENS} (got {n})")
    check_numbers(args.guidance, loras)
    scale = getattr(args, "slg_scale", None)
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise GenerateError(f"--slg-scale must be a finite number above 0 (got {scale}); --slg off turns "
                            "skip-layer guidance off")
    for key, problem in skip_layer_problems(asked_skip_layers(args), args.guidance, "--guidance"):
        raise GenerateError(f"{key}: {problem}")
    for path, _ in loras:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--lora: {path} is not a file")
        if not getattr(args, "allow_pickle", False):
            read_lora(path, False)  # refuses a pickle file


def check_numbers(guidance: Optional[float], loras: Sequence[tuple[Path, float]]) -> None:
    """A guidance scale below 0 or not finite, or a LoRA scale that is not finite (NaN renders
    black images), is refused naming the flag."""
    if guidance is not None and not (math.isfinite(guidance) and guidance >= 0):
        raise GenerateError(f"--guidance must be a finite number, 0 or more (got {guidance}); "
                            "1 turns classifier-free guidance off")
    for path, scale in loras:
        if not math.isfinite(scale):
            raise GenerateError(f"--lora {path}:{scale}: a LoRA's scale must be a finite number, "
                                f"e.g. {path}:0.8")


def _output_folder(out: Path) -> Path:
    """--out, created now (run_generate has tried writing in it before any model loads)."""
    if out.exists() and not out.is_dir():
        raise GenerateError(f"--out: {out} is a file; give a folder for the images")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GenerateError(f"--out: cannot create the folder {out} ({exc.strerror or exc})") from None
    return out


def _write(image, path: Path, info: dict[str, str]) -> None:
    try:
        save_png(image, path, info)
    except OSError as exc:
        raise GenerateError(f"--out: could not write {path} ({exc.strerror or exc}); the images "
                            "listed before it are written") from None


def _resolve(text: str, flag: str, args):
    """(source, family) of a model flag: nothing is loaded yet, only the file's header is read."""
    # --base uses --tokenizers only where it has none of its own (a tiny model always has)
    own = flag == "--base"
    config = ModelConfig(path=text, tokenizers=None if own else args.tokenizers,
                         allow_pickle=bool(getattr(args, "allow_pickle", False)))
    try:
        try:
            source = resolve_source(config, args.cache_dir)
        except OSError:  # a tiny model or a converted pickle file could not be written in the cache
            given = args.cache_dir is not None
            problem = folder_problem("--cache-dir" if given else "--cache-dir (not set: the default folder)",
                                     str(args.cache_dir if given else default_cache_root()))
            if problem:
                raise GenerateError(problem) from None
            raise
        if own and source.tokenizers is None and args.tokenizers:
            source = dataclasses.replace(source, tokenizers=Path(args.tokenizers).expanduser())
        family = detect_family(source)
        if source.kind == "single_file":
            require_tokenizers(source)  # now, not after the other model has rendered
        return source, family
    except (SourceError, CheckpointError) as exc:
        raise _flagged(exc, flag) from None


def _pipeline(source, family, args, progress: bool, flag: str):
    """Load a resolved model and build its pipeline; the loader's messages name generate's flags."""
    try:
        # a single file's T5 is stored as --t5 asks while it loads (models/parts.py)
        bundle = family.load(source, t5_precision=args.t5 or "bf16") if family.has_t5 else family.load(source)
    except (SourceError, CheckpointError) as exc:
        raise _flagged(exc, flag) from None
    bundle.extra["t5_precision"] = args.t5 or "bf16"
    bundle.extra["skip_layer_guidance"] = asked_skip_layers(args)  # the family's pipeline applies it
    family.prepare_encoders(bundle)
    pipe = build_pipeline(bundle)
    pipe.set_progress_bar_config(disable=not progress, leave=False, desc="denoising steps", unit="step")
    return pipe, bundle


def _check_size(pipe, width: int, height: int, model: str) -> None:
    m = size_multiple(pipe)
    for flag, value in (("--width", width), ("--height", height)):
        if value % m:
            raise GenerateError(f"{flag} {value}: {model} ({_family(pipe).name}) renders sizes that are "
                                f"multiples of {m}; use e.g. {max(m, round(value / m) * m)}")
