"""Image generation: render prompts from a model (with any number of LoRAs), compare base vs fine-tuned.

The pipeline is a real diffusers StableDiffusionXLPipeline / StableDiffusion3Pipeline built from
the parts a family loaded (nothing is downloaded). Every image has its own CPU-seeded generator
(seed + image index), so an image depends only on its prompt, seed and settings: the same command
gives the same pixels, and `--compare` renders the base model on exactly the seeds of the
fine-tuned images. Memory stays low by default: on CUDA the models go to the GPU one at a time
(diffusers' model CPU offload), each prompt is encoded once, and images are rendered one by one.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

DEFAULT_STEPS = 30
DEFAULT_GUIDANCE = {"sdxl": 5.0, "sd3": 7.0}
DEFAULT_SIZE = 1024
SD3_MAX_SEQUENCE_LENGTH = 256  # the T5 tokens diffusers' SD3 pipeline uses
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
               "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


# ---- pipeline -------------------------------------------------------------------------------

def build_pipeline(bundle) -> Any:
    """A diffusers pipeline over the bundle's own modules (shared, not copied).

    If the bundle's VAE and text encoders were dropped for training, they are loaded again from
    the source for the pipeline (the bundle itself is not changed).
    """
    vae, encoders, tokenizers = bundle.vae, list(bundle.text_encoders), list(bundle.tokenizers)
    if vae is None or len(encoders) < 2:
        from vramfit.models.registry import FAMILIES

        vae, encoders = FAMILIES[bundle.family].load_encoders(bundle.source)
        encoders = list(encoders)
    if bundle.family == "sdxl":
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        from vramfit.models.tiny import shipped_config

        scheduler = EulerDiscreteScheduler.from_config(shipped_config("sdxl_scheduler"))
        pipe = StableDiffusionXLPipeline(
            vae=vae, text_encoder=encoders[0], text_encoder_2=encoders[1], tokenizer=tokenizers[0],
            tokenizer_2=tokenizers[1], unet=bundle.denoiser, scheduler=scheduler,
            force_zeros_for_empty_prompt=True, add_watermarker=False)
    elif bundle.family == "sd3":
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        has_t5 = len(encoders) > 2 and len(tokenizers) > 2
        pipe = StableDiffusion3Pipeline(
            transformer=bundle.denoiser, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
            text_encoder=encoders[0], tokenizer=tokenizers[0], text_encoder_2=encoders[1],
            tokenizer_2=tokenizers[1], text_encoder_3=encoders[2] if has_t5 else None,
            tokenizer_3=tokenizers[2] if has_t5 else None)
    else:
        raise ValueError(f"no image pipeline for model family {bundle.family!r}")
    pipe.vramfit_family = bundle.family
    return pipe


def _family(pipe) -> str:
    return "sd3" if hasattr(pipe, "transformer") else "sdxl"


def _denoiser(pipe) -> torch.nn.Module:
    return pipe.transformer if _family(pipe) == "sd3" else pipe.unet


def size_multiple(pipe) -> int:
    """Width and height must be multiples of this (VAE factor, times the patch size for SD3)."""
    factor = int(pipe.vae_scale_factor)
    if _family(pipe) == "sd3":
        factor *= int(pipe.transformer.config.patch_size)
    return factor


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

def load_loras(pipe, loras: Sequence[tuple[Path, float]]) -> list[str]:
    """Load each LoRA as adapter `lora<i>` and activate them all, each at its own scale.

    Files are read by diffusers' `load_lora_weights` (diffusers/peft keys with `unet.`,
    `transformer.`, `text_encoder.` prefixes, or kohya `lora_unet_*` / `lora_te*_*` keys).
    A file none of whose tensors fits the model is refused. Returns the adapter names.
    """
    names: list[str] = []
    try:
        for i, (path, _) in enumerate(loras):
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(f"--lora: {path} is not a file")
            name = f"lora{i}"
            names.append(name)  # before loading, so that a half-loaded adapter is removed too
            try:
                pipe.load_lora_weights(str(path), adapter_name=name)
            except (ValueError, KeyError, RuntimeError, OSError) as exc:
                raise ValueError(f"--lora {path}: diffusers could not load it into this "
                                 f"{_family(pipe)} model: {exc}") from None
            if not any(name in found for found in pipe.get_list_adapters().values()):
                raise ValueError(f"--lora {path}: none of its tensors match a layer of this "
                                 f"{_family(pipe)} model (is it a LoRA for another model family?)")
        if names:
            pipe.set_adapters(names, adapter_weights=[float(scale) for _, scale in loras])
    except BaseException:
        unload_loras(pipe, names)
        raise
    return names


def unload_loras(pipe, names: Sequence[str]) -> None:
    """Delete the named adapters, leaving any other adapter (e.g. one being trained) in place."""
    loaded = {n for found in pipe.get_list_adapters().values() for n in found} if names else set()
    names = [n for n in names if n in loaded]
    if names:
        pipe.delete_adapters(names)


# ---- rendering ------------------------------------------------------------------------------

@torch.no_grad()
def _encode(pipe, prompt: str, negative: Optional[str], guidance: float,
            max_sequence_length: Optional[int]) -> dict[str, Optional[torch.Tensor]]:
    """The prompt's embeddings, computed once for all of its images, in the denoiser's dtype."""
    kwargs = dict(prompt=prompt, prompt_2=None, device=pipe._execution_device, num_images_per_prompt=1,
                  do_classifier_free_guidance=guidance > 1.0, negative_prompt=negative)
    if _family(pipe) == "sd3":
        kwargs.update(prompt_3=None, max_sequence_length=max_sequence_length or SD3_MAX_SEQUENCE_LENGTH)
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
    if _family(pipe) == "sd3":
        latents = latents / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)
    elif getattr(cfg, "latents_mean", None) is not None and getattr(cfg, "latents_std", None) is not None:
        mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1).to(latents)
        std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1).to(latents)
        latents = latents * std / cfg.scaling_factor + mean
    else:
        latents = latents / cfg.scaling_factor
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
            guidance: float, width: int, height: int, max_sequence_length: Optional[int]) -> list:
    """One image per seed, each from its own CPU generator, one at a time."""
    embeds = _encode(pipe, prompt, negative, guidance, max_sequence_length)
    images = []
    for seed in seeds:
        generator = torch.Generator("cpu").manual_seed(int(seed))
        noise = initial_noise(pipe, generator, width, height).to(embeds["prompt_embeds"].dtype)
        latents = pipe(**embeds, latents=noise, num_inference_steps=steps, guidance_scale=guidance,
                       width=width, height=height, generator=generator, output_type="latent",
                       return_dict=False)[0]
        images += _decode(pipe, latents)
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
                         f"{_family(pipe)} model (got {width}x{height})")


def generate(pipe, prompts: Sequence[str], *, negative: Optional[str] = None, seed: int = 0,
             steps: int = DEFAULT_STEPS, guidance: Optional[float] = None, width: int = DEFAULT_SIZE,
             height: int = DEFAULT_SIZE, count: int = 1, loras: Sequence[tuple[Path, float]] = (),
             device="cpu", dtype: Optional[torch.dtype] = torch.float32, offload: bool = True,
             max_sequence_length: Optional[int] = None) -> list:
    """`count` images per prompt, in order prompt 0 (images 0..count-1), prompt 1, ...

    Image i (over all prompts) uses seed + i. LoRAs are loaded as adapters lora0, lora1, ... each
    at its own scale, and removed again afterwards, so the pipeline is left as it was. `dtype`
    casts the pipeline's models (None: keep them as they are).
    """
    guidance = DEFAULT_GUIDANCE[_family(pipe)] if guidance is None else float(guidance)
    _check(pipe, prompts, steps, width, height, count)
    place(pipe, device, dtype, offload=offload)
    names = load_loras(pipe, loras)
    try:
        images = []
        for p, prompt in enumerate(prompts):
            seeds = [seed + p * count + j for j in range(count)]
            images += _render(pipe, prompt, seeds, negative=negative, steps=steps, guidance=guidance,
                              width=width, height=height, max_sequence_length=max_sequence_length)
        return images
    finally:
        unload_loras(pipe, names)


def sample_grid(pipe, prompts: Sequence[str], seeds: Sequence[int], *, negative: Optional[str] = None,
                steps: int = 20, guidance: Optional[float] = None, width: int = DEFAULT_SIZE,
                height: int = DEFAULT_SIZE, device=None, dtype: Optional[torch.dtype] = None,
                offload: bool = True, max_sequence_length: Optional[int] = None, labels: bool = True):
    """A grid of fixed prompts (rows) x fixed seeds (columns), for samples during training.

    Uses the adapters active on the pipeline's denoiser (e.g. the LoRA being trained) and loads
    none. Models are put in eval mode for the samples and back in their previous mode after.
    With `device`, the pipeline is placed as `place` does and afterwards every model goes back
    to the device it was on (offload hooks removed), so a training model is where it was;
    `dtype` (default None: none) casts the models, the denoiser included, and is not undone.
    """
    guidance = DEFAULT_GUIDANCE[_family(pipe)] if guidance is None else float(guidance)
    _check(pipe, prompts, steps, width, height, max(1, len(seeds)))
    if not seeds:
        raise ValueError("sample_grid needs at least one seed")
    modules = {name: m for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    modes = {name: m.training for name, m in modules.items()}
    devices = {name: next(m.parameters()).device for name, m in modules.items()
               if next(m.parameters(), None) is not None}
    placed_before = getattr(pipe, "_vramfit_placed", None)
    try:
        for m in modules.values():
            m.eval()
        if device is not None:
            place(pipe, device, dtype, offload=offload)
        elif dtype is not None:
            _cast(pipe, dtype)
        rows = [_render(pipe, prompt, seeds, negative=negative, steps=steps, guidance=guidance,
                        width=width, height=height, max_sequence_length=max_sequence_length)
                for prompt in prompts]
    finally:
        for name, m in modules.items():
            m.train(modes[name])
        if device is not None:
            if getattr(pipe, "_vramfit_placed", None) != placed_before:
                pipe.remove_all_hooks()
                for name, m in modules.items():
                    if name in devices:
                        m.to(devices[name])
                pipe._vramfit_placed = placed_before
    if not labels:
        return image_grid(rows)
    return image_grid(rows, [[f"seed {s}" for s in seeds] for _ in prompts],
                      row_labels=[_short(p) for p in prompts])


# ---- grids ----------------------------------------------------------------------------------

def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _label(image, text: str, *, top: bool = True) -> None:
    """Small text in a dark box at the top-left (or bottom-left) corner, drawn in place."""
    from PIL import ImageDraw, ImageFont

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
    from PIL import Image

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


def _lora_arg(text: str) -> tuple[Path, float]:
    path, scale = parse_lora(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path} is not a file (expected PATH[:SCALE])")
    return path, scale


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `generate` subcommand (sets func=run_generate)."""
    p = subparsers.add_parser(
        "generate", help="render images from a model, with LoRAs; --compare shows base vs fine-tuned",
        description="Render images from an SDXL-family or SD3 model, optionally with LoRAs (each at its "
        "own scale). Image i is rendered with seed SEED+i, so the same command gives the same images. "
        "On CUDA the models are moved to the GPU one at a time to keep memory low.")
    p.add_argument("--model", required=True,
                   help="single-file .safetensors, diffusers folder, repo id or tiny:<name>")
    p.add_argument("--tokenizers", help="folder with tokenizer/ and tokenizer_2/ (and tokenizer_3/ for "
                   "SD3 with T5), when a single file has none beside it")
    p.add_argument("--prompt", action="append", required=True, help="prompt to render (repeatable)")
    p.add_argument("--negative", help="negative prompt for every image")
    p.add_argument("--seed", type=int, default=0, help="seed of the first image; image i uses SEED+i (default 0)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"inference steps (default {DEFAULT_STEPS})")
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance scale (default 5.0 for SDXL, 7.0 for SD3; 1 turns it off)")
    p.add_argument("--width", type=int, default=DEFAULT_SIZE, help=f"image width (default {DEFAULT_SIZE})")
    p.add_argument("--height", type=int, default=DEFAULT_SIZE, help=f"image height (default {DEFAULT_SIZE})")
    p.add_argument("--count", type=int, default=1, help="images per prompt (default 1)")
    p.add_argument("--lora", action="append", default=[], type=_lora_arg, metavar="PATH[:SCALE]",
                   help="LoRA .safetensors (diffusers or kohya keys) with its scale, default 1.0 "
                   "(repeatable; all are applied together)")
    p.add_argument("--compare", action="store_true",
                   help="also render the same prompts and seeds without the LoRAs and write compare.png "
                   "(base row above the fine-tuned row)")
    p.add_argument("--out", type=Path, default=Path("samples"), help="output folder (default samples)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                   help="model precision (auto: bfloat16 on CUDA where supported, else float16; float32 on CPU)")
    p.add_argument("--no-offload", action="store_true",
                   help="keep all models on the GPU (faster, needs memory for all of them at once)")
    p.add_argument("--t5", default="bf16", choices=["bf16", "int8", "fp8", "nf4", "none"],
                   help="SD3: how T5-XXL is stored: bf16 (as loaded), int8 or nf4 (quantized, about 1/2 or "
                   "1/4 of the memory), fp8 (storage only), none (left out: zero embeddings, as SD3 "
                   "allows); default bf16")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help=f"SD3: T5 tokens per prompt (default {SD3_MAX_SEQUENCE_LENGTH}, as diffusers' pipeline)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where tiny models and converted checkpoints are kept (default ~/.cache/vramfit)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_generate)
    return p


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPE_NAMES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def save_png(image, path: Path, info: dict[str, str]) -> None:
    from PIL.PngImagePlugin import PngInfo

    meta = PngInfo()
    for key, value in info.items():
        meta.add_itxt(key, value)
    tmp = path.with_name(f".{path.name}.tmp")
    image.save(tmp, format="PNG", pnginfo=meta)
    tmp.replace(path)


def run_generate(args) -> int:
    """The `vramfit generate` command: write <out>/<index>-<seed>.png (and compare.png), print paths."""
    from vramfit.config.schema import ModelConfig
    from vramfit.memory.accounting import pick_device
    from vramfit.models.registry import detect_family
    from vramfit.models.sources import resolve_source

    loras = [tuple(item) if not isinstance(item, str) else parse_lora(item) for item in (args.lora or [])]
    if args.compare and not loras:
        raise ValueError("--compare renders the model with and without LoRAs: give at least one --lora")
    for path, _ in loras:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--lora: {path} is not a file")
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)

    source = resolve_source(ModelConfig(path=args.model, tokenizers=args.tokenizers), args.cache_dir)
    family = detect_family(source)
    bundle = family.load(source)
    bundle.extra["t5_precision"] = args.t5
    family.prepare_encoders(bundle)
    pipe = build_pipeline(bundle)
    pipe.set_progress_bar_config(disable=bool(getattr(args, "no_progress", False)), leave=False)
    common = dict(negative=args.negative, seed=args.seed, steps=args.steps, guidance=args.guidance,
                  width=args.width, height=args.height, count=args.count, device=device, dtype=dtype,
                  offload=not args.no_offload, max_sequence_length=args.max_sequence_length)
    _check(pipe, args.prompt, args.steps, args.width, args.height, args.count)

    base = generate(pipe, args.prompt, loras=[], **common) if args.compare else None
    images = generate(pipe, args.prompt, loras=loras, **common)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    guidance = DEFAULT_GUIDANCE[family.name] if args.guidance is None else args.guidance
    settings = {"model": args.model, "steps": str(args.steps), "guidance": str(guidance),
                "size": f"{args.width}x{args.height}",
                "loras": ", ".join(f"{Path(p).name}:{s:g}" for p, s in loras)}
    if args.negative:
        settings["negative"] = args.negative
    paths = []
    for i, image in enumerate(images):
        seed = args.seed + i
        path = out / f"{i}-{seed}.png"
        save_png(image, path, {**settings, "prompt": args.prompt[i // args.count], "seed": str(seed)})
        paths.append(path)
    if base is not None:
        path = out / "compare.png"
        save_png(compare_grid(base, images), path, {**settings, "prompts": " | ".join(args.prompt),
                                                      "seeds": f"{args.seed}..{args.seed + len(images) - 1}"})
        paths.append(path)
    for path in paths:
        print(path)
    sys.stdout.flush()
    return 0
