"""GPU check of the walking skeleton: examples/ssd1b_full_8gb.toml on the real SSD-1B layout.

Builds a full SSD-1B single file (UNet, VAE, CLIP-L, bigG) with random weights from the shipped
configs (bench/build.py), writes 1024x1024 synthetic images, then runs `vramfit train` through the
CLI exactly as a user would, and copies the memory report to --out. Not run in CI.

usage: python bench/ssd1b_example.py --out DIR [--steps N] [--accum N] [--work DIR] [--stream]
                                    [--set K=V ...] [--tag TEXT]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from build import ROOT, ensure_model, finish_single_run, make_images, run_train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vramfit-bench"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--accum", type=int, default=32)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--layout", default="ssd1b", choices=["ssd1b", "sdxl"])
    ap.add_argument("--stream", action="store_true", help="--set memory.stream_weights=true")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="K=V",
                    help="a further setting (as vramfit train --set), e.g. train.cuda_graphs=false")
    ap.add_argument("--tag", default="", help="appended to the report's name")
    args = ap.parse_args()
    ckpt = ensure_model(args.layout, args.work)
    images = make_images(args.work / "images", args.images, 1024)
    tag = f"{args.layout}_accum{args.accum}" + ("_stream" if args.stream else "") + args.tag
    sets = [f"model.path={ckpt}", f"data.path={images}", f"train.steps={args.steps}",
            f"train.grad_accum={args.accum}", "save.every_steps=0", f"cache.dir={args.work / 'cache'}"]
    if args.stream:
        sets.append("memory.stream_weights=true")
    sets += args.sets
    report = run_train(ROOT / "examples" / "ssd1b_full_8gb.toml", sets, args.work / f"run-{tag}")
    finish_single_run(report, args.out / f"{tag}.json")


if __name__ == "__main__":
    main()
