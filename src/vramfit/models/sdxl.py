"""The SDXL family: SDXL, SSD-1B, Segmind-Vega and any other SDXL-shaped UNet.

The UNet layout (transformer depth per block, mid block) is read from the checkpoint's keys,
never from a table per model name, so distilled variants load as they are. Text conditioning
is SDXL's: the penultimate hidden states of CLIP-L and OpenCLIP bigG concatenated (2048 wide),
the projected pooled output of bigG, and the 6 size/crop numbers per image.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import diffusers
import torch
from accelerate import init_empty_weights

from vramfit.config.schema import ModelConfig, TrainConfig
from vramfit.data.fingerprint import module_fingerprint
from vramfit.formats import clip as clipfmt
from vramfit.formats import ldm_vae, sgm_unet
from vramfit.formats.safetensors_io import (
    CheckpointError, begin_folder, commit_folder, load_prefixed, meta_tensors, read_header, save_atomic,
    save_model_folder, write_text_atomic,
)
from vramfit.memory.encoder_stream import encoder_on
from vramfit.memory.vae_tiling import set_vae_tiling
from vramfit.models.adapter import ModelBundle, Source, resolution_problems
from vramfit.models.sources import require_tokenizers
from vramfit.models.tiny import shipped_config
from vramfit.models.objectives import epsilon_draws, epsilon_inputs, min_snr_weights, weighted_mse

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


def _build(cls, config: dict, state: dict[str, torch.Tensor], what: str, path: Path,
           file_key: Optional[Callable[[str], str]] = None):
    """Instantiate without allocating random weights, then take the checkpoint's tensors."""
    with init_empty_weights():
        model = cls(**config)
    return _assign(model, state, what, path, file_key)


def check_shapes(model, state: Mapping[str, torch.Tensor], what: str, path: Path,
                 file_key: Optional[Callable[[str], str]] = None) -> None:
    """Refuse, naming the tensor (as the file names it, via `file_key`) and both shapes, a state
    whose tensor shapes differ from those of `model` (built on the meta device from the config the
    file describes), before load_state_dict would fail with a traceback."""
    expected = model.state_dict()
    for key, t in state.items():
        want = expected.get(key)
        if want is not None and tuple(t.shape) != tuple(want.shape):
            name = file_key(key) if file_key else key
            raise CheckpointError(
                f"{path}: tensor {name} has shape {list(t.shape)}, but the {what} that the file's other "
                f"tensors describe needs {list(want.shape)}; the file is damaged or mixes two models")


def check_folder_shapes(cls, folder: Path, sub: str) -> None:
    """check_shapes for a diffusers/transformers model folder: its config built on the meta device
    against the shapes in its safetensors headers (no weights read)."""
    where = folder / sub
    try:
        with init_empty_weights():
            if hasattr(cls, "config_class"):  # transformers
                model = cls(cls.config_class.from_pretrained(where))
            else:
                model = cls.from_config(cls.load_config(where))
    except ValueError as exc:  # e.g. channel counts that norm_num_groups does not divide
        raise CheckpointError(f"{where / 'config.json'}: {exc}") from None
    keys = set(model.state_dict())
    for file in _weight_files(where):
        stored = meta_tensors(read_header(file)[0])
        check_shapes(model, {_same_key(k, keys): t for k, t in stored.items()}, sub, file)


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files from_pretrained loads (variants such as model.fp16.safetensors aside)."""
    return [f for f in sorted(folder.glob("*.safetensors")) if "." not in f.name[:-len(".safetensors")]]


def _same_key(key: str, keys) -> str:
    """`key` as named among `keys`, with or without the `text_model.` wrapper that CLIP folders
    of older transformers have and the installed CLIPTextModel may not (formats/clip.py)."""
    for candidate in (key, key.removeprefix("text_model."), "text_model." + key):
        if candidate in keys:
            return candidate
    return key


def as_stored(model, folder: Path) -> dict[str, torch.Tensor]:
    """`model`'s state dict with each tensor in the dtype its source folder stores it in (loaders
    widen some: diffusers loads fp32, transformers keeps T5's `wo` in fp32), so that carried-over
    weights are written back as the source holds them. Variant files (model.fp16.safetensors) are
    not what from_pretrained loaded and are skipped."""
    state = model.state_dict()
    stored: dict[str, torch.dtype] = {}
    for file in _weight_files(folder):
        stored.update({_same_key(k, state): t.dtype for k, t in meta_tensors(read_header(file)[0]).items()})
    return {k: v.to(stored[k]) if k in stored and v.is_floating_point() else v for k, v in state.items()}


def _assign(model, state: dict[str, torch.Tensor], what: str, path: Path,
            file_key: Optional[Callable[[str], str]] = None):
    """Give `model`, made under accelerate's init_empty_weights (parameters on the meta device,
    buffers real), the checkpoint's tensors; a mismatch is a CheckpointError naming the file."""
    check_shapes(model, state, what, path, file_key)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: the {what} weights do not match the detected architecture "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    for name, buf in list(model.named_buffers()):
        if buf.device.type == "meta":  # non-persistent buffers (e.g. position_ids) are rebuilt
            raise CheckpointError(f"{path}: {what} buffer {name} was not initialised")
    return model.eval()


class SDXLFamily:
    name = "sdxl"
    # LoRA files a run writes by default, the primary first (saved as <name>.safetensors): kohya
    # keys, which ComfyUI and A1111 load; the diffusers/PEFT file goes beside it.
    lora_formats = ("lora_kohya", "lora")
    resolution_multiple = 8  # the VAE's factor; the UNet's up blocks follow any latent size
    shipped_layouts = SHIPPED_LAYOUTS

    # ---- detection ---------------------------------------------------------------------------
    def detect_single_file(self, keys: set[str]) -> bool:
        return any(k.startswith(UNET + "label_emb.") for k in keys) and any(
            k.startswith(UNET + "input_blocks.") for k in keys)

    def detect_diffusers(self, model_index: dict) -> bool:
        return model_index.get("_class_name", "").startswith("StableDiffusionXL")

    def config_problems(self, cfg) -> list[str]:
        """SD3-only settings given for an SDXL-family model are refused, not silently ignored."""
        # Values that differ from the defaults, not keys given: a resolved config.toml lists them all.
        train, model = TrainConfig(), ModelConfig()
        problems = [f"train.{name}: applies to SD3's flow-matching objective, not to {self.name}"
                    for name in ("weighting_scheme", "logit_mean", "logit_std", "mode_scale")
                    if getattr(cfg.train, name) != getattr(train, name)]
        for key in ("max_sequence_length", "t5_precision"):
            if getattr(cfg.model, key) != getattr(model, key):
                problems.append(f"model.{key}: applies to SD3's T5 encoder only")
        for key in ("clip_l", "clip_g", "t5"):
            if getattr(cfg.model, key):
                problems.append(f"model.{key}: separate text encoder files are read for SD3 single "
                                "files only")
        return problems + resolution_problems(self, cfg)

    def prepare_encoders(self, bundle: ModelBundle) -> None:
        """Nothing to do: SDXL's CLIP encoders are small enough to run as stored."""

    # ---- loading -----------------------------------------------------------------------------
    def load(self, source: Source) -> ModelBundle:
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import DDPMScheduler

        scheduler = DDPMScheduler.from_config(shipped_config("sdxl_scheduler"))
        if source.kind == "single_file":
            unet, vae, encoders = self._load_single_file(source.path)
        else:
            unet, vae, encoders = self._load_diffusers(source.path)
        tok_dir = require_tokenizers(source)
        tokenizers = self.load_tokenizers(tok_dir)
        return ModelBundle(self.name, layout_name(dict(unet.config)), source, unet, vae, encoders,
                           tokenizers, scheduler)

    def load_tokenizers(self, folder: Path) -> list[Any]:
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from transformers import CLIPTokenizer

        # SDXL's second tokenizer pads with "!" (id 0) rather than end-of-text.
        return [CLIPTokenizer.from_pretrained(folder / "tokenizer"),
                CLIPTokenizer.from_pretrained(folder / "tokenizer_2", pad_token="!")]

    def caption_tokenizers(self, source: Source, cfg: Any) -> list[Any]:
        """CLIP-L's and CLIP-G's tokenizers, as `load` finds them (each keeps 77 tokens)."""
        return self.load_tokenizers(require_tokenizers(source))

    def _load_single_file(self, path: Path):
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import UNet2DConditionModel

        header, _ = read_header(path)
        if not self.detect_single_file(set(header)):
            raise CheckpointError(f"{path}: no SDXL-family UNet found (no {UNET}label_emb.* keys)")
        try:
            config = sgm_unet.unet_config_from_sgm(meta_tensors(header, UNET), _pooled_width(header))
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        state = sgm_unet.sgm_to_diffusers_unet(load_prefixed(path, UNET), config)
        to_sgm = sgm_unet.unet_key_map(config)
        unet = _build(UNet2DConditionModel, config, state, "UNet", path, lambda k: UNET + to_sgm[k])
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
        vae = _build(AutoencoderKL, vae_cfg, ldm_vae.ldm_to_diffusers_vae(load_prefixed(path, VAE)), "VAE",
                     path, lambda k: VAE + vae_names[k])
        enc1 = self._clip(load_prefixed(path, CLIP_L), "quick_gelu", False, path)
        enc2 = self._clip(clipfmt.openclip_to_hf(load_prefixed(path, CLIP_G)), "gelu", True, path)
        return vae, [enc1, enc2]

    def _clip(self, state: dict, act: str, projection: bool, path: Path):
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

        cfg = clipfmt.clip_config_from_keys(state, hidden_act=act, with_projection=projection)
        vocab = cfg["vocab_size"]
        cfg.update(bos_token_id=vocab - 2, eos_token_id=vocab - 1)
        config = CLIPTextConfig(**cfg)
        cls = CLIPTextModelWithProjection if projection else CLIPTextModel
        with init_empty_weights():
            model = cls(config)
        state = clipfmt.normalize_hf_clip_keys(state, model)
        # Parameters on the meta device (no random initialisation: 10 s for bigG on two cores),
        # then the file's tensors, in the precision the file stores: an fp16 bigG on the GPU is
        # half the size of an fp32 one.
        stored = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
        state = {k: v.to(stored) if v.is_floating_point() else v for k, v in state.items()}
        return _assign(model, state, "text encoder", path)

    def _load_diffusers(self, folder: Path):
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        parts = {"unet": UNet2DConditionModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel,
                 "text_encoder_2": CLIPTextModelWithProjection}
        for sub, cls in parts.items():
            if not (folder / sub / "config.json").is_file():
                raise CheckpointError(f"{folder}: diffusers folder has no {sub}/config.json")
            check_folder_shapes(cls, folder, sub)
        try:
            sgm_unet.check_text_time(json.loads((folder / "unet" / "config.json").read_text()), json.loads(
                (folder / "text_encoder_2" / "config.json").read_text()).get("projection_dim"))
        except ValueError as exc:
            raise CheckpointError(f"{folder / 'unet' / 'config.json'}: {exc}") from None
        unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet", low_cpu_mem_usage=True)
        vae = AutoencoderKL.from_pretrained(folder, subfolder="vae")
        enc1 = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder")
        enc2 = CLIPTextModelWithProjection.from_pretrained(folder, subfolder="text_encoder_2")
        return unet.eval(), vae.eval(), [enc1.eval(), enc2.eval()]

    def load_encoders(self, source: Source):
        """VAE and text encoders again, for saving after they were freed for training."""
        if source.kind == "single_file":
            header, _ = read_header(source.path)
            return self._single_file_encoders(source.path, header)
        _, vae, encoders = self._load_diffusers(source.path)
        return vae, encoders

    # ---- encoding ----------------------------------------------------------------------------
    def encoder_identity(self, bundle: ModelBundle, part: str) -> str:
        if part == "vae":
            return "sdxl-vae:" + module_fingerprint(bundle.vae)
        return "sdxl-text:" + "+".join(module_fingerprint(m) for m in bundle.text_encoders)

    @torch.no_grad()
    def encode_text(self, bundle: ModelBundle, captions: list[str], device: torch.device,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Penultimate hidden states of both encoders (one on the device at a time; streamed layer
        by layer with memory.stream_encoders, bundle.extra) and bigG's pooled."""
        hidden, pooled = [], None
        for tokenizer, encoder in zip(bundle.tokenizers, bundle.text_encoders):
            ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                            truncation=True, return_tensors="pt").input_ids
            with encoder_on(encoder, device, bundle.extra.get("stream_encoders", False)):
                out = encoder(ids.to(device), output_hidden_states=True)
                hidden.append(out.hidden_states[-2].float().cpu())
                if hasattr(out, "text_embeds"):
                    pooled = out.text_embeds.float().cpu()
        return {"prompt_embeds": torch.cat(hidden, dim=-1).to(dtype), "pooled": pooled.to(dtype)}

    @torch.no_grad()
    def encode_images(self, bundle: ModelBundle, pixels: torch.Tensor, device: torch.device,
                      dtype: torch.dtype, tiling: bool) -> dict[str, torch.Tensor]:
        """The VAE's latent distribution (mean, log-variance); sampling happens at train time."""
        vae = bundle.vae
        set_vae_tiling(vae, tiling)
        vae_dtype = next(vae.parameters()).dtype
        dist = vae.encode(pixels.to(device, vae_dtype)).latent_dist
        return {"mean": dist.mean.float().cpu().to(dtype), "logvar": dist.logvar.float().cpu().to(dtype)}

    def latents(self, bundle: ModelBundle, encoded: dict[str, torch.Tensor],
                generator: torch.Generator) -> torch.Tensor:
        return sample_latent(encoded, generator) * VAE_SCALE

    def predict(self, bundle: ModelBundle, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: dict[str, torch.Tensor], time_ids: torch.Tensor) -> torch.Tensor:
        return bundle.denoiser(noisy, timesteps, encoder_hidden_states=text["prompt_embeds"],
                               added_cond_kwargs={"text_embeds": text["pooled"], "time_ids": time_ids}).sample

    def training_loss(self, bundle: ModelBundle, batch: dict, cfg, generator: torch.Generator,
                      device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Epsilon-prediction loss on SDXL's DDPM schedule, with noise offset and min-SNR weights."""
        return self.loss_from(bundle, self.loss_inputs(bundle, batch, cfg, generator), cfg, device, dtype)

    def loss_inputs(self, bundle: ModelBundle, batch: dict, cfg, generator: torch.Generator,
                    dtype: Optional[torch.dtype] = None, at: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """What `loss_from` needs from the host, on the CPU: the batch's conditioning and every
        random draw of the loss (the latent sample, the noise and the timesteps; `at`, positions in
        [0, 1] per sample, fixes the timesteps). With `dtype` the conditioning is in that dtype
        already, as `loss_from` casts it (the same values)."""
        latents = self.latents(bundle, {"mean": batch["mean"], "logvar": batch["logvar"]}, generator)
        inputs = {"latents": latents,
                  **epsilon_draws(latents.shape, bundle.noise_scheduler, generator, cfg.noise_offset, at)}
        inputs.update({k: batch[k] if dtype is None else batch[k].to(dtype) for k in ("prompt_embeds", "pooled", "time_ids")})
        inputs.update({k: batch[k] for k in ("sample_weight", "loss_mask") if k in batch})
        return inputs

    def loss_from(self, bundle: ModelBundle, inputs: dict, cfg, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
        """The loss of `loss_inputs` (on the CPU, or copied to `device` ahead)."""
        latents = inputs["latents"].to(device)
        noisy, noise, timesteps = epsilon_inputs(latents, bundle.noise_scheduler, inputs, cfg.noise_offset)
        text = {k: inputs[k].to(device, dtype) for k in ("prompt_embeds", "pooled")}
        pred = self.predict(bundle, noisy.to(dtype), timesteps, text, inputs["time_ids"].to(device, dtype))
        weights = min_snr_weights(bundle.noise_scheduler, timesteps, cfg.min_snr_gamma)
        return weighted_mse(pred, noise, weights, inputs.get("sample_weight"), inputs.get("loss_mask"))

    # ---- saving ------------------------------------------------------------------------------
    def unet_sgm_state(self, bundle: ModelBundle, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        config = dict(bundle.denoiser.config)
        sd = {k: v.detach().to("cpu", dtype) for k, v in bundle.denoiser.state_dict().items()}
        return {UNET + k: v for k, v in sgm_unet.diffusers_to_sgm_unet(sd, config).items()}

    def save_single_file(self, bundle: ModelBundle, path: Path, dtype: torch.dtype,
                         metadata: dict[str, str]) -> None:
        """UNet converted back to SGM keys; VAE and text encoders carried over from the source."""
        metadata = {**metadata, "modelspec.architecture": "stable-diffusion-xl-v1-base"}
        state = self.unet_sgm_state(bundle, dtype)
        src = bundle.source
        if src.kind == "single_file":
            # Everything that is not the UNet is copied byte for byte from the input file.
            state.update(load_prefixed(src.path, "", exclude=UNET))
        else:
            vae, (enc1, enc2) = self.load_encoders(src)  # written in the dtypes the folder stores
            vae_state = ldm_vae.diffusers_to_ldm_vae(as_stored(vae, src.path / "vae"))
            state.update({VAE + k: v for k, v in vae_state.items()})
            clip_l = clipfmt.to_sgm_clip_keys(as_stored(enc1, src.path / "text_encoder"))
            state.update({CLIP_L + k: v for k, v in clip_l.items()})
            # OpenCLIP files carry the contrastive temperature, which text conditioning never
            # uses and diffusers drops; write ln(100), its trained value, so the key set is complete.
            bigg = clipfmt.hf_to_openclip(as_stored(enc2, src.path / "text_encoder_2"),
                                          logit_scale=torch.tensor(4.6052))
            state.update({CLIP_G + k: v for k, v in bigg.items()})
        save_atomic(state, path, metadata)

    def save_diffusers(self, bundle: ModelBundle, folder: Path, dtype: torch.dtype) -> None:
        """A diffusers SDXL folder that StableDiffusionXLPipeline.from_pretrained loads."""
        # heavy: diffusers/transformers classes (0.3-2 s), kept off `vramfit plan` and pre-load checks
        from diffusers import EulerDiscreteScheduler

        tmp = begin_folder(folder)
        save_model_folder(bundle.denoiser, tmp / "unet", dtype)
        vae, encoders = (bundle.vae, bundle.text_encoders) if bundle.vae is not None else \
            self.load_encoders(bundle.source)
        vae.save_pretrained(tmp / "vae")
        encoders[0].save_pretrained(tmp / "text_encoder")
        encoders[1].save_pretrained(tmp / "text_encoder_2")
        for sub, tok in zip(("tokenizer", "tokenizer_2"), bundle.tokenizers):
            tok.save_pretrained(tmp / sub)
        EulerDiscreteScheduler.from_config(shipped_config("sdxl_scheduler")).save_pretrained(tmp / "scheduler")
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

    # ---- inspection --------------------------------------------------------------------------
    def describe(self, source: Source) -> dict:
        """Family, layout, parameter counts and dtypes per component, without loading weights."""
        if source.kind == "single_file":
            header, _ = read_header(source.path)
            parts = {"unet": UNET, "vae": VAE, "text_encoder (CLIP-L)": CLIP_L,
                     "text_encoder_2 (bigG)": CLIP_G}
            comps = {name: _count(header, prefix) for name, prefix in parts.items()}
            config = sgm_unet.unet_config_from_sgm(meta_tensors(header, UNET), _pooled_width(header))
        else:
            comps = {}
            for sub in ("unet", "vae", "text_encoder", "text_encoder_2"):
                files = sorted((source.path / sub).glob("*.safetensors"))
                comps[sub] = _merge([_count(read_header(f)[0], "") for f in files])
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


def sample_latent(encoded: dict[str, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
    """One draw from a cached latent distribution (mean, log-variance), as diffusers' sample()."""
    mean = encoded["mean"].float()
    eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device="cpu").to(mean.device)
    std = torch.exp(0.5 * encoded["logvar"].float().clamp(-30.0, 20.0))
    return mean + std * eps


def _count(header: dict, prefix: str) -> dict:
    params, dtypes = 0, {}
    for key, info in header.items():
        if key.startswith(prefix):
            n = 1
            for s in info["shape"]:
                n *= s
            params += n
            dtypes[info["dtype"]] = dtypes.get(info["dtype"], 0) + n
    return {"params": params, "dtypes": dtypes}


def _merge(counts: list[dict]) -> dict:
    out = {"params": 0, "dtypes": {}}
    for c in counts:
        out["params"] += c["params"]
        for k, v in c["dtypes"].items():
            out["dtypes"][k] = out["dtypes"].get(k, 0) + v
    return out
