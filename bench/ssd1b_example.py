"""GPU check of the walking skeleton: examples/ssd1b_full_8gb.toml on the real SSD-1B layout.

Builds a full SSD-1B single file (UNet, VAE, CLIP-L, bigG) with random weights from the shipped
configs (memory and speed of training do not depend on the weight values), writes 1024x1024
synthetic images, then runs `vramfit train` through the CLI exactly as a user would, and copies
the memory report to --out. Not run in CI.

usage: python bench/ssd1b_example.py --out DIR [--steps N] [--accum N] [--work DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def build_single_file(path: Path, layout: str = "ssd1b") -> None:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from vramfit.formats.clip import hf_to_openclip, to_sgm_clip_keys
    from vramfit.formats.ldm_vae import diffusers_to_ldm_vae
    from vramfit.formats.safetensors_io import save_atomic
    from vramfit.formats.sgm_unet import diffusers_to_sgm_unet
    from vramfit.models.tiny import shipped_config, write_tiny_tokenizers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    state = {}
    cfg = shipped_config(f"{layout}_unet")
    with torch.device(dev):
        unet = UNet2DConditionModel(**cfg).half()
    state.update({"model.diffusion_model." + k: v.cpu() for k, v in diffusers_to_sgm_unet(unet.state_dict(), cfg).items()})
    del unet
    with torch.device(dev):
        vae = AutoencoderKL(**shipped_config("sdxl_vae"))
        l = CLIPTextModel(CLIPTextConfig(**shipped_config("clip_l"))).half()
        g = CLIPTextModelWithProjection(CLIPTextConfig(**shipped_config("clip_g"))).half()
    state.update({"first_stage_model." + k: v.cpu() for k, v in diffusers_to_ldm_vae(vae.state_dict()).items()})
    state.update({"conditioner.embedders.0.transformer." + k: v.cpu() for k, v in to_sgm_clip_keys(l.state_dict()).items()})
    state.update({"conditioner.embedders.1.model." + k: v.cpu() for k, v in hf_to_openclip(g.state_dict()).items()})
    save_atomic(state, path)
    # Byte-level tokenizers (ids < 520) stand in for CLIP's: memory does not depend on the vocabulary.
    write_tiny_tokenizers(path.parent)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vramfit-bench"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--accum", type=int, default=32)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--layout", default="ssd1b")
    args = ap.parse_args()
    from vramfit.data.synth import make_synthetic_dataset

    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.work / "model" / f"{args.layout}-random.safetensors"
    t0 = time.time()
    if not ckpt.exists():
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        build_single_file(ckpt, args.layout)
    print(f"built {ckpt} in {time.time() - t0:.0f} s", flush=True)
    make_synthetic_dataset(args.work / "images", n=args.images, size=1024, seed=0)
    run_dir = args.work / f"run-accum{args.accum}"
    cmd = [sys.executable, "-m", "vramfit", "train", "examples/ssd1b_full_8gb.toml", "--no-progress",
           "--set", f"model.path={ckpt}", "--set", f"data.path={args.work / 'images'}",
           "--set", f"train.steps={args.steps}", "--set", f"train.grad_accum={args.accum}",
           "--set", "save.every_steps=0", "--set", f"output.dir={run_dir}",
           "--set", f"cache.dir={args.work / 'cache'}", "--set", "save.name=bench"]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, text=True, capture_output=True)
    print(proc.stdout[-6000:], proc.stderr[-6000:], flush=True)
    report = json.loads((run_dir / "bench.memory.json").read_text())
    report["command"] = " ".join(cmd)
    report["wall_seconds"] = round(time.time() - t0, 1)
    report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    (args.out / f"{args.layout}_accum{args.accum}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
