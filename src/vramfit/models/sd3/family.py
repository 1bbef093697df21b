"""The Stable Diffusion 3 family: SD3 Medium, SD3.5 Medium and SD3.5 Large.

The transformer layout is read from the checkpoint's keys (models/sd3/mmdit.py): SD3.5's RMS
q/k norms, and SD3.5 Medium's second image attention in its first blocks, name the layout at any
size (`layout_name`). Stability ships SD3.5 as the MMDiT and VAE in one file, with the text
encoders in files of their own in text_encoders/ beside it; they are found there (`encoder_files`)
unless model.clip_l / clip_g / t5 name them. Text
conditioning is SD3's: the penultimate hidden states of CLIP-L and CLIP-G concatenated (2048 wide
at full size), zero-padded to the joint attention width and followed on the sequence axis by T5's
output; the pooled vector is both CLIPs' projected pooled outputs side by side. CLIP-L has no
projection in Stability's files, so an identity projection stands in (as diffusers and ComfyUI
do). T5 is optional: without it its part of the sequence is zeros, as SD3 allows.
Training is rectified flow (models/sd3/flow.py) on SD3's shift-3 sigma table.
"""
from __future__ import annotations

import json
import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Mapping, Optional

import diffusers
import torch
from huggingface_hub import try_to_load_from_cache

from vramfit.config.schema import SkipLayerGuidance, TrainConfig
from vramfit.data.fingerprint import module_fingerprint
from vramfit.formats import clip as clipfmt
from vramfit.formats import ldm_vae
from vramfit.formats.lora import module_kind, to_diffusers
from vramfit.formats.safetensors_io import (
    CheckpointError, Lazy, begin_folder, commit_folder, eager, file_tensors, load_prefixed, meta_tensors,
    read_header, save_atomic_lazy, save_model_folder, write_text_atomic,
)
from vramfit.memory.encoder_stream import encoder_on
from vramfit.memory.quantize import quantize_encoder
from vramfit.models.adapter import ActivationShape, FileLayout, ModelBundle, Source, resolution_problems
from vramfit.models.flow import DDPM_KEYS, flow_snr, decoder_input
from vramfit.models.objectives import loss_of, objective_terms, sample_latent
from vramfit.models.parts import (
    as_stored, build_checked, check_folder_shapes, clip_text_model, count_params, encode_vae_images,
    encoder_file_state, encoder_fingerprint, folder_encoders, lazy_state, load_clip_tokenizers, merge_counts,
    require_tokenizers, save_encoder_folder, shipped_config, t5_file_encoder, t5_folder_encoder, t5_hidden_states,
    t5_identity,
    trained_encoder_states, warn_named_over_own,
)
from vramfit.models.sd3.flow import (
    DEFAULT_LOGIT_MEAN, DEFAULT_LOGIT_STD, DEFAULT_MODE_SCALE, DEFAULT_SCHEME, DEFAULT_SHIFT,
    NUM_TRAIN_TIMESTEPS, flow_inputs, loss_weighting, sample_density, sd3_sigmas,
)
from vramfit.models.sd3.memory import mmdit_activations, mmdit_batch
from vramfit.models.sd3.mmdit import (
    sai_names, sai_plan, sai_to_diffusers_mmdit, sd3_config_from_keys,
)
from vramfit.models.sd3.tiny import (
    CLIP_G_FILE, CLIP_L_FILE, ENCODER_FOLDER, T5_FILE, TINY_NAMES, materialize_sd3, materialize_sd35,
    tiny_transformer_config,
)

TRANSFORMER = "model.diffusion_model."
VAE = "first_stage_model."
CLIP_L = "text_encoders.clip_l.transformer."
CLIP_G = "text_encoders.clip_g.transformer."
T5 = "text_encoders.t5xxl.transformer."
T5_EMBED = "encoder.embed_tokens.weight"  # tied to shared.weight
VAE_SCALE = 1.5305
VAE_SHIFT = 0.0609
CLIP_MAX_LENGTH = 77
DEFAULT_MAX_SEQUENCE_LENGTH = 77  # diffusers' SD3 training script; its pipeline uses 256
# Stability's text encoder files of a release, in text_encoders/ beside the model file, by part
# (T5: the fp16 file where both are there, else the fp8 one)
RELEASE_ENCODER_FILES = {"clip_l": (CLIP_L_FILE,), "clip_g": (CLIP_G_FILE,),
                         "t5": (T5_FILE, "t5xxl_fp8_e4m3fn.safetensors")}
ENCODER_PREFIXES = {"clip_l": CLIP_L, "clip_g": CLIP_G, "t5": T5}
# the single-file metadata naming the encoder files a saved file was trained with, where it holds none
ENCODER_FILES_META = "vramfit.text_encoders"
# Sampling defaults of a layout, passed to StableDiffusion3Pipeline where a call leaves them out:
# SD3.5 Medium's skip-layer guidance as Stability's reference sampler runs it (layers 7-9 left
# out of a third prediction, at scale 2.5, over the first 1-20% of the steps; it applies only
# with classifier-free guidance, guidance > 1)
LAYOUT_SAMPLING = {"sd3.5-medium": {"skip_guidance_layers": [7, 8, 9], "skip_layer_guidance_scale": 2.5,
                                    "skip_layer_guidance_start": 0.01, "skip_layer_guidance_stop": 0.2}}

log = logging.getLogger(__name__)

# (layers, width, qk_norm, dual attention layers) of the released models -> layout name
_LAYOUTS = {
    (24, 1536, None, ()): "sd3-medium",
    (24, 1536, "rms_norm", tuple(range(13))): "sd3.5-medium",
    (38, 2432, "rms_norm", ()): "sd3.5-large",
}
# The released layouts whose configs ship in models/configs: name -> (denoiser, VAE, text encoders'
# configs; "t5xxl" is T5 v1.1 XXL), for `vramfit plan --model NAME` without the checkpoint
SHIPPED_LAYOUTS = {"sd3-medium": ("sd3_medium_transformer", "sd3_vae", ("clip_l", "clip_g", "t5xxl")),
                   "sd3.5-medium": ("sd35_medium_transformer", "sd3_vae", ("clip_l", "clip_g", "t5xxl")),
                   "sd3.5-large": ("sd35_large_transformer", "sd3_vae", ("clip_l", "clip_g", "t5xxl"))}
_WIDTHS = {1536: "SD3 Medium / SD3.5 Medium width", 2432: "SD3.5 Large width"}  # of LoRA files
_ARCHITECTURES = {"sd3-medium": "stable-diffusion-3-medium", "sd3.5-medium": "stable-diffusion-3.5-medium",
                  "sd3.5-large": "stable-diffusion-3.5-large"}


def layout_name(config: dict) -> str:
    """The released layout a transformer config has: SD3 Medium by its exact shape; SD3.5 by its
    structure at any size (RMS q/k norms, with the second image attention in the first blocks:
    SD3.5 Medium; without it: SD3.5 Large), so a smaller model of the same class is named as its
    release; anything else "sd3-custom"."""
    dual = tuple(config.get("dual_attention_layers") or ())
    key = (config["num_layers"], config["caption_projection_dim"], config.get("qk_norm"), dual)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    if config.get("qk_norm") != "rms_norm":
        return "sd3-custom"
    if not dual:
        return "sd3.5-large"
    return "sd3.5-medium" if dual == tuple(range(len(dual))) else "sd3-custom"


def release_transformer_config(layout: str) -> dict:
    """The SD3Transformer2DModel config of a released layout (bench and tests build it): the shipped
    config (models/configs/sd35_*_transformer.json, as diffusers' configs of the releases have them)."""
    return shipped_config(SHIPPED_LAYOUTS[layout][0])


def skip_layer_defaults(layout: str, num_layers: int) -> dict:
    """The skip-layer guidance a layout samples with by default ({} for none), for the layers the
    model has (a smaller model of the class may have fewer)."""
    options = dict(LAYOUT_SAMPLING.get(layout, {}))
    layers = [i for i in options.get("skip_guidance_layers", []) if i < num_layers]
    return {**options, "skip_guidance_layers": layers} if layers else {}


def skip_layer_choice(layout: str, num_layers: int, asked: SkipLayerGuidance) -> tuple[dict, Optional[str]]:
    """(pipeline call arguments, None) of the skip-layer guidance `asked` for a model of `layout` with
    `num_layers` blocks ({}: none), or ({}, why not) naming the setting: blocks it lacks, or the
    default's blocks asked of a layout without a default."""
    default = skip_layer_defaults(layout, num_layers)
    if asked.on is False:
        return {}, None
    if not asked.given:
        return default, None
    layers_key = asked.keys[1]
    layers = asked.layers if asked.layers is not None else default.get("skip_guidance_layers")
    if not layers:
        return {}, (f"{asked.key}: this {layout} model samples without skip-layer guidance by default; give "
                    f"the transformer blocks to leave out with {layers_key} (0 to {num_layers - 1})")
    beyond = [i for i in layers if i >= num_layers]
    if beyond:
        named = f"blocks {', '.join(map(str, beyond))} are" if len(beyond) > 1 else f"block {beyond[0]} is"
        return {}, (f"{layers_key}: {named} beyond this model's {num_layers} transformer blocks; give "
                    f"blocks 0 to {num_layers - 1}")
    options = {**LAYOUT_SAMPLING.get(layout, {}), "skip_guidance_layers": list(layers)}
    if asked.scale is not None:
        options["skip_layer_guidance_scale"] = float(asked.scale)
    return options, None


class SD3Family:
    name = "sd3"
    display_name = "SD3"
    lora_formats = ("lora",)  # diffusers/PEFT keys, as <name>.safetensors: ComfyUI and diffusers load them
    base_model_version = "sd3"  # ss_base_model_version, as kohya writes it
    # VAE factor 8 x patch size 2: every SD3 and SD3.5 release patches 2x2 latents (the
    # family is checked before its file is read, so the released value stands here)
    resolution_multiple = 16
    shipped_layouts = SHIPPED_LAYOUTS
    shipped_aliases = {"sd3m": "sd3-medium"}  # the name bench/plan_check.py and older tests use
    tiny_models = TINY_NAMES  # the tiny:<name> models of models/sd3/tiny.py
    files = FileLayout(TRANSFORMER, "transformer", VAE, (("CLIP-L", CLIP_L, "text_encoder", "clip", "clip_l"),
                                                         ("CLIP-G", CLIP_G, "text_encoder_2", "clip", "clip_g"),
                                                         ("T5", T5, "text_encoder_3", "t5", "t5")))
    block_containers = ("transformer_blocks",)
    repeated_blocks = ("JointTransformerBlock",)
    default_guidance = 7.0
    guidance_doubles_batch = True
    has_t5 = True
    samples_without_t5 = True  # StableDiffusion3Pipeline puts zeros in T5's place
    skip_layer_guidance = True  # diffusers' SD3 pipeline takes it for any SD3 transformer
    # the pipeline component of the denoiser, and its module roots in peft and kohya LoRA files
    denoiser_component = "transformer"
    lora_roots = ("transformer_blocks.", "pos_embed.", "time_text_embed.", "context_embedder", "norm_out.",
                  "proj_out")
    kohya_roots = ("joint_blocks_",)  # SAI names; kohya SD3 files are not read (kohya_names)

    def materialize_tiny(self, name: str, root: Path) -> Path:
        """The single file of tiny:`name` under `root`, written with its tokenizers (and, for the
        SD3.5 layouts, its text_encoders/ files) if needed."""
        return materialize_sd3(root) if name == "sd3" else materialize_sd35(name, root)

    def tiny_denoiser_config(self, name: str) -> dict:
        if name not in TINY_NAMES:
            raise FileNotFoundError(f"no tiny SD3 model {name!r} (tiny models: {', '.join(TINY_NAMES)})")
        return tiny_transformer_config(name)

    # ---- detection ---------------------------------------------------------------------------
    def detect_single_file(self, keys: set[str]) -> bool:
        return any(k.startswith(TRANSFORMER + "joint_blocks.") for k in keys)

    def detect_diffusers(self, model_index: dict) -> bool:
        return model_index.get("_class_name", "").startswith("StableDiffusion3")

    # ---- loading -----------------------------------------------------------------------------
    def load(self, source: Source, t5_precision: Optional[str] = None) -> ModelBundle:
        """The model of `source`; its T5 (a single file's or a folder's) stored as `t5_precision` asks
        while it loads (models/parts.py `t5_file_encoder`, `t5_folder_encoder`; None: as the source
        stores it, for prepare_encoders; "none": not read at all, no T5 in the bundle)."""
        warn_named_over_own(source, {"clip_l": CLIP_L, "clip_g": CLIP_G})
        if source.kind == "single_file":
            transformer, vae, encoders = self._load_single_file(source.path, source, t5_precision)
            scheduler = self._scheduler(None)
        else:
            transformer, vae, encoders = self._load_diffusers(source.path, t5_precision)
            scheduler = self._scheduler(source.path)
        tok_dir = require_tokenizers(source)
        tokenizers = self.load_tokenizers(tok_dir, t5=len(encoders) == 3)
        return ModelBundle(self.name, layout_name(dict(transformer.config)), source, transformer, vae,
                           encoders, tokenizers, scheduler,
                           extra={"max_sequence_length": DEFAULT_MAX_SEQUENCE_LENGTH})

    def _scheduler(self, folder: Optional[Path]):
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import FlowMatchEulerDiscreteScheduler

        if folder is not None and (folder / "scheduler" / "scheduler_config.json").is_file():
            return FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS,
                                               shift=DEFAULT_SHIFT)

    def load_tokenizers(self, folder: Path, t5: bool) -> list[Any]:
        """CLIP-L and CLIP-G tokenizers (CLIP-G pads with "!", as SDXL's), then T5's when T5 is used."""
        tokenizers = load_clip_tokenizers(folder)
        if t5:
            # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
            from transformers import T5TokenizerFast

            if not (folder / "tokenizer_3").is_dir():
                raise CheckpointError(f"model.tokenizers: {folder} has no tokenizer_3/ folder (the T5 "
                                      "tokenizer), which this checkpoint's T5 encoder needs")
            tokenizers.append(T5TokenizerFast.from_pretrained(folder / "tokenizer_3"))
        return tokenizers

    def caption_tokenizers(self, source: Source, cfg) -> list[Any]:
        """The CLIP tokenizers (77 tokens each), then T5's (model.max_sequence_length tokens) where the
        source has a T5 encoder and model.t5_precision is not "none"; no weight is read."""
        if source.kind == "single_file":
            header, meta = read_header(source.path)
            t5 = "t5" in self.encoder_files(source, header, meta) or any(k.startswith(T5) for k in header)
        else:
            t5 = (source.path / "text_encoder_3" / "config.json").is_file()
        t5 = t5 and cfg.model.t5_precision != "none"
        tokenizers = self.load_tokenizers(require_tokenizers(source), t5=t5)
        for tok in tokenizers[:2]:
            tok.model_max_length = CLIP_MAX_LENGTH
        if len(tokenizers) > 2:
            tokenizers[2].model_max_length = cfg.model.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        return tokenizers

    def default_t5_tokens(self, config: Mapping) -> int:
        """77, as SD3's DreamBooth script (model.max_sequence_length not set)."""
        return DEFAULT_MAX_SEQUENCE_LENGTH

    def _load_single_file(self, path: Path, source: Optional[Source] = None,
                          t5_precision: Optional[str] = None):
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import SD3Transformer2DModel

        header, _ = read_header(path)
        if not self.detect_single_file(set(header)):
            raise CheckpointError(f"{path}: no SD3 transformer found (no {TRANSFORMER}joint_blocks.* keys)")
        config = sd3_config_from_keys(meta_tensors(header, TRANSFORMER))
        state = sai_to_diffusers_mmdit(load_prefixed(path, TRANSFORMER))
        names = sai_names(state)
        transformer = build_checked(SD3Transformer2DModel, config, state, "transformer", path,
                             lambda k: TRANSFORMER + names.get(k, k))
        vae, encoders = self._single_file_encoders(path, header, source, t5_precision)
        return transformer, vae, encoders

    def encoder_files(self, source: Source, header: dict, meta: Optional[dict] = None) -> dict[str, Path]:
        """{part: file} of the text encoders a single file is used with, for "clip_l", "clip_g" and
        "t5": the file model.<part> names; else, for a part the single file does not hold, the file
        of Stability's release layout in text_encoders/ beside it (clip_l.safetensors,
        clip_g.safetensors, t5xxl_fp16.safetensors or t5xxl_fp8_e4m3fn.safetensors); else the one
        its metadata names (a file vramfit saved from such a source), where that file is there."""
        named = json.loads((meta or {}).get(ENCODER_FILES_META) or "{}")
        files = {}
        for part, prefix in ENCODER_PREFIXES.items():
            own = source.encoder_file(part)
            if own or any(k.startswith(prefix) for k in header):
                if own:
                    files[part] = own
                continue
            found = [source.path.parent / ENCODER_FOLDER / name for name in RELEASE_ENCODER_FILES[part]]
            found = [f for f in found if f.is_file()]
            if not found and named.get(part) and Path(named[part]).is_file():
                found = [Path(named[part])]
            if found:
                files[part] = found[0]
        return files

    def _single_file_encoders(self, path: Path, header: dict, source: Optional[Source] = None,
                              t5_precision: Optional[str] = None):
        """VAE from the file; each text encoder from its own file (`encoder_files`), else from the
        single file (T5 stored as `t5_precision` asks while it loads, unless None; "none": no T5)."""
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import AutoencoderKL

        files = self.encoder_files(source, header, read_header(path)[1]) if source else {}
        found = {part: f for part, f in files.items() if f != (source.encoder_file(part) if source else None)}
        if found:
            log.info("text encoders of %s from files of their own: %s", path.name,
                     ", ".join(f"{part} {f}" for part, f in found.items()))
        for prefix, what, part in ((VAE, "VAE", None), (CLIP_L, "CLIP-L text encoder", "clip_l"),
                                   (CLIP_G, "CLIP-G text encoder", "clip_g")):
            if not files.get(part) and not any(k.startswith(prefix) for k in header):
                where = path.parent / ENCODER_FOLDER / RELEASE_ENCODER_FILES[part][0] if part else None
                named = json.loads(read_header(path)[1].get(ENCODER_FILES_META) or "{}").get(part)
                gone = f" (it was saved with {named}, which is not there any more)" if named else ""
                hint = (f"{gone}; put Stability's {where.name} at {where}, or give it as a file of its own "
                        f"with model.{part}, or use ") if part else "; use "
                raise CheckpointError(
                    f"{path}: the file has no {what} ({prefix}* keys){hint}an SD3 file with the "
                    "text encoders (e.g. sd3_medium_incl_clips.safetensors) or a diffusers folder")
        vae_cfg = ldm_vae.vae_config_from_ldm(meta_tensors(header, VAE), scaling_factor=VAE_SCALE,
                                              shift_factor=VAE_SHIFT)
        vae_names = ldm_vae.vae_key_map(vae_cfg)
        vae_state = ldm_vae.ldm_to_diffusers_vae(load_prefixed(path, VAE))
        vae = build_checked(AutoencoderKL, vae_cfg, vae_state, "VAE", path, lambda k: VAE + vae_names[k])

        def part_state(part: str, prefix: str) -> tuple[dict, Path]:
            own = files.get(part)
            return (encoder_file_state(own, prefix), own) if own else (load_prefixed(path, prefix), path)

        clip_l, where = part_state("clip_l", CLIP_L)
        if not any(k.endswith("text_projection.weight") for k in clip_l):
            clip_l["text_projection.weight"] = _identity_projection(clip_l)
        enc1 = clip_text_model(clip_l, "quick_gelu", True, where)
        clip_g, where = part_state("clip_g", CLIP_G)
        enc2 = clip_text_model(clip_g, "gelu", True, where)
        encoders = [enc1, enc2]
        if (files.get("t5") or any(k.startswith(T5) for k in header)) and t5_precision != "none":
            own = files.get("t5")
            encoders.append(t5_file_encoder(own or path, T5, t5_precision, own_file=bool(own)))
        return vae, encoders

    def _load_diffusers(self, folder: Path, t5_precision: Optional[str] = None, transformer: bool = True):
        """The folder's transformer (None without `transformer`: load_encoders reads it not again),
        VAE and text encoders, its T5 as `load` says."""
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        parts = {"transformer": SD3Transformer2DModel, "vae": AutoencoderKL,
                 "text_encoder": CLIPTextModelWithProjection, "text_encoder_2": CLIPTextModelWithProjection}
        for sub, cls in parts.items():
            if sub == "transformer" and not transformer:
                continue
            if not (folder / sub / "config.json").is_file():
                raise CheckpointError(f"{folder}: diffusers folder has no {sub}/config.json")
            check_folder_shapes(cls, folder, sub)
        has_t5 = (folder / "text_encoder_3" / "config.json").is_file() and t5_precision != "none"
        if has_t5:
            check_folder_shapes(T5EncoderModel, folder, "text_encoder_3")
        denoiser = None
        if transformer:
            denoiser = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer",
                                                             low_cpu_mem_usage=True).eval()
        vae = AutoencoderKL.from_pretrained(folder, subfolder="vae")
        encoders = [CLIPTextModelWithProjection.from_pretrained(folder, subfolder="text_encoder").eval(),
                    CLIPTextModelWithProjection.from_pretrained(folder, subfolder="text_encoder_2").eval()]
        if has_t5:
            encoders.append(t5_folder_encoder(folder / "text_encoder_3", t5_precision))
        return denoiser, vae.eval(), encoders

    def load_encoders(self, source: Source, t5_precision: Optional[str] = None):
        """VAE and text encoders again, for saving (None: T5 as the source stores it) or sampling
        (T5 stored as `t5_precision` asks while it loads) after they were freed for training."""
        if source.kind == "single_file":
            header, _ = read_header(source.path)
            return self._single_file_encoders(source.path, header, source, t5_precision)
        _, vae, encoders = self._load_diffusers(source.path, t5_precision, transformer=False)
        return vae, encoders

    # ---- encoding ----------------------------------------------------------------------------
    def encoder_identity(self, bundle: ModelBundle, part: str) -> str:
        if part == "vae":
            return "sd3-vae:" + module_fingerprint(bundle.vae)
        if part == "frozen text":  # T5, which never trains (none: no frozen part)
            if len(bundle.text_encoders) < 3:
                return ""
            return t5_identity("sd3", bundle, bundle.text_encoders[2], self._max_len(bundle, None))
        prints = "+".join(encoder_fingerprint(m) for m in bundle.text_encoders)
        t5 = "t5" if len(bundle.text_encoders) == 3 else "no-t5"
        joint = bundle.denoiser.config.joint_attention_dim
        precision = bundle.extra.get("t5_precision", "bf16")
        return f"sd3-text:{prints}:{t5}:{precision}:{self._max_len(bundle, None)}:{joint}"

    @staticmethod
    def _max_len(bundle: ModelBundle, requested: Optional[int]) -> int:
        return int(requested or bundle.extra.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH))

    def encode_text(self, bundle: ModelBundle, captions: list[str], device: torch.device,
                    dtype: torch.dtype, max_sequence_length: Optional[int] = None, *,
                    frozen: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """prompt_embeds [B, 77 + max_sequence_length, joint_attention_dim] and pooled [B, 2 x proj].

        One encoder is on the device at a time and goes back to the CPU after; with
        memory.stream_encoders (bundle.extra) only its embedding and a layer or two are there.
        CLIP encoders that train (bundle.extra["text_encoders_trained"]: lora.text_encoder_rank) stay
        where they were placed and encode with gradients where they are enabled; T5 never trains:
        `frozen` gives its outputs (encode_frozen_text, cached), and it is not run.
        """
        stream = bundle.extra.get("stream_encoders", False)
        trained = bool(bundle.extra.get("text_encoders_trained"))
        n_t5 = self._max_len(bundle, max_sequence_length)
        joint = bundle.denoiser.config.joint_attention_dim
        hidden, pooled = [], []
        for tokenizer, encoder in zip(bundle.tokenizers[:2], bundle.text_encoders[:2]):
            ids = tokenizer(captions, padding="max_length", max_length=CLIP_MAX_LENGTH,
                            truncation=True, return_tensors="pt").input_ids
            placed = nullcontext() if trained else encoder_on(encoder, device, stream)
            with placed, torch.set_grad_enabled(trained and torch.is_grad_enabled()):
                out = encoder(ids.to(device), output_hidden_states=True)
                hidden.append(out.hidden_states[-2].float().cpu())
                pooled.append(out.text_embeds.float().cpu())
        clip = torch.cat(hidden, dim=-1)
        if clip.shape[-1] > joint:
            raise ValueError(f"the CLIP embeddings are {clip.shape[-1]} wide, more than the transformer's "
                             f"joint_attention_dim {joint}")
        clip = torch.nn.functional.pad(clip, (0, joint - clip.shape[-1]))
        if frozen is not None:
            t5_out = frozen["t5"].float()
        elif len(bundle.text_encoders) > 2:
            t5_out = t5_hidden_states(bundle, 2, captions, device, n_t5, add_special_tokens=True)
        else:
            t5_out = torch.zeros(len(captions), n_t5, joint)
        return {"prompt_embeds": torch.cat([clip, t5_out], dim=-2).to(dtype),
                "pooled": torch.cat(pooled, dim=-1).to(dtype)}

    def encode_frozen_text(self, bundle: ModelBundle, captions: list[str], device: torch.device,
                           dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """T5's last hidden states [B, max_sequence_length, joint_attention_dim] ("t5"), which
        encode_text takes as `frozen` while the CLIP encoders train."""
        n_t5 = self._max_len(bundle, None)
        return {"t5": t5_hidden_states(bundle, 2, captions, device, n_t5, add_special_tokens=True).to(dtype)}

    def release_frozen_encoders(self, bundle: ModelBundle) -> None:
        """T5, once its outputs are cached (the CLIP encoders train; grids load their own T5)."""
        del bundle.text_encoders[2:]

    def encode_images(self, bundle: ModelBundle, pixels: torch.Tensor, device: torch.device,
                      dtype: torch.dtype, tiling: bool) -> dict[str, torch.Tensor]:
        """The VAE's latent distribution (mean, log-variance); sampling happens at train time."""
        return encode_vae_images(bundle, pixels, device, dtype, tiling)

    def latents(self, bundle: ModelBundle, encoded: dict[str, torch.Tensor],
                generator: torch.Generator) -> torch.Tensor:
        return (sample_latent(encoded, generator) - VAE_SHIFT) * VAE_SCALE

    def predict(self, bundle: ModelBundle, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: dict[str, torch.Tensor]) -> torch.Tensor:
        return bundle.denoiser(hidden_states=noisy, timestep=timesteps,
                               encoder_hidden_states=text["prompt_embeds"], pooled_projections=text["pooled"],
                               return_dict=False)[0]

    def prepare_encoders(self, bundle: ModelBundle) -> None:
        """Store T5 as model.t5_precision asks (bundle.extra), or leave it out for "none"."""
        mode = bundle.extra.get("t5_precision", "bf16")
        if len(bundle.text_encoders) < 3:
            return
        if mode == "none":
            bundle.text_encoders = bundle.text_encoders[:2]
            bundle.tokenizers = bundle.tokenizers[:2]
        else:
            quantize_encoder(bundle.text_encoders[2], mode)

    def config_problems(self, cfg) -> list[str]:
        """Settings of another family's objective, refused before any weight loads."""
        problems = [f"train.{name}: applies to the SDXL family's objective; leave it out for SD3"
                    for name in DDPM_KEYS if getattr(cfg.train, name) != getattr(TrainConfig(), name)]
        path = cfg.model.path
        if not (path.startswith("tiny:") or Path(path).expanduser().is_file()):
            problems += [f"model.{key}: separate text encoder files apply to single files; a diffusers "
                         "folder or repo brings its own" for key in ("clip_l", "clip_g", "t5")
                         if getattr(cfg.model, key)]
        for side in ("width", "height"):  # unset: data.resolution, which resolution_problems checks
            value = getattr(cfg.sample, side)
            if cfg.sample.every_steps and value and value % self.resolution_multiple:
                problems.append(f"sample.{side}: {value} is not a multiple of {self.resolution_multiple}, "
                                "which SD3 needs (VAE factor 8 x patch size 2)")
        if cfg.model.vae:
            problems.append("model.vae: a VAE file of its own is read for Flux.1 transformer-only files; "
                            "SD3 files carry their VAE")
        if cfg.train.guidance != 1.0:  # TrainConfig's default
            problems.append("train.guidance: applies to Flux.1 dev's guidance embedding, not to SD3 "
                            "(sampling guidance is sample.guidance)")
        if "lora_kohya" in (cfg.save.formats or ()):  # the default is each family's own formats
            problems.append("save.formats: lora_kohya is for SDXL-family UNets; SD3 LoRAs are saved as "
                            "'lora' (diffusers/PEFT keys, which ComfyUI also loads)")
        if cfg.train.mode == "lora" and cfg.lora.type in ("lokr", "loha"):
            problems.append(f"lora.type: {cfg.lora.type!r} is written in kohya/LyCORIS keys for SDXL-family "
                            "UNets only; SD3 adapters train as 'lora' or 'dora'")
        if cfg.train.mode == "lora" and cfg.lora.conv_rank:
            problems.append("lora.conv_rank: SD3's transformer blocks have no convolutions; leave it out")
        problem = self.skip_layer_problem(cfg.model, cfg.sample.skip_layers)
        return problems + ([problem] if problem else []) + resolution_problems(self, cfg)

    def skip_layer_problem(self, model, asked: SkipLayerGuidance) -> Optional[str]:
        """Why the transformer of `model` (model.*) cannot take `asked`, from its config (no weight
        read); None where it can, or where its config is not found (the pipeline checks it then)."""
        config = self._transformer_config_of(model) if asked.given else None
        if config is None:
            return None
        return skip_layer_choice(layout_name(config), config["num_layers"], asked)[1]

    def _transformer_config_of(self, model) -> Optional[dict]:
        """The transformer config of `model` (model.*) without loading weights: a tiny model's, a single
        file's from its header, a folder's or a downloaded repo's config.json; None where not found."""
        path = model.path
        if path.startswith("tiny:"):
            return tiny_transformer_config(path[5:]) if path[5:] in TINY_NAMES else None
        where = Path(path).expanduser()
        try:
            if where.is_file():
                return sd3_config_from_keys(meta_tensors(read_header(where)[0], TRANSFORMER))
            found = where / "transformer" / "config.json"
            if not where.is_dir():  # a repo id: its config where a download left it
                cached = try_to_load_from_cache(path, "transformer/config.json", revision=model.revision)
                found = Path(cached) if isinstance(cached, str) else None
            return json.loads(found.read_text()) if found is not None else None
        except (OSError, ValueError, KeyError, CheckpointError):  # not readable here: load says why
            return None

    def training_loss(self, bundle: ModelBundle, batch: dict, cfg, generator: torch.Generator,
                      device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Rectified-flow loss (velocity target) with SD3's timestep density and loss weighting."""
        return self.loss_from(bundle, self.loss_inputs(bundle, batch, cfg, generator), cfg, device, dtype)

    def loss_inputs(self, bundle: ModelBundle, batch: dict, cfg, generator: torch.Generator,
                    dtype: Optional[torch.dtype] = None, at: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """What `loss_from` needs from the host, on the CPU: the batch's conditioning, every random
        draw of the loss (the latent sample, the noise, the timestep density's; `at`, positions in
        [0, 1] per sample, fixes the density's draw) and what follows from them there (the sigmas,
        the model's timesteps, the loss weights). With `dtype` the conditioning is in that dtype
        already, as `loss_from` casts it (the same values)."""
        for name in ("noise_offset", "input_perturbation"):  # SDXL objective settings with no SD3 meaning
            if getattr(cfg, name, 0) > 0:
                raise ValueError(f"train.{name} applies to the SDXL family's objective; set it to 0 for SD3")
        scheme = getattr(cfg, "weighting_scheme", DEFAULT_SCHEME)
        latents = self.latents(bundle, {"mean": batch["mean"], "logvar": batch["logvar"]}, generator)
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
        u = at if at is not None else sample_density(
            scheme, latents.shape[0], generator, logit_mean=getattr(cfg, "logit_mean", DEFAULT_LOGIT_MEAN),
            logit_std=getattr(cfg, "logit_std", DEFAULT_LOGIT_STD),
            mode_scale=getattr(cfg, "mode_scale", DEFAULT_MODE_SCALE))
        h, w = latents.shape[-2:]
        sigmas, timesteps = sd3_sigmas(u, (h // 2) * (w // 2), bundle.noise_scheduler.config, cfg)
        inputs = {"latents": latents, "noise": noise, "sigmas": sigmas, "timesteps": timesteps,
                  **objective_terms(flow_snr(sigmas), "flow", cfg, loss_weighting(scheme, sigmas))}
        inputs.update({k: batch[k] if dtype is None else batch[k].to(dtype) for k in ("prompt_embeds", "pooled")})
        inputs.update({k: batch[k] for k in ("sample_weight", "loss_mask") if k in batch})
        return inputs

    def loss_from(self, bundle: ModelBundle, inputs: dict, cfg, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
        """The loss of `loss_inputs` (on the CPU, or copied to `device` ahead)."""
        noisy, target = flow_inputs(inputs["latents"].to(device), inputs["noise"].to(device),
                                    inputs["sigmas"])
        text = {k: inputs[k].to(device, dtype) for k in ("prompt_embeds", "pooled")}
        pred = self.predict(bundle, noisy.to(dtype), inputs["timesteps"].to(device), text)
        return loss_of(pred, target, inputs, cfg)

    # ---- saving ------------------------------------------------------------------------------
    def transformer_sai_entries(self, bundle: ModelBundle, dtype: torch.dtype) -> dict[str, Lazy]:
        """The transformer under its SAI keys, each tensor made in `dtype` only when it is written."""
        return lazy_state(bundle.denoiser, sai_plan(bundle.denoiser.state_dict()), dtype, TRANSFORMER)

    def save_single_file(self, bundle: ModelBundle, path: Path, dtype: torch.dtype,
                         metadata: dict[str, str]) -> None:
        """Transformer converted back to SAI keys; VAE and text encoders carried over from the source.
        Written a tensor at a time: each is made (cast, or read from the source) as it is written."""
        state = self.transformer_sai_entries(bundle, dtype)
        src = bundle.source
        meta = dict(metadata)
        if src.kind == "single_file":
            # Everything that is not the transformer is copied byte for byte (T5 stays in fp8); text
            # encoders in files of their own stay there, named in the metadata for loading it again
            state.update(file_tensors(src.path, lambda k: not k.startswith(TRANSFORMER)))
            header, src_meta = read_header(src.path)
            files = self.encoder_files(src, header, src_meta)
            if files:
                meta[ENCODER_FILES_META] = json.dumps({p: str(f.resolve()) for p, f in files.items()})
        else:
            vae, encoders = self.load_encoders(src)  # written in the dtypes the folder stores
            subs = ("text_encoder", "text_encoder_2", "text_encoder_3")
            stored = [as_stored(enc, src.path / sub) for enc, sub in zip(encoders, subs)]
            vae_state = ldm_vae.diffusers_to_ldm_vae(as_stored(vae, src.path / "vae"))
            state.update({VAE + k: eager(v) for k, v in vae_state.items()})
            clip_l = clipfmt.to_sgm_clip_keys(stored[0])
            proj = clip_l.get("text_projection.weight")
            if proj is not None and torch.equal(proj, torch.eye(proj.shape[0], dtype=proj.dtype)):
                del clip_l["text_projection.weight"]  # Stability's files carry no CLIP-L projection
            state.update({CLIP_L + k: eager(v) for k, v in clip_l.items()})
            state.update({CLIP_G + k: eager(v) for k, v in clipfmt.to_sgm_clip_keys(stored[1]).items()})
            if len(encoders) > 2:
                state.update({T5 + k: eager(v) for k, v in stored[2].items() if k != T5_EMBED})
        # train.text_encoders = "full": the trained CLIP encoders are written into the file, where the
        # loader takes them before any file of their own (unless model.clip_l / clip_g name one)
        named = json.loads(meta.get(ENCODER_FILES_META) or "{}")
        for part, prefix, trained in zip(("clip_l", "clip_g"), (CLIP_L, CLIP_G),
                                         trained_encoder_states(bundle, dtype)):
            if trained is not None:
                state = {k: v for k, v in state.items() if not k.startswith(prefix)}
                state.update({prefix + k: eager(v) for k, v in clipfmt.to_sgm_clip_keys(trained).items()})
                named.pop(part, None)
        if ENCODER_FILES_META in meta:
            meta[ENCODER_FILES_META] = json.dumps(named)
        if T5 + "shared.weight" in state and T5 + T5_EMBED not in state:
            # Stability's files carry the tied embedding under both names; diffusers' single-file
            # loader does not tie it and would leave it unset (and A1111 looks for this name).
            state[T5 + T5_EMBED] = state[T5 + "shared.weight"]  # written twice (made again for each)
        meta["modelspec.architecture"] = _ARCHITECTURES.get(bundle.layout, "stable-diffusion-3")
        save_atomic_lazy(state, path, meta)

    def save_diffusers(self, bundle: ModelBundle, folder: Path, dtype: torch.dtype) -> None:
        """A diffusers SD3 folder that StableDiffusion3Pipeline.from_pretrained loads."""
        tmp = begin_folder(folder)
        save_model_folder(bundle.denoiser, tmp / "transformer", dtype)
        vae, encoders, trained = folder_encoders(self, bundle, dtype)  # a stored or dropped T5: the source's
        vae.save_pretrained(tmp / "vae")
        subs = ("text_encoder", "text_encoder_2", "text_encoder_3")
        for sub, enc, own in zip(subs, encoders, trained):
            save_encoder_folder(enc, tmp / sub, own)
        tokenizers = bundle.tokenizers if len(bundle.tokenizers) >= len(encoders) else \
            self.load_tokenizers(require_tokenizers(bundle.source), t5=len(encoders) == 3)
        for sub, tok in zip(("tokenizer", "tokenizer_2", "tokenizer_3"), tokenizers[:len(encoders)]):
            tok.save_pretrained(tmp / sub)
        bundle.noise_scheduler.save_pretrained(tmp / "scheduler")
        has_t5 = len(encoders) == 3
        index = {"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": diffusers.__version__,
                 "transformer": ["diffusers", "SD3Transformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
                 "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
                 "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
                 "text_encoder_3": ["transformers", "T5EncoderModel"] if has_t5 else [None, None],
                 "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
                 "tokenizer_3": ["transformers", "T5TokenizerFast"] if has_t5 else [None, None],
                 "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                 "image_encoder": [None, None], "feature_extractor": [None, None]}
        write_text_atomic(tmp / "model_index.json", json.dumps(index, indent=2))
        commit_folder(tmp, Path(folder))

    # ---- LoRA files, sampling ------------------------------------------------------------------
    def kohya_names(self, config: Optional[Mapping]) -> None:
        """None: kohya SD3 LoRAs are not read (save them in the diffusers layout)."""
        return None

    def lora_target(self, modules: dict[str, dict], kohya: bool) -> str:
        """"SD3 MMDiT", with the width of its attention inputs and the releases of that width."""
        q = next((e["width"] for m, e in modules.items() if module_kind(m, e["ndim"]) == "attn.to_q"), None)
        return "SD3 MMDiT" + (f" ({q} wide: {_WIDTHS.get(q, 'a custom width')})" if q else "")

    def lora_tensors(self, fmt: str, state: dict[str, torch.Tensor], config: Mapping,
                     alpha: float) -> dict[str, torch.Tensor]:
        """"lora": diffusers keys with alpha/rank folded into lora_B (diffusers and ComfyUI read them
        at scale 1); a DoRA module's magnitude both as diffusers reads it and as ComfyUI does."""
        return to_diffusers(state, self.denoiser_component, alpha=alpha, comfy_dora=True)

    def pipeline(self, bundle: ModelBundle, vae, encoders: list, tokenizers: list):
        """A StableDiffusion3Pipeline with SD3's shift-3 flow-matching scheduler; T5 where both
        its encoder and its tokenizer are there. It samples with the skip-layer guidance that
        bundle.extra["skip_layer_guidance"] asks for (default: the layout's, SD3.5 Medium's) where a
        call does not set it; ValueError naming the setting where the model cannot take it."""
        asked = bundle.extra.get("skip_layer_guidance") or SkipLayerGuidance()
        options, problem = skip_layer_choice(bundle.layout, bundle.denoiser.config.num_layers, asked)
        if problem:
            raise ValueError(problem)
        # heavy: diffusers pipelines (~2 s); generate's checks before loading run without them
        from diffusers import FlowMatchEulerDiscreteScheduler

        from vramfit.models.sd3.pipeline import LayoutPipeline

        has_t5 = len(encoders) > 2 and len(tokenizers) > 2
        pipe = LayoutPipeline(
            transformer=bundle.denoiser, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
            text_encoder=encoders[0], tokenizer=tokenizers[0], text_encoder_2=encoders[1],
            tokenizer_2=tokenizers[1], text_encoder_3=encoders[2] if has_t5 else None,
            tokenizer_3=tokenizers[2] if has_t5 else None)
        pipe.layout_defaults = options
        return pipe

    def sampling_defaults(self, config: Mapping) -> dict:
        """None of its own: generate's defaults (default_guidance, its steps and T5 tokens)."""
        return {}

    def prompt_options(self, t5_tokens: int) -> dict:
        return {"prompt_3": None, "max_sequence_length": t5_tokens}

    def vae_input(self, latents: torch.Tensor, vae_config) -> torch.Tensor:
        return decoder_input(latents, vae_config)

    # ---- memory profile ------------------------------------------------------------------------
    def denoiser_class(self) -> type:
        # heavy: diffusers/transformers classes (~2 s); `vramfit plan` reads a model's facts from headers
        from diffusers import SD3Transformer2DModel

        return SD3Transformer2DModel

    def denoiser_config(self, keys: Mapping[str, torch.Tensor]) -> dict:
        return sd3_config_from_keys(keys)

    def activations(self, config: dict, latent_h: int, latent_w: int, t5_tokens: int) -> ActivationShape:
        return mmdit_activations(config, latent_h, latent_w, t5_tokens)

    def synthetic_batch(self, config: dict, batch: int, side: tuple[int, int], cfg) -> dict:
        return mmdit_batch(config, batch, side, cfg)

    # ---- inspection --------------------------------------------------------------------------
    def describe(self, source: Source) -> dict:
        """Family, layout, transformer shape and parameter counts/dtypes per component, without loading weights."""
        if source.kind == "single_file":
            header, _ = read_header(source.path)
            parts = {"transformer": TRANSFORMER, "vae": VAE, "text_encoder (CLIP-L)": CLIP_L,
                     "text_encoder_2 (CLIP-G)": CLIP_G, "text_encoder_3 (T5)": T5}
            comps = {name: count_params(header, prefix) for name, prefix in parts.items()
                     if any(k.startswith(prefix) for k in header)}
            names = {"clip_l": "text_encoder (CLIP-L)", "clip_g": "text_encoder_2 (CLIP-G)",
                     "t5": "text_encoder_3 (T5)"}
            for part, file in self.encoder_files(source, header, read_header(source.path)[1]).items():
                comps[names[part]] = {**count_params(read_header(file)[0], ""), "file": str(file)}
            config = sd3_config_from_keys(meta_tensors(header, TRANSFORMER))
        else:
            comps = {}
            for sub in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
                files = sorted((source.path / sub).glob("*.safetensors"))
                if files:
                    comps[sub] = merge_counts([count_params(read_header(f)[0], "") for f in files])
            config = json.loads((source.path / "transformer" / "config.json").read_text())
        return {"family": self.name, "layout": layout_name(config), "num_layers": config["num_layers"],
                "width": config["caption_projection_dim"], "qk_norm": config.get("qk_norm"),
                "dual_attention_layers": list(config.get("dual_attention_layers") or ()),
                "t5": any(k.startswith("text_encoder_3") for k in comps), "components": comps}


def _identity_projection(clip_state: dict[str, torch.Tensor]) -> torch.Tensor:
    """diffusers/ComfyUI's stand-in for the CLIP-L projection that SD3 files do not carry."""
    emb = next((t for k, t in clip_state.items() if k.endswith("embeddings.token_embedding.weight")), None)
    if emb is None:
        raise CheckpointError("CLIP-L state has no embeddings.token_embedding.weight")
    return torch.eye(emb.shape[1], dtype=emb.dtype)
