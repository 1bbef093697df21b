"""The SDXL family: SDXL, SSD-1B, Segmind-Vega and any other SDXL-shaped UNet.

The UNet layout (transformer depth per block, mid block) is read from the checkpoint's keys,
never from a table per model name, so distilled variants load as they are. Text conditioning
is SDXL's: the penultimate hidden states of CLIP-L and OpenCLIP bigG concatenated (2048 wide),
the projected pooled output of bigG, and the 6 size/crop numbers per image.
"""
from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Mapping, Optional

import diffusers
import torch

from vramfit.config.schema import ModelConfig, TrainConfig
from vramfit.data.fingerprint import module_fingerprint
from vramfit.formats import clip as clipfmt
from vramfit.formats import ldm_vae
from vramfit.formats.safetensors_io import (
    CheckpointError, Lazy, begin_folder, commit_folder, eager, file_tensors, load_prefixed, meta_tensors,
    read_header, save_atomic_lazy, save_model_folder, write_text_atomic,
)
from vramfit.memory.encoder_stream import encoder_on
from vramfit.formats.lora import to_diffusers
from vramfit.models.adapter import (
    ActivationShape, FileLayout, ModelBundle, Source, resolution_problems, skip_layer_refusals,
)
from vramfit.models.objectives import loss_of, sample_latent
from vramfit.models.parts import (
    as_stored, build_checked, check_folder_shapes, clip_text_model, count_params, encode_vae_images,
    first_part, folder_encoders, lazy_state, load_clip_tokenizers, merge_counts, require_tokenizers,
    save_encoder_folder, shipped_config, trained_encoder_states,
)
from vramfit.models.sdxl.sgm_unet import (
    check_text_time, diffusers_to_sgm_unet, sgm_to_diffusers_unet, unet_config_from_sgm, unet_key_map,
)
from vramfit.models.sdxl.kohya import describe_target, kohya_unet_names, shipped_kohya_names, to_kohya_sdxl
from vramfit.models.sdxl.memory import unet_activations, unet_batch
from vramfit.models.sdxl.objective import (
    V_PRED_KEY, ZTSNR_KEY, ddpm_draws, ddpm_inputs, ddpm_terms, folder_settings, noise_scheduler,
    sampling_config, single_file_markers, single_file_settings, train_scheduler,
)
from vramfit.models.sdxl.tiny import TINY_NAMES, materialize

UNET = "model.diffusion_model."
VAE = "first_stage_model."
CLIP_L = "conditioner.embedders.0.transformer."
CLIP_G = "conditioner.embedders.1.model."
VAE_SCALE = 0.13025
# The released layouts whose configs ship in models/configs: name -> (denoiser, VAE, text encoders'
# configs), for naming a checkpoint's layout and for `vramfit plan --model NAME` without the file
SHIPPED_LAYOUTS = {"sdxl": ("sdxl_unet", "sdxl_vae", ("clip_l", "clip_g")),
                 "ssd1b": ("ssd1b_unet", "sdxl_vae", ("clip_l", "clip_g"))}


def layout_name(config: dict) -> str:
    """Name a UNet layout by comparing its depths with the known distilled variants."""
    depths = (json.dumps(config.get("transformer_layers_per_block")),
              json.dumps(config.get("reverse_transformer_layers_per_block")), config.get("mid_block_type"))
    for name, (unet_config, _, _) in SHIPPED_LAYOUTS.items():
        ref = shipped_config(unet_config)
        ref_depths = (json.dumps(ref["transformer_layers_per_block"]),
                      json.dumps(ref["reverse_transformer_layers_per_block"]), ref["mid_block_type"])
        if depths == ref_depths and config["block_out_channels"] == ref["block_out_channels"]:
            return name
    return "sdxl-custom"


class SDXLFamily:
    name = "sdxl"
    display_name = "SDXL-family"
    # LoRA files a run writes by default, the primary first (saved as <name>.safetensors): kohya
    # keys, which ComfyUI and A1111 load; the diffusers/PEFT file goes beside it.
    lora_formats = ("lora_kohya", "lora")
    base_model_version = "sdxl_base_v1-0"  # ss_base_model_version, as kohya writes it
    resolution_multiple = 8  # the VAE's factor; the UNet's up blocks follow any latent size
    shipped_layouts = SHIPPED_LAYOUTS
    shipped_aliases: dict[str, str] = {}
    tiny_models = TINY_NAMES  # the tiny:<name> models of models/sdxl/tiny.py
    files = FileLayout(UNET, "unet", VAE, (("CLIP-L", CLIP_L, "text_encoder", "clip", "clip_l"),
                                           ("bigG", CLIP_G, "text_encoder_2", "clip", "clip_g")))
    block_containers = ("down_blocks", "mid_block", "up_blocks")
    repeated_blocks = ("BasicTransformerBlock", "ResnetBlock2D")
    default_guidance = 5.0
    guidance_doubles_batch = True
    has_t5 = False
    samples_without_t5 = True
    skip_layer_guidance = False  # its sampler has none
    # the pipeline component of the denoiser, and its module roots in peft and kohya LoRA files
    denoiser_component = "unet"
    lora_roots = ("down_blocks.", "mid_block.", "up_blocks.", "conv_in", "conv_out", "time_embedding.",
                  "add_embedding.", "conv_norm_out")
    kohya_roots = ("input_blocks_", "middle_block_", "output_blocks_", "time_embed_", "label_emb_", "out_",
                   *(root.replace(".", "_") for root in lora_roots))  # SGM names, then diffusers' (kohya.py)

    def materialize_tiny(self, name: str, root: Path) -> Path:
        """The single file of tiny:`name` under `root`, written with its tokenizers if needed."""
        return materialize(name, root)

    def tiny_denoiser_config(self, name: str) -> dict:
        return shipped_config(f"tiny_{name}_unet")

    # ---- detection ---------------------------------------------------------------------------
    def encoder_files(self, source: Source, header: dict, meta: Optional[dict] = None) -> dict[str, Path]:
        """None: SDXL-family single files hold their VAE and text encoders."""
        return {}

    def detect_single_file(self, keys: set[str]) -> bool:
        return any(k.startswith(UNET + "label_emb.") for k in keys) and any(
            k.startswith(UNET + "input_blocks.") for k in keys)

    def detect_diffusers(self, model_index: dict) -> bool:
        return model_index.get("_class_name", "").startswith("StableDiffusionXL")

    def skip_layer_problem(self, model, asked) -> Optional[str]:
        """None: the SDXL family has no skip-layer guidance (skip_layer_refusals refuses it)."""
        return None

    def config_problems(self, cfg) -> list[str]:
        """SD3-only settings given for an SDXL-family model are refused, not silently ignored."""
        # Values that differ from the defaults, not keys given: a resolved config.toml lists them all.
        train, model = TrainConfig(), ModelConfig()
        problems = [f"train.{name}: applies to the flow-matching objective (SD3, Flux.1), not to {self.name}"
                    for name in ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "flow_shift",
                                 "flow_shift_mode")
                    if getattr(cfg.train, name) != getattr(train, name)]
        for key in ("max_sequence_length", "t5_precision"):
            if getattr(cfg.model, key) != getattr(model, key):
                problems.append(f"model.{key}: applies to SD3's T5 encoder only")
        for key in ("clip_l", "clip_g", "t5"):
            if getattr(cfg.model, key):
                problems.append(f"model.{key}: separate text encoder files are read for SD3 single "
                                "files only")
        if cfg.model.vae:
            problems.append("model.vae: a VAE file of its own is read for Flux.1 transformer-only files only")
        if cfg.train.guidance != train.guidance:
            problems.append(f"train.guidance: applies to Flux.1 dev's guidance embedding, not to {self.name}")
        return problems + skip_layer_refusals(self, cfg) + resolution_problems(self, cfg)

    def default_t5_tokens(self, config: Mapping) -> int:
        """0: the SDXL family has no T5 encoder (has_t5 is False)."""
        return 0

    def prepare_encoders(self, bundle: ModelBundle) -> None:
        """Nothing to do: SDXL's CLIP encoders are small enough to run as stored."""

    # ---- loading -----------------------------------------------------------------------------
    def load(self, source: Source) -> ModelBundle:
        if source.kind == "single_file":
            unet, vae, encoders = self._load_single_file(source.path)
            scheduler = noise_scheduler(*single_file_settings(read_header(source.path)[0]))
        else:
            unet, vae, encoders = self._load_diffusers(source.path)
            try:
                scheduler = noise_scheduler(*folder_settings(source.path))
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
        tok_dir = require_tokenizers(source)
        tokenizers = load_clip_tokenizers(tok_dir)
        return ModelBundle(self.name, layout_name(dict(unet.config)), source, unet, vae, encoders,
                           tokenizers, scheduler)

    def caption_tokenizers(self, source: Source, cfg: Any) -> list[Any]:
        """CLIP-L's and CLIP-G's tokenizers, as `load` finds them (each keeps 77 tokens)."""
        return load_clip_tokenizers(require_tokenizers(source))

    def _load_single_file(self, path: Path):
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import UNet2DConditionModel

        header, _ = read_header(path)
        if not self.detect_single_file(set(header)):
            raise CheckpointError(f"{path}: no SDXL-family UNet found (no {UNET}label_emb.* keys)")
        try:
            config = unet_config_from_sgm(meta_tensors(header, UNET), _pooled_width(header))
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        state = sgm_to_diffusers_unet(load_prefixed(path, UNET), config)
        to_sgm = unet_key_map(config)
        unet = build_checked(UNet2DConditionModel, config, state, "UNet", path, lambda k: UNET + to_sgm[k])
        vae, encoders = self._single_file_encoders(path, header)
        return unet, vae, encoders

    def _single_file_encoders(self, path: Path, header: dict):
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import AutoencoderKL

        for prefix, what in ((VAE, "VAE"), (CLIP_L, "CLIP-L text encoder"), (CLIP_G, "bigG text encoder")):
            if not any(k.startswith(prefix) for k in header):
                raise CheckpointError(
                    f"{path}: the file has no {what} ({prefix}* keys); vramfit needs a full "
                    "checkpoint (UNet, VAE and both text encoders) or a diffusers folder")
        vae_cfg = ldm_vae.vae_config_from_ldm(meta_tensors(header, VAE), scaling_factor=VAE_SCALE)
        vae_names = ldm_vae.vae_key_map(vae_cfg)
        vae_state = ldm_vae.ldm_to_diffusers_vae(load_prefixed(path, VAE))
        vae = build_checked(AutoencoderKL, vae_cfg, vae_state, "VAE", path, lambda k: VAE + vae_names[k])
        enc1 = clip_text_model(load_prefixed(path, CLIP_L), "quick_gelu", False, path)
        enc2 = clip_text_model(clipfmt.openclip_to_hf(load_prefixed(path, CLIP_G)), "gelu", True, path)
        return vae, [enc1, enc2]

    def _load_diffusers(self, folder: Path, unet: bool = True):
        """The folder's UNet (None without `unet`: load_encoders reads it not again), VAE and text
        encoders."""
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        parts = {"unet": UNet2DConditionModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel,
                 "text_encoder_2": CLIPTextModelWithProjection}
        for sub, cls in parts.items():
            if sub == "unet" and not unet:
                continue
            if not (folder / sub / "config.json").is_file():
                raise CheckpointError(f"{folder}: diffusers folder has no {sub}/config.json")
            check_folder_shapes(cls, folder, sub)
        denoiser = None
        if unet:
            try:
                check_text_time(json.loads((folder / "unet" / "config.json").read_text()), json.loads(
                    (folder / "text_encoder_2" / "config.json").read_text()).get("projection_dim"))
            except ValueError as exc:
                raise CheckpointError(f"{folder / 'unet' / 'config.json'}: {exc}") from None
            denoiser = UNet2DConditionModel.from_pretrained(folder, subfolder="unet",
                                                            low_cpu_mem_usage=True).eval()
        vae = AutoencoderKL.from_pretrained(folder, subfolder="vae")
        enc1 = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder")
        enc2 = CLIPTextModelWithProjection.from_pretrained(folder, subfolder="text_encoder_2")
        return denoiser, vae.eval(), [enc1.eval(), enc2.eval()]

    def load_encoders(self, source: Source):
        """VAE and text encoders again, for saving or sampling after they were freed for training."""
        if source.kind == "single_file":
            header, _ = read_header(source.path)
            return self._single_file_encoders(source.path, header)
        _, vae, encoders = self._load_diffusers(source.path, unet=False)
        return vae, encoders

    # ---- encoding ----------------------------------------------------------------------------
    def encoder_identity(self, bundle: ModelBundle, part: str) -> str:
        if part == "vae":
            return "sdxl-vae:" + module_fingerprint(bundle.vae)
        if part == "frozen text":  # both encoders are CLIPs, which train together or not at all
            return ""
        return "sdxl-text:" + "+".join(module_fingerprint(m) for m in bundle.text_encoders)

    def encode_frozen_text(self, bundle: ModelBundle, captions: list[str], device: torch.device,
                           dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raise ValueError("the SDXL family's text encoders are CLIPs that train together: none stays frozen")

    def release_frozen_encoders(self, bundle: ModelBundle) -> None:
        """None to let go of (both encoders are CLIPs)."""

    def encode_text(self, bundle: ModelBundle, captions: list[str], device: torch.device,
                    dtype: torch.dtype, *, frozen: Optional[dict[str, torch.Tensor]] = None
                    ) -> dict[str, torch.Tensor]:
        """Penultimate hidden states of both encoders (one on the device at a time; streamed layer
        by layer with memory.stream_encoders, bundle.extra) and bigG's pooled. Encoders that train
        (bundle.extra["text_encoders_trained"]: lora.text_encoder_rank) stay where they were placed
        and encode with gradients where they are enabled; frozen ones without. (`frozen`: none here,
        see encode_frozen_text.)"""
        if frozen is not None:
            raise ValueError("the SDXL family has no frozen text encoder outputs to take")
        trained = bool(bundle.extra.get("text_encoders_trained"))
        hidden, pooled = [], None
        for tokenizer, encoder in zip(bundle.tokenizers, bundle.text_encoders):
            ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                            truncation=True, return_tensors="pt").input_ids
            placed = nullcontext() if trained else encoder_on(encoder, device,
                                                               bundle.extra.get("stream_encoders", False))
            with placed, torch.set_grad_enabled(trained and torch.is_grad_enabled()):
                out = encoder(ids.to(device), output_hidden_states=True)
                hidden.append(out.hidden_states[-2].float().cpu())
                if hasattr(out, "text_embeds"):
                    pooled = out.text_embeds.float().cpu()
        return {"prompt_embeds": torch.cat(hidden, dim=-1).to(dtype), "pooled": pooled.to(dtype)}

    def encode_images(self, bundle: ModelBundle, pixels: torch.Tensor, device: torch.device,
                      dtype: torch.dtype, tiling: bool) -> dict[str, torch.Tensor]:
        """The VAE's latent distribution (mean, log-variance); sampling happens at train time."""
        return encode_vae_images(bundle, pixels, device, dtype, tiling)

    def latents(self, bundle: ModelBundle, encoded: dict[str, torch.Tensor],
                generator: torch.Generator) -> torch.Tensor:
        return sample_latent(encoded, generator) * VAE_SCALE

    def predict(self, bundle: ModelBundle, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: dict[str, torch.Tensor], time_ids: torch.Tensor) -> torch.Tensor:
        return bundle.denoiser(noisy, timesteps, encoder_hidden_states=text["prompt_embeds"],
                               added_cond_kwargs={"text_embeds": text["pooled"], "time_ids": time_ids}).sample

    def training_loss(self, bundle: ModelBundle, batch: dict, cfg, generator: torch.Generator,
                      device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Epsilon- or v-prediction loss on SDXL's DDPM schedule (models/sdxl/objective.py)."""
        return self.loss_from(bundle, self.loss_inputs(bundle, batch, cfg, generator), cfg, device, dtype)

    def loss_inputs(self, bundle: ModelBundle, batch: dict, cfg, generator: torch.Generator,
                    dtype: Optional[torch.dtype] = None, at: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """What `loss_from` needs from the host, on the CPU: the batch's conditioning and every
        random draw of the loss (the latent sample, the noise and the timesteps; `at`, positions in
        [0, 1] per sample, fixes the timesteps). With `dtype` the conditioning is in that dtype
        already, as `loss_from` casts it (the same values)."""
        scheduler = train_scheduler(bundle, cfg)
        latents = self.latents(bundle, {"mean": batch["mean"], "logvar": batch["logvar"]}, generator)
        inputs = {"latents": latents, **ddpm_draws(latents.shape, scheduler, generator, cfg.noise_offset, at,
                                                   getattr(cfg, "input_perturbation", 0.0))}
        inputs.update(ddpm_terms(scheduler, inputs["timesteps"], cfg))
        inputs.update({k: batch[k] if dtype is None else batch[k].to(dtype) for k in ("prompt_embeds", "pooled", "time_ids")})
        inputs.update({k: batch[k] for k in ("sample_weight", "loss_mask") if k in batch})
        return inputs

    def loss_from(self, bundle: ModelBundle, inputs: dict, cfg, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
        """The loss of `loss_inputs` (on the CPU, or copied to `device` ahead)."""
        latents = inputs["latents"].to(device)
        # the run's scheduler (a bundle copied before `loss_inputs` replaced it gets its own once)
        noisy, target, timesteps = ddpm_inputs(latents, train_scheduler(bundle, cfg), inputs, cfg.noise_offset,
                                               getattr(cfg, "input_perturbation", 0.0))
        text = {k: inputs[k].to(device, dtype) for k in ("prompt_embeds", "pooled")}
        pred = self.predict(bundle, noisy.to(dtype), timesteps, text, inputs["time_ids"].to(device, dtype))
        return loss_of(pred, target, inputs, cfg)

    # ---- saving ------------------------------------------------------------------------------
    def unet_sgm_entries(self, bundle: ModelBundle, dtype: torch.dtype) -> dict[str, Lazy]:
        """The UNet under its SGM keys, each tensor cast to `dtype` only when it is written."""
        keys = {k: k for k in bundle.denoiser.state_dict()}
        names = diffusers_to_sgm_unet(keys, dict(bundle.denoiser.config))  # {SGM key: diffusers key}
        return lazy_state(bundle.denoiser, {s: ((d,), first_part) for s, d in names.items()}, dtype, UNET)

    def save_single_file(self, bundle: ModelBundle, path: Path, dtype: torch.dtype,
                         metadata: dict[str, str]) -> None:
        """UNet converted back to SGM keys; VAE and text encoders carried over from the source; the
        `v_pred`/`ztsnr` markers of the trained prediction type (ComfyUI reads them)."""
        metadata = {**metadata, "modelspec.architecture": "stable-diffusion-xl-v1-base"}
        # written a tensor at a time: the UNet's cast as each is written, the source's read then
        state = self.unet_sgm_entries(bundle, dtype)
        src = bundle.source
        if src.kind == "single_file":
            # Everything that is not the UNet is copied byte for byte from the input file.
            state.update(file_tensors(src.path, lambda k: not k.startswith(UNET)))
            for key in (V_PRED_KEY, ZTSNR_KEY):  # the source's markers; the trained ones follow
                state.pop(key, None)
        else:
            vae, (enc1, enc2) = self.load_encoders(src)  # written in the dtypes the folder stores
            vae_state = ldm_vae.diffusers_to_ldm_vae(as_stored(vae, src.path / "vae"))
            state.update({VAE + k: eager(v) for k, v in vae_state.items()})
            clip_l = clipfmt.to_sgm_clip_keys(as_stored(enc1, src.path / "text_encoder"))
            state.update({CLIP_L + k: eager(v) for k, v in clip_l.items()})
            # OpenCLIP files carry the contrastive temperature, which text conditioning never
            # uses and diffusers drops; write ln(100), its trained value, so the key set is complete.
            bigg = clipfmt.hf_to_openclip(as_stored(enc2, src.path / "text_encoder_2"),
                                          logit_scale=torch.tensor(4.6052))
            state.update({CLIP_G + k: eager(v) for k, v in bigg.items()})
        # train.text_encoders = "full": written (none where the encoders were freed after caching)
        clip_l, clip_g = trained_encoder_states(bundle, dtype) or [None, None]
        if clip_l is not None:
            state = {k: v for k, v in state.items() if not k.startswith(CLIP_L)}
            state.update({CLIP_L + k: eager(v) for k, v in clipfmt.to_sgm_clip_keys(clip_l).items()})
        if clip_g is not None:
            kept = state.get(CLIP_G + "logit_scale")
            logit_scale = torch.tensor(4.6052) if kept is None else kept.produce()
            state = {k: v for k, v in state.items() if not k.startswith(CLIP_G)}
            bigg = clipfmt.hf_to_openclip(clip_g, logit_scale=logit_scale)
            state.update({CLIP_G + k: eager(v) for k, v in bigg.items()})
        state.update({k: eager(v) for k, v in single_file_markers(bundle.noise_scheduler).items()})
        save_atomic_lazy(state, path, metadata)

    def save_diffusers(self, bundle: ModelBundle, folder: Path, dtype: torch.dtype) -> None:
        """A diffusers SDXL folder that StableDiffusionXLPipeline.from_pretrained loads."""
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import EulerDiscreteScheduler

        tmp = begin_folder(folder)
        save_model_folder(bundle.denoiser, tmp / "unet", dtype)
        vae, encoders, trained = folder_encoders(self, bundle, dtype)
        vae.save_pretrained(tmp / "vae")
        for sub, enc, own in zip(("text_encoder", "text_encoder_2"), encoders, trained):
            save_encoder_folder(enc, tmp / sub, own)
        for sub, tok in zip(("tokenizer", "tokenizer_2"), bundle.tokenizers):
            tok.save_pretrained(tmp / sub)
        scheduler = EulerDiscreteScheduler.from_config(sampling_config(bundle.noise_scheduler))
        scheduler.save_pretrained(tmp / "scheduler")
        index = {"_class_name": "StableDiffusionXLPipeline", "_diffusers_version": diffusers.__version__,
                 "force_zeros_for_empty_prompt": True, "vae": ["diffusers", "AutoencoderKL"],
                 "unet": ["diffusers", "UNet2DConditionModel"],
                 "text_encoder": ["transformers", "CLIPTextModel"],
                 "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
                 "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
                 "scheduler": ["diffusers", "EulerDiscreteScheduler"],
                 "image_encoder": [None, None], "feature_extractor": [None, None]}
        write_text_atomic(tmp / "model_index.json", json.dumps(index, indent=2))
        commit_folder(tmp, Path(folder))

    # ---- LoRA files, sampling ------------------------------------------------------------------
    def kohya_names(self, config: Optional[Mapping]) -> dict[str, str]:
        """{kohya name: diffusers module} of the UNet `config`, or of every shipped layout (None)."""
        return kohya_unet_names(config) if config is not None else shipped_kohya_names()

    def lora_target(self, modules: dict[str, dict], kohya: bool) -> str:
        return describe_target(modules, kohya)

    def lora_tensors(self, fmt: str, state: dict[str, torch.Tensor], config: Mapping,
                     alpha: float) -> dict[str, torch.Tensor]:
        """"lora": diffusers keys with alpha/rank folded into lora_B (diffusers and ComfyUI read them
        at scale 1); "lora_kohya": kohya's SGM names with .alpha tensors."""
        if fmt == "lora":
            return to_diffusers(state, self.denoiser_component, alpha=alpha)
        return to_kohya_sdxl(state, config, alpha)

    def pipeline(self, bundle: ModelBundle, vae, encoders: list, tokenizers: list):
        """A StableDiffusionXLPipeline with SDXL's Euler scheduler, set for the model's prediction type."""
        # heavy: diffusers pipelines (~2 s); generate's checks before loading run without them
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        scheduler = EulerDiscreteScheduler.from_config(sampling_config(bundle.noise_scheduler))
        return StableDiffusionXLPipeline(
            vae=vae, text_encoder=encoders[0], text_encoder_2=encoders[1], tokenizer=tokenizers[0],
            tokenizer_2=tokenizers[1], unet=bundle.denoiser, scheduler=scheduler,
            force_zeros_for_empty_prompt=True, add_watermarker=False)

    def sampling_defaults(self, config: Mapping) -> dict:
        """None of its own: generate's defaults (default_guidance, its steps and T5 tokens)."""
        return {}

    def prompt_options(self, t5_tokens: int) -> dict:
        return {}

    def vae_input(self, latents: torch.Tensor, vae_config) -> torch.Tensor:
        """Latents scaled back by the VAE's factor (per channel where its config has means and deviations)."""
        cfg = vae_config
        if getattr(cfg, "latents_mean", None) is not None and getattr(cfg, "latents_std", None) is not None:
            mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1).to(latents)
            std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1).to(latents)
            return latents * std / cfg.scaling_factor + mean
        return latents / cfg.scaling_factor

    # ---- memory profile ------------------------------------------------------------------------
    def denoiser_class(self) -> type:
        # heavy: diffusers/transformers classes (~2 s); `vramfit plan` reads a model's facts from headers
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel

    def denoiser_config(self, keys: Mapping[str, torch.Tensor]) -> dict:
        return unet_config_from_sgm(keys)

    def activations(self, config: dict, latent_h: int, latent_w: int, t5_tokens: int) -> ActivationShape:
        return unet_activations(config, latent_h, latent_w, t5_tokens)

    def synthetic_batch(self, config: dict, batch: int, side: tuple[int, int], cfg) -> dict:
        return unet_batch(config, batch, side, cfg)

    # ---- inspection --------------------------------------------------------------------------
    def describe(self, source: Source) -> dict:
        """Family, layout, parameter counts and dtypes per component, without loading weights."""
        if source.kind == "single_file":
            header, _ = read_header(source.path)
            parts = {"unet": UNET, "vae": VAE, "text_encoder (CLIP-L)": CLIP_L,
                     "text_encoder_2 (bigG)": CLIP_G}
            comps = {name: count_params(header, prefix) for name, prefix in parts.items()}
            config = unet_config_from_sgm(meta_tensors(header, UNET), _pooled_width(header))
        else:
            comps = {}
            for sub in ("unet", "vae", "text_encoder", "text_encoder_2"):
                files = sorted((source.path / sub).glob("*.safetensors"))
                comps[sub] = merge_counts([count_params(read_header(f)[0], "") for f in files])
            config = json.loads((source.path / "unet" / "config.json").read_text())
        return {"family": self.name, "layout": layout_name(config),
                "transformer_layers_per_block": config.get("transformer_layers_per_block"),
                "reverse_transformer_layers_per_block": config.get("reverse_transformer_layers_per_block"),
                "mid_block_type": config.get("mid_block_type"),
                "addition_time_embed_dim": config.get("addition_time_embed_dim"),
                "norm_num_groups": config.get("norm_num_groups"),
                **({"assumed": "norm_num_groups (not stored in single files; SDXL's value, checked to divide "
                               "every normalised channel count)"} if source.kind == "single_file" else {}),
                "components": comps}


def _pooled_width(header: dict) -> Optional[int]:
    """The width of the pooled text embedding (bigG's projection, OpenCLIP [width, pooled]), if any."""
    projection = header.get(CLIP_G + "text_projection")
    return int(projection["shape"][1]) if projection else None


