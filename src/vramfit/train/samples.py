"""Sample grids during training: the same prompts and seeds every N steps, one PNG per render.

The grid is rendered by a diffusers pipeline over the model being trained (with its LoRA
active), so what it shows is what an exported checkpoint will give. Where captions are cached,
the sample prompts are encoded with them, in the caption phase (`encode_sample_prompts`), and
the VAE is kept in CPU memory: a grid then needs only the denoiser and the decoder on the GPU, and
reads nothing from disk. A streamed denoiser (memory.stream_weights, which then needs both caches)
renders as it trains: its streamer brings each block to the GPU as it runs, and only the VAE is
placed there, whole, for the grid. Otherwise (live text encoders) the VAE and text encoders are read from
the source again for each grid (T5 stored as model.t5_precision asks while it loads, a part at a
time) and freed after; on CUDA
each model visits the GPU only while it runs (generate.sample_grid). With
ema.sample_with_ema the EMA weights are swapped into the denoiser for the render and the trained
ones put back after (memory/ema.py).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from contextlib import nullcontext
from typing import Callable, ContextManager, Optional

import torch

from vramfit.config.schema import RunConfig
from vramfit.generate import build_pipeline, decoder_pipeline, encode_prompts, sample_grid, save_png
from vramfit.memory.quantize import stored_precision
from vramfit.train.data import free_device_memory
from vramfit.train.lora import merge_trained_encoders
from vramfit.train.state import Progress

log = logging.getLogger("vramfit")


def grid_dtype(denoiser: torch.nn.Module) -> torch.dtype:
    """The dtype a grid runs the encoders and the VAE in: the denoiser's frozen weights' (a LoRA's
    base), or its weights' when all train (fit/planner.py counts the grid so)."""
    params = list(denoiser.parameters())
    return next((p.dtype for p in params if not p.requires_grad), params[0].dtype)


@dataclass
class SampleInputs:
    """What a grid needs besides the denoiser, made in the caption phase: each prompt's embeddings
    and the VAE, both in CPU memory."""

    encoded: dict
    vae: torch.nn.Module


def encode_sample_prompts(cfg: RunConfig, bundle, device: torch.device) -> Optional[SampleInputs]:
    """The sample prompts encoded by the bundle's text encoders (still loaded: the caption phase), and
    its VAE kept, when grids are on and captions and latents cached (else the VAE stays in the run's
    own use); else None (grids load their encoders)."""
    if not (cfg.sample.grids and cfg.cache.text and cfg.cache.latents and bundle.vae is not None
            and bundle.text_encoders):
        return None
    s = cfg.sample
    bundle.extra["skip_layer_guidance"] = s.skip_layers  # the family's pipeline checks it now
    pipe = build_pipeline(bundle)
    encoded = encode_prompts(pipe, s.prompts, negative=s.negative_prompt, guidance=s.guidance, device=device,
                             max_sequence_length=bundle.extra.get("max_sequence_length"),
                             stream=cfg.memory.stream_encoders)
    log.info("sample grids: %d prompt(s) encoded with the captions; the grids need no text encoder",
             len(encoded))
    return SampleInputs(encoded, bundle.vae)


class SampleGrids:
    """Callable with a step number; renders when the step is due. `final` renders regardless."""

    def __init__(self, cfg: RunConfig, family, bundle, device: torch.device, folder: Path,
                 epoch_ended: Optional[Callable[[Progress], bool]] = None,
                 release: Optional[Callable[[], bool]] = None, inputs: Optional[SampleInputs] = None,
                 weights: Optional[Callable[[], ContextManager]] = None):
        self.cfg, self.family, self.bundle, self.device = cfg, family, bundle, device
        bundle.extra["skip_layer_guidance"] = cfg.sample.skip_layers  # what the grids' pipelines apply
        self.inputs = inputs  # prompts encoded in the caption phase, and the VAE
        self.weights = weights  # ema.sample_with_ema: the EMA's swap (memory/ema.py), around each render
        self.folder = folder
        self.release = release  # the step engine's: its CUDA graph recordings make room for the grid
        self.epoch_ended = epoch_ended  # sample.every_epochs: whether a step ended an N-th epoch
        self.paths: list[Path] = []

    @property
    def enabled(self) -> bool:
        return self.cfg.sample.grids

    def maybe(self, step: int, progress: Optional[Progress] = None) -> None:
        every = self.cfg.sample.every_steps
        due = (every and step % every == 0) or (
            self.epoch_ended is not None and progress is not None and self.epoch_ended(progress))
        if self.enabled and due and step < self.cfg.train.steps:
            self.render(step)

    def render(self, step: int) -> Path:
        if self.release is not None and self.release():  # CUDA graphs' pools and gradient buffers: the grid's now
            log.info("train.cuda_graphs: recordings dropped for the sample grid; the next step records again")
            free_device_memory(self.device)
        s = self.cfg.sample
        dtype = grid_dtype(self.bundle.denoiser)
        # a streamed denoiser renders as it trains, each block brought to the GPU as it runs; only
        # the VAE is placed (config/rules.py: such a grid always has its prompts encoded before)
        leave = self.bundle.denoiser if self.cfg.memory.stream_weights else None
        if self.inputs is not None:
            vae, encoders = self.inputs.vae.to(dtype), []
            pipe = decoder_pipeline(self.bundle, vae)
        else:
            # T5 stored as model.t5_precision asks while it loads: never whole in bf16 beside the rest
            stored = {"t5_precision": self.bundle.extra.get("t5_precision")} if self.family.has_t5 else {}
            vae, encoders = self.family.load_encoders(self.bundle.source, **stored)
            if self.bundle.extra.get("text_encoders_trained"):  # lora.text_encoder_rank: what they learned
                with self.weights() if self.weights is not None else nullcontext():  # the EMA's, if it samples
                    merge_trained_encoders(list(encoders), list(self.bundle.text_encoders))
            for m in (vae, *encoders):
                if stored_precision(m) is None:  # a stored T5 stays so (a cast would widen it)
                    m.to(dtype)
            temp = dataclasses.replace(self.bundle, vae=vae, text_encoders=list(encoders),
                                       tokenizers=list(self.bundle.tokenizers), extra=dict(self.bundle.extra))
            self.family.prepare_encoders(temp)
            pipe = build_pipeline(temp)
            del temp
        pipe.set_progress_bar_config(disable=True)
        size = self.cfg.data.resolution
        try:
            with self.weights() if self.weights is not None else nullcontext():
                grid = sample_grid(pipe, s.prompts, s.seeds, negative=s.negative_prompt, steps=s.steps,
                                   guidance=s.guidance, width=s.width or size, height=s.height or size,
                                   device=self.device,
                                   max_sequence_length=self.bundle.extra.get("max_sequence_length"),
                                   encoded=None if self.inputs is None else self.inputs.encoded, leave=leave)
        finally:
            del pipe, vae, encoders
            free_device_memory(self.device)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"step-{step:06d}.png"
        meta = {"step": str(step), "prompts": " | ".join(s.prompts), "seeds": ", ".join(map(str, s.seeds)),
                "steps": str(s.steps), "weights": "ema" if self.weights is not None else "trained"}
        if s.skip_layers.given:  # as generate writes it; the model's default is not written out
            meta["skip-layer guidance"] = s.skip_layers.text
        save_png(grid, path, meta)
        self.paths.append(path)
        log.info("sample grid: %s", path)
        return path
