"""Predict the peak host (CPU) memory of each phase of a run without loading weights, and the host
budget (memory.host_budget) the planner's choice must fit. What is read: the model's facts
(fit/model_facts.py) and the config; the denoiser's terms that need the planner's tensor model
(what is streamed, what is offloaded) come in a `DenoiserHost` the planner fills.

Each phase (bytes resident in the process, RSS; n: a model's parameter count):
- every phase: BASELINE, the interpreter with torch, vramfit's run path, diffusers and transformers
  imported (about 470 MiB, measured on a CPU build of torch; a CUDA context adds its own host
  memory, not counted: the budget's margin covers it).
- load: every model as loaded (models load into CPU memory before they move): the denoiser as the
  file stores it (facts.loaded_bytes: float8 widened to bf16; a diffusers folder in fp32; 2 bytes
  a value for a shipped layout), the VAE in cache.vae_dtype, the CLIPs as stored (widened to fp32
  on a CPU run) and T5 stored as model.t5_precision asks while it loads, a part at a time, from a
  single file or a diffusers folder alike (the stored encoder and its largest part as read, widened
  to bf16 and being stored; "none": T5 is not read). A single file's parts and a folder's T5 are
  read a tensor at a time without a memory map (formats/safetensors_io.py `read_tensors`): no
  second copy. Not counted: a diffusers folder's from_pretrained maps its other weight files while
  they load (their pages resident meanwhile).
- fit probe (memory.fit_probe, on a GPU): the models as loaded, and beside them what the probe's
  stand-in denoiser holds once placed as the run places it (the train phase's steady denoiser
  terms: its weights read as zeros from pages never written, fit/probe.py `untouched_zeros`, so
  neither it nor its cast is resident; its units share one set of gradient sums at home); given back
  before caching (memory/pinned.py: no pinned
  block stays cached).
- cache_latents, cache_text: the same models, T5 now stored as model.t5_precision asks, less the
  one on the device (the VAE; the largest encoder, which memory.stream_encoders keeps at home,
  pinned: it stays counted).
- train: the denoiser's host terms (`DenoiserHost`): with streamed weights the denoiser is first
  cast in CPU memory to the train precision, one unit copied to pinned memory beside it; a
  quantized LoRA base is never cast whole: it stays as loaded, its unquantized parts (norms,
  embeddings, convolutions) cast, while each linear in turn goes to the device to be widened and
  quantized there (on a CPU run one linear's widened copy beside it: `placed_by_layer`); then the
  streamed weights' pinned homes, and where a streamed full fine-tune steps in CPU memory their
  gradients (pinned) and optimizer state, where they step on the device with accumulation and
  memory.streamed_grad_sums is not "device" the sums of their earlier micro-batches' gradients
  (`home_sums`); offloaded activations' pinned
  buffers (what the device would have saved); the EMA in CPU memory and its staging copy
  (planner.ema_host_bytes). Encoders that encode live (cache.text off) stay in CPU memory between
  uses; the VAE stays there where captions encode live beside cached latents, or for sample grids
  after caching. The caption and latent caches are on disk and read a batch at a time: no term.
- samples: the train terms, plus the grid's VAE and encoders reloaded from the file in the grid's
  dtype, T5 stored as it loads (where captions and latents are cached the kept VAE serves).
- save: the train terms (saves come between steps too, the step's buffers held), plus the larger of the
  training state's copy of the trained weights (those not at home in CPU memory already) and what
  the checkpoint holds while it is written: a full fine-tune's single file is written a tensor at
  a time (`written_at_once`: about its largest tensor; from a diffusers folder also the VAE and
  encoders, read whole to be carried over); a diffusers-folder save (`diffusers_save_bytes`): its
  denoiser a tensor at a time and the VAE and encoders read again; a LoRA's adapter.
On a CPU run the device is this memory: each phase adds the device prediction's peak. Several
processes on this machine (torchrun, accelerate launch: LOCAL_WORLD_SIZE) each hold all of it.

Budget: memory.host_budget, or by default what the machine has (psutil) less 10%, at least 2 GiB,
for the system and other programs (`host_budget_of`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import psutil
import torch

from vramfit.config.rules import streamed_step_on_device
from vramfit.config.schema import RunConfig, parse_size
from vramfit.fit.estimates import GIB, MIB, PhaseEstimate, Phases, size_text
from vramfit.fit.model_facts import (EncoderFacts, ModelFacts, caches_frozen_text, encoder_bytes,
                                     sampled_encoder_bytes, weight_item_bytes)
from vramfit.memory.offload.staging import SHEETS
from vramfit.train.distributed import launched_world

BASELINE = 470 * MIB  # about: RSS after importing torch (CPU build), vramfit.run, diffusers, transformers
HOST_MARGIN = 0.10  # of the machine's memory left to the system by default ...
HOST_MARGIN_MIN = 2 * GIB  # ... and at least this much


class HostBudgetError(ValueError):
    """memory.host_budget does not parse; the message names the key."""


def local_processes() -> int:
    """Processes of this run on this machine (the launcher's LOCAL_WORLD_SIZE; else all of them)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or launched_world())


def machine_memory() -> int:
    """Bytes of memory this machine has."""
    return psutil.virtual_memory().total


def host_budget_of(cfg: RunConfig, total: Optional[int] = None) -> tuple[int, str]:
    """(bytes, where from) of the host memory the run may use: memory.host_budget, else the
    machine's memory (`total`, default psutil's) less HOST_MARGIN of it, at least HOST_MARGIN_MIN."""
    text = cfg.memory.host_budget
    if text is not None:
        try:
            return parse_size(text), "memory.host_budget"
        except ValueError as exc:
            raise HostBudgetError(f"memory.host_budget: {exc}") from None
    total = machine_memory() if total is None else total
    margin = max(int(total * HOST_MARGIN), HOST_MARGIN_MIN)
    why = (f"automatic: this machine's {total / GIB:.1f} GiB less {margin / GIB:.1f} GiB for the system; set "
           "memory.host_budget to change it")
    return max(total - margin, 0), why


@dataclass(frozen=True)
class DenoiserHost:
    """The denoiser's terms in host memory, from the planner's tensor model (fit/planner.py)."""

    placed: int = 0  # the whole denoiser cast in CPU memory before placement (streamed), else 0
    largest_unit: int = 0  # the unit copied to pinned memory beside it while homes are made
    streamed: int = 0  # the streamed weights' homes
    streamed_grads: int = 0  # their gradients' pinned homes, where they step in CPU memory
    streamed_state: int = 0  # their optimizer state, where they step in CPU memory
    offloaded: int = 0  # pinned buffers of offloaded activations
    ema: int = 0  # an EMA in CPU memory and its staging copy
    trained_copy: int = 0  # the trained tensors the training state copies to CPU memory (not at home there)
    adapter: int = 0  # a LoRA's trained tensors, as its file is written


class HostPrediction(Phases):
    """Peak host memory by phase."""

    def table(self, gpu: Optional[dict[str, int]] = None) -> str:
        """One row per phase, indented under the GPU tables: the predicted host peak, the device's
        peak beside it (`gpu`: by phase) and the host terms."""
        rows = [f"  {'host phase':<14}{'device':>9}{'host':>9}   host terms"]
        for p in self.phases:
            device = size_text(gpu[p.name]) if gpu and p.name in gpu else "-"
            terms = ", ".join(f"{k} {size_text(v)}" for k, v in p.parts.items() if v)
            rows.append(f"  {p.name:<14}{device:>9}{size_text(p.peak):>9}   {terms}")
        return "\n".join(rows)


def _clip_bytes(enc: EncoderFacts, cpu: bool) -> int:
    return 4 * enc.params if cpu else enc.stored_bytes


def loaded_encoders(facts: ModelFacts, cfg: RunConfig, cpu: bool) -> dict[str, int]:
    """Each encoder's bytes as loaded: CLIPs as stored (fp32 on a CPU run); T5 stored as
    model.t5_precision asks while it loads ("none": not read, no term)."""
    precision = cfg.model.t5_precision
    return {e.name: _t5_loading(e, precision) if e.kind == "t5" else _clip_bytes(e, cpu)
            for e in facts.encoders if e.kind != "t5" or precision != "none"}


def _t5_loading(enc: EncoderFacts, precision: str) -> int:
    """T5's peak while it is read a part at a time, from a single file or a diffusers folder
    (models/parts.py `t5_file_encoder`, `t5_folder_encoder`): the stored encoder, plus its largest
    part (a block's feed-forward: three linears of the largest size, gated) as read, widened to bf16
    and being stored, whose quantizer's temporaries are about 2 bytes a value (int8, fp8) or 4
    (nf4), measured on CPU."""
    part = min(3 * enc.largest_linear, enc.linear_numel // max(enc.layers, 1))
    read = enc.stored_bytes / max(enc.params, 1)  # bytes a value as the file stores it
    temporaries = {"bf16": 0, "int8": 2, "fp8": 2, "nf4": 4}[precision]
    return encoder_bytes(enc, precision)[0] + int(part * (read + 2 + temporaries))


def prepared_encoders(facts: ModelFacts, cfg: RunConfig, cpu: bool) -> dict[str, int]:
    """Each encoder's bytes once prepared: T5 stored as model.t5_precision asks ("none": dropped)."""
    out = {}
    for e in facts.encoders:
        if e.kind != "t5":
            out[e.name] = _clip_bytes(e, cpu)
        elif cfg.model.t5_precision != "none":
            out[e.name] = encoder_bytes(e, cfg.model.t5_precision)[0]
    return out


def _grid_encoders(facts: ModelFacts, cfg: RunConfig, item: int) -> int:
    """The encoders a sample grid reloads, in the grid's dtype (`item` bytes a value)."""
    return sum(sampled_encoder_bytes(e, cfg.model.t5_precision, item) for e in facts.encoders
               if e.kind != "t5" or cfg.model.t5_precision != "none")


def home_sums(cfg: RunConfig, den: DenoiserHost, cpu: bool, shared: bool = False) -> int:
    """The gradient sums of earlier micro-batches of streamed weights that step on the device, kept in
    pinned CPU memory (memory.streamed_grad_sums not "device", memory/offload/grads.py). A full
    fine-tune trains every streamed weight: a value per value at home, fp32 for bf16 weights with
    train.stochastic_rounding (twice the homes' bytes), else in their dtype (the homes' bytes); on a
    GPU, the sheets the gradients are copied into on their way (memory/offload/staging.py: SHEETS
    x the largest unit). `shared`: the fit probe's stand-in, whose units share the largest unit's
    sums (grads.py `share_home_sums`)."""
    t = cfg.train
    if not (streamed_step_on_device(cfg) and t.grad_accum > 1) or cfg.memory.streamed_grad_sums == "device":
        return 0
    widened = 2 if t.precision == "full_bf16" and t.stochastic_rounding else 1
    return (den.largest_unit if shared else den.streamed) * widened + (0 if cpu else SHEETS * den.largest_unit)


# The most tensors a single-file layout joins into one from the denoiser's (q, k and v; Flux's linear1
# joins them with the MLP's input, 1.75 times the largest of its parts)
JOINED = 3


def written_at_once(facts: ModelFacts, cfg: RunConfig, item: int) -> int:
    """Host bytes a full fine-tune's single file holds while it is written (`item`: bytes a value of
    save.dtype; the denoiser is never held whole). The families write it a
    tensor at a time (formats/safetensors_io.py `save_atomic_lazy`): the largest denoiser tensor
    made in save.dtype with the parts it is joined from (twice its size). From a single file, or
    the largest part read from the source as stored; text encoders trained whole are first copied
    in save.dtype. From a diffusers folder (no single-file facts: the largest tensor as joined is
    bounded by JOINED times the model's largest), with the VAE and encoders as stored, which are
    read and converted whole."""
    whole = cfg.train.text_encoders == "full"
    trained = sum(e.params for e in facts.encoders if e.kind == "clip") if whole else 0
    if not facts.largest_denoiser_values:
        largest = JOINED * max((p.numel() for p in facts.denoiser.parameters()), default=0)
        vae = facts.vae_stored_bytes or 2 * facts.vae_params  # unread (a shipped layout): fp16
        return 2 * item * largest + vae + sum(e.stored_bytes for e in facts.encoders) + item * trained
    return max(2 * item * facts.largest_denoiser_values, facts.largest_part_bytes) + item * trained


def diffusers_save_bytes(facts: ModelFacts, item: int) -> int:
    """Host bytes a diffusers-folder save (save.formats "diffusers") holds beside the run: the
    denoiser written a tensor at a time (formats/safetensors_io.py `save_model_folder`: its largest
    tensor cast to save.dtype, `item` bytes a value), and the VAE and text encoders read again from
    the source, as the families' save_diffusers do where the run has freed them or stored its T5
    (counted always): the VAE in fp32 at most, the CLIPs as stored, T5 in bf16 at least (a float8
    file's is widened)."""
    encoders = sum(max(e.stored_bytes, 2 * e.params) if e.kind == "t5" else e.stored_bytes
                   for e in facts.encoders)
    return item * facts.largest_denoiser_values + 4 * facts.vae_params + encoders


def placed_by_layer(facts: ModelFacts, cfg: RunConfig, loaded: int, cpu: bool) -> int:
    """Host bytes of the denoiser (`loaded` as loaded) while a quantized LoRA base is placed, else 0:
    as loaded, with what stays unquantized cast to the train precision (one stored dtype assumed for
    the whole file), and on a CPU run the largest linear widened beside it (on a GPU the device
    widens each)."""
    if cfg.train.mode != "lora" or cfg.lora.base_quantization == "none":
        return 0
    item = weight_item_bytes(cfg)
    tensors = [*facts.denoiser.parameters(), *facts.denoiser.buffers()]
    floats = sum(t.numel() for t in tensors if t.is_floating_point())
    layers = [sum(p.numel() for p in m.parameters()) for m in facts.denoiser.modules()
              if isinstance(m, torch.nn.Linear)]
    stored = loaded / max(floats, 1)  # bytes a value as loaded
    rest = max(item - stored, 0) * (floats - sum(layers))  # norms, embeddings, convolutions widened
    return loaded + int(rest) + (item * max(layers, default=0) if cpu else 0)


def predict_host(facts: ModelFacts, cfg: RunConfig, den: DenoiserHost, *, cpu: bool = False,
                 device: Optional[dict[str, int]] = None, processes: int = 1) -> HostPrediction:
    """Predicted peak host memory of each phase `cfg` runs (see the module docstring). `cpu`: the
    run trains on the CPU, whose device peaks by phase (`device`) are added; `processes` of the run
    on this machine each hold as much."""
    device = device or {}
    n = sum(p.numel() for p in facts.denoiser.parameters())
    loaded = facts.loaded_bytes or 2 * n
    vae = facts.vae_params * (4 if cfg.cache.vae_dtype == "fp32" else 2)
    phases = []

    def add(name: str, parts: dict[str, int]) -> None:
        parts = {"baseline": BASELINE, **parts}
        if cpu and name in device:
            parts["device (CPU run)"] = device[name]
        if processes > 1:
            parts[f"{processes - 1} more processes"] = (processes - 1) * sum(parts.values())
        phases.append(PhaseEstimate(name, sum(parts.values()), parts))

    as_loaded = {"denoiser": loaded, "vae": vae, **loaded_encoders(facts, cfg, cpu)}
    add("load", as_loaded)
    encoders = prepared_encoders(facts, cfg, cpu)
    grids = cfg.sample.grids
    models: dict[str, int] = {}
    if not cfg.cache.text:  # live captions: the encoders wait in CPU memory between uses
        trained_clips = cfg.text_encoder_training is not None  # on the device for the whole run
        cached_t5 = caches_frozen_text(facts, cfg)  # its outputs cached, then let go of
        models["text encoders"] = sum(encoders.get(e.name, 0) for e in facts.encoders
                                      if not (trained_clips and e.kind == "clip")
                                      and not (cached_t5 and e.kind == "t5"))
    if cfg.cache.latents and (grids or not cfg.cache.text):
        models["vae"] = vae  # kept: for live captions' run, or for the grids after caching
    steady = {**models, "streamed homes": den.streamed, "streamed gradients": den.streamed_grads,
              "streamed optimizer state": den.streamed_state,
              "streamed gradient sums": home_sums(cfg, den, cpu),
              "offloaded activations": den.offloaded,
              "ema": den.ema}
    placing = {**models, "denoiser cast": den.placed, "unit being pinned": den.largest_unit,
               "denoiser placed by layer": placed_by_layer(facts, cfg, loaded, cpu)}
    placed = max(steady, placing, key=lambda d: sum(d.values()))
    if cfg.memory.fit_probe and not cpu:  # before caching: its stand-in placed beside the models as loaded
        probed = {**steady, "streamed gradient sums": home_sums(cfg, den, cpu, shared=True)}
        add("fit probe", {**as_loaded, **{f"stand-in's {k}": v for k, v in probed.items() if k not in models}})
    if cfg.cache.latents:  # the VAE on the device
        add("cache_latents", {"denoiser": loaded, **encoders})
    # the largest encoder on the device (T5 where only its outputs are cached), unless streamed
    # from its pinned home
    if cfg.cache.text or caches_frozen_text(facts, cfg):
        on_device = 0 if cfg.memory.stream_encoders else max(encoders.values(), default=0)
        add("cache_text", {"denoiser": loaded, "vae": vae,
                           "text encoders": sum(encoders.values()) - on_device})
    add("train", placed)
    if grids:
        item = weight_item_bytes(cfg)
        reloaded = 0 if cfg.cache.latents and cfg.cache.text else \
            facts.vae_params * item + _grid_encoders(facts, cfg, item)
        add("samples", {**steady, "grid models": reloaded})
    kept = steady  # saves come between steps too (save.every_steps, a stop): the step's buffers are held
    if cfg.train.mode == "full":
        item = {"fp32": 4, "bf16": 2, "fp16": 2}[cfg.save.dtype]
        checkpoint = written_at_once(facts, cfg, item)
        if "diffusers" in cfg.save_formats:
            checkpoint = max(checkpoint, diffusers_save_bytes(facts, item))
    else:
        checkpoint = den.adapter
    add("save", {**kept, "written state": max(den.trained_copy, checkpoint)})
    return HostPrediction(phases)
