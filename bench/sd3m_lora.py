"""GPU measurement of an SD3-Medium LoRA run through `vramfit train` (the second write-up's job).

Builds the SD3-Medium architecture (2,028 M transformer parameters, 16-channel VAE, CLIP-L and
CLIP-G; no T5, as Stability's sd3_medium_incl_clips file) with random weights from the shipped
configs as an SAI single file (bench/build.py), writes synthetic images, and trains a rank-4 LoRA on
to_q/to_k/to_v/to_out.0 at 512x512, batch 4, accumulation 4, lr 1e-4 constant, logit-normal
timesteps, seed 42, gradient checkpointing, bf16 base. Not run in CI.

usage: python bench/sd3m_lora.py --out DIR [--steps N] [--res 512] [--batch 4] [--accum 4] [--stream]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from build import ensure_model, finish_single_run, make_images, run_train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vramfit-bench-sd3"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--res", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--mode", default="lora")
    ap.add_argument("--stream", action="store_true", help="--set memory.stream_weights=true")
    args = ap.parse_args()
    ckpt = ensure_model("sd3m", args.work)
    images = make_images(args.work / f"images{args.res}", 8, args.res)
    tag = f"sd3m_{args.mode}_{args.res}_bs{args.batch}" + ("_stream" if args.stream else "")
    sets = [f"model.path={ckpt}", f"data.path={images}", f"data.resolution={args.res}", f"data.min_size={args.res}",
            "data.instance_prompt=a photo of sks dog", f"train.mode={args.mode}",
            f"train.batch_size={args.batch}", f"train.grad_accum={args.accum}", "train.lr=1e-4",
            "train.optimizer=adamw", "train.lr_scheduler=constant", "train.weighting_scheme=logit_normal",
            "train.seed=42", "train.gradient_checkpointing=true", "train.precision=full_bf16",
            f"train.steps={args.steps}", "data.max_aspect=1.0", f"cache.dir={args.work / 'cache'}"]
    if args.mode == "lora":
        sets.append("lora.rank=4")
    if args.stream:
        sets.append("memory.stream_weights=true")
    report = run_train(None, sets, args.work / tag)
    finish_single_run(report, args.out / f"{tag}.json")


if __name__ == "__main__":
    main()
