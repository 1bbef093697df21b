"""The family-facing interface: what every model family provides to the rest of vramfit.

A family (one folder, models/<family>/) loads a ModelBundle from a resolved source, encodes
captions and images for the cache, runs the denoiser on a batch, writes checkpoints and LoRA
files, builds its sampling pipeline, and tells the planner and the fit probe its memory profile.
The rest of the code finds a family through the registry (models/registry.py) and only calls
these methods and reads these attributes; it never looks at a family's name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol

import torch

from vramfit.formats.lora import LoraFamily


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


@dataclass
class ActivationShape:
    """Elements per batch item: saved checkpoint inputs, the largest block's work, and the
    inputs of every resnet (`resnet_inputs`, checked against diffusers in the tests). `blocks`: each
    checkpointable block's input, in the order the forward calls them ("resnet" or "block",
    elements), `fixed` the saved inputs of the layers between them, which never recompute, and
    `unchecked` the inputs of resnets called without checkpointing; `saved` is all of them."""
    saved: int = 0
    work: int = 0
    resnet_inputs: int = 0
    blocks: list[tuple[str, int]] = field(default_factory=list)
    fixed: int = 0
    unchecked: int = 0  # inputs of resnets never checkpointed: every activation kept under a share


@dataclass(frozen=True)
class FileLayout:
    """Where a family's parts are: key prefixes in its single files, subfolders of its diffusers
    folders (what fit/model_facts.py reads from headers)."""

    denoiser_prefix: str
    denoiser_folder: str
    vae_prefix: str
    # (name, single-file prefix, diffusers folder, kind: "clip" | "t5", model.<part> key of a file of its
    # own), in the order the family loads them
    encoders: tuple[tuple[str, str, str, str, str], ...]


class Family(LoraFamily, Protocol):
    """A model family (with LoraFamily's name, display_name, denoiser_component, lora_roots,
    kohya_roots, kohya_names and lora_target: how its LoRA files name its denoiser)."""

    # Image sides (data.resolution, data.bucket_step) must be multiples of this: the VAE's
    # downsampling factor, times the denoiser's patch size where it has one.
    resolution_multiple: int
    lora_formats: tuple[str, ...]  # the save.formats LoRA entries it writes, the primary first
    base_model_version: str  # ss_base_model_version in LoRA metadata (kohya's name, read by A1111/Civitai)
    # released layouts whose configs ship in models/configs: name -> (denoiser, VAE, encoder configs)
    shipped_layouts: dict[str, tuple[str, str, tuple[str, ...]]]
    shipped_aliases: dict[str, str]  # other names of shipped layouts
    tiny_models: tuple[str, ...]  # the tiny:<name> models it builds
    files: FileLayout
    block_containers: tuple[str, ...]  # the denoiser's attributes holding its blocks (streamed weights)
    repeated_blocks: tuple[str, ...]  # class names of its repeated blocks (compiled one by one)
    default_guidance: float  # classifier-free guidance scale when none is given
    # guidance above 1 runs each sampling step on a conditional and an unconditional half (a batch of
    # twice the images); False: guidance is an input of one forward (Flux.1's distilled guidance)
    guidance_doubles_batch: bool
    has_t5: bool  # a T5 encoder: model.t5_precision, model.max_sequence_length, generate --t5 apply
    samples_without_t5: bool  # its pipeline samples with T5 left out (t5_precision "none", --t5 none)
    # its sampler takes skip-layer guidance (sample.skip_layer_guidance*, generate --slg): the family's
    # pipeline applies bundle.extra["skip_layer_guidance"]; the others refuse it (skip_layer_refusals)
    skip_layer_guidance: bool

    def materialize_tiny(self, name: str, root: Path) -> Path:
        """The single file of tiny:`name` under `root`, written with its tokenizers if needed."""
        ...

    def tiny_denoiser_config(self, name: str) -> dict:
        """The shipped config of tiny:`name`'s denoiser (FileNotFoundError: none ships)."""
        ...

    def detect_single_file(self, keys: set[str]) -> bool: ...

    def detect_diffusers(self, model_index: dict) -> bool: ...

    def prepare_encoders(self, bundle: ModelBundle) -> None:
        """Apply encoder storage settings from bundle.extra (after cache keys are assigned)."""
        ...

    def config_problems(self, cfg: Any) -> list[str]:
        """Settings that make no sense for this family (checked before any weight loads)."""
        ...

    def skip_layer_problem(self, model: Any, asked: Any) -> Optional[str]:
        """Why the model of `model` (model.* settings) cannot take skip-layer guidance `asked`
        (config.schema.SkipLayerGuidance), read without loading weights; None where it can, or where
        that shows only once it loads. Families without skip-layer guidance: None (refused before)."""
        ...

    def load(self, source: Source) -> ModelBundle: ...

    def load_encoders(self, source: Source) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
        """The VAE and text encoders again, for saving and sampling after they were freed (families
        with has_t5 also take `t5_precision`, as `load` does: T5 stored so while it loads)."""
        ...

    def caption_tokenizers(self, source: Source, cfg: Any) -> list:
        """The tokenizers training encodes captions with, without loading any weight, each with its
        model_max_length set to the tokens its encoder keeps (`vramfit data` counts with them)."""
        ...

    def default_t5_tokens(self, config: Mapping) -> int:
        """T5 tokens per caption for the denoiser `config` where model.max_sequence_length is not
        set (families with has_t5; see `t5_tokens`)."""
        ...

    def encoder_identity(self, bundle: ModelBundle, part: str) -> str:
        """What the cache keys of `part` name: "vae", "text" (every text encoder's outputs), or
        "frozen text" (the outputs of the encoders that never train, cached while the CLIP encoders
        train: SD3's and Flux.1's T5; "" where the family has none or the model lacks it)."""
        ...

    def encode_text(self, bundle: ModelBundle, captions: list[str], device: torch.device,
                    dtype: torch.dtype, *, frozen: Optional[dict[str, torch.Tensor]] = None
                    ) -> dict[str, torch.Tensor]:
        """The conditioning of `captions`; `frozen`: the frozen encoders' outputs for them
        (`encode_frozen_text`, from the cache), which are then not run."""
        ...

    def encode_frozen_text(self, bundle: ModelBundle, captions: list[str], device: torch.device,
                           dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The outputs of the encoders that never train (see encoder_identity's "frozen text")."""
        ...

    def release_frozen_encoders(self, bundle: ModelBundle) -> None:
        """Let go of the encoders that never train once their outputs are cached (nothing reads
        them while the others train; sample grids load their own)."""
        ...

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

    # ---- LoRA files, sampling ------------------------------------------------------------------
    def lora_tensors(self, fmt: str, state: dict[str, torch.Tensor], config: Mapping,
                     alpha: float) -> dict[str, torch.Tensor]:
        """The tensors of LoRA format `fmt` (one of lora_formats) for the peft `state` of a denoiser
        of `config` trained with `alpha`."""
        ...

    def pipeline(self, bundle: ModelBundle, vae: torch.nn.Module, encoders: list, tokenizers: list) -> Any:
        """A diffusers pipeline over the bundle's denoiser and these parts (shared, not copied)."""
        ...

    def sampling_defaults(self, config: Mapping) -> dict:
        """What a denoiser of `config` samples with where generate is not told, by variant or
        layout: any of "guidance", "steps", "t5_tokens" (generate's defaults for those left out)."""
        ...

    def prompt_options(self, t5_tokens: int) -> dict:
        """The family's own arguments of its pipeline's encode_prompt (`t5_tokens`: T5's length)."""
        ...

    def vae_input(self, latents: torch.Tensor, vae_config: Any) -> torch.Tensor:
        """The denoiser's latents as the VAE decodes them (its scaling and shift undone)."""
        ...

    # ---- memory profile (fit/) -----------------------------------------------------------------
    def denoiser_class(self) -> type:
        """The denoiser's diffusers class (imported when asked: it is heavy)."""
        ...

    def encoder_files(self, source: Source, header: dict, meta: Optional[dict] = None) -> dict[str, Path]:
        """{part: file} of the parts ("vae", "clip_l", ...) a single file is used with from files of
        their own (model.<part>, or where the family's releases keep them)."""
        ...

    def denoiser_config(self, keys: Mapping[str, torch.Tensor]) -> dict:
        """The denoiser's config from its single-file keys and shapes (prefix removed, meta tensors)."""
        ...

    def activations(self, config: dict, latent_h: int, latent_w: int, t5_tokens: int) -> ActivationShape:
        """The planner's activation model: elements kept per batch item at a latent size."""
        ...

    def synthetic_batch(self, config: dict, batch: int, side: tuple[int, int], cfg: Any) -> dict:
        """The fit probe's batch: a cached batch's shapes for `batch` images of `side` (w, h)."""
        ...


def t5_tokens(family: Family, cfg: Any, config: Mapping) -> int:
    """T5 tokens per caption: model.max_sequence_length where set, else the family's default for
    the denoiser `config` (SD3 77, Flux.1 dev 512, schnell 256); 0 for a family without T5."""
    if cfg.model.max_sequence_length is not None:
        return int(cfg.model.max_sequence_length)
    return family.default_t5_tokens(config) if family.has_t5 else 0


def skip_layer_refusals(family: Family, cfg: Any) -> list[str]:
    """Skip-layer guidance asked of a family whose sampler has none, each key given (off is what it
    does already, and is not refused)."""
    asked = cfg.sample.skip_layers
    if family.skip_layer_guidance or not asked.given:
        return []
    return [f"{key}: {family.display_name} models sample without skip-layer guidance; leave it out"
            for key, value in zip(asked.keys, (asked.on, asked.layers, asked.scale))
            if value is not None and value is not False]


def resolution_problems(family: Family, cfg: Any) -> list[str]:
    """data.resolution and data.bucket_step (and each dataset's) that are not multiples of the
    family's resolution_multiple: every bucket side is a multiple of the step, the base side of both."""
    multiple = family.resolution_multiple
    named = [("data", cfg.data)] + [(f"data.datasets[{i}]", d) for i, d in enumerate(cfg.data.datasets)]
    return [f"{where}.{key}: {value} is not a multiple of {multiple}, which the {family.name} family needs "
            f"(every bucket side must be); use e.g. {max(multiple, value // multiple * multiple)}"
            for where, d in named for key in ("resolution", "bucket_step")
            if (value := getattr(d, key)) % multiple and (where == "data" or key in d.model_fields_set)]
