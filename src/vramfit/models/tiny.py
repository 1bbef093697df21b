"""Tiny models of the real classes (`tiny:sdxl`, `tiny:ssd1b`) for tests and the demo.

A tiny model is written once as a real SGM single file with tokenizer folders beside it, then
loaded through exactly the path a user's checkpoint takes. Architectures come from the JSON
files shipped in `configs/`; weights are seeded, so every machine builds the same file.
The tokenizers are byte-level CLIP BPE vocabularies made here (every byte, a handful of
merges, CLIP's start/end tokens), so nothing is ever downloaded.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from vramfit.formats.clip import hf_to_openclip, to_sgm_clip_keys
from vramfit.formats.ldm_vae import diffusers_to_ldm_vae
from vramfit.formats.safetensors_io import save_atomic, write_text_atomic
from vramfit.formats.sgm_unet import diffusers_to_sgm_unet
from vramfit.models.names import TINY_MODELS, unknown_tiny

TINY_NAMES = tuple(name for name, family in TINY_MODELS.items() if family == "sdxl")
_FORMAT = "1"  # bump when the tiny architectures or the way they are written change
_MERGES = ["t h", "th e</w>", "o n</w>", "a n", "r e", "e d</w>"]  # 512 bytes + 6 merges + 2 specials = 520, the tiny encoders' vocab_size


def shipped_config(name: str) -> dict:
    """A shipped architecture config (models/configs/<name>.json)."""
    text = resources.files("vramfit.models").joinpath("configs", f"{name}.json").read_text()
    return json.loads(text)


def _byte_chars() -> list[str]:
    """The byte-to-unicode table of GPT-2/CLIP BPE: printable stand-ins for all 256 bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def write_tiny_tokenizers(folder: Path) -> None:
    """Write tokenizer/ (pads with end-of-text) and tokenizer_2/ (pads with "!") as SDXL has them."""
    chars = _byte_chars()
    vocab: dict[str, int] = {}
    for token in [*chars, *(c + "</w>" for c in chars), *(m.replace(" ", "") for m in _MERGES)]:
        vocab.setdefault(token, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    for sub, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):
        d = folder / sub
        d.mkdir(parents=True, exist_ok=True)
        write_text_atomic(d / "vocab.json", json.dumps(vocab))
        write_text_atomic(d / "merges.txt", "#version: 0.2\n" + "\n".join(_MERGES) + "\n")
        config = {"model_max_length": 77, "pad_token": pad, "bos_token": "<|startoftext|>",
                  "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                  "tokenizer_class": "CLIPTokenizer"}
        write_text_atomic(d / "tokenizer_config.json", json.dumps(config))


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
        raise ValueError(unknown_tiny(f"tiny:{name}") or f"tiny:{name} is built by tiny_sd3.py, not here")
    folder = Path(root) / f"tiny-{name}-v{_FORMAT}"
    path = folder / f"tiny-{name}.safetensors"
    if path.exists() and (folder / "tokenizer_2" / "tokenizer_config.json").exists():
        return path
    write_tiny_tokenizers(folder)
    meta = {"vramfit.tiny": name, "modelspec.title": f"vramfit tiny {name}"}
    save_atomic(build_tiny_sgm_state(name), path, metadata=meta)
    return path
