"""The SDXL family's tiny models (`tiny:sdxl`, `tiny:ssd1b`) for tests and the demo.

A tiny model is written once as a real SGM single file with tokenizer folders beside it, then
loaded through exactly the path a user's checkpoint takes. Architectures come from the JSON
files shipped in models/configs/; weights are seeded, so every machine builds the same file.
"""
from __future__ import annotations

from pathlib import Path

import torch

from vramfit.formats.clip import hf_to_openclip, to_sgm_clip_keys
from vramfit.formats.ldm_vae import diffusers_to_ldm_vae
from vramfit.formats.safetensors_io import save_atomic
from vramfit.models.parts import shipped_config
from vramfit.models.sdxl.sgm_unet import diffusers_to_sgm_unet
from vramfit.models.tiny import write_tiny_tokenizers

TINY_NAMES = ("sdxl", "ssd1b")  # tiny:<name>, each with configs/tiny_<name>_unet.json
_FORMAT = "1"  # bump when the tiny architectures or the way they are written change


def build_tiny_sgm_state(name: str) -> dict[str, torch.Tensor]:
    """The full single-file state dict (SGM/LDM keys) of a seeded tiny model."""
    # heavy: diffusers/transformers classes (~2 s), kept off `vramfit plan` and pre-load checks
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    unet_cfg = shipped_config(f"tiny_{name}_unet")
    unet = UNet2DConditionModel(**unet_cfg)
    vae = AutoencoderKL(**shipped_config("tiny_vae"))
    clip_l = CLIPTextModel(CLIPTextConfig(**shipped_config("tiny_clip_l")))
    clip_g = CLIPTextModelWithProjection(CLIPTextConfig(**shipped_config("tiny_clip_g")))
    # diffusers zero-initialises conv_out; a trained model never has that, and a zero output
    # layer would hide bugs in the training tests, so give it small random weights.
    torch.nn.init.normal_(unet.conv_out.weight, std=0.02)
    state = {}
    for key, t in diffusers_to_sgm_unet(unet.state_dict(), unet_cfg).items():
        state["model.diffusion_model." + key] = t
    for key, t in diffusers_to_ldm_vae(vae.state_dict()).items():
        state["first_stage_model." + key] = t
    for key, t in to_sgm_clip_keys(clip_l.state_dict()).items():
        state["conditioner.embedders.0.transformer." + key] = t
    for key, t in hf_to_openclip(clip_g.state_dict(), logit_scale=torch.tensor(4.6052)).items():
        state["conditioner.embedders.1.model." + key] = t
    return {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}


def materialize(name: str, root: Path) -> Path:
    """Return the tiny model's single file under `root`, writing it (and tokenizers) if needed."""
    if name not in TINY_NAMES:
        raise ValueError(f"tiny:{name} is not a tiny model of the SDXL family ({', '.join(TINY_NAMES)})")
    folder = Path(root) / f"tiny-{name}-v{_FORMAT}"
    path = folder / f"tiny-{name}.safetensors"
    if path.exists() and (folder / "tokenizer_2" / "tokenizer_config.json").exists():
        return path
    write_tiny_tokenizers(folder)
    meta = {"vramfit.tiny": name, "modelspec.title": f"vramfit tiny {name}"}
    save_atomic(build_tiny_sgm_state(name), path, metadata=meta)
    return path
