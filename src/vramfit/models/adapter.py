"""The family-facing interface: what every model family provides to the one training loop.

A family (SDXL and its distilled layouts today) loads a ModelBundle from a resolved source,
encodes captions and images for the cache, runs the denoiser on a batch and writes checkpoints.
The loop never looks at the family's name; it only calls these methods.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

import torch


@dataclass(frozen=True)
class Source:
    """Where a model comes from, after resolving repo ids and tiny:<name> to local paths."""

    kind: str  # "single_file" | "diffusers"
    path: Path
    tokenizers: Optional[Path] = None
    label: str = ""  # what the user wrote, for messages and metadata
    # Text encoders given as files of their own (SD3 single files): (("clip_l", path), ...)
    encoder_files: tuple[tuple[str, Path], ...] = ()

    def encoder_file(self, part: str) -> Optional[Path]:
        return dict(self.encoder_files).get(part)


@dataclass
class ModelBundle:
    """All parts of a text-to-image model, on the CPU until a phase moves one to the device."""

    family: str
    layout: str
    source: Source
    denoiser: torch.nn.Module
    vae: Optional[torch.nn.Module]
    text_encoders: list[torch.nn.Module]
    tokenizers: list[Any]
    noise_scheduler: Any
    extra: dict = field(default_factory=dict)

    def drop_encoders(self) -> None:
        """Free the VAE and text encoders once everything they produce is cached."""
        self.vae = None
        self.text_encoders = []


class Family(Protocol):
    name: str
    # Image sides (data.resolution, data.bucket_step) must be multiples of this: the VAE's
    # downsampling factor, times the denoiser's patch size where it has one.
    resolution_multiple: int

    def detect_single_file(self, keys: set[str]) -> bool: ...

    def detect_diffusers(self, model_index: dict) -> bool: ...

    def prepare_encoders(self, bundle: ModelBundle) -> None:
        """Apply encoder storage settings from bundle.extra (after cache keys are assigned)."""
        ...

    def config_problems(self, cfg: Any) -> list[str]:
        """Settings that make no sense for this family (checked before any weight loads)."""
        ...

    def load(self, source: Source) -> ModelBundle: ...

    def caption_tokenizers(self, source: Source, cfg: Any) -> list:
        """The tokenizers training encodes captions with, without loading any weight, each with its
        model_max_length set to the tokens its encoder keeps (`vramfit data` counts with them)."""
        ...

    def encoder_identity(self, bundle: ModelBundle, part: str) -> str: ...

    def encode_text(self, bundle: ModelBundle, captions: list[str], device: torch.device,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]: ...

    def encode_images(self, bundle: ModelBundle, pixels: torch.Tensor, device: torch.device,
                      dtype: torch.dtype, tiling: bool) -> dict[str, torch.Tensor]: ...

    def latents(self, bundle: ModelBundle, encoded: dict[str, torch.Tensor],
                generator: torch.Generator) -> torch.Tensor: ...

    def training_loss(self, bundle: ModelBundle, batch: dict[str, torch.Tensor], cfg: Any,
                      generator: torch.Generator, device: torch.device,
                      dtype: torch.dtype) -> torch.Tensor:
        """The family's objective on one micro-batch (cached/live encodings), random draws
        from `generator` only: `loss_from` of `loss_inputs`."""
        ...

    def loss_inputs(self, bundle: ModelBundle, batch: dict[str, torch.Tensor], cfg: Any,
                    generator: torch.Generator, dtype: Optional[torch.dtype] = None,
                    at: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """Everything the loss of one micro-batch needs from the host, as CPU tensors: its
        conditioning and every random draw (so the training loop can make them ahead and copy them
        to the device without holding the host up, train/loop.py). With `dtype` (the training's)
        the conditioning `loss_from` casts to it is cast already. `at` (one position in [0, 1] per
        sample, 0 the least noise) fixes the timesteps instead of drawing them (the validation
        loss); the batch's `loss_mask` and `sample_weight`, where present, weight the loss."""
        ...

    def loss_from(self, bundle: ModelBundle, inputs: dict[str, torch.Tensor], cfg: Any, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
        """The loss of `loss_inputs`, whether they are still on the CPU or already on `device`:
        the same values either way."""
        ...

    def save_single_file(self, bundle: ModelBundle, path: Path, dtype: torch.dtype,
                         metadata: dict[str, str]) -> None: ...

    def save_diffusers(self, bundle: ModelBundle, folder: Path, dtype: torch.dtype) -> None: ...

    def describe(self, source: Source) -> dict: ...


def resolution_problems(family: Family, cfg: Any) -> list[str]:
    """data.resolution and data.bucket_step (and each dataset's) that are not multiples of the
    family's resolution_multiple: every bucket side is a multiple of the step, the base side of both."""
    multiple = family.resolution_multiple
    named = [("data", cfg.data)] + [(f"data.datasets[{i}]", d) for i, d in enumerate(cfg.data.datasets)]
    return [f"{where}.{key}: {value} is not a multiple of {multiple}, which the {family.name} family needs "
            f"(every bucket side must be); use e.g. {max(multiple, value // multiple * multiple)}"
            for where, d in named for key in ("resolution", "bucket_step")
            if (value := getattr(d, key)) % multiple and (where == "data" or key in d.model_fields_set)]
