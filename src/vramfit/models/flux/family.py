"""The Flux.1 family (dev and schnell-shaped transformers): BFL and diffusers layouts, CLIP-L and
T5 text encoding, the rectified-flow objective with Flux's resolution-dependent shift, 2x2 latent
packing, the guidance embedding of dev, LoRA formats, tiny model and memory profile.

Text conditioning is Flux's: T5's last hidden states are the text tokens, CLIP-L's pooled output
the conditioning vector. T5 is optional (model.t5_precision none): its tokens are then zeros.
A guidance-distilled (dev) transformer is given train.guidance as its guidance while training.
"""
from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Mapping, Optional

import diffusers
import torch

from vramfit.config.schema import TrainConfig
from vramfit.data.fingerprint import module_fingerprint
from vramfit.formats import clip as clipfmt
from vramfit.formats import ldm_vae
from vramfit.formats.lora import lora_ranks, module_kind, to_diffusers
from vramfit.formats.safetensors_io import (
    CheckpointError, Lazy, begin_folder, commit_folder, eager, file_tensors, load_prefixed, meta_tensors,
    read_header, save_atomic_lazy, save_model_folder, write_text_atomic,
)
from vramfit.memory.encoder_stream import encoder_on
from vramfit.memory.quantize import quantize_encoder
from vramfit.models.adapter import (
    ActivationShape, FileLayout, ModelBundle, Source, resolution_problems, skip_layer_refusals,
)
from vramfit.models.flow import DDPM_KEYS, density_from, flow_inputs, flow_snr, loss_weighting, decoder_input
from vramfit.models.flux.bfl import bfl_names, bfl_plan, bfl_to_diffusers, flux_config_from_keys
from vramfit.models.flux.kohya import from_kohya_flux, kohya_width, to_kohya_flux
from vramfit.models.flux.memory import flux_activations, flux_batch
from vramfit.models.flux.objective import SCHEDULER, flux_sigmas, image_ids, pack, unpack
from vramfit.models.flux.stored import MARKER as SCALED_FP8_MARKER
from vramfit.models.flux.stored import is_stored_extra, load_widened
from vramfit.models.flux.tiny import TINY_NAMES, materialize_flux, tiny_transformer_config
from vramfit.models.flux.variants import VARIANT_DEFAULTS, default_t5_tokens, variant, variant_of_keys
from vramfit.models.objectives import loss_of, objective_terms, sample_latent
from vramfit.models.parts import (
    as_stored, build_checked, check_folder_shapes, clip_text_model, count_params, encode_vae_images,
    encoder_file_state, encoder_fingerprint, folder_encoders, lazy_state, merge_counts, require_tokenizers,
    save_encoder_folder, t5_file_encoder, t5_folder_encoder, t5_hidden_states, t5_identity,
    trained_encoder_states, warn_named_over_own,
)

TRANSFORMER = "model.diffusion_model."
VAE = "first_stage_model."
CLIP_L = "text_encoders.clip_l.transformer."
T5 = "text_encoders.t5xxl.transformer."
VAE_SCALE = 0.3611
VAE_SHIFT = 0.1159
CLIP_MAX_LENGTH = 77
DEFAULT_GUIDANCE = 1.0  # train.guidance when the config has none
TINY_SIDE = 8  # the tiny model's native latent side (64 pixels)
_ARCHITECTURES = {"flux-dev": "flux-1-dev", "flux-schnell": "flux-1-schnell"}


def layout_name(config: Mapping) -> str:
    """flux-dev / flux-schnell for the released shape (19 double, 38 single blocks, 3072 wide)."""
    released = (config["num_layers"], config["num_single_layers"],
                config["num_attention_heads"] * config["attention_head_dim"]) == (19, 38, 3072)
    if not released:
        return "flux-custom"
    return "flux-dev" if config.get("guidance_embeds") else "flux-schnell"


class FluxFamily:
    name = "flux"
    display_name = "Flux.1"
    # diffusers/PEFT keys as <name>.safetensors, and kohya's BFL names (ComfyUI, kohya, A1111 forks)
    lora_formats = ("lora", "lora_kohya")
    base_model_version = "flux1"  # ss_base_model_version, as kohya writes it
    resolution_multiple = 16  # VAE factor 8 x the 2x2 packing
    # the released transformer (dev; schnell differs by the guidance embedding only), for `vramfit plan --model`
    shipped_layouts = {"flux1-dev": ("flux1_dev_transformer", "flux_vae", ("clip_l", "t5xxl"))}
    shipped_aliases: dict = {}
    tiny_models = TINY_NAMES
    files = FileLayout(TRANSFORMER, "transformer", VAE, (("CLIP-L", CLIP_L, "text_encoder", "clip", "clip_l"),
                                                         ("T5", T5, "text_encoder_2", "t5", "t5")))
    block_containers = ("transformer_blocks", "single_transformer_blocks")
    repeated_blocks = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
    default_guidance = 3.5  # FluxPipeline's, fed to dev's guidance embedding
    guidance_doubles_batch = False  # one forward a step: no negative prompt, guidance an input
    has_t5 = True
    samples_without_t5 = False  # FluxPipeline has no T5-less path
    skip_layer_guidance = False  # its sampler has none
    denoiser_component = "transformer"
    lora_roots = ("transformer_blocks.", "single_transformer_blocks.", "x_embedder", "context_embedder",
                  "time_text_embed.", "norm_out.", "proj_out")
    kohya_roots = ("double_blocks_", "single_blocks_")

    def materialize_tiny(self, name: str, root: Path) -> Path:
        return materialize_flux(root, name)

    def tiny_denoiser_config(self, name: str) -> dict:
        """The tiny model's config, with the native latent side generate asks for (Flux has no
        sample_size)."""
        if name not in TINY_NAMES:
            raise FileNotFoundError(f"no tiny Flux.1 model {name!r}")
        return {**tiny_transformer_config(name), "sample_size": TINY_SIDE}

    # ---- detection ---------------------------------------------------------------------------
    def encoder_files(self, source: Source, header: dict, meta: Optional[dict] = None) -> dict[str, Path]:
        """{part: file} of the parts given as files of their own (model.vae, model.clip_l, model.t5:
        BFL's ae.safetensors, ComfyUI's clip_l and t5xxl files)."""
        return {part: file for part in ("vae", "clip_l", "t5") if (file := source.encoder_file(part))}

    def detect_single_file(self, keys: set[str]) -> bool:
        return any(k.startswith((TRANSFORMER + "double_blocks.", "double_blocks.")) for k in keys)

    def detect_diffusers(self, model_index: dict) -> bool:
        return model_index.get("_class_name", "").startswith("Flux")

    # ---- loading -----------------------------------------------------------------------------
    def load(self, source: Source, t5_precision: Optional[str] = None) -> ModelBundle:
        """The model of `source`; its T5 (a single file's or a folder's) stored as `t5_precision` asks
        while it loads (models/parts.py `t5_file_encoder`, `t5_folder_encoder`; None: as the source
        stores it, for prepare_encoders; "none": not read at all, no T5 in the bundle)."""
        warn_named_over_own(source, {"clip_l": CLIP_L})
        if source.kind == "single_file":
            transformer, vae, encoders = self._load_single_file(source, t5_precision)
        else:
            transformer, vae, encoders = self._load_diffusers(source.path, t5_precision)
        tokenizers = self.load_tokenizers(require_tokenizers(source), t5=len(encoders) == 2)
        return ModelBundle(self.name, layout_name(dict(transformer.config)), source, transformer, vae,
                           encoders, tokenizers, self._scheduler(source),
                           extra={"max_sequence_length": default_t5_tokens(transformer.config),
                                  "guidance_embeds": bool(transformer.config.get("guidance_embeds"))})

    def _scheduler(self, source: Source):
        # heavy: diffusers classes, kept off `vramfit plan` and pre-load checks
        from diffusers import FlowMatchEulerDiscreteScheduler

        folder = source.path
        if source.kind == "diffusers" and (folder / "scheduler" / "scheduler_config.json").is_file():
            return FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
        return FlowMatchEulerDiscreteScheduler(**SCHEDULER)

    def load_tokenizers(self, folder: Path, t5: bool) -> list[Any]:
        """CLIP-L's tokenizer (tokenizer/), then T5's (tokenizer_2/, as diffusers' Flux folders) when used."""
        # heavy: transformers classes, kept off `vramfit plan` and pre-load checks
        from transformers import CLIPTokenizer, T5TokenizerFast

        tokenizers = [CLIPTokenizer.from_pretrained(folder / "tokenizer")]
        if t5:
            try:
                tokenizers.append(T5TokenizerFast.from_pretrained(folder / "tokenizer_2"))
            except (OSError, ValueError, TypeError) as exc:
                raise CheckpointError(f"model.tokenizers: {folder / 'tokenizer_2'} is not a T5 tokenizer "
                                      f"folder ({exc}); Flux's second tokenizer is T5's") from None
        return tokenizers

    def caption_tokenizers(self, source: Source, cfg) -> list[Any]:
        """CLIP-L's (77 tokens), then T5's (model.max_sequence_length, else the variant's default)
        unless model.t5_precision is none."""
        if source.kind == "single_file":
            keys = read_header(source.path)[0]
            t5 = bool(source.encoder_file("t5")) or any(k.startswith(T5) for k in keys)
            kind = variant_of_keys(keys)
        else:
            t5 = (source.path / "text_encoder_2" / "config.json").is_file()
            kind = self._variant_of(str(source.path)) or "dev"
        tokenizers = self.load_tokenizers(require_tokenizers(source),
                                          t5=t5 and cfg.model.t5_precision != "none")
        tokenizers[0].model_max_length = CLIP_MAX_LENGTH
        if len(tokenizers) > 1:
            tokenizers[1].model_max_length = cfg.model.max_sequence_length or \
                VARIANT_DEFAULTS[kind]["t5_tokens"]
        return tokenizers

    def _transformer(self, state: dict, path: Path, prefix: str,
                     fp8_scales: Optional[dict[str, torch.Tensor]] = None):
        """The transformer of BFL-keyed `state`; each linear whose weight the file stores in
        float8_e4m3fn marked with its scale per row (`fp8_scales`, BFL keys: `mark_fp8_source`)."""
        # heavy: diffusers classes, kept off `vramfit plan` and pre-load checks
        from diffusers import FluxTransformer2DModel

        try:
            config = flux_config_from_keys(meta_tensors({k: v for k, v in read_header(path)[0].items()
                                                          if k.startswith(prefix)
                                                          and not is_stored_extra(k[len(prefix):])}, prefix))
            # one value per row for every tensor, NaN where not from fp8: fused weights split and
            # halves swap on the output axis as the weights do, and every block is there
            rows = {k: fp8_scales[k] if k in fp8_scales else torch.full((t.shape[0],), math.nan)
                    for k, t in state.items() if t.ndim} if fp8_scales else {}
            state = bfl_to_diffusers(state, config)
            rows = bfl_to_diffusers(rows, config) if rows else {}
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        names = bfl_names(state)
        return build_checked(FluxTransformer2DModel, config, state, "transformer", path,
                             lambda k: prefix + names.get(k, k), fp8_scales=rows)

    def _load_single_file(self, source: Source, t5_precision: Optional[str] = None):
        path = source.path
        header, _ = read_header(path)
        if not self.detect_single_file(set(header)):
            raise CheckpointError(f"{path}: no Flux transformer found (no double_blocks.* keys)")
        prefix = TRANSFORMER if any(k.startswith(TRANSFORMER) for k in header) else ""
        # float8 files (flux1-dev-fp8, ComfyUI's scaled fp8) widened as read (models/flux/stored.py)
        scales: dict[str, torch.Tensor] = {}  # of float8_e4m3fn weights, for an fp8 LoRA base
        state = load_widened(path, prefix, exclude=(VAE, CLIP_L, T5), fp8_scales=scales)
        transformer = self._transformer(state, path, prefix, scales)
        vae, encoders = self._single_file_encoders(path, header, source, t5_precision)
        return transformer, vae, encoders

    def _single_file_encoders(self, path: Path, header: dict, source: Source,
                              t5_precision: Optional[str] = None):
        """VAE, CLIP-L and (where there is one) T5: each from its own file where one is given
        (model.vae, model.clip_l, model.t5: BFL's ae.safetensors, ComfyUI's clip_l and t5xxl
        files), else from the single file (ComfyUI's all-in-one checkpoints). T5 is stored as
        `t5_precision` asks while it loads, unless None; "none": no T5."""
        # heavy: diffusers classes, kept off `vramfit plan` and pre-load checks
        from diffusers import AutoencoderKL

        files = {part: source.encoder_file(part) for part in ("vae", "clip_l", "t5")}
        for part, prefix, what in (("vae", VAE, "VAE"), ("clip_l", CLIP_L, "CLIP-L text encoder")):
            if not files[part] and not any(k.startswith(prefix) for k in header):
                raise CheckpointError(f"{path}: the file has no {what} ({prefix}* keys); give it as a file "
                                      f"of its own with model.{part}, or use a Flux checkpoint with its VAE "
                                      "and text encoders or a diffusers folder")
        vae_file = files["vae"] or path
        vae_prefix = _vae_prefix(vae_file) if files["vae"] else VAE
        vae_header = read_header(vae_file)[0]
        vae_cfg = ldm_vae.vae_config_from_ldm(meta_tensors(vae_header, vae_prefix), scaling_factor=VAE_SCALE,
                                              shift_factor=VAE_SHIFT)
        vae_names = ldm_vae.vae_key_map(vae_cfg)
        vae_state = ldm_vae.ldm_to_diffusers_vae(load_prefixed(vae_file, vae_prefix))
        vae = build_checked(AutoencoderKL, vae_cfg, vae_state, "VAE", vae_file,
                            lambda k: vae_prefix + vae_names[k])
        own = files["clip_l"]
        clip = encoder_file_state(own, CLIP_L) if own else load_prefixed(path, CLIP_L)
        encoders = [clip_text_model(clip, "quick_gelu", False, own or path)]
        if (files["t5"] or any(k.startswith(T5) for k in header)) and t5_precision != "none":
            own = files["t5"]
            encoders.append(t5_file_encoder(own or path, T5, t5_precision, own_file=bool(own)))
        return vae, encoders

    def _load_diffusers(self, folder: Path, t5_precision: Optional[str] = None, transformer: bool = True):
        """The folder's transformer (None without `transformer`: load_encoders reads it not again),
        VAE and text encoders, its T5 as `load` says."""
        # heavy: diffusers/transformers classes, kept off `vramfit plan` and pre-load checks
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        parts = {"transformer": FluxTransformer2DModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel}
        for sub, cls in parts.items():
            if sub == "transformer" and not transformer:
                continue
            if not (folder / sub / "config.json").is_file():
                raise CheckpointError(f"{folder}: diffusers folder has no {sub}/config.json")
            check_folder_shapes(cls, folder, sub)
        has_t5 = (folder / "text_encoder_2" / "config.json").is_file() and t5_precision != "none"
        if has_t5:
            check_folder_shapes(T5EncoderModel, folder, "text_encoder_2")
        denoiser = None
        if transformer:
            denoiser = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer",
                                                              low_cpu_mem_usage=True).eval()
        vae = AutoencoderKL.from_pretrained(folder, subfolder="vae")
        encoders = [CLIPTextModel.from_pretrained(folder, subfolder="text_encoder").eval()]
        if has_t5:
            encoders.append(t5_folder_encoder(folder / "text_encoder_2", t5_precision))
        return denoiser, vae.eval(), encoders

    def load_encoders(self, source: Source, t5_precision: Optional[str] = None):
        """VAE and text encoders again, for saving (None: T5 as the source stores it) or sampling
        (T5 stored as `t5_precision` asks while it loads) after they were freed for training."""
        if source.kind == "single_file":
            return self._single_file_encoders(source.path, read_header(source.path)[0], source, t5_precision)
        _, vae, encoders = self._load_diffusers(source.path, t5_precision, transformer=False)
        return vae, encoders

    def prepare_encoders(self, bundle: ModelBundle) -> None:
        """Store T5 as model.t5_precision asks (bundle.extra), or leave it out for "none"."""
        mode = bundle.extra.get("t5_precision", "bf16")
        if len(bundle.text_encoders) < 2:
            return
        if mode == "none":
            bundle.text_encoders, bundle.tokenizers = bundle.text_encoders[:1], bundle.tokenizers[:1]
        else:
            quantize_encoder(bundle.text_encoders[1], mode)

    def skip_layer_problem(self, model, asked) -> Optional[str]:
        """None: Flux.1 has no skip-layer guidance (skip_layer_refusals refuses it)."""
        return None

    def config_problems(self, cfg) -> list[str]:
        """Settings of another family's objective, refused before any weight loads."""
        problems = [f"train.{name}: applies to the SDXL family's objective; leave it out for Flux.1"
                    for name in DDPM_KEYS if getattr(cfg.train, name) != getattr(TrainConfig(), name)]
        problems += [f"{where}.negative_prompt: Flux.1 takes no negative prompt (its guidance is distilled "
                     "into the model); leave it out" for where in ("sample", "prior")
                     if getattr(getattr(cfg, where), "negative_prompt", None)]
        if cfg.model.clip_g:
            problems.append("model.clip_g: Flux.1 has no CLIP-G text encoder (its encoders are CLIP-L "
                            "and T5)")
        if cfg.model.t5_precision == "none" and cfg.sample.grids:  # else it fails after caching
            problems.append("model.t5_precision: \"none\" leaves Flux.1 without T5, which sampling needs "
                            "(FluxPipeline has no T5-less path); sample grids (sample.every_steps / "
                            "sample.every_epochs) need it: store it as int8 or nf4, or turn the grids off")
        # not TrainConfig's default (1.0): a value given; a resolved config.toml lists every key
        if cfg.train.guidance != 1.0 and self._variant_of(cfg.model.path) == "schnell":
            problems.append(f"train.guidance: applies to Flux.1 dev's guidance embedding; {cfg.model.path} "
                            "is schnell-shaped (no guidance_in keys), which takes no guidance: leave it out")
        path = cfg.model.path
        if not (path.startswith("tiny:") or Path(path).expanduser().is_file()):
            problems += [f"model.{key}: files of their own apply to single files; a diffusers folder or "
                         "repo brings its own" for key in ("vae", "clip_l", "t5") if getattr(cfg.model, key)]
        for side in ("width", "height"):
            value = getattr(cfg.sample, side)
            if cfg.sample.every_steps and value and value % self.resolution_multiple:
                problems.append(f"sample.{side}: {value} is not a multiple of {self.resolution_multiple}, "
                                "which Flux.1 needs (VAE factor 8 x 2x2 packing)")
        if cfg.train.mode == "lora" and cfg.lora.type in ("lokr", "loha"):
            problems.append(f"lora.type: {cfg.lora.type!r} is written in kohya/LyCORIS keys for SDXL-family "
                            "UNets only; Flux.1 adapters train as 'lora' or 'dora'")
        if cfg.train.mode == "lora" and cfg.lora.conv_rank:
            problems.append("lora.conv_rank: Flux.1's transformer blocks have no convolutions; leave it out")
        if cfg.train.mode == "lora" and cfg.lora.type == "dora" and "lora_kohya" in cfg.save_formats:
            problems.append("lora.type: 'dora' has no kohya Flux.1 layout (its fused qkv would need one "
                            "magnitude per part); set save.formats = ['lora'] (diffusers reads its DoRA)")
        return problems + skip_layer_refusals(self, cfg) + resolution_problems(self, cfg)

    @staticmethod
    def _variant_of(path: str) -> Optional[str]:
        """The variant of model.path from its name (tiny), header or transformer config, without
        loading weights; None where that needs a download (a repo id)."""
        if path.startswith("tiny:"):
            return variant(tiny_transformer_config(path[5:])) if path[5:] in TINY_NAMES else None
        where = Path(path).expanduser()
        if where.is_file() and where.suffix == ".safetensors":
            return variant_of_keys(read_header(where)[0])
        try:
            return variant(json.loads((where / "transformer" / "config.json").read_text()))
        except (OSError, ValueError, AttributeError):  # not there (yet), or not a config: load says so
            return None

    # ---- encoding ----------------------------------------------------------------------------
    def encoder_identity(self, bundle: ModelBundle, part: str) -> str:
        if part == "vae":
            return "flux-vae:" + module_fingerprint(bundle.vae)
        if part == "frozen text":  # T5, which never trains (none: no frozen part)
            if len(bundle.text_encoders) < 2:
                return ""
            return t5_identity("flux", bundle, bundle.text_encoders[1], self._max_len(bundle, None))
        prints = "+".join(encoder_fingerprint(m) for m in bundle.text_encoders)
        t5 = "t5" if len(bundle.text_encoders) == 2 else "no-t5"
        precision = bundle.extra.get("t5_precision", "bf16")
        joint = bundle.denoiser.config.joint_attention_dim
        return f"flux-text:{prints}:{t5}:{precision}:{self._max_len(bundle, None)}:{joint}"

    @staticmethod
    def _max_len(bundle: ModelBundle, requested: Optional[int]) -> int:
        return int(requested or bundle.extra.get("max_sequence_length")
                   or default_t5_tokens(bundle.denoiser.config))

    def encode_text(self, bundle: ModelBundle, captions: list[str], device: torch.device,
                    dtype: torch.dtype, max_sequence_length: Optional[int] = None, *,
                    frozen: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """prompt_embeds [B, max_sequence_length, joint_attention_dim] (T5's last hidden states, or
        zeros without T5) and pooled [B, CLIP-L width] (CLIP-L's pooled output). A CLIP-L that trains
        (bundle.extra["text_encoders_trained"]: lora.text_encoder_rank) stays where it was placed and
        encodes with gradients where they are enabled; T5 never trains: `frozen` gives its outputs
        (encode_frozen_text, cached), and it is not run."""
        stream = bundle.extra.get("stream_encoders", False)
        trained = bool(bundle.extra.get("text_encoders_trained"))
        n_t5 = self._max_len(bundle, max_sequence_length)
        clip, tokenizer = bundle.text_encoders[0], bundle.tokenizers[0]
        ids = tokenizer(captions, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True,
                        return_tensors="pt").input_ids
        placed = nullcontext() if trained else encoder_on(clip, device, stream)
        with placed, torch.set_grad_enabled(trained and torch.is_grad_enabled()):
            pooled = clip(ids.to(device), output_hidden_states=False).pooler_output.float().cpu()
        joint = bundle.denoiser.config.joint_attention_dim
        if frozen is not None:
            text = frozen["t5"]
        elif len(bundle.text_encoders) > 1:
            text = t5_hidden_states(bundle, 1, captions, device, n_t5)
        else:
            text = torch.zeros(len(captions), n_t5, joint)
        return {"prompt_embeds": text.to(dtype), "pooled": pooled.to(dtype)}

    def encode_frozen_text(self, bundle: ModelBundle, captions: list[str], device: torch.device,
                           dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """T5's last hidden states [B, max_sequence_length, joint_attention_dim] ("t5"), which
        encode_text takes as `frozen` while CLIP-L trains."""
        return {"t5": t5_hidden_states(bundle, 1, captions, device, self._max_len(bundle, None)).to(dtype)}

    def release_frozen_encoders(self, bundle: ModelBundle) -> None:
        """T5, once its outputs are cached (the CLIP encoders train; grids load their own T5)."""
        del bundle.text_encoders[1:]

    def encode_images(self, bundle: ModelBundle, pixels: torch.Tensor, device: torch.device,
                      dtype: torch.dtype, tiling: bool) -> dict[str, torch.Tensor]:
        return encode_vae_images(bundle, pixels, device, dtype, tiling)

    def latents(self, bundle: ModelBundle, encoded: dict[str, torch.Tensor],
                generator: torch.Generator) -> torch.Tensor:
        return (sample_latent(encoded, generator) - VAE_SHIFT) * VAE_SCALE

    # ---- the objective -----------------------------------------------------------------------
    def training_loss(self, bundle: ModelBundle, batch: dict, cfg, generator: torch.Generator,
                      device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Rectified-flow loss (velocity target) with Flux's resolution-dependent shift."""
        return self.loss_from(bundle, self.loss_inputs(bundle, batch, cfg, generator), cfg, device, dtype)

    def loss_inputs(self, bundle: ModelBundle, batch: dict, cfg, generator: torch.Generator,
                    dtype: Optional[torch.dtype] = None,
                    at: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """On the CPU: the batch's conditioning, every random draw (latent sample, noise, the
        density's `u`, or `at`) and the sigmas, loss weights and guidance that follow from them."""
        for name in ("noise_offset", "input_perturbation"):
            if getattr(cfg, name, 0) > 0:
                raise ValueError(f"train.{name} applies to the SDXL family's objective; set it to 0 "
                                 "for Flux.1")
        latents = self.latents(bundle, {"mean": batch["mean"], "logvar": batch["logvar"]}, generator)
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
        u = at if at is not None else density_from(cfg, latents.shape[0], generator)
        h, w = latents.shape[-2:]
        sigmas = flux_sigmas(u, (h // 2) * (w // 2), bundle.noise_scheduler.config, cfg)
        guidance = float(getattr(cfg, "guidance", DEFAULT_GUIDANCE))
        weights = loss_weighting(getattr(cfg, "weighting_scheme", "logit_normal"), sigmas)
        inputs = {"latents": latents, "noise": noise, "sigmas": sigmas,
                  **objective_terms(flow_snr(sigmas), "flow", cfg, weights),
                  "guidance": torch.full((latents.shape[0],), guidance)}
        inputs.update({k: batch[k] if dtype is None else batch[k].to(dtype)
                       for k in ("prompt_embeds", "pooled")})
        inputs.update({k: batch[k] for k in ("sample_weight", "loss_mask") if k in batch})
        return inputs

    def loss_from(self, bundle: ModelBundle, inputs: dict, cfg, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
        noisy, target = flow_inputs(inputs["latents"].to(device), inputs["noise"].to(device),
                                    inputs["sigmas"])
        h, w = noisy.shape[-2:]
        text = inputs["prompt_embeds"].to(device, dtype)
        model = bundle.denoiser  # maybe a wrapper (CUDA graph replay) without the diffusers config
        guided = bundle.extra["guidance_embeds"]
        packed = model(hidden_states=pack(noisy).to(dtype), timestep=inputs["sigmas"].to(device, dtype),
                       guidance=inputs["guidance"].to(device, dtype) if guided else None,
                       pooled_projections=inputs["pooled"].to(device, dtype), encoder_hidden_states=text,
                       txt_ids=torch.zeros(text.shape[1], 3, device=device, dtype=dtype),
                       img_ids=image_ids(h, w).to(device, dtype), return_dict=False)[0]
        return loss_of(unpack(packed, h, w), target, inputs, cfg)

    # ---- saving ------------------------------------------------------------------------------
    def transformer_bfl_entries(self, bundle: ModelBundle, dtype: torch.dtype,
                                prefix: str = "") -> dict[str, Lazy]:
        """The transformer under its BFL keys, each tensor made in `dtype` only when it is written."""
        return lazy_state(bundle.denoiser, bfl_plan(bundle.denoiser.state_dict()), dtype, prefix)

    def save_single_file(self, bundle: ModelBundle, path: Path, dtype: torch.dtype,
                         metadata: dict[str, str]) -> None:
        """The transformer in BFL keys: alone where the source was a transformer-only file (BFL's own
        layout), else under model.diffusion_model. with the VAE and text encoders carried over from
        the source (byte for byte from a single file)."""
        src = bundle.source
        bare = src.kind == "single_file" and not any(k.startswith(TRANSFORMER)
                                                     for k in read_header(src.path)[0])
        prefix = "" if bare else TRANSFORMER
        state = self.transformer_bfl_entries(bundle, dtype, prefix)  # made as each is written
        if bare:
            pass  # a transformer-only file (flux1-dev.safetensors) is saved as one: the parts stay in theirs
        elif src.kind == "single_file":  # not a scaled-fp8 marker: the transformer is saved widened
            state.update(file_tensors(src.path,
                                      lambda k: not k.startswith(TRANSFORMER) and k != SCALED_FP8_MARKER))
        else:
            vae, encoders = self.load_encoders(src)
            stored = [as_stored(enc, src.path / sub)
                      for enc, sub in zip(encoders, ("text_encoder", "text_encoder_2"))]
            vae_state = ldm_vae.diffusers_to_ldm_vae(as_stored(vae, src.path / "vae"))
            state.update({VAE + k: eager(v) for k, v in vae_state.items()})
            state.update({CLIP_L + k: eager(v) for k, v in clipfmt.to_sgm_clip_keys(stored[0]).items()})
            if len(stored) > 1:
                state.update({T5 + k: eager(v) for k, v in stored[1].items()})
        clip_l = (trained_encoder_states(bundle, dtype) or [None])[0]  # none: the encoders were freed
        if clip_l is not None:  # train.text_encoders = "full": into the file, a transformer-only one too
            state = {k: v for k, v in state.items() if not k.startswith(CLIP_L)}
            state.update({CLIP_L + k: eager(v) for k, v in clipfmt.to_sgm_clip_keys(clip_l).items()})
        meta = dict(metadata)
        meta["modelspec.architecture"] = _ARCHITECTURES.get(bundle.layout, "flux-1")
        save_atomic_lazy(state, path, meta)

    def save_diffusers(self, bundle: ModelBundle, folder: Path, dtype: torch.dtype) -> None:
        """A diffusers Flux folder that FluxPipeline.from_pretrained loads."""
        tmp = begin_folder(folder)
        save_model_folder(bundle.denoiser, tmp / "transformer", dtype)
        vae, encoders, trained = folder_encoders(self, bundle, dtype)  # a stored or dropped T5: the source's
        vae.save_pretrained(tmp / "vae")
        for sub, enc, own in zip(("text_encoder", "text_encoder_2"), encoders, trained):
            save_encoder_folder(enc, tmp / sub, own)
        tokenizers = bundle.tokenizers if len(bundle.tokenizers) >= len(encoders) else \
            self.load_tokenizers(require_tokenizers(bundle.source), t5=len(encoders) == 2)
        for sub, tok in zip(("tokenizer", "tokenizer_2"), tokenizers[:len(encoders)]):
            tok.save_pretrained(tmp / sub)
        bundle.noise_scheduler.save_pretrained(tmp / "scheduler")
        has_t5 = len(encoders) == 2
        index = {"_class_name": "FluxPipeline", "_diffusers_version": diffusers.__version__,
                 "transformer": ["diffusers", "FluxTransformer2DModel"],
                 "vae": ["diffusers", "AutoencoderKL"],
                 "text_encoder": ["transformers", "CLIPTextModel"],
                 "text_encoder_2": ["transformers", "T5EncoderModel"] if has_t5 else [None, None],
                 "tokenizer": ["transformers", "CLIPTokenizer"],
                 "tokenizer_2": ["transformers", "T5TokenizerFast"] if has_t5 else [None, None],
                 "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                 "image_encoder": [None, None], "feature_extractor": [None, None]}
        write_text_atomic(tmp / "model_index.json", json.dumps(index, indent=2))
        commit_folder(tmp, Path(folder))

    # ---- LoRA files, sampling ------------------------------------------------------------------
    def kohya_names(self, config: Optional[Mapping]) -> None:
        """None: kohya Flux.1 modules are not renames of the transformer's (read_kohya reads them)."""
        return None

    def read_kohya(self, tensors: Mapping[str, torch.Tensor], config: Optional[Mapping]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """A kohya Flux.1 LoRA (lora_unet_double_blocks_..., BFL names) as the transformer's peft keys
        with each module's alpha / rank folded into lora_B (so alpha = rank): fused modules split
        into their parts (models/flux/kohya.py), at the width of `config`, else the file's own."""
        if config is None:
            config = {"num_attention_heads": 1, "attention_head_dim": kohya_width(tensors)}
        out = from_kohya_flux(tensors, config)
        state = {k[len(self.denoiser_component) + 1:]: v for k, v in out.items()}
        return state, {m: float(r) for m, r in lora_ranks(state).items()}

    def lora_target(self, modules: dict[str, dict], kohya: bool) -> str:
        q = next((e["width"] for m, e in modules.items() if module_kind(m, e["ndim"]) == "attn.to_q"
                  or kohya and m.endswith(("_img_attn_qkv", "_linear1"))), None)
        return "Flux.1 transformer" + (f" ({q} wide)" if q else "")

    def lora_tensors(self, fmt: str, state: dict[str, torch.Tensor], config: Mapping,
                     alpha: float) -> dict[str, torch.Tensor]:
        """"lora": diffusers keys with alpha/rank folded into lora_B (FluxPipeline.load_lora_weights);
        "lora_kohya": kohya's BFL names, fused modules exact (models/flux/kohya.py)."""
        if fmt == "lora":
            return to_diffusers(state, self.denoiser_component, alpha=alpha, comfy_dora=True)
        return to_kohya_flux(state, config, alpha)

    def pipeline(self, bundle: ModelBundle, vae, encoders: list, tokenizers: list):
        """A FluxPipeline (speaking generate's conventions, models/flux/pipeline.py) over these parts;
        without T5 the pipeline is refused: FluxPipeline has no T5-less path."""
        # heavy: diffusers pipelines (~2 s); generate's checks before loading run without them
        from diffusers import FlowMatchEulerDiscreteScheduler

        from vramfit.models.flux.pipeline import VramfitFluxPipeline

        if len(encoders) < 2 or len(tokenizers) < 2:
            raise CheckpointError(f"{bundle.source.path}: sampling a Flux.1 model needs its T5 encoder "
                                  "and tokenizer (FluxPipeline has no T5-less path)")
        return VramfitFluxPipeline(transformer=bundle.denoiser,
                                   scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae,
                                   text_encoder=encoders[0], tokenizer=tokenizers[0],
                                   text_encoder_2=encoders[1], tokenizer_2=tokenizers[1])

    def default_t5_tokens(self, config: Mapping) -> int:
        """The variant's: dev 512, schnell 256 (models/flux/variants.py)."""
        return default_t5_tokens(config)

    def sampling_defaults(self, config: Mapping) -> dict:
        """{"guidance", "steps", "t5_tokens"} a transformer of `config` samples with unless told
        otherwise: its variant's (VARIANT_DEFAULTS)."""
        return dict(VARIANT_DEFAULTS[variant(config)])

    def prompt_options(self, t5_tokens: int) -> dict:
        return {"max_sequence_length": t5_tokens}

    def vae_input(self, latents: torch.Tensor, vae_config) -> torch.Tensor:
        return decoder_input(latents, vae_config)

    # ---- memory profile ------------------------------------------------------------------------
    def denoiser_class(self) -> type:
        # heavy: diffusers classes (~2 s); `vramfit plan` reads a model's facts from headers
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel

    def denoiser_config(self, keys: Mapping[str, torch.Tensor]) -> dict:
        return flux_config_from_keys(keys)

    def activations(self, config: dict, latent_h: int, latent_w: int, t5_tokens: int) -> ActivationShape:
        return flux_activations(config, latent_h, latent_w, t5_tokens)

    def synthetic_batch(self, config: dict, batch: int, side: tuple[int, int], cfg) -> dict:
        return flux_batch(config, batch, side, cfg)

    # ---- inspection --------------------------------------------------------------------------
    def describe(self, source: Source) -> dict:
        """Family, layout, transformer shape and parameter counts/dtypes per component, without
        loading weights."""
        if source.kind == "single_file":
            header, _ = read_header(source.path)
            prefix = TRANSFORMER if any(k.startswith(TRANSFORMER) for k in header) else ""
            parts = {"vae": VAE, "text_encoder (CLIP-L)": CLIP_L, "text_encoder_2 (T5)": T5}
            comps = {name: count_params(header, p) for name, p in parts.items()
                     if any(k.startswith(p) for k in header)}
            comps["transformer"] = count_params({k: v for k, v in header.items()
                                                 if not k.startswith((VAE, CLIP_L, T5))}, prefix)
            config = flux_config_from_keys(meta_tensors(header, prefix))
        else:
            comps = {}
            for sub in ("transformer", "vae", "text_encoder", "text_encoder_2"):
                files = sorted((source.path / sub).glob("*.safetensors"))
                if files:
                    comps[sub] = merge_counts([count_params(read_header(f)[0], "") for f in files])
            config = json.loads((source.path / "transformer" / "config.json").read_text())
        return {"family": self.name, "layout": layout_name(config), "variant": variant(config),
                "num_layers": config["num_layers"],
                "num_single_layers": config["num_single_layers"],
                "width": config["num_attention_heads"] * config["attention_head_dim"],
                "guidance_embeds": bool(config.get("guidance_embeds")),
                "t5": any(k.startswith("text_encoder_2") for k in comps), "components": comps}


def _vae_prefix(path: Path) -> str:
    """The prefix of the LDM VAE keys in a VAE file of its own (BFL's ae.safetensors: none)."""
    header = read_header(path)[0]
    for candidate in (VAE, "vae.", ""):
        if any(k.startswith((candidate + "encoder.", candidate + "decoder.")) for k in header):
            return candidate
    raise CheckpointError(f"{path}: not a VAE file (no encoder.* or decoder.* keys)")
