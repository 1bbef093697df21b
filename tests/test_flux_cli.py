"""Flux.1 through the same CLI path as the other families: LoRA and full training, resume,
generate, inspect; its BFL key map checked against diffusers' own converter."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main

LORA = ("train.mode=lora", "lora.rank=4", "train.lr=1e-2", "save.name=m")


def test_flux_lora_trains_and_generate_renders(images, tmp_path, cache_root):
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "f1", *LORA, model="tiny:flux")) == 0
    run = json.loads((out / "run.json").read_text())
    assert len(run["losses"]) == 2 and all(l > 0 for l in run["losses"])
    lora = load_file(str(out / "m.safetensors"))
    assert any(k.startswith("transformer.single_transformer_blocks.") for k in lora)
    assert any(k.startswith("transformer.transformer_blocks.") for k in lora)
    pics = tmp_path / "pics"
    assert main(["generate", "--model", "tiny:flux", "--prompt", "a red circle", "--steps", "2",
                 "--width", "64", "--height", "64", "--out", str(pics), "--cache-dir", str(cache_root / "f1")]) == 0
    assert len(list(pics.glob("*.png"))) == 1
