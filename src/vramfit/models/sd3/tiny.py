"""The tiny SD3 model (`tiny:sd3`): a real SAI single file of the real classes, for tests and the demo.

The file has the layout of Stability's ``sd3_medium_incl_clips_t5xxlfp8.safetensors``: the MMDiT
under ``model.diffusion_model.`` (SAI naming), the 16-channel VAE under ``first_stage_model.``,
CLIP-L and CLIP-G under ``text_encoders.clip_{l,g}.transformer.`` (HF keys; CLIP-L without a
projection) and T5 under ``text_encoders.t5xxl.transformer.`` stored in float8 (e4m3) as in the
original. Tokenizer folders (tokenizer/, tokenizer_2/, tokenizer_3/) are written beside it; the
T5 tokenizer is a small Unigram vocabulary made here, so nothing is ever downloaded.
"""
from __future__ import annotations

from pathlib import Path

import torch

from vramfit.formats.clip import to_sgm_clip_keys
from vramfit.formats.ldm_vae import diffusers_to_ldm_vae
from vramfit.formats.safetensors_io import save_atomic
from vramfit.models.parts import shipped_config
from vramfit.models.sd3.mmdit import diffusers_to_sai_mmdit
from vramfit.models.tiny import write_t5_tokenizer, write_tiny_tokenizers

TINY_NAMES = ("sd3",)  # tiny:<name>
_FORMAT = "2"  # bump when the tiny SD3 architecture or the way it is written changes
TRANSFORMER = "model.diffusion_model."
VAE = "first_stage_model."
CLIP_L = "text_encoders.clip_l.transformer."
CLIP_G = "text_encoders.clip_g.transformer."
T5 = "text_encoders.t5xxl.transformer."


def write_sd3_tokenizers(folder: Path) -> None:
    """tokenizer/ and tokenizer_2/ (the tiny CLIP BPE of tiny.py) and tokenizer_3/ (tiny T5)."""
    write_tiny_tokenizers(folder)
    write_t5_tokenizer(Path(folder) / "tokenizer_3")


def build_tiny_sd3_state(with_t5: bool = True) -> dict[str, torch.Tensor]:
    """The full single-file state dict (SAI keys) of the seeded tiny SD3 model."""
    # heavy: diffusers/transformers classes (~2 s), kept off `vramfit plan` and pre-load checks
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config,
                              T5EncoderModel)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = SD3Transformer2DModel(**shipped_config("tiny_sd3_transformer"))
        vae = AutoencoderKL(**shipped_config("tiny_sd3_vae"))
        clip_l = CLIPTextModel(CLIPTextConfig(**shipped_config("tiny_clip_l")))
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(**shipped_config("tiny_clip_g")))
        t5 = T5EncoderModel(T5Config(**shipped_config("tiny_t5"))) if with_t5 else None
    state = {}
    for key, t in diffusers_to_sai_mmdit(transformer.state_dict()).items():
        state[TRANSFORMER + key] = t
    for key, t in diffusers_to_ldm_vae(vae.state_dict()).items():
        state[VAE + key] = t
    for key, t in to_sgm_clip_keys(clip_l.state_dict()).items():  # HF keys, no projection
        state[CLIP_L + key] = t
    for key, t in to_sgm_clip_keys(clip_g.state_dict()).items():  # HF keys with text_projection
        state[CLIP_G + key] = t
    state = {k: v.detach().to(torch.float32).contiguous() if v.is_floating_point() else v.contiguous()
             for k, v in state.items()}
    if t5 is not None:
        for key, t in t5.state_dict().items():  # the tied embedding under both names, as Stability's files
            state[T5 + key] = t.detach().to(torch.float8_e4m3fn).contiguous()
    return state


def materialize_sd3(root: Path, *, with_t5: bool = True) -> Path:
    """Return the tiny SD3 single file under `root`, writing it (and tokenizers) if needed."""
    name = "sd3" if with_t5 else "sd3-no-t5"
    folder = Path(root) / f"tiny-{name}-v{_FORMAT}"
    path = folder / f"tiny-{name}.safetensors"
    if path.exists() and (folder / "tokenizer_3" / "tokenizer_config.json").exists():
        return path
    write_sd3_tokenizers(folder)
    meta = {"vramfit.tiny": name, "modelspec.title": f"vramfit tiny {name}",
            "modelspec.architecture": "stable-diffusion-3"}
    save_atomic(build_tiny_sd3_state(with_t5), path, metadata=meta)
    return path
