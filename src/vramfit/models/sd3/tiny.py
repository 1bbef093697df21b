"""The tiny SD3 models: real SAI single files of the real classes, for tests and the demo.

`tiny:sd3` has the layout of Stability's ``sd3_medium_incl_clips_t5xxlfp8.safetensors``: the MMDiT
under ``model.diffusion_model.`` (SAI naming), the 16-channel VAE under ``first_stage_model.``,
CLIP-L and CLIP-G under ``text_encoders.clip_{l,g}.transformer.`` (HF keys; CLIP-L without a
projection) and T5 under ``text_encoders.t5xxl.transformer.`` stored in float8 (e4m3) as in the
original.

`tiny:sd3.5-medium` and `tiny:sd3.5-large` are written as Stability ships SD3.5
(``sd3.5_medium.safetensors``, ``sd3.5_large.safetensors``): the single file holds the MMDiT and
the VAE only, and the text encoders are files of their own in ``text_encoders/`` beside it
(``clip_l.safetensors``, ``clip_g.safetensors``: bare HF keys in fp16, CLIP-L without a
projection; ``t5xxl_fp16.safetensors``). Their MMDiTs have SD3.5's RMS q/k norms; the medium one
also has the second image attention (``attn2``) in its first blocks and a position grid twice
SD3's, as SD3.5 Medium (384 vs 192 patches a side), and enough blocks for its skip-layer guidance
layers (7, 8, 9).

Tokenizer folders (tokenizer/, tokenizer_2/, tokenizer_3/) are written beside each file; the
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

TINY_NAMES = ("sd3", "sd3.5-medium", "sd3.5-large")  # tiny:<name>
_FORMAT = "2"  # bump when the tiny SD3 architecture or the way it is written changes
_FORMAT_35 = "1"  # the same for the tiny SD3.5 models
# the tiny SD3.5 MMDiTs: tiny:sd3's config with these changes
_SD35 = {
    "sd3.5-medium": {"num_layers": 10, "qk_norm": "rms_norm", "dual_attention_layers": [0, 1, 2, 3, 4],
                     "pos_embed_max_size": 64, "sample_size": 32},
    "sd3.5-large": {"num_layers": 3, "num_attention_heads": 2, "caption_projection_dim": 128,
                    "qk_norm": "rms_norm", "dual_attention_layers": [], "sample_size": 32},
}
# Stability's names of the text encoder files of an SD3.5 release (text_encoders/ beside the model)
ENCODER_FOLDER = "text_encoders"
CLIP_L_FILE, CLIP_G_FILE, T5_FILE = "clip_l.safetensors", "clip_g.safetensors", "t5xxl_fp16.safetensors"
TRANSFORMER = "model.diffusion_model."
VAE = "first_stage_model."
CLIP_L = "text_encoders.clip_l.transformer."
CLIP_G = "text_encoders.clip_g.transformer."
T5 = "text_encoders.t5xxl.transformer."


def write_sd3_tokenizers(folder: Path) -> None:
    """tokenizer/ and tokenizer_2/ (the tiny CLIP BPE of tiny.py) and tokenizer_3/ (tiny T5)."""
    write_tiny_tokenizers(folder)
    write_t5_tokenizer(Path(folder) / "tokenizer_3")


def tiny_transformer_config(name: str) -> dict:
    """The SD3Transformer2DModel config of tiny:`name`."""
    return {**shipped_config("tiny_sd3_transformer"), **_SD35.get(name, {})}


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


def build_tiny_sd35(name: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(the single file's state: MMDiT and VAE under SAI prefixes, in fp32; {encoder file name: its
    state in fp16, bare HF keys}) of the seeded tiny:`name`."""
    # heavy: diffusers/transformers classes (~2 s), kept off `vramfit plan` and pre-load checks
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config,
                              T5EncoderModel)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(35)
        transformer = SD3Transformer2DModel(**tiny_transformer_config(name))
        vae = AutoencoderKL(**shipped_config("tiny_sd3_vae"))
        clip_l = CLIPTextModel(CLIPTextConfig(**shipped_config("tiny_clip_l")))
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(**shipped_config("tiny_clip_g")))
        t5 = T5EncoderModel(T5Config(**shipped_config("tiny_t5")))
    state = {TRANSFORMER + k: t for k, t in diffusers_to_sai_mmdit(transformer.state_dict()).items()}
    state.update({VAE + k: t for k, t in diffusers_to_ldm_vae(vae.state_dict()).items()})
    state = {k: v.detach().float().contiguous() for k, v in state.items()}

    def half(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach().half().contiguous() if v.is_floating_point() else v.contiguous()
                for k, v in sd.items()}

    # T5's tied embedding under both of its names, as Stability's t5xxl files carry it
    encoders = {CLIP_L_FILE: half(to_sgm_clip_keys(clip_l.state_dict())),
                CLIP_G_FILE: half(to_sgm_clip_keys(clip_g.state_dict())), T5_FILE: half(t5.state_dict())}
    return state, encoders


def materialize_sd35(name: str, root: Path) -> Path:
    """Return the single file of tiny:`name` (an SD3.5 layout) under `root`, writing it, its
    text_encoders/ files and tokenizers if needed. The single file is written last, so its
    presence means the rest is there."""
    folder = Path(root) / f"tiny-{name}-v{_FORMAT_35}"
    path = folder / f"tiny-{name}.safetensors"
    if path.exists() and (folder / "tokenizer_3" / "tokenizer_config.json").exists():
        return path
    write_sd3_tokenizers(folder)
    state, encoders = build_tiny_sd35(name)
    for file, tensors in encoders.items():
        save_atomic(tensors, folder / ENCODER_FOLDER / file)
    meta = {"vramfit.tiny": name, "modelspec.title": f"vramfit tiny {name}",
            "modelspec.architecture": f"stable-diffusion-{name.replace('sd', '')}"}
    save_atomic(state, path, metadata=meta)
    return path
