"""The tiny Flux.1 models (`tiny:flux`, dev-shaped, and `tiny:flux-schnell`): real single files of the
real classes, for tests and the demo.

The file has the layout of ComfyUI's all-in-one Flux checkpoints (flux1-dev-fp8.safetensors): the
transformer under ``model.diffusion_model.`` in BFL's keys (models/flux/bfl.py), dev-like (with a
guidance embedding) or schnell-like (without: no ``guidance_in`` keys), the 16-channel VAE under
``first_stage_model.`` (LDM keys), CLIP-L under ``text_encoders.clip_l.transformer.`` and T5 under
``text_encoders.t5xxl.transformer.`` (HF keys).
Tokenizer folders are written beside it as a diffusers Flux folder has them: tokenizer/ (CLIP) and
tokenizer_2/ (T5, the small Unigram vocabulary of models/tiny.py), so nothing is downloaded.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from vramfit.formats.clip import to_sgm_clip_keys
from vramfit.formats.ldm_vae import diffusers_to_ldm_vae
from vramfit.formats.safetensors_io import save_atomic
from vramfit.models.flux.bfl import diffusers_to_bfl
from vramfit.models.parts import shipped_config
from vramfit.models.tiny import write_t5_tokenizer, write_tiny_tokenizers

TINY_NAMES = ("flux", "flux-schnell")  # tiny:<name>
SCHNELL = "flux-schnell"
_FORMAT = "1"  # bump when the tiny Flux architecture or the way it is written changes
TRANSFORMER = "model.diffusion_model."
VAE = "first_stage_model."
CLIP_L = "text_encoders.clip_l.transformer."
T5 = "text_encoders.t5xxl.transformer."


def write_flux_tokenizers(folder: Path) -> None:
    """tokenizer/ (the tiny CLIP BPE of models/tiny.py) and tokenizer_2/ (the tiny T5)."""
    folder = Path(folder)
    write_tiny_tokenizers(folder)
    shutil.rmtree(folder / "tokenizer_2")  # a CLIP-G tokenizer there; Flux's second is T5's
    write_t5_tokenizer(folder / "tokenizer_2")


def tiny_transformer_config(name: str) -> dict:
    """The tiny transformer's config: the shipped (dev) one, without the guidance embedding for schnell."""
    return {**shipped_config("tiny_flux_transformer"), "guidance_embeds": name != SCHNELL}


def build_tiny_flux_state(name: str = "flux") -> dict[str, torch.Tensor]:
    """The full single-file state dict of the seeded tiny Flux model `name` (one of TINY_NAMES)."""
    # heavy: diffusers/transformers classes (~2 s), kept off `vramfit plan` and pre-load checks
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = FluxTransformer2DModel(**tiny_transformer_config(name))
        vae = AutoencoderKL(**shipped_config("tiny_flux_vae"))
        clip_l = CLIPTextModel(CLIPTextConfig(**shipped_config("tiny_clip_l")))
        t5 = T5EncoderModel(T5Config(**shipped_config("tiny_t5")))
    state = {TRANSFORMER + k: t for k, t in diffusers_to_bfl(transformer.state_dict()).items()}
    state.update({VAE + k: t for k, t in diffusers_to_ldm_vae(vae.state_dict()).items()})
    state.update({CLIP_L + k: t for k, t in to_sgm_clip_keys(clip_l.state_dict()).items()})
    # the tied embedding under both names (shared and encoder.embed_tokens), as the released files
    state.update({T5 + k: t.clone() for k, t in t5.state_dict().items()})
    return {k: v.detach().to(torch.float32).contiguous() if v.is_floating_point() else v.contiguous()
            for k, v in state.items()}


def materialize_flux(root: Path, name: str = "flux") -> Path:
    """Return the single file of tiny:`name` under `root`, writing it (and tokenizers) if needed."""
    folder = Path(root) / f"tiny-{name}-v{_FORMAT}"
    path = folder / f"tiny-{name}.safetensors"
    if path.exists() and (folder / "tokenizer_2" / "tokenizer_config.json").exists():
        return path
    write_flux_tokenizers(folder)
    meta = {"vramfit.tiny": name, "modelspec.title": f"vramfit tiny {name}",
            "modelspec.architecture": "flux-1-schnell" if name == SCHNELL else "flux-1-dev"}
    save_atomic(build_tiny_flux_state(name), path, metadata=meta)
    return path
