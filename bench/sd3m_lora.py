"""GPU measurement of an SD3-Medium LoRA run through `vramfit train` (the second write-up's job).

Builds the SD3-Medium architecture (2,028 M transformer parameters, 16-channel VAE, CLIP-L and
CLIP-G; no T5, as Stability's sd3_medium_incl_clips file) with random weights from the shipped
configs as an SAI single file, writes synthetic images, and trains a rank-4 LoRA on
to_q/to_k/to_v/to_out.0 at 512x512, batch 4, accumulation 4, lr 1e-4 constant, logit-normal
timesteps, seed 42, gradient checkpointing, bf16 base. Not run in CI.

usage: python bench/sd3m_lora.py --out DIR [--steps N] [--res 512] [--batch 4] [--accum 4]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def build_single_file(path: Path) -> None:
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from vramfit.formats.clip import to_sgm_clip_keys
    from vramfit.formats.ldm_vae import diffusers_to_ldm_vae
    from vramfit.formats.safetensors_io import save_atomic
    from vramfit.formats.sd3_mmdit import diffusers_to_sai_mmdit
    from vramfit.models.tiny import shipped_config, write_tiny_tokenizers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        tr = SD3Transformer2DModel(**shipped_config("sd3_medium_transformer")).half()
    state = {"model.diffusion_model." + k: v.cpu() for k, v in diffusers_to_sai_mmdit(tr.state_dict()).items()}
    del tr
    with torch.device(dev):
        vae = AutoencoderKL(**shipped_config("sd3_vae"))
        clip_l = CLIPTextModelWithProjection(CLIPTextConfig(**shipped_config("clip_l"))).half()
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(**shipped_config("clip_g"))).half()
    state.update({"first_stage_model." + k: v.cpu() for k, v in diffusers_to_ldm_vae(vae.state_dict()).items()})
    # SAI's file has no CLIP-L projection (the loader puts an identity in its place)
    l_state = {k: v for k, v in clip_l.state_dict().items() if not k.startswith("text_projection")}
    state.update({"text_encoders.clip_l.transformer." + k: v.cpu() for k, v in to_sgm_clip_keys(l_state).items()})
    state.update({"text_encoders.clip_g.transformer." + k: v.cpu()
                  for k, v in to_sgm_clip_keys(clip_g.state_dict()).items()})
    save_atomic(state, path)
    write_tiny_tokenizers(path.parent)  # byte-level CLIP BPE: memory does not depend on the vocabulary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vramfit-bench-sd3"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--res", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--mode", default="lora")
    args = ap.parse_args()
    from vramfit.data.synth import make_synthetic_dataset

    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.work / "model" / "sd3m-random.safetensors"
    t0 = time.time()
    if not ckpt.exists():
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        build_single_file(ckpt)
    print(f"built {ckpt} in {time.time() - t0:.0f} s", flush=True)
    images = args.work / f"images{args.res}"
    make_synthetic_dataset(images, n=8, size=args.res, seed=0)
    tag = f"sd3m_{args.mode}_{args.res}_bs{args.batch}"
    run_dir = args.work / tag
    sets = [f"model.path={ckpt}", f"data.path={images}", f"data.resolution={args.res}", f"data.min_size={args.res}",
            "data.instance_prompt=a photo of sks dog", f"train.mode={args.mode}", "lora.rank=4",
            f"train.batch_size={args.batch}", f"train.grad_accum={args.accum}", "train.lr=1e-4",
            "train.optimizer=adamw", "train.lr_scheduler=constant", "train.weighting_scheme=logit_normal",
            "train.seed=42", "train.gradient_checkpointing=true", "train.precision=full_bf16",
            f"train.steps={args.steps}", "data.max_aspect=1.0", f"output.dir={run_dir}",
            f"cache.dir={args.work / 'cache'}", "save.name=bench", "logging.tensorboard=false"]
    cmd = [sys.executable, "-m", "vramfit", "train", "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    print(" ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, text=True, capture_output=True)
    print(proc.stdout[-6000:], proc.stderr[-6000:], flush=True)
    report = json.loads((run_dir / "bench.memory.json").read_text())
    report["command"] = " ".join(cmd)
    report["wall_seconds"] = round(time.time() - t0, 1)
    report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    (args.out / f"{tag}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
