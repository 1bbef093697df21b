"""GPU measurement of examples/flux1_dev_lora_8gb.toml end to end, at real size with random weights.

Builds the files ComfyUI users keep for Flux.1-dev: the BFL transformer alone
(flux1-dev.safetensors, 11.9 B parameters, bf16), BFL's autoencoder (ae.safetensors), CLIP-L
(clip_l.safetensors) and T5-XXL stored in float8 e4m3 (t5xxl_fp8_e4m3fn.safetensors), with
stand-in tokenizers beside the transformer; writes synthetic 1024x1024 images; runs the stock
recipe of diffusers' train_dreambooth_lora_flux.py (bench/seeds.py flux_lora1024 stock and, with its
--gradient_checkpointing, stock_ckpt; `--stock`)
and the example as written, plus any `--variant NAME:KEY=VALUE,...` (each a run of its own), and
reports every run's phase peaks, step time and host memory. Not run in CI.

`--full` runs examples/flux1_dev_full_12gb.toml instead (a full fine-tune, streamed; its rows are
written to flux_full_example.json).

usage: python bench/flux_example.py --out DIR [--steps 4] [--stock] [--variant NAME:K=V,...] [--tiny] [--full]
                                    [--work DIR] [--runs DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from build import ROOT, log, make_images, run_train, train_phase

T5_XXL = {"d_ff": 10240, "d_kv": 64, "d_model": 4096, "dense_act_fn": "gelu_new", "eos_token_id": 1,
          "feed_forward_proj": "gated-gelu", "is_encoder_decoder": True, "is_gated_act": True,
          "layer_norm_epsilon": 1e-6, "num_heads": 64, "num_layers": 24, "pad_token_id": 0,
          "relative_attention_max_distance": 128, "relative_attention_num_buckets": 32,
          "tie_word_embeddings": False, "vocab_size": 32128}
FILES = ("flux1-dev.safetensors", "ae.safetensors", "clip_l.safetensors", "t5xxl_fp8_e4m3fn.safetensors")


def build_flux_files(folder: Path, tiny: bool) -> dict[str, Path]:
    """The four files (built once per machine); tiny: tiny:flux's parts, split the same way."""
    paths = {name: folder / name for name in FILES}
    if all(p.exists() for p in paths.values()):
        return paths
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from vramfit.formats.clip import to_sgm_clip_keys
    from vramfit.formats.ldm_vae import diffusers_to_ldm_vae
    from vramfit.formats.safetensors_io import save_atomic
    from vramfit.models.flux.bfl import diffusers_to_bfl
    from vramfit.models.flux.tiny import write_flux_tokenizers
    from vramfit.models.parts import shipped_config

    t0 = time.time()
    pre = "tiny_" if tiny else ""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    def save(name: str, state: dict, dtype: torch.dtype) -> None:
        save_atomic({k: v.to(dtype).cpu().contiguous() for k, v in state.items()}, paths[name])
        log(f"wrote {paths[name]} ({paths[name].stat().st_size / 2**30:.2f} GiB)")

    with torch.device(device):
        tr = FluxTransformer2DModel(**shipped_config("tiny_flux_transformer" if tiny else "flux1_dev_transformer"))
    save("flux1-dev.safetensors", diffusers_to_bfl(tr.to(torch.bfloat16).state_dict()), torch.bfloat16)
    del tr
    with torch.device(device):
        vae = AutoencoderKL(**shipped_config(f"{pre}flux_vae"))
        clip = CLIPTextModel(CLIPTextConfig(**shipped_config(f"{pre}clip_l")))
    save("ae.safetensors", diffusers_to_ldm_vae(vae.state_dict()), torch.float32)
    save("clip_l.safetensors", to_sgm_clip_keys(clip.state_dict()), torch.float16)
    del vae, clip
    with torch.device(device):
        t5 = T5EncoderModel(T5Config(**(shipped_config("tiny_t5") if tiny else T5_XXL))).to(torch.bfloat16)
    save("t5xxl_fp8_e4m3fn.safetensors", t5.state_dict(), torch.float8_e4m3fn)
    del t5
    if device == "cuda":  # the runs measured after this are processes of their own: leave them the GPU
        torch.cuda.empty_cache()
    write_flux_tokenizers(folder)
    log(f"built the Flux.1-dev files in {time.time() - t0:.0f} s")
    return paths


def stock(args, case: str = "stock") -> dict:
    """The stock recipe (`case`: "stock", or "stock_ckpt" with its checkpointing flag) in a fresh
    process (bench/seeds.py), as one JSON row."""
    cmd = [sys.executable, str(ROOT / "bench" / "seeds.py"), "flux_lora1024", case, "--steps", str(args.steps)]
    cmd += ["--tiny"] if args.tiny else []
    log(" ".join(cmd))
    proc = subprocess.run(cmd, text=True, capture_output=True, cwd=ROOT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        return dict(case=case, error=(proc.stdout[-2000:] + proc.stderr[-3000:]))
    return json.loads(line[len("RESULT "):])


def summary(name: str, report: dict) -> dict:
    """The row of one vramfit run: training peaks, step time, host peak, every phase's peaks."""
    train = train_phase(report) or {}
    phases = report.get("phases", [])
    return dict(case=name, error=str(report.get("error", ""))[-3000:] or None,
                train_peak_alloc_gib=gib(train.get("gpu_peak_allocated")),
                train_peak_reserved_gib=gib(train.get("gpu_peak_reserved")),
                step_s=train.get("step_seconds"), host_peak_rss_gib=gib(max((p["rss_peak"] for p in phases), default=0)),
                phases={p["name"]: dict(alloc=gib(p["gpu_peak_allocated"]), rss=gib(p["rss_peak"]),
                                        seconds=round(p["seconds"], 1)) for p in phases},
                wall_s=report.get("wall_seconds"), command=report.get("command"))


def gib(nbytes) -> float | None:
    return round(nbytes / 2**30, 2) if nbytes else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vramfit-bench-flux"))
    ap.add_argument("--runs", type=Path, help="where the runs write (default: under --work); the full "
                    "fine-tune's end writes its training state and a 22 GiB file beside the 27 GiB of sources")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--stock", action="store_true", help="also run the stock recipe (bench/seeds.py)")
    ap.add_argument("--skip-example", action="store_true", help="only the variants")
    ap.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,KEY=VALUE")
    ap.add_argument("--tiny", action="store_true", help="tiny:flux's parts at 64x64 on the CPU (checks the script)")
    ap.add_argument("--full", action="store_true", help="the full fine-tune example instead of the LoRA one")
    args = ap.parse_args()
    files = build_flux_files(args.work / ("files-tiny" if args.tiny else "files"), args.tiny)
    res = 64 if args.tiny else 1024
    images = make_images(args.work / f"images{res}", 4, res)
    base = [f"model.path={files['flux1-dev.safetensors']}", f"model.vae={files['ae.safetensors']}",
            f"model.clip_l={files['clip_l.safetensors']}", f"model.t5={files['t5xxl_fp8_e4m3fn.safetensors']}",
            f"data.path={images}", f"data.resolution={res}", f"data.min_size={res}", f"train.steps={args.steps}",
            "save.every_steps=0"] + ([] if args.full else ["save.formats=[\"lora\"]"])
    base += ["train.device=cpu", "memory.stream_weights=false", "memory.stream_encoders=false"] if args.tiny else []
    stem = "flux_full_example" if args.full else "flux_example"
    out_file = args.out / (f"{stem}_tiny.json" if args.tiny else f"{stem}.json")
    example = ROOT / "examples" / ("flux1_dev_full_12gb.toml" if args.full else "flux1_dev_lora_8gb.toml")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    rows: list[dict] = []

    def put(row: dict) -> None:  # written after every run: a run cut short keeps the rows before it
        rows.append(row)
        args.out.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(dict(gpu=gpu, rows=rows), indent=2))
        log(json.dumps({k: v for k, v in row.items() if k not in ("command", "phases", "step_times")}))

    runs = ([("example", [])] if not args.skip_example else []) + [
        (v.split(":", 1)[0], v.split(":", 1)[1].split(",")) for v in args.variant]
    for i, (name, sets) in enumerate(runs):
        log(f"vramfit {name} ...")
        run_dir = (args.runs or args.work) / f"run-{'full-' if args.full else ''}{name}"
        report = run_train(example, base + [f"cache.dir={args.work / 'cache'}", *sets], run_dir)
        put(summary(name, report))
        if i == 0 and args.stock:  # the references right after the first row, before any variant
            put(stock(args))
            put(stock(args, "stock_ckpt"))
    if args.stock and not runs:
        put(stock(args))
        put(stock(args, "stock_ckpt"))


if __name__ == "__main__":
    sys.exit(main())
