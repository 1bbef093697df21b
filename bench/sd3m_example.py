"""GPU measurement of examples/sd3m_dreambooth_lora.toml end to end, T5-XXL included.

Builds Stability's `sd3_medium_incl_clips_t5xxlfp8` layout with random weights from the shipped
configs (the SD3-Medium file of bench/build.py plus a T5 v1.1 XXL encoder of 4,762 M parameters
stored in float8 e4m3, as Stability ships it), writes synthetic images and runs the example as
written (T5 stored in int8 while captions are encoded, 512x512, batch 4, accumulation 4, 8-bit
AdamW, LoRA rank 4) for a few steps, then reports every phase's peak memory. Any extra
`--set KEY=VALUE` is passed on (e.g. model.t5_precision=bf16 for the comparison row).
Not run in CI.

usage: python bench/sd3m_example.py --out DIR [--steps 3] [--tag NAME] [--set KEY=VALUE ...] [--tiny]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from build import ROOT, ensure_model, finish_single_run, log, make_images, run_train

T5_PREFIX = "text_encoders.t5xxl.transformer."
T5_XXL = {"d_ff": 10240, "d_kv": 64, "d_model": 4096, "dense_act_fn": "gelu_new", "eos_token_id": 1,
          "feed_forward_proj": "gated-gelu", "is_encoder_decoder": True, "is_gated_act": True,
          "layer_norm_epsilon": 1e-6, "num_heads": 64, "num_layers": 24, "pad_token_id": 0,
          "relative_attention_max_distance": 128, "relative_attention_num_buckets": 32,
          "tie_word_embeddings": False, "vocab_size": 32128}  # model-facts.md: 4,762,310,656 params


def build_with_t5(work: Path) -> Path:
    """The SD3-M random file plus T5-XXL in float8 (built once per machine)."""
    path = work / "model-t5" / "sd3m-t5fp8-random.safetensors"
    if path.exists():
        return path
    from safetensors.torch import load_file
    from transformers import T5Config, T5EncoderModel

    from vramfit.formats.safetensors_io import save_atomic
    from vramfit.models.sd3.tiny import write_t5_tokenizer

    base = ensure_model("sd3m", work)
    t0 = time.time()
    state = load_file(str(base))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        t5 = T5EncoderModel(T5Config(**T5_XXL)).to(torch.bfloat16)
    n = sum(p.numel() for p in t5.parameters())
    for key, t in t5.state_dict().items():
        if key != "encoder.embed_tokens.weight":  # tied to shared.weight; files store it once
            state[T5_PREFIX + key] = t.to(torch.float8_e4m3fn).cpu()
    del t5
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(state, path)
    for sub in ("tokenizer", "tokenizer_2"):
        shutil.copytree(base.parent / sub, path.parent / sub, dirs_exist_ok=True)
    write_t5_tokenizer(path.parent / "tokenizer_3")
    log(f"built {path} with T5 of {n / 1e6:.0f} M params ({path.stat().st_size / 2**30:.2f} GiB) "
        f"in {time.time() - t0:.0f} s")
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vramfit-bench-sd3"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tag", default="sd3m_example")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--tiny", action="store_true", help="tiny:sd3 at 64x64 on the CPU (checks the script)")
    args = ap.parse_args()
    ckpt = "tiny:sd3" if args.tiny else build_with_t5(args.work)
    res = 64 if args.tiny else 512
    images = make_images(args.work / f"images{res}", 8, res)
    small = [f"data.resolution={res}", "train.batch_size=1", "train.device=cpu"] if args.tiny else []
    sets = [f"model.path={ckpt}", f"data.path={images}", f"data.min_size={res}", f"train.steps={args.steps}",
            *small,
            "save.every_steps=0", "sample.steps=8", f"cache.dir={args.work / ('cache-' + args.tag)}",
            *args.sets]
    report = run_train(ROOT / "examples" / "sd3m_dreambooth_lora.toml", sets, args.work / args.tag)
    finish_single_run(report, args.out / f"{args.tag}.json")


if __name__ == "__main__":
    sys.exit(main())
