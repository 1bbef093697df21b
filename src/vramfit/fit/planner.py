"""Predict the peak GPU memory of each phase of a run without loading weights; choose settings
for a budget. What is read: fit/model_facts.py (headers and configs, no tensor data).

Each phase (bytes allocated; n = a tensor's element count):
- cache_latents: the VAE in cache.vae_dtype + VAE_BYTES_PER_PIXEL x the pixels encoded at once: the
  largest bucket's image, or with cache.vae_tiling one tile (at most facts.vae_tile on a side), the
  rest of the image waiting on the device (3 channels in the VAE's dtype).
- cache_text: the largest encoder as the GPU holds it (CLIPs as stored; T5 widened to bf16, then
  stored per model.t5_precision; memory.stream_encoders: its rest and two layers) + its widened
  largest linear when quantized + a chunk's hidden states + TEXT_WORKSPACE. One at a time.
- train: weights W (train precision; LoRA fp32; quantized linears at their exact torchao sizes;
  streamed: what is outside the blocks, plus the slots units are copied into while training, as
  large as the STREAM_SLOTS largest units), optimizer state S and gradients G (exact per trained
  tensor; a streamed full fine-tune stepping in backward with Adafactor steps its streamed weights
  on the device: their state counts in S, STREAM_GRAD_SHARE of a unit of their gradients beside
  the unit, and they count for T; with accumulation and memory.streamed_grad_sums = "device" their
  gradient sums too, all phase long), step temporaries T (STEP_TEMP_BYTES x the values of one
  optimizer pack: the largest trained tensor, or 4 Mi values, at most all trained values),
  activations A (saved + work; with DoRA, LoKr and LoHa the adapted weights they form each step,
  `adapter_temporaries`) and WORKSPACE. A LoRA's trained tensors are those peft builds for
  lora.type and lora.conv_rank (`_adapter_shapes`). The peak is the largest of: the end of forward
  (W + S + accumulated G + A + autocast's bf16 weight copies); backward (W + S + G + work, + the
  saved inputs too with accumulation, whose buffer lives through every backward); the step after
  backward (W + S + G + T); with optimizer_in_backward instead backward with one tensor's gradient
  (all of G with accumulation) + A + IN_BACKWARD_TEMP_SHARE x T (Adafactor and AdamW step a tensor
  of more than 4 Mi values in chunks there: T of at most 4 Mi values). With that step, accumulation
  and memory.resident_blocks, RESIDENT_ACCUM_SHARE of the resident stream blocks' weight bytes more
  all phase long: measured beyond the terms above, its cause not yet found.
- samples (with sample.every_steps or every_epochs; train.cuda_graphs drops its recordings, their pool and its
  gradient buffers before a grid): S + the largest of the two largest encoders together (model
  CPU offload leaves the last encoder on the GPU while the first run again for the negative
  prompt), W + SAMPLE_WORK x the largest block's elements at the sample size for both halves of
  guidance (where the family's guidance doubles the batch: not Flux.1's), and the VAE decoding one
  image (VAE_DECODE_BYTES_PER_PIXEL); all but W and T5 (reloaded stored as it loads) doubled where
  the grid runs in fp32.
- ema (ema.enabled, ema.device = "gpu"): the EMA of every trained tensor on the device, 4 bytes a
  value (2 in bf16), in train, samples and save; in CPU memory it adds no term here (plan_report
  states its host bytes: `ema_host_bytes`).
- save: W + S + SAVE_WORKSPACE, or SAVE_WORKSPACE_STREAMED with streamed weights (the optimizer
  still lives while the state is written).

Activations: a small per-family model (each family's `activations`, models/<family>/memory.py)
counts elements per batch item: with gradient checkpointing the inputs of the checkpointed modules
(SDXL family: each resnet and transformer block, the layers around them; SD3: each joint block's
image + text tokens x width) x `saved`, plus the largest block's tokens x channels x `work` (its
recompute). A share s of the blocks checkpointed (memory/checkpointing.py, spread evenly): the
model lists the checkpointable blocks in the order the forward calls them and picks the ones that
recompute as PartialCheckpoint does; those keep their input x `saved`, the others their input x
`all_resnet` / `all_block`, the layers between blocks their inputs x `saved`; plus the `work` of
the largest block that recomputes. Without checkpointing it is the same sum with no block
recomputing and no work. Offloaded activations keep only the largest block's `work`, at any share.
The constants per element kept (`_CONSTANTS`): `all_resnet` / `all_block` under autocast,
`bf16_resnet` / `bf16_block` in full bf16 and fp32 (at twice the bytes), `lora_block` for a LoRA's
blocks where the family has one.

Constants: the fitted ones (the names above, `_CONSTANTS`, STREAMED_FULL_COST) are read from
fit/calibration.json at import, which records each one's unit, the measurements it was fitted to,
and how far today's predictions are from every measured bench phase that depends on it
(`python bench/plan_check.py docs/bench/*.json --write-calibration src/vramfit/fit/calibration.json`
rewrites those errors).

Budget: `choose` tries the combinations of the memory settings the user did not set, fastest first
(the ladder in `KNOBS`), and takes the first whose every phase fits in budget x (1 - MARGIN)
and whose predicted host peak (fit/host.py, `host_prediction`) fits memory.host_budget.
Cost: building the denoiser on the meta device (about a second for SDXL), reading headers.
"""
from __future__ import annotations

import itertools
import json
import math
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from vramfit.config.rules import (WHOLE_STEP_OPTIMIZERS, streamed_step_in_cpu_memory, streamed_step_on_device,
                                  streamed_sums_on_device)
from vramfit.config.schema import RunConfig, parse_size
from vramfit.data.buckets import make_buckets
from vramfit.memory.accounting import pick_device
from vramfit.memory.checkpointing import recomputed_blocks
from vramfit.fit.model_facts import (ModelFacts, caches_frozen_text, encoder_device_bytes, quantized_linear_bytes,
                                     read_facts, sampled_encoder_bytes, state_bytes, weight_item_bytes)
from vramfit.fit.estimates import GIB, MIB, PhaseEstimate, Phases, size_text
from vramfit.fit.host import DenoiserHost, HostPrediction, host_budget_of, local_processes, predict_host
from vramfit.memory.offload.units import stream_blocks, too_many_resident
from vramfit.models.adapter import t5_tokens
from vramfit.models.registry import FAMILIES
from vramfit.optim.base import ParamOptimizer
from vramfit.optim.build import optimizer_class, other_state_bytes
from vramfit.optim.wrapped import WrappedOptimizer
from vramfit.train.distributed import composition_problems, launched_world
from vramfit.train.lora import conv_modules, target_modules

MARGIN = 0.10  # a choice must fit in budget x (1 - MARGIN): prediction error and fragmentation

VAE_IMAGE_CHANNELS = 3  # the image, on the device in the VAE's dtype while its tiles encode
TEXT_CHUNK = 64  # captions per encode call (train/data.py)


@dataclass(frozen=True)
class ActivationConstants:
    saved: float  # bytes per saved element (2 = one bf16 copy)
    work: float  # bytes per element of the largest block's tokens x channels, recompute
    all_resnet: float  # without checkpointing, bytes per element of a resnet's input
    all_block: float  # ... of a transformer block's input (a full fine-tune: every linear saves its input)
    # all_block under LoRA, whose frozen linears save no input; None: the same
    lora_block: Optional[float] = None
    # all_resnet and all_block of a full fine-tune in full bf16, where no autocast copy is saved; None: the same
    bf16_resnet: Optional[float] = None  # (fp32 too, at twice the bytes; a LoRA's lora_block still wins)
    bf16_block: Optional[float] = None


# ---- the fitted constants: fit/calibration.json ----------------------------------------------------

CALIBRATION = Path(__file__).with_name("calibration.json")
_UNITS = {"MiB": MIB}  # values written in these units are used in bytes


def calibration_values(data: dict) -> dict[str, object]:
    """The planner's fitted constants from calibration.json's data, named and shaped as this module
    uses them (sizes in bytes). Raises ValueError naming a constant missing or unknown."""
    entries = dict(data["constants"])

    def take(name: str):
        if name not in entries:
            raise ValueError(f"no constant {name}")
        entry = entries.pop(name)
        scale, value = _UNITS.get(entry["unit"], 1), entry["value"]
        if scale == 1:
            return value
        return {k: v * scale for k, v in value.items()} if isinstance(value, dict) else value * scale

    out = {name: take(name) for name in (
        "VAE_BYTES_PER_PIXEL", "VAE_DECODE_BYTES_PER_PIXEL", "SAMPLE_WORK", "TEXT_WORKSPACE", "STEP_TEMP_BYTES",
        "IN_BACKWARD_TEMP_SHARE", "STREAM_GRAD_SHARE", "RESIDENT_ACCUM_SHARE", "WORKSPACE", "SAVE_WORKSPACE", "SAVE_WORKSPACE_STREAMED",
        "STREAMED_FULL_COST")}
    out["STREAM_SLOTS"] = {key == "true": n for key, n in take("STREAM_SLOTS").items()}
    out["_CONSTANTS"] = {family: ActivationConstants(**fields)
                         for family, fields in take("ACTIVATION_CONSTANTS").items()}
    if entries:
        raise ValueError(f"unknown constants {', '.join(entries)}")
    return out


def _read_calibration() -> dict[str, object]:
    try:
        return calibration_values(json.loads(CALIBRATION.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise RuntimeError(f"{CALIBRATION}: the planner's constants cannot be read ({e}); this file ships with "
                           "vramfit: reinstall it") from e


_FITTED = _read_calibration()
VAE_BYTES_PER_PIXEL = _FITTED["VAE_BYTES_PER_PIXEL"]  # by cache.vae_dtype, a pixel encoded at once
VAE_DECODE_BYTES_PER_PIXEL = _FITTED["VAE_DECODE_BYTES_PER_PIXEL"]  # bf16, one image (sample grids)
SAMPLE_WORK = _FITTED["SAMPLE_WORK"]  # by family: bf16 bytes per element of `work` per image, no gradients
TEXT_WORKSPACE = _FITTED["TEXT_WORKSPACE"]
STEP_TEMP_BYTES = _FITTED["STEP_TEMP_BYTES"]  # by optimizer: fp32 temporaries per value of a pack
IN_BACKWARD_TEMP_SHARE = _FITTED["IN_BACKWARD_TEMP_SHARE"]  # of T, overlapping the activation peak
STREAM_GRAD_SHARE = _FITTED["STREAM_GRAD_SHARE"]  # of a stream unit: its gradients waiting to step on the device
# of the resident stream blocks' weights: held beyond the counted terms with the step inside backward
# and accumulation (measured; its cause not yet found)
RESIDENT_ACCUM_SHARE = _FITTED["RESIDENT_ACCUM_SHARE"]
# the device buffers streamed units are copied into, kept while training (memory/offload/slots.py):
# as large as this many of the largest units, by whether streamed weights step on the device
STREAM_SLOTS = _FITTED["STREAM_SLOTS"]
WORKSPACE = _FITTED["WORKSPACE"]
SAVE_WORKSPACE = _FITTED["SAVE_WORKSPACE"]
SAVE_WORKSPACE_STREAMED = _FITTED["SAVE_WORKSPACE_STREAMED"]
_CONSTANTS = _FITTED["_CONSTANTS"]  # by family: ActivationConstants


# ---- bytes of each term -----------------------------------------------------------------------------

@dataclass
class _Tensor:
    name: str
    shape: tuple
    numel: int
    dtype_bytes: int
    trained: bool
    streamed: bool = False
    kept_block: bool = False  # a weight of a stream block memory.resident_blocks keeps on the device


def _adapted_modules(facts: ModelFacts, cfg: RunConfig) -> list[tuple[str, torch.nn.Module, int]]:
    """(name, module, rank) of every module train/lora.py adapts: the targeted linears at lora.rank
    and, with lora.conv_rank, the UNet's convolutions it picks at that rank."""
    linears = [(n, facts.denoiser.get_submodule(n), cfg.lora.rank)
               for n in target_modules(facts.denoiser, cfg.lora)]
    convs = conv_modules(facts.denoiser) if cfg.lora.conv_rank else []
    return linears + [(n, facts.denoiser.get_submodule(n), cfg.lora.conv_rank) for n in convs]


def _factor_pair(dim: int, factor: int) -> tuple[int, int]:
    """(m, n), m * n = dim, as LoKr splits a dimension for lora.lokr_factor: the factor itself
    where it divides dim, else m the largest divisor at most sqrt(dim) (and at most the factor)."""
    if factor > 0 and dim % factor == 0:
        return factor, dim // factor
    limit = dim if factor == -1 else factor
    m = max((d for d in range(1, int(dim ** 0.5) + 1) if dim % d == 0 and d <= limit), default=1)
    return m, dim // m


def _adapter_shapes(kind: str, module: torch.nn.Module, r: int, factor: int) -> dict[str, tuple]:
    """The trained tensors (peft's names) of one module's adapter of `kind` at rank r: LoRA's A
    and B (a conv's A carries the kernel, its B is 1x1), DoRA's + a magnitude per output row,
    LoHa's two pairs (a conv flattened to [out, in x kernel]), LoKr's Kronecker factors (w1 whole;
    w2 whole where r reaches half its larger side, else as a rank-r pair)."""
    conv = isinstance(module, torch.nn.Conv2d)
    if conv:
        out, inp, kernel = module.out_channels, module.in_channels // module.groups, tuple(module.kernel_size)
    else:
        out, inp, kernel = module.out_features, module.in_features, ()
    flat = inp * math.prod(kernel)
    if kind in ("lora", "dora"):
        shapes = {"lora_A": (r, inp, *kernel), "lora_B": (out, r, *(1,) * len(kernel))}
        if kind == "dora":  # a conv's as [1, out, 1, 1]
            shapes["lora_magnitude_vector"] = (1, out, 1, 1) if conv else (out,)
        return shapes
    if kind == "loha":
        return {"hada_w1_a": (out, r), "hada_w1_b": (r, flat), "hada_w2_a": (out, r), "hada_w2_b": (r, flat)}
    (out_l, out_k), (in_m, in_n) = _factor_pair(out, factor), _factor_pair(inp, factor)
    shapes = {"lokr_w1": (out_l, in_m)}
    if r >= max(out_k, in_n) / 2:
        shapes["lokr_w2"] = (out_k, in_n, *kernel)
    else:
        shapes.update({"lokr_w2_a": (out_k, r), "lokr_w2_b": (r, in_n * math.prod(kernel))})
    return shapes


def _lora_tensors(facts: ModelFacts, cfg: RunConfig) -> list[_Tensor]:
    """The adapter's trained fp32 tensors as train/lora.py has peft build them for lora.type."""
    out = []
    for name, module, r in _adapted_modules(facts, cfg):
        for part, shape in _adapter_shapes(cfg.lora.type, module, r, cfg.lora.lokr_factor).items():
            out.append(_Tensor(f"{name}.{part}", shape, math.prod(shape), 4, True))
    return out


def adapter_temporaries(facts: ModelFacts, cfg: RunConfig) -> int:
    """Bytes of the weight-sized fp32 tensors DoRA, LoKr and LoHa form each step (0 for LoRA):
    LoKr and LoHa build each adapted module's update (its weight's size) and the product with the
    input keeps it for backward, in every module whose block does not recompute (with
    checkpointing, the blocks that recompute form theirs again in backward: the largest, twice
    while it is formed); DoRA forms B A and W + s B A one module at a time to take row norms
    (two of the largest)."""
    if cfg.train.mode != "lora" or cfg.lora.type == "lora":
        return 0
    sizes = [4 * module.weight.numel() for _, module, _ in _adapted_modules(facts, cfg)]
    largest = max(sizes, default=0)
    if cfg.lora.type == "dora":
        return 2 * largest
    kept = (1.0 - _checkpointed_share(cfg)) * sum(sizes)
    return int(kept) + (2 * largest if _checkpointed_share(cfg) else largest)


def _quantized(facts: ModelFacts, cfg: RunConfig) -> dict[int, int]:
    """Bytes of each linear weight a LoRA's lora.base_quantization quantizes, by the weight's id."""
    method = cfg.lora.base_quantization if cfg.train.mode == "lora" else "none"
    quantized: dict[int, int] = {}
    if method != "none":
        for m in facts.denoiser.modules():
            if isinstance(m, torch.nn.Linear):
                size = quantized_linear_bytes(m.out_features, m.in_features, method)
                if size is not None:
                    quantized[id(m.weight)] = size
    return quantized


def _stream_blocks(facts: ModelFacts, cfg: RunConfig, quantized: dict[int, int],
                   resident: int = 0) -> list[tuple[str, torch.nn.Module, bool]]:
    """The stream blocks as the streamer cuts them for `cfg` (units.py `stream_blocks`: quantized
    weights never stream; a LoRA's frozen base under checkpointing cut no finer than the recomputed
    blocks), `resident` of them kept."""
    limit = int(cfg.memory.stream_unit_mib * MIB * 4 / weight_item_bytes(cfg))  # meta tensors are fp32
    whole = cfg.train.gradient_checkpointing is not False and cfg.train.mode != "full"
    return stream_blocks(facts.denoiser, FAMILIES[facts.family].block_containers, limit,
                         lambda p: id(p) not in quantized, resident, whole)


def block_count(facts: ModelFacts, cfg: RunConfig) -> int:
    """The stream blocks of `cfg`'s run (the denoiser's blocks, those over memory.stream_unit_mib
    cut into their parts), among which memory.resident_blocks counts."""
    return len(_stream_blocks(facts, cfg, _quantized(facts, cfg)))


def resident_problem(facts: ModelFacts, cfg: RunConfig) -> Optional[str]:
    """What is wrong with `cfg`'s memory.resident_blocks for this model (more than its stream
    blocks), or None; the same words the streamer would use when it places the weights."""
    resident = cfg.memory.resident_blocks or 0
    if not (cfg.memory.stream_weights and resident):
        return None
    return too_many_resident(resident, block_count(facts, cfg), FAMILIES[facts.family].block_containers,
                             cfg.memory.stream_unit_mib)


def _denoiser_tensors(facts: ModelFacts, cfg: RunConfig) -> tuple[list[_Tensor], list[int]]:
    """The denoiser's tensors as the run places them and the bytes of each stream unit, largest
    first (the slots of memory/offload/slots.py take the largest units' sizes: STREAM_SLOTS). The
    stream blocks memory.resident_blocks keeps (the streamer's own pick, units.py `stream_blocks`;
    None as 0) are resident."""
    dtype_bytes = weight_item_bytes(cfg)
    lora = cfg.train.mode == "lora"
    quantized = _quantized(facts, cfg)
    streamed_ids: set[int] = set()
    kept_ids: set[int] = set()
    unit_sizes: list[int] = []
    if cfg.memory.stream_weights:
        try:
            found = _stream_blocks(facts, cfg, quantized, cfg.memory.resident_blocks or 0)
        except ValueError:  # more resident than there are
            raise PlanError(resident_problem(facts, cfg)) from None
        for _, unit, kept in found:
            if kept:
                kept_ids.update(id(p) for p in unit.parameters())
                continue
            ids = [id(p) for p in unit.parameters() if id(p) not in quantized and id(p) not in streamed_ids]
            streamed_ids.update(ids)
            unit_sizes.append(sum(p.numel() for p in unit.parameters() if id(p) in ids) * dtype_bytes)
    tensors = []
    for name, p in facts.denoiser.named_parameters():
        size = quantized.get(id(p))
        if size is not None:
            tensors.append(_Tensor(name, tuple(p.shape), size, 1, False))
            continue
        tensors.append(_Tensor(name, tuple(p.shape), p.numel(), dtype_bytes, not lora, id(p) in streamed_ids,
                               id(p) in kept_ids))
    for name, b in facts.denoiser.named_buffers():
        if b.is_floating_point():
            tensors.append(_Tensor(name, tuple(b.shape), b.numel(), dtype_bytes, False))
    if lora:
        tensors += _lora_tensors(facts, cfg)
    return tensors, sorted(unit_sizes, reverse=True)


class Prediction(Phases):
    """The planner's peak GPU memory by phase."""

    def table(self) -> str:
        rows = [f"{'phase':<14}{'predicted':>11}   terms"]
        for p in self.phases:
            terms = ", ".join(f"{k} {size_text(v)}" for k, v in p.parts.items() if v)
            rows.append(f"{p.name:<14}{size_text(p.peak):>11}   {terms}")
        return "\n".join(rows)


def all_buckets(cfg: RunConfig) -> list[tuple[int, int]]:
    """The buckets of every dataset of the config (those of data.kohya are planned with [data]'s
    resolution: reading them is the data layer's)."""
    datasets = cfg.data.dataset_list() or [cfg.data]
    return sorted({b for d in datasets for b in make_buckets(d.resolution, d.bucket_step, d.max_aspect)})


def largest_bucket(cfg: RunConfig) -> tuple[int, int]:
    return max(all_buckets(cfg), key=lambda b: b[0] * b[1])


def _vae_phase(facts: ModelFacts, cfg: RunConfig) -> dict[str, int]:
    """The VAE encoding one image of the largest bucket: whole, or tiled (memory/vae_tiling.py
    `set_vae_tiling`: tiles of at most facts.vae_tile on a side, one at a time, while the whole
    image stays on the device; an image no larger than a tile is encoded whole)."""
    dtype = cfg.cache.vae_dtype
    item = 4 if dtype == "fp32" else 2
    tile = facts.vae_tile if cfg.cache.vae_tiling else 1 << 30

    def parts(w: int, h: int) -> dict[str, int]:
        encoded = min(w, tile) * min(h, tile)  # pixels the encoder runs on at once
        return {"activations": VAE_BYTES_PER_PIXEL[dtype] * encoded,
                "image": VAE_IMAGE_CHANNELS * item * (w * h - encoded)}  # the rest of the image, waiting

    worst = max((parts(w, h) for w, h in all_buckets(cfg)), key=lambda x: sum(x.values()))
    return {"vae": facts.vae_params * item, **worst}


def _text_phase(facts: ModelFacts, cfg: RunConfig, captions: int) -> dict[str, int]:
    """The caption phase: the largest encoder on the device (only T5 where it alone is cached)."""
    best: dict[str, int] = {}
    frozen_only = caches_frozen_text(facts, cfg)
    for enc in facts.encoders:
        if (enc.kind == "t5" and cfg.model.t5_precision == "none") or (frozen_only and enc.kind != "t5"):
            continue
        weights, widened = encoder_device_bytes(enc, cfg.model, cfg.memory)
        tokens = 77 if enc.kind == "clip" else t5_tokens(FAMILIES[facts.family], cfg, facts.config)
        hidden = (enc.layers + 1 if enc.kind == "clip" else 4) * captions * tokens * enc.hidden * 2
        parts = {f"{enc.name}": weights, "widened linear": widened, "hidden states": hidden,
                 "workspace": TEXT_WORKSPACE}
        if sum(parts.values()) > sum(best.values()):
            best = parts
    return best


def _activations(facts: ModelFacts, cfg: RunConfig, side: tuple[int, int]) -> dict[str, int]:
    """Activation bytes at the training peak: {"saved": ..., "work": ...}."""
    k = _CONSTANTS[facts.family]
    family = FAMILIES[facts.family]
    shape = family.activations(facts.config, side[1] // 8, side[0] // 8, t5_tokens(family, cfg, facts.config))
    scale = cfg.step_batch * (2.0 if cfg.train.precision == "fp32" else 1.0)  # class images double it
    work = k.work * shape.work * scale
    resnet, block = k.all_resnet, k.all_block
    if cfg.train.precision in ("full_bf16", "fp32"):  # no autocast copies (fp32: twice the bytes, in `scale`)
        resnet = k.bf16_resnet if k.bf16_resnet is not None else resnet
        block = k.bf16_block if k.bf16_block is not None else block
    if cfg.train.mode == "lora" and k.lora_block is not None:
        block = k.lora_block
    share = _checkpointed_share(cfg)
    if share == 1.0:
        return {"saved": 0 if cfg.memory.offload_activations else int(k.saved * shape.saved * scale), "work": int(work)}
    # the blocks that recompute keep their inputs, the others every activation; the layers between
    # blocks never recompute and keep their inputs, as under full checkpointing (none recompute
    # without checkpointing: the same sum, with no recompute's work)
    recomputes = recomputed_blocks(share, len(shape.blocks)) if share else [False] * len(shape.blocks)
    inputs = shape.fixed + sum(n for (_, n), r in zip(shape.blocks, recomputes) if r)
    offloaded = cfg.memory.offload_activations  # every block's activations come back: the largest block's work
    if share and not offloaded:  # the recompute's working memory is that of the largest block that recomputes
        work = k.work * max((n for (_, n), r in zip(shape.blocks, recomputes) if r), default=0) * scale
    kept = resnet * shape.unchecked + sum(n * (resnet if kind == "resnet" else block)
                                          for (kind, n), r in zip(shape.blocks, recomputes) if not r)
    saved = 0.0 if offloaded else (k.saved * inputs + kept) * scale
    return {"saved": int(saved), "work": int(work) if share or offloaded else 0}


def _checkpointed_share(cfg: RunConfig) -> float:
    """The share of the denoiser's blocks that recompute in backward (memory/checkpointing.py)."""
    setting = cfg.train.gradient_checkpointing
    return 1.0 if setting is True else 0.0 if setting is False else float(setting)


def optimizer_state_bytes(optimizer: str, x: "_Tensor") -> int:
    """Optimizer state of one trained tensor, as optim/ (or the class it wraps) allocates it."""
    counted = other_state_bytes(optimizer, x.numel, x.shape, x.dtype_bytes)
    return state_bytes(optimizer, x.numel, x.shape, x.dtype_bytes) if counted is None else counted


def device_terms(facts: ModelFacts, cfg: RunConfig) -> dict[str, int]:
    """Bytes on the device while training, exact where vramfit allocates them itself: weights
    (incl. buffers, LoRA, quantized linears; the stream unit apart), optimizer state, all
    gradients, the bf16 copies autocast makes, and the largest trained tensor (bytes, elements)."""
    tensors, units = _denoiser_tensors(facts, cfg)
    unit = units[0] if units else 0
    on_device = [x for x in tensors if not x.streamed]
    # streamed weights that step on the device inside backward keep their state there too, and
    # their unit's gradients wait there until it steps (memory/offload/grads.py)
    stepped_here = streamed_step_on_device(cfg)
    trained = [x for x in tensors if x.trained and (stepped_here or not x.streamed)]
    none = _Tensor("", (), 0, 0, True)
    largest = max((x for x in trained if not x.streamed), key=lambda x: x.numel, default=none)
    stepped = max(trained, key=lambda x: x.numel, default=none)
    return {"weights": sum(x.numel * x.dtype_bytes for x in on_device),  # quantized: numel = bytes
            # on the device only while a streamed block runs; stepped here, a share of a unit's gradients too
            "stream unit": sum(units[:STREAM_SLOTS[stepped_here]])
            + (int(STREAM_GRAD_SHARE * unit) if stepped_here else 0),
            "optimizer state": sum(optimizer_state_bytes(cfg.train.optimizer, x) for x in trained),
            "gradients": sum(x.numel * x.dtype_bytes for x in trained if not x.streamed),
            # memory.streamed_grad_sums = "device": the streamed weights' sums, kept through the phase
            "gradient sums": sum(x.numel * x.dtype_bytes for x in trained if x.streamed)
            if streamed_sums_on_device(cfg) else 0,
            # beside the trained weights: the denoiser's not streamed, and the trained text encoders'
            "ema": (sum(x.numel for x in trained if not x.streamed) + trained_encoder_values(facts, cfg))
            * _ema_item(cfg) if cfg.ema.device == "gpu" else 0,
            "autocast copies": sum(2 * x.numel for x in on_device if x.dtype_bytes == 4)
            if cfg.train.precision == "mixed_bf16" else 0,
            "largest bytes": largest.numel * largest.dtype_bytes, "largest numel": largest.numel,
            # the optimizer steps packs of tensors of up to this many values (optim/base.py)
            "pack numel": min(sum(x.numel for x in trained),
                              max(stepped.numel, ParamOptimizer.MIN_PACK_NUMEL)),
            "trained numel": sum(x.numel for x in trained),
            # the weights of the stream blocks memory.resident_blocks keeps (quantized ones apart)
            "kept block bytes": sum(x.numel * x.dtype_bytes for x in on_device if x.kept_block)}


def _ema_item(cfg: RunConfig) -> int:
    """Bytes an EMA value takes (memory/ema.py); 0 without [ema]."""
    return 0 if not cfg.ema.enabled else 4 if cfg.ema.dtype == "fp32" else 2


def ema_host_bytes(facts: ModelFacts, cfg: RunConfig) -> int:
    """Host memory of an EMA in CPU memory (ema.device = "cpu"): the EMA itself and the staging copy
    of the trained weights it is updated from (memory/ema.py); 0 otherwise."""
    if not cfg.ema.enabled or cfg.ema.device != "cpu":
        return 0
    trained = [x for x in _denoiser_tensors(facts, cfg)[0] if x.trained]
    # the trained text encoders' values: fp32 LoRA, or the whole CLIPs in the weights' dtype
    encoder_item = weight_item_bytes(cfg) if cfg.text_encoder_training == "full" else 4
    return sum(x.numel * (_ema_item(cfg) + x.dtype_bytes) for x in trained) + \
        trained_encoder_values(facts, cfg) * (_ema_item(cfg) + encoder_item)


def _train_phase(facts: ModelFacts, cfg: RunConfig, side: tuple[int, int], terms: dict[str, int]) -> dict[str, int]:
    """The training phase's parts; `terms`: `device_terms(facts, cfg)`."""
    t = cfg.train
    grads = terms["gradients"]
    temps = STEP_TEMP_BYTES[t.optimizer] * terms["pack numel"]
    if t.optimizer in WHOLE_STEP_OPTIMIZERS and t.precision == "full_bf16":  # fp32 copies of bf16 weights
        temps += WrappedOptimizer.COPY_BYTES * terms["trained numel"]
    act = _activations(facts, cfg, side)
    act["adapter weights"] = adapter_temporaries(facts, cfg)  # with the activations: formed in forward
    base = {k: terms[k] for k in ("weights", "stream unit", "optimizer state", "ema", "gradient sums")}
    if not cfg.cache.latents:
        base.update(_vae_phase(facts, cfg))
    if not cfg.cache.text:
        base["text encoder"] = max((encoder_device_bytes(e, cfg.model, cfg.memory)[0] for e in facts.encoders), default=0)
    if cfg.text_encoder_training:
        base.update(_trained_encoders(facts, cfg))
        base.pop("text encoder", None)  # a frozen T5's outputs are cached (caches_frozen_text)
    base["workspace"] = WORKSPACE
    if t.optimizer_in_backward and t.grad_accum > 1 and cfg.memory.resident_blocks:
        base["resident blocks, accumulating (measured)"] = int(RESIDENT_ACCUM_SHARE * terms["kept block bytes"])
    accumulated = grads if t.grad_accum > 1 else 0  # the earlier micro-batches' sum lives on
    if t.cuda_graphs is True and not t.optimizer_in_backward:
        # train/graphs.py: the gradient buffers stay allocated, and the recordings' pool keeps the
        # room of the activations while the optimizer steps. With the step inside backward the
        # recorded backward steps too: its pool's peak is the eager step's (below)
        return {**base, **max([{"gradients": grads, **act, "autocast copies": terms["autocast copies"]},
                               {"gradients": grads, **act, "step temporaries": temps}],
                              key=lambda c: sum(c.values()))}
    # autocast's bf16 copies of the fp32 weights live until forward ends
    candidates = [{"gradients": accumulated, **act, "autocast copies": terms["autocast copies"]}]
    if t.optimizer_in_backward:
        # tensors of more than a pack limit step in chunks of one (the optimizers' `chunks_weights_of`:
        # Adafactor, and AdamW on bf16 weights; fp32 ones step in place)
        weights = torch.bfloat16 if t.precision == "full_bf16" else torch.float32
        if optimizer_class(t.optimizer).chunks_weights_of(weights):
            temps = STEP_TEMP_BYTES[t.optimizer] * min(terms["pack numel"], ParamOptimizer.MIN_PACK_NUMEL)
        candidates.append({"gradients": max(accumulated, terms["largest bytes"]), **act,
                           "step temporaries": int(IN_BACKWARD_TEMP_SHARE * temps)})
    else:
        # the gradients grow while the saved activations are freed
        held = act["saved"] if t.grad_accum > 1 else 0
        candidates.append({"gradients": grads, "saved": held, "work": act["work"]})
        candidates.append({"gradients": grads, "step temporaries": temps})
    return {**base, **max(candidates, key=lambda c: sum(c.values()))}


def trained_encoder_values(facts: ModelFacts, cfg: RunConfig) -> int:
    """Values trained in the CLIP text encoders: every weight (train.text_encoders = "full"), or
    their LoRA's (lora.text_encoder_rank: 18 * rank * hidden a layer, by q/k/v/out and fc1/fc2);
    0 where they are frozen."""
    clips = [e for e in facts.encoders if e.kind == "clip"]
    if cfg.text_encoder_training == "full":
        return sum(e.params for e in clips)
    if cfg.text_encoder_training == "lora":
        return sum(18 * cfg.lora.text_encoder_rank * e.hidden * e.layers for e in clips)
    return 0


# `_trained_encoders`' terms that live as long as the run, not only through the step
TRAINED_ENCODERS_KEPT = ("text encoders trained", "text encoder lora", "text encoder optimizer state")


def _trained_encoders(facts: ModelFacts, cfg: RunConfig) -> dict[str, int]:
    """Trained CLIP encoders stay on the GPU through the step (T5 never trains), with the activations
    their backward keeps (about 20 values of each token's width a layer: attention, MLP, norms).
    lora.text_encoder_rank: their weights as stored, and their fp32 LoRA (weights, gradients, two
    optimizer moments at most: 16 bytes a value, by the q/k/v/out and fc1/fc2 linears of each layer:
    18 * rank * hidden). train.text_encoders = "full": their weights and gradients in the training
    precision (bf16 under full_bf16, else fp32) and the optimizer's state of them (the linears as one
    matrix of their rows, the token table as a matrix, the rest as vectors)."""
    clips = [e for e in facts.encoders if e.kind == "clip"]
    batch = cfg.step_batch
    item = 4 if cfg.train.precision == "fp32" else 2
    act = {"text encoder activations": sum(20 * item * batch * 77 * e.hidden * e.layers for e in clips)}
    if cfg.text_encoder_training == "full":
        weight = weight_item_bytes(cfg)
        state, name = 0, cfg.train.optimizer
        for e in clips:
            rows, hidden = max(e.linear_rows, 1), max(e.hidden, 1)
            rest = e.params - e.linear_numel - e.embedding_numel
            for numel, shape in ((e.linear_numel, (rows, e.linear_numel // rows)),
                                 (e.embedding_numel, (e.embedding_numel // hidden, hidden)), (rest, (rest,))):
                other = other_state_bytes(name, numel, shape, weight)
                state += state_bytes(name, numel, shape, weight) if other is None else other
        return {"text encoders trained": sum(weight * e.params for e in clips),
                "text encoder gradients": sum(weight * e.params for e in clips),
                "text encoder optimizer state": state, **act}
    return {"text encoders trained": sum(encoder_device_bytes(e, cfg.model, cfg.memory)[0] for e in clips),
            "text encoder lora": 16 * trained_encoder_values(facts, cfg), **act}


def _samples_phase(facts: ModelFacts, cfg: RunConfig, terms: dict[str, int]) -> dict[str, int]:
    """Sample grids (train/samples.py): diffusers' model CPU offload brings one model at a time to
    the GPU (a streamed denoiser streams instead, beside the whole VAE); with captions cached the
    prompts were encoded before (the denoiser, then the VAE),
    else the last text encoder is still there when the first ones run again for the negative
    prompt (the two largest encoders at once); the optimizer state stays. The grid
    runs every model in the dtype of the denoiser's frozen weights (all its weights when none is
    frozen: train/samples.py `grid_dtype`), which is bf16 under full_bf16 and fp32 otherwise (a
    LoRA's base too): fp32 doubles every term but the weights."""
    item = weight_item_bytes(cfg)
    encoders = sorted(sampled_encoder_bytes(e, cfg.model.t5_precision, item) for e in facts.encoders
                      if e.kind != "t5" or cfg.model.t5_precision != "none")
    w, h = cfg.sample.width or cfg.data.resolution, cfg.sample.height or cfg.data.resolution
    family = FAMILIES[facts.family]
    shape = family.activations(facts.config, h // 8, w // 8, t5_tokens(family, cfg, facts.config))
    guidance = family.default_guidance if cfg.sample.guidance is None else cfg.sample.guidance
    halves = 2 if family.guidance_doubles_batch and guidance > 1 else 1  # guidance: both halves at once
    work = {"work": int(halves * SAMPLE_WORK[facts.family] * item / 2 * shape.work)}
    decoding = {"activations": int(VAE_DECODE_BYTES_PER_PIXEL * item / 2 * w * h)}
    kept = {"optimizer state": terms["optimizer state"], "ema": terms["ema"]}
    if cfg.memory.stream_weights:
        # a streamed denoiser renders as it trains (its resident weights, slots and device sums stay),
        # with the VAE on the device through the grid (prompts always encoded before: config/rules.py)
        streamed = {k: terms[k] for k in ("weights", "stream unit", "gradient sums")}
        return {**kept, **streamed, "vae": item * facts.vae_params,
                **max(work, decoding, key=lambda st: sum(st.values())), "workspace": WORKSPACE}
    # with captions and latents cached the prompts were encoded in the caption phase (train/samples.py)
    stages = [{"text encoders": 0 if cfg.cache.text and cfg.cache.latents else sum(encoders[-2:])},
              {"weights": terms["weights"], **work},
              {"vae": item * facts.vae_params, **decoding}]
    return {**kept, **max(stages, key=lambda st: sum(st.values())), "workspace": WORKSPACE}


def predict(facts: ModelFacts, cfg: RunConfig, captions: int = TEXT_CHUNK) -> Prediction:
    """Predicted peak GPU allocation of each phase `cfg` runs (see the module docstring)."""
    side = largest_bucket(cfg)
    phases = []
    if cfg.cache.latents:
        parts = _vae_phase(facts, cfg)
        phases.append(PhaseEstimate("cache_latents", sum(parts.values()), parts))
    if cfg.cache.text or caches_frozen_text(facts, cfg):
        parts = _text_phase(facts, cfg, min(captions, TEXT_CHUNK))
        phases.append(PhaseEstimate("cache_text", sum(parts.values()), parts))
    terms = device_terms(facts, cfg)
    parts = _train_phase(facts, cfg, side, terms)
    phases.append(PhaseEstimate("train", sum(parts.values()), parts))
    # trained text encoders stay on the device through grids and saves (a grid renders with copies)
    encoders = {k: v for k, v in parts.items() if k in TRAINED_ENCODERS_KEPT}
    if cfg.sample.grids:
        # (CUDA graphs drop their pool and buffers before a grid)
        samples = {**_samples_phase(facts, cfg, terms), **encoders}
        phases.append(PhaseEstimate("samples", sum(samples.values()), samples))
    parts = {k: v for k, v in parts.items()
             if k in ("weights", "optimizer state", "ema", *TRAINED_ENCODERS_KEPT)}
    parts["workspace"] = SAVE_WORKSPACE_STREAMED if cfg.memory.stream_weights else SAVE_WORKSPACE
    phases.append(PhaseEstimate("save", sum(parts.values()), parts))
    return Prediction(phases)


# ---- choosing settings for a budget ----------------------------------------------------------------

@dataclass(frozen=True)
class Knob:
    """A memory setting the planner may choose: options fastest first, a rank each, the phase group
    it acts on. Ranks are powers of two (but nf4, one above int8, and a share of the blocks
    checkpointed, that share of checkpointing's 1: less recomputation, so tried first), so sorting
    combinations by their sum follows the ladder: with CUDA graphs, checkpointing, then the step in
    backward (recorded with the backward: SSD-1B 0.180 s a step at 3.30 GiB, against 0.364 s at
    5.61 GiB for checkpointing alone without graphs, docs/benchmarks.md), then both; then the same
    without graphs, + offloaded activations; + quantized base (LoRA; int8, then nf4 with the same
    other settings); + streamed weights: a rung is taken only when no mix of the earlier ones fits.
    A combination the config's own checks refuse (graphs beside streamed weights that step in
    CPU memory, say) is skipped."""

    key: str  # section.name
    options: tuple
    costs: tuple
    group: str  # "cache_latents" | "cache_text" | "train"


KNOBS = (
    # a share of the blocks recomputes (memory/checkpointing.py): less recomputation than all of them
    Knob("train.gradient_checkpointing", (False, 0.25, 0.5, 0.75, True), (0, 0.25, 0.5, 0.75, 1), "train"),
    # the step in backward records with the backward (train/graphs.py): cheap beside graphs
    Knob("train.optimizer_in_backward", (False, True), (0, 2), "train"),
    # its copies record with graphs (memory/offload/activations.py keeps the pinned buffers)
    Knob("memory.offload_activations", (False, True), (0, 4), "train"),
    # without graphs every step is bound by the host: slower than any recorded rung
    Knob("train.cuda_graphs", (True, False), (0, 8), "train"),
    # nf4 just after int8: a step over either is about as fast (SD3-M LoRA 512 batch 4, docs/benchmarks.md:
    # 0.193 s int8 and 0.204 s nf4 with graphs, 0.423 s int8 without), so a quantized base
    # that keeps graphs (or leaves the step out of backward, or activations on the GPU) comes first
    Knob("lora.base_quantization", ("none", "int8", "nf4"), (0, 16, 17), "train"),
    Knob("memory.stream_weights", (False, True), (0, 64), "train"),
    Knob("cache.vae_dtype", ("fp32", "bf16"), (0, 1), "cache_latents"),
    Knob("cache.vae_tiling", (False, True), (0, 2), "cache_latents"),
    Knob("model.t5_precision", ("bf16", "int8", "nf4"), (0, 1, 2), "cache_text"),  # never "none" by itself
    Knob("memory.stream_encoders", (False, True), (0, 4), "cache_text"),  # after every T5 precision alone
)


# where a full fine-tune's streamed weights rank (memory.stream_weights' cost): after every rung with
# CUDA graphs, before the first without (fitted to step times: calibration.json)
STREAMED_FULL_COST = _FITTED["STREAMED_FULL_COST"]


def ladder(cfg: RunConfig) -> tuple[Knob, ...]:
    """KNOBS as ranked for `cfg`'s run (STREAMED_FULL_COST)."""
    if cfg.train.mode != "full":
        return KNOBS
    return tuple(replace(k, costs=(0, STREAMED_FULL_COST)) if k.key == "memory.stream_weights" else k
                 for k in KNOBS)


class PlanError(ValueError):
    """No combination of the free settings fits the budget; the message says what would."""


@dataclass
class Choice:
    config: RunConfig
    budget: int
    chosen: dict[str, object]  # key -> value the planner set (including ones equal to the default)
    reasons: list[str]
    before: Prediction
    after: Prediction


def setting(cfg: RunConfig, key: str):
    """The value of "section.name" in cfg."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def with_values(cfg: RunConfig, values: dict[str, object]) -> RunConfig:
    """`cfg` with `values` ({"section.key": value}) set, other settings untouched."""
    sections: dict[str, dict] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return cfg.model_copy(update={s: getattr(cfg, s).model_copy(update=v) for s, v in sections.items()})


def _applies(knob: Knob, cfg: RunConfig, facts: ModelFacts) -> bool:
    # some memory-saving option must pass the config's own checks beside the user's settings and
    # compose with the launched processes: alone, or with the step in backward where that is free
    # too (train.cuda_graphs = true records a full fine-tune's streamed weights only where they step
    # in backward); `choose` checks each combination it tries again
    partners: list[dict] = [{}]
    if "optimizer_in_backward" not in cfg.train.model_fields_set:
        partners.append({"train.optimizer_in_backward": True})
    if not any(_valid(cfg, {**extra, knob.key: option}) for option in knob.options[1:] for extra in partners):
        return False
    if knob.key == "lora.base_quantization":
        return cfg.train.mode == "lora"
    if knob.key == "model.t5_precision":
        return any(e.kind == "t5" for e in facts.encoders)
    if knob.key == "train.cuda_graphs":  # a GPU run only
        device = cfg.train.device
        return device != "cpu" and (device != "auto" or torch.cuda.is_available())
    return True


def _valid(cfg: RunConfig, combo: dict[str, object]) -> bool:
    """Whether the config with `combo` passes its own checks and adds no problem of composing
    with the processes it was launched with: train/distributed.py's own check (one problem per
    refused key) decides."""
    trial = with_values(cfg, combo)
    data = trial.model_dump()
    if "cuda_graphs" not in cfg.train.model_fields_set and "train.cuda_graphs" not in combo:
        data["train"]["cuda_graphs"] = "auto"  # the default's choice follows the trial's settings
    try:
        type(cfg).model_validate(data)
    except ValueError:
        return False
    world = launched_world()
    return world <= 1 or not any(p.startswith(k + ":") for k in combo for p in composition_problems(trial, world))


def free_knobs(cfg: RunConfig, facts: ModelFacts) -> list[Knob]:
    """The knobs the user did not set (pydantic's model_fields_set of each section)."""
    return [k for k in ladder(cfg) if _applies(k, cfg, facts)
            and k.key.split(".")[1] not in getattr(cfg, k.key.split(".")[0]).model_fields_set]


def _combinations(knobs: list[Knob]) -> list[dict[str, object]]:
    """Every assignment of `knobs`, cheapest (fastest) first."""
    combos = itertools.product(*[range(len(k.options)) for k in knobs])
    ranked = sorted(combos, key=lambda idx: (sum(k.costs[i] for k, i in zip(knobs, idx)), idx))
    return [{k.key: k.options[i] for k, i in zip(knobs, idx)} for idx in ranked]


def _group_of(knob: Knob, cfg: RunConfig, facts: ModelFacts) -> str:
    # Encoders that stay live during training put their settings into the training group.
    if knob.group == "cache_latents" and not cfg.cache.latents:
        return "train"
    if knob.group == "cache_text" and caches_frozen_text(facts, cfg):
        return "cache_text"  # T5 encodes in the caption phase only (its outputs cached while the CLIPs train)
    grids = cfg.sample.grids
    if knob.group == "cache_text" and (not cfg.cache.text or (grids and not cfg.cache.latents)):
        # the encoders run while the denoiser trains: live captions, or sample grids that encode their
        # prompts (with captions and latents cached they take them from the caption phase, train/samples.py)
        return "train"
    return knob.group


def _never_tried(cfg: RunConfig, values: dict[str, object]) -> Optional[str]:
    """Why the search never tries these values (chosen beside `cfg`'s settings), or None: they
    are slower than a neighbour that needs no more memory. Only where the planner chose one of
    the settings involved: a combination the user wrote is theirs."""
    pair = {"memory.offload_activations", "train.gradient_checkpointing"}
    trial = with_values(cfg, values)
    if trial.memory.offload_activations and trial.train.gradient_checkpointing is not True and pair & values.keys():
        return "offloading every activation of a block is slower than recomputing it"
    return None


def _tried_last(cfg: RunConfig, values: dict[str, object]) -> Optional[str]:
    """Why the search tries these values (chosen beside `cfg`'s settings) only when nothing else
    of their group fits, or None. Streamed weights stepping after backward step in CPU memory,
    seconds a step, where inside backward they step on the GPU for a little more memory (their
    optimizer state and some gradients)."""
    if values.get("train.optimizer_in_backward") is not False:
        return None  # only where the planner chooses it
    trial = with_values(cfg, values)
    if trial.memory.stream_weights and streamed_step_on_device(
            with_values(trial, {"train.optimizer_in_backward": True})):
        return ("streamed weights step in CPU memory after backward (seconds a step) and on the GPU inside "
                "backward")
    return None


def _search(cfg: RunConfig, facts: ModelFacts, knobs: list[Knob], usable: int, captions: int,
            host: Optional[Callable[[RunConfig, str, dict], bool]] = None):
    """(values, prediction) of the fastest fitting assignment, or (None, (peak, phase, values)) of
    the smallest prediction of the first phase group that cannot fit. Groups are searched in
    phase order: each phase's settings affect only that phase (live encoders join training).
    `host(trial, group, values)`: whether a combination that fits the GPU fits host memory too."""
    values: dict[str, object] = {}
    smallest: Optional[tuple[int, str, dict]] = None
    for group in ("cache_latents", "cache_text", "train"):
        mine = [k for k in knobs if _group_of(k, cfg, facts) == group]
        found = last = None
        for combo in _combinations(mine):
            trial = with_values(cfg, {**values, **combo})
            if _never_tried(cfg, combo):
                continue
            if not _valid(cfg, {**values, **combo}):
                continue
            if resident_problem(facts, trial):  # the user's count, where these settings cut fewer
                continue
            pred = predict(facts, trial, captions)
            fits = [p for p in pred.phases if p.name == group or (group == "train" and p.name in ("save", "samples"))]
            worst = max(fits, key=lambda p: p.peak, default=None)
            if worst is None or worst.peak <= usable:
                if host is not None and not host(trial, group, {**values, **combo}):
                    continue
                if _tried_last(cfg, {**values, **combo}):
                    last = combo if last is None else last
                    continue
                found = combo
                break
            if smallest is None or worst.peak < smallest[0]:
                smallest = (worst.peak, worst.name, {**values, **combo})
        if found is None:
            found = last
        if found is None:
            return None, smallest
        values.update(found)
        smallest = None
    return values, predict(facts, with_values(cfg, values), captions)


def _phase_group(phase: str) -> str:
    """The knob group whose settings act on `phase` (save and sample grids: training's)."""
    return phase if phase in ("cache_latents", "cache_text") else "train"


def _fits(cfg: RunConfig, facts: ModelFacts, values: dict, group: str, usable: int, captions: int) -> bool:
    """Whether the config with `values` is valid and every phase of `group` fits in `usable`."""
    if not _valid(cfg, values):
        return False
    phases = predict(facts, with_values(cfg, values), captions).phases
    return all(p.peak <= usable for p in phases if _phase_group(p.name) == group)


def _blocking_settings(cfg: RunConfig, facts: ModelFacts, knobs: list, usable: int, captions: int,
                       phase: str) -> Optional[str]:
    """Which of the user's own settings keep `phase` (the first that cannot fit) from fitting, and
    the values that would fit it, or None. Only settings that act on that phase are considered
    (a knob's group: `_group_of`), and of those only the ones that must change: each is given back
    its written value while the phase still fits."""
    group = _phase_group(phase)
    fixed = [k for k in ladder(cfg)
             if _applies(k, cfg, facts) and k not in knobs and _group_of(k, cfg, facts) == group]
    if not fixed:
        return None
    freed, failed = _search(cfg, facts, knobs + fixed, usable, captions)
    later = ""
    if freed is None:
        if failed is None:  # no combination passes the config's checks
            return None
        _, failed_phase, tried = failed
        if _phase_group(failed_phase) == group:
            return None  # not even their other values fit it
        freed, later = tried, f" (the {failed_phase} phase then does not fit either)"
    changed = [k.key for k in fixed if setting(cfg, k.key) != freed[k.key]]
    for key in list(changed):
        kept = {**freed, key: setting(cfg, key)}
        if _fits(cfg, facts, kept, group, usable, captions):
            freed = kept
            changed.remove(key)
    if not changed:
        return None
    return (f"your own setting of {', '.join(changed)} keeps the {phase} phase from fitting: the planner "
            f"would fit it with {_describe({k: freed[k] for k in changed})}{later}")


def _describe(values: dict[str, object]) -> str:
    return ", ".join(f"{k} = {json.dumps(v)}" for k, v in values.items()) or "the settings as written"


def choose(cfg: RunConfig, budget: int, facts: ModelFacts, captions: int = TEXT_CHUNK) -> Choice:
    """The fastest combination of the settings the user left free whose every phase is predicted
    to fit in budget x (1 - MARGIN); raises PlanError naming the smallest prediction otherwise."""
    usable = int(budget * (1 - MARGIN))
    problem = resident_problem(facts, cfg)  # a count the user wrote, with the other settings as written
    if problem:
        raise PlanError(problem)
    knobs = free_knobs(cfg, facts)
    host_budget, host_source = host_budget_of(cfg)
    host_over: list[tuple[int, str, dict, str]] = []  # fit the GPU, not the host: peak, phase, values, group

    def host_fits(trial: RunConfig, group: str, tried: dict) -> bool:
        # unset gradient sums: "device" where they fit beside the trial, as `_grad_sums` then chooses
        summed = with_values(trial, {"memory.streamed_grad_sums": "device"})
        if trial.memory.streamed_grad_sums is None and streamed_sums_on_device(summed) and all(
                p.peak <= usable for p in predict(facts, summed, captions).phases
                if _phase_group(p.name) == group):
            trial = summed
        phases = [p for p in host_prediction(facts, trial, captions, for_gpu=True).phases
                  if p.name != "load" and _phase_group(p.name) == group]  # no setting changes loading
        worst = max(phases, key=lambda p: p.peak, default=None)
        if worst is None or worst.peak <= host_budget:
            return True
        host_over.append((worst.peak, worst.name, tried, group))
        return False

    host_notes = []  # over the machine's own budget: warned of, not refused
    load = host_prediction(facts, cfg, captions, for_gpu=True).phase("load").peak
    if load > host_budget:  # the models as loaded: no setting of the plan changes it
        note = (f"memory.host_budget is {host_budget / GIB:.2f} GiB ({host_source}); loading the models is "
                f"predicted at {load / GIB:.2f} GiB of host memory whatever the settings")
        if cfg.memory.host_budget is not None:
            raise PlanError(f"nothing fits in host memory: {note}; give memory.host_budget at least that "
                            "where the machine has it")
        host_notes.append(note)
    host_check: Optional[Callable] = host_fits
    values, pred = _search(cfg, facts, knobs, usable, captions, host_check)
    failed = None if values is not None else _phase_group(pred[1]) if pred is not None else \
        host_over[-1][3] if host_over else None  # the group that did not fit
    refused = [o for o in host_over if o[3] == failed]
    if refused:
        peak, phase, tried, _ = min(refused, key=lambda o: o[0])
        note = (f"memory.host_budget is {host_budget / GIB:.2f} GiB ({host_source}); of the "
                f"combinations that fit {usable / GIB:.2f} GiB of GPU memory the smallest host "
                f"prediction is {peak / GIB:.2f} GiB in the {phase} phase, with {_describe(tried)} "
                "(the others do not fit the GPU)")
        if phase == "fit probe":  # its stand-in's buffers beside the models as loaded
            note += "; memory.fit_probe = false leaves out the fit probe, whose phase this is"
        if cfg.memory.host_budget is not None:
            raise PlanError(f"nothing fits in host memory: {note}; give memory.host_budget at least "
                            "that where the machine has it, or leave out what holds host memory (streamed "
                            "weights, offloaded activations, an EMA with ema.device = \"cpu\")")
        host_notes.append(note)  # the machine's own budget, not the user's: the GPU's choice stands
        host_check = None
        values, pred = _search(cfg, facts, knobs, usable, captions)
    if values is None:
        peak, phase, tried = pred
        need = peak / (1 - MARGIN)
        lines = [f"nothing fits in {budget / GIB:.2f} GiB ({usable / GIB:.2f} GiB after the {MARGIN:.0%} margin): "
                 f"the smallest prediction is {peak / GIB:.2f} GiB in the {phase} phase, with {_describe(tried)}; "
                 f"it needs a budget of at least {need / GIB:.2f} GiB"]
        blocking = _blocking_settings(cfg, facts, knobs, usable, captions, phase)
        if blocking:
            lines.append(blocking)
        if phase == "samples":
            lines.append("the samples phase renders the sample grids (sample.every_steps / every_epochs)"
                         + ("" if cfg.cache.text else " with the text encoders on the GPU for their prompts (cached "
                            "captions would encode them before training)")
                         + ": sample.every_steps = 0 and sample.every_epochs = 0 leave the grids out "
                         "(render them after training with vramfit generate)")
        if any(e.kind == "t5" for e in facts.encoders) and cfg.model.t5_precision != "none":
            lines.append("model.t5_precision = \"none\" (T5 left out, as SD3 allows) is never chosen for you")
        raise PlanError("; ".join(lines))
    reasons = []
    if "streamed_grad_sums" not in cfg.memory.model_fields_set:
        summed = {**values, "memory.streamed_grad_sums": "device"}
        if streamed_sums_on_device(with_values(cfg, summed)):
            values, why = _grad_sums(cfg, facts, knobs, values, usable, captions, host_check)
            reasons.append(why)
            pred = predict(facts, with_values(cfg, values), captions)
    for knob in knobs:
        value = values[knob.key]
        # the settings the sums on the device need are judged as if the sums were not there
        other = {k: v for k, v in values.items()
                 if k != "memory.streamed_grad_sums" or knob.key not in SUMS_NEED}
        if value == knob.options[0]:
            reasons.append(f"{knob.key} = {json.dumps(value)}: the fastest option fits")
            continue
        if not _valid(cfg, {**other, knob.key: knob.options[0]}):
            reasons.append(f"{knob.key} = {json.dumps(value)}: {json.dumps(knob.options[0])} does not go with "
                           "the other settings")
            continue
        why = _never_tried(cfg, {**other, knob.key: knob.options[0]}) or _tried_last(
            cfg, {**other, knob.key: knob.options[0]})
        if why:
            reasons.append(f"{knob.key} = {json.dumps(value)}: {why}")
            continue
        fastest = with_values(cfg, {**other, knob.key: knob.options[0]})
        over = max(predict(facts, fastest, captions).phases, key=lambda p: p.peak)
        if over.peak <= usable:  # it fits the GPU: refused for host memory
            worst = max(host_prediction(facts, fastest, captions, for_gpu=True).phases, key=lambda p: p.peak)
            reasons.append(f"{knob.key} = {json.dumps(value)}: with {json.dumps(knob.options[0])} the "
                           f"{worst.name} phase is predicted at {worst.peak / GIB:.2f} GiB of host memory, "
                           f"over memory.host_budget ({host_budget / GIB:.2f} GiB)")
            continue
        reasons.append(f"{knob.key} = {json.dumps(value)}: with {json.dumps(knob.options[0])} the {over.name} "
                       f"phase is predicted at {over.peak / GIB:.2f} GiB, over the {usable / GIB:.2f} GiB usable")
    for knob in ladder(cfg):
        if _applies(knob, cfg, facts) and knob not in knobs:
            reasons.append(f"{knob.key} = {json.dumps(setting(cfg, knob.key))}: set by you, kept")
    if with_values(cfg, values).memory.stream_weights:
        # after the reasons above, which compare the settings with every block streamed
        if "resident_blocks" in cfg.memory.model_fields_set:
            reasons.append(f"memory.resident_blocks = {cfg.memory.resident_blocks} of "
                           f"{block_count(facts, with_values(cfg, values))} stream blocks: set by you, kept")
        else:
            values["memory.resident_blocks"], why = _most_resident(cfg, facts, values, usable, captions)
            reasons.append(why)
            pred = predict(facts, with_values(cfg, values), captions)
    for note in host_notes:
        reasons.append(f"host memory: over this machine's: {note}; the run may swap or be stopped by the "
                       "system (set memory.host_budget to refuse such a choice)")
    return Choice(with_values(cfg, values), budget, values, reasons, predict(facts, cfg, captions), pred)


# what memory.streamed_grad_sums = "device" needs beside it (with an optimizer of compact state: rules.py)
SUMS_NEED = {"memory.stream_weights": True, "train.optimizer_in_backward": True}


def _grad_sums(cfg: RunConfig, facts: ModelFacts, knobs: list[Knob], values: dict, usable: int,
               captions: int, host: Optional[Callable] = None) -> tuple[dict, str]:
    """`values` with memory.streamed_grad_sums, and why: "device" with the fastest other settings that
    fit beside the sums (summed in CPU memory they cost a CPU pass over the gradients each
    micro-batch, more than any other setting saves), else "home". `host`: choose's host check."""
    # what the sums need fixed (checked by the caller: the values have it), the rest searched again
    fixed = {"memory.streamed_grad_sums": "device", **SUMS_NEED}
    free = [k for k in knobs if k.key not in fixed]
    found, _ = _search(with_values(cfg, fixed), facts, free, usable, captions, host)
    if found is not None:
        return {**found, **{k: v for k, v in fixed.items() if k in values},
                "memory.streamed_grad_sums": "device"}, (
            "memory.streamed_grad_sums = \"device\": the gradient sums of earlier micro-batches fit on the "
            "device (in CPU memory they cost a CPU pass over the gradients each micro-batch)")
    summed = with_values(cfg, {**values, "memory.streamed_grad_sums": "device"})
    over = max(predict(facts, summed, captions).phases, key=lambda p: p.peak)
    return {**values, "memory.streamed_grad_sums": "home"}, (
        f"memory.streamed_grad_sums = \"home\": with \"device\" the {over.name} phase is predicted at "
        f"{over.peak / GIB:.2f} GiB, over the {usable / GIB:.2f} GiB usable")


def _most_resident(cfg: RunConfig, facts: ModelFacts, values: dict, usable: int,
                   captions: int) -> tuple[int, str]:
    """The most stream blocks (units.py `stream_blocks`: the blocks, the large ones cut, so the
    SDXL family's 7 blocks give more steps than 7) memory.resident_blocks may keep on the device
    beside `values` (streamed weights, every phase fitting with none resident) with every phase
    still fitting in `usable`, and the reason. Each resident one adds its weights (and a full
    fine-tune's gradients and state) and takes at most one unit from the slots, so the peaks grow
    with the count: a binary search (which only ever takes a count that fits). The top counts are
    tried first, from all of them down: where fewer units stream than there are slots, the slots
    shrink by a whole unit with each one kept, and with none streamed no slot and no gradient
    waiting beside one is left, so these may take less than a count below."""
    n = block_count(facts, with_values(cfg, values))

    def peak(count: int) -> PhaseEstimate:
        trial = with_values(cfg, {**values, "memory.resident_blocks": count})
        return max(predict(facts, trial, captions).phases, key=lambda p: p.peak)

    top = max(0, n - max(STREAM_SLOTS.values()))  # at most this many: as many units streamed as slots
    low = next((count for count in range(n, top, -1) if peak(count).peak <= usable), None)
    low, high = (low, low) if low is not None else (0, top)  # peak(0) fits: the search's choice
    while low < high:
        mid = (low + high + 1) // 2
        if peak(mid).peak <= usable:
            low = mid
        else:
            high = mid - 1
    if low == n:
        return low, (f"memory.resident_blocks = {low} of {n} stream blocks: every one fits on the device "
                     "(none streams)")
    over = peak(low + 1) if low + 1 < n else peak(n)
    return low, (f"memory.resident_blocks = {low} of {n} stream blocks: the most kept on the device that "
                 f"fit; with {low + 1} the {over.name} phase is predicted at {over.peak / GIB:.2f} GiB, over "
                 f"the {usable / GIB:.2f} GiB usable")


def budget_of(cfg: RunConfig, override: Optional[str] = None) -> Optional[int]:
    """Bytes of --vram (`override`), else of memory.vram_budget; None without either. A size that
    does not parse is a PlanError naming the flag or key."""
    name, text = "--vram", override
    if override is None:
        name, text = "memory.vram_budget", cfg.memory.vram_budget
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise PlanError(f"{name}: {exc}") from None


def host_prediction(facts: ModelFacts, cfg: RunConfig, captions: int = TEXT_CHUNK, *,
                    for_gpu: bool = False) -> HostPrediction:
    """Predicted peak host memory of each phase (fit/host.py), the denoiser's terms taken from this
    module's tensor model; on a CPU run the device's peaks are added. `for_gpu`: a plan for a GPU
    budget, which is a GPU run whatever this machine has (unless train.device is "cpu")."""
    tensors, units = _denoiser_tensors(facts, cfg)
    streamed = [x for x in tensors if x.streamed]
    stepped_here = [x for x in streamed if x.trained] if streamed_step_in_cpu_memory(cfg) else []
    trained = [x for x in tensors if x.trained]
    placed = 0
    # a quantized LoRA base is placed a layer at a time, never cast whole (fit/host.py placed_by_layer)
    if cfg.memory.stream_weights and (cfg.train.mode != "lora" or cfg.lora.base_quantization == "none"):
        item = weight_item_bytes(cfg)  # cast in CPU memory before it is placed
        placed = item * sum(t.numel() for t in [*facts.denoiser.parameters(), *facts.denoiser.buffers()]
                            if t.is_floating_point())
    offloaded = 0
    if cfg.memory.offload_activations:  # what the device would have saved
        kept = with_values(cfg, {"memory.offload_activations": False})
        offloaded = _activations(facts, kept, largest_bucket(kept))["saved"]
    # the trained CLIPs' weights, which the training state copies too
    clips = _trained_encoders(facts, cfg)["text encoders trained"] if cfg.text_encoder_training == "full" else 0
    den = DenoiserHost(
        placed=placed, largest_unit=units[0] if units and placed else 0,
        streamed=sum(x.numel * x.dtype_bytes for x in streamed),
        streamed_grads=sum(x.numel * x.dtype_bytes for x in stepped_here),
        streamed_state=sum(optimizer_state_bytes(cfg.train.optimizer, x) for x in stepped_here),
        offloaded=offloaded, ema=ema_host_bytes(facts, cfg),
        trained_copy=sum(x.numel * x.dtype_bytes for x in trained if not x.streamed) + clips,
        adapter=sum(x.numel * x.dtype_bytes for x in trained) if cfg.train.mode == "lora" else 0)
    cpu = cfg.train.device == "cpu" or (not for_gpu and pick_device(cfg.train.device).type == "cpu")
    device = {p.name: p.peak for p in predict(facts, cfg, captions).phases} if cpu else None
    return predict_host(facts, cfg, den, cpu=cpu, device=device, processes=local_processes())


def _host_table(facts: ModelFacts, cfg: RunConfig, host_budget: int, for_gpu: bool) -> str:
    """`host_prediction`'s table with the GPU peaks beside it, and a line where it exceeds `host_budget`."""
    host = host_prediction(facts, cfg, for_gpu=for_gpu)
    text = host.table({p.name: p.peak for p in predict(facts, cfg).phases})
    worst = max(host.phases, key=lambda p: p.peak)
    if worst.peak > host_budget:
        text += (f"\nthe {worst.name} phase is predicted at {worst.peak / GIB:.2f} GiB of host memory, over "
                 f"memory.host_budget's {host_budget / GIB:.2f} GiB")
    return text


def plan_report(cfg: RunConfig, facts: ModelFacts, budget: Optional[int]) -> str:
    """What `vramfit plan` prints: the predicted peaks as written, and with a budget the choice,
    why, and the peaks after it (raises PlanError when nothing fits)."""
    side = largest_bucket(cfg)
    model = f"{facts.layout} ({facts.family} family, from its shipped config)" if facts.layout else \
        f"{facts.family} model"
    lines = [f"{model}, largest bucket {side[0]}x{side[1]}, batch {cfg.step_batch}; "
             "predicted peak GPU memory allocated (G = GiB, M = MiB):", "", "as written:",
             predict(facts, cfg).table()]
    captions = ("cache.text is off: the CLIP encoders encode each caption each step, T5's outputs are cached "
                "in the caption phase" if caches_frozen_text(facts, cfg) else
                "cache.text is off, captions are encoded each step")
    if cfg.text_encoder_training == "lora":
        lines.append(f"lora.text_encoder_rank = {cfg.lora.text_encoder_rank}: the CLIP text encoders train "
                     f"in the train phase (their weights, LoRA and activations); {captions}")
    elif cfg.text_encoder_training == "full":
        lines.append("train.text_encoders = 'full': every weight of the CLIP text encoders trains in the "
                     "train phase (their weights, gradients, optimizer state and activations); " + captions)
    host = ema_host_bytes(facts, cfg)
    if host:
        lines.append(f"host memory: the EMA (ema.device = \"cpu\") and its staging copy {size_text(host)}")
    host_budget, host_source = host_budget_of(cfg)
    host_title = (f"predicted peak host memory (RSS) by phase{{}}, the device's beside it; host budget "
                  f"{host_budget / GIB:.2f} GiB ({host_source}):")
    if budget is None:
        return "\n".join(lines + ["", host_title.format(""), _host_table(facts, cfg, host_budget, False)])
    choice = choose(cfg, budget, facts)
    changed = {k: v for k, v in choice.chosen.items() if v != setting(cfg, k)}
    lines += ["", host_title.format(" with the choice below"),
              _host_table(facts, choice.config, host_budget, True)]
    lines += ["", f"budget {budget / GIB:.2f} GiB ({budget * (1 - MARGIN) / GIB:.2f} GiB usable after the "
              f"{MARGIN:.0%} margin); chosen:"]
    lines += [f"  {r}" for r in choice.reasons]
    lines += ["", "with the choice:", choice.after.table(), ""]
    lines.append("changes: " + (" ".join(f"--set {k}={json.dumps(v)}" for k, v in changed.items()) if changed else
                                "none (the config as written fits)"))
    return "\n".join(lines)


def fit_to_budget(cfg: RunConfig, cache_root=None) -> RunConfig:
    """`cfg` with the planner's choice applied when memory.vram_budget is set (and logged);
    before any weight loads. Raises PlanError when nothing fits."""
    budget = budget_of(cfg)
    if budget is None:
        return cfg
    choice = choose(cfg, budget, read_facts(cfg, cache_root))
    log = logging.getLogger("vramfit")
    log.info("memory.vram_budget %.2f GiB: predicted peak %.2f GiB (%s)", budget / GIB, choice.after.peak / GIB,
             ", ".join(f"{p.name} {p.peak / GIB:.2f}" for p in choice.after.phases))
    for reason in choice.reasons:
        log.info("  %s", reason)
    return choice.config


def check_host_budget(cfg: RunConfig, gpu: bool, cache_root=None) -> None:
    """memory.host_budget set without memory.vram_budget (no plan chooses settings): raises PlanError
    naming the phase predicted over it, before any weight loads. `gpu`: the run trains on a GPU."""
    if cfg.memory.host_budget is None or budget_of(cfg) is not None:
        return
    host_budget, _ = host_budget_of(cfg)
    worst = max(host_prediction(read_facts(cfg, cache_root), cfg, for_gpu=gpu).phases, key=lambda p: p.peak)
    if worst.peak > host_budget:
        raise PlanError(f"memory.host_budget is {host_budget / GIB:.2f} GiB; the {worst.name} phase is predicted "
                        f"at {worst.peak / GIB:.2f} GiB of host memory with the settings as written; give "
                        "memory.host_budget at least that where the machine has it, or memory.vram_budget to "
                        "have the planner choose settings that fit both")
