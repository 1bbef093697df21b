"""GPU measurement of SD3.5 Medium and SD3.5 Large LoRA training through `vramfit train`, on files
written as Stability ships them.

For each layout: the real-size MMDiT is built with random weights directly on the GPU (meta
device, then to_empty and an init, bf16) and written as Stability's single file (MMDiT under
model.diffusion_model., VAE under first_stage_model.), with real-size CLIP-L and CLIP-G in
text_encoders/ beside it, where vramfit finds them. T5-XXL is left out unless --with-t5: the
captions are cached before training, so T5 changes nothing that is measured, and without it the
T5 part of the sequence is zeros of the same length (model.max_sequence_length, 77). Then
`python -m vramfit train` runs a LoRA (rank 16, 1024x1024, batch 1, 4 steps, latents and captions
cached, gradient checkpointing) and its memory report gives the training phase's peak allocated
memory and median step time. The Stability file and the trained LoRA are then loaded with
diffusers (SD3Transformer2DModel.from_single_file, load_lora_adapter) as a check. A "stock" row
trains the same transformer as diffusers' train_dreambooth_lora_sd3.py does by default (rank 4 on
to_q/to_k/to_v/to_out.0, 8-bit AdamW, cached latents, checkpointing: bench/seeds.py's "cached"
case). Each step runs in a fresh process, so peaks do not mix. Not run in CI.

`--tiny` runs the same path on the CPU in seconds with the tiny SD3.5 architectures
(models/sd3/tiny.py) at 64x64.

`--variant NAME:KEY=VALUE,...` trains the same LoRA again with those settings (e.g. a quantized
base: `nf4:lora.base_quantization=nf4`), a row of its own under the layout's "variants".

usage: python bench/sd35_layouts.py --out DIR [--layouts medium,large] [--tiny] [--steps 4]
                                    [--res 1024] [--with-t5] [--no-stock] [--work DIR]
                                    [--variant NAME:KEY=VALUE,...] [--example]

`--example` also trains examples/sd35_medium_lora.toml as written on the Medium file (with
`--with-t5`, its int8 T5 streamed while captions are encoded), a sample grid at its last step.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from build import ROOT, log, make_images, run_train, train_phase

LAYOUTS = ("medium", "large")
GIB = 2 ** 30


def _device(tiny: bool) -> str:
    return "cuda" if torch.cuda.is_available() and not tiny else "cpu"


def _configs(layout: str, tiny: bool) -> dict:
    """The configs of the transformer, VAE, CLIP-L, CLIP-G and T5 of the layout (tiny or released)."""
    from vramfit.fit.model_facts import T5_XXL
    from vramfit.models.parts import shipped_config
    from vramfit.models.sd3.family import release_transformer_config
    from vramfit.models.sd3.tiny import tiny_transformer_config

    name = f"sd3.5-{layout}"
    if tiny:
        return {"transformer": tiny_transformer_config(name), "vae": shipped_config("tiny_sd3_vae"),
                "clip_l": shipped_config("tiny_clip_l"), "clip_g": shipped_config("tiny_clip_g"),
                "t5": shipped_config("tiny_t5")}
    return {"transformer": release_transformer_config(name), "vae": shipped_config("sd3_vae"),
            "clip_l": shipped_config("clip_l"), "clip_g": shipped_config("clip_g"), "t5": T5_XXL}


def _random_init(model: torch.nn.Module) -> None:
    """Weights of a module made on the meta device and moved with to_empty: matrices N(0, 0.02),
    biases 0, norm scales 1, buffers (the position grid) N(0, 0.02). Memory and speed of training
    do not depend on the values; these keep the loss finite."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
        for b in model.buffers():
            if b.is_floating_point():
                b.normal_(0.0, 0.02)


def build(layout: str, folder: Path, tiny: bool, with_t5: bool) -> None:
    """Write folder/sd3.5_<layout>.safetensors (MMDiT and VAE), folder/text_encoders/ (clip_l,
    clip_g, and t5xxl_fp16 with --with-t5), tokenizers, and folder/config/transformer/config.json
    (for diffusers' from_single_file, offline)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config,
                              T5EncoderModel)

    from vramfit.formats.clip import to_sgm_clip_keys
    from vramfit.formats.ldm_vae import diffusers_to_ldm_vae
    from vramfit.formats.safetensors_io import save_atomic
    from vramfit.models.sd3.mmdit import diffusers_to_sai_mmdit
    from vramfit.models.sd3.tiny import write_sd3_tokenizers

    dev, cfg = _device(tiny), _configs(layout, tiny)
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device("meta"):
        transformer = SD3Transformer2DModel(**cfg["transformer"]).to(torch.bfloat16)
    transformer = transformer.to_empty(device=dev)  # bf16 storage on the device, filled next
    _random_init(transformer)
    transformer.save_config(folder / "config" / "transformer")
    params = sum(p.numel() for p in transformer.parameters())
    sai = diffusers_to_sai_mmdit(transformer.state_dict())
    state = {"model.diffusion_model." + k: v.cpu() for k, v in sai.items()}
    del sai
    del transformer
    with torch.device(dev):
        vae = AutoencoderKL(**cfg["vae"]).to(torch.bfloat16)
    vae_state = diffusers_to_ldm_vae(vae.state_dict())
    state.update({"first_stage_model." + k: v.cpu() for k, v in vae_state.items()})
    log(f"built the {layout} MMDiT ({params / 1e6:.1f} M parameters) and VAE on {dev} "
        f"in {time.time() - t0:.0f} s")
    path = folder / f"sd3.5_{layout}.safetensors"
    save_atomic(state, path, {"modelspec.architecture": f"stable-diffusion-3.5-{layout}"})
    del state
    encoders = folder / "text_encoders"
    with torch.device(dev):
        clip_l = CLIPTextModel(CLIPTextConfig(**cfg["clip_l"])).half()
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(**cfg["clip_g"])).half()
    # bare HF keys, CLIP-L without a projection, as Stability's text_encoders/ files
    for name, clip in (("clip_l", clip_l), ("clip_g", clip_g)):
        save_atomic({k: v.cpu() for k, v in to_sgm_clip_keys(clip.state_dict()).items()},
                    encoders / f"{name}.safetensors")
    if with_t5:
        with torch.device(dev):
            t5 = T5EncoderModel(T5Config(**cfg["t5"])).half()
        # the tied token table under both of its names, as Stability's file (own copies: safetensors
        # writes no shared storage)
        save_atomic({k: v.cpu().clone() for k, v in t5.state_dict().items()}, encoders / "t5xxl_fp16.safetensors")
    write_sd3_tokenizers(folder)
    (folder / "params.json").write_text(json.dumps({"params": params}))
    log(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) and text_encoders/ "
        f"in {time.time() - t0:.0f} s")


def check(layout: str, folder: Path, lora: Path, tiny: bool) -> None:
    """Load the Stability file's transformer with diffusers' from_single_file and the trained LoRA
    into it; print a RESULT line."""
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    t0 = time.time()
    model = SD3Transformer2DModel.from_single_file(
        str(folder / f"sd3.5_{layout}.safetensors"), config=str(folder / "config"), subfolder="transformer",
        torch_dtype=torch.bfloat16, local_files_only=True).to(_device(tiny))
    state = load_file(str(lora))
    model.load_lora_adapter(state, prefix="transformer", adapter_name="bench")
    key = next(k for k in state if k.endswith("attn.to_q.lora_B.weight"))
    module = model.get_submodule(key.removeprefix("transformer.").removesuffix(".lora_B.weight"))
    loaded = module.lora_B["bench"].weight
    same = torch.equal(loaded.cpu(), state[key].to(loaded.dtype))  # as stored in the model's dtype
    dual = [i for i, block in enumerate(model.transformer_blocks) if block.attn2 is not None]
    result = {"loaded": True, "lora_matches": same, "qk_norm": model.config.qk_norm,
              "dual_attention_layers": dual, "seconds": round(time.time() - t0, 1)}
    print("RESULT " + json.dumps(result), flush=True)


def stock(layout: str, tiny: bool, steps: int, res: int) -> None:
    """bench/seeds.py's "cached" SD3 LoRA case (diffusers' train_dreambooth_lora_sd3.py defaults
    with cached latents) on this layout's transformer; print its RESULT line."""
    from seeds import Bench

    bench = Bench("sd3_lora1024", tiny, _device(tiny))
    bench.cfg, bench.res = _configs(layout, tiny)["transformer"], res
    print("RESULT " + json.dumps(bench.run("cached", steps)), flush=True)


def _result(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, text=True, capture_output=True, cwd=ROOT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        return {"error": (proc.stdout[-2000:] + proc.stderr[-3000:])}
    return json.loads(line.removeprefix("RESULT "))


def _gib(n) -> float | None:
    return round(n / GIB, 2) if n else None


def _trained(sets: list[str], run_dir: Path) -> dict:
    """One `vramfit train` run's training phase: peaks, median step, peak RSS, and the layout vramfit
    read from the file's keys (as its LoRA's metadata names it)."""
    report = run_train(None, sets, run_dir, echo=False)
    train = train_phase(report)
    if report.get("error") or train is None:
        return {"error": report.get("error", "no training phase in the report")}
    with safe_open(str(run_dir / "bench.safetensors"), "pt") as fh:
        read_as = fh.metadata().get("vramfit.layout")
    return {"peak_allocated_gib": _gib(train["gpu_peak_allocated"]),
            "peak_reserved_gib": _gib(train["gpu_peak_reserved"]),
            "step_s": round(train["step_seconds"], 4), "rss_peak_gib": _gib(train["rss_peak"]),
            "lora_rank": 16, "layout": read_as}


def _example(layout: str, model: Path, images: Path, res: int, args) -> dict:
    """examples/sd35_<layout>_lora.toml as written, on the built file: every phase's peaks (a sample
    grid at the last step, so the sample phase is measured too), the training step and peak RSS."""
    example = ROOT / "examples" / f"sd35_{layout}_lora.toml"
    if not example.exists():
        return {"error": f"no {example.name}"}
    sets = [f"model.path={model}", f"data.path={images}", f"data.resolution={res}", f"data.min_size={res}",
            f"train.steps={args.steps}", f"sample.every_steps={args.steps}", "save.every_steps=0",
            f"cache.dir={args.work / 'cache-example'}"]
    if args.tiny:
        sets += ["train.device=cpu", "memory.stream_encoders=false", "data.bucket_step=32", "sample.steps=2"]
    report = run_train(example, sets, args.work / f"run-{'tiny-' if args.tiny else ''}{layout}-example", echo=False)
    train = train_phase(report)
    if report.get("error") or train is None:
        return {"error": str(report.get("error", "no training phase in the report"))[-3000:]}
    phases = report.get("phases", [])
    return {"example": example.name, "peak_allocated_gib": _gib(train["gpu_peak_allocated"]),
            "peak_reserved_gib": _gib(train["gpu_peak_reserved"]), "step_s": round(train["step_seconds"], 4),
            "rss_peak_gib": _gib(max((p["rss_peak"] for p in phases), default=0)),
            "phases": {p["name"]: {"alloc_gib": _gib(p["gpu_peak_allocated"]), "resv_gib": _gib(p["gpu_peak_reserved"]),
                                   "rss_gib": _gib(p["rss_peak"]), "seconds": round(p["seconds"], 1)}
                       for p in phases}}


def run_layout(layout: str, args) -> dict:
    folder = args.work / (f"tiny_sd3.5_{layout}" if args.tiny else f"sd3.5_{layout}")
    model = folder / f"sd3.5_{layout}.safetensors"
    flags = ["--tiny"] if args.tiny else []
    t5_missing = args.with_t5 and not (folder / "text_encoders" / "t5xxl_fp16.safetensors").exists()
    if not model.exists() or not (folder / "params.json").exists() or t5_missing:
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "build", layout, str(folder), *flags,
                        *(["--with-t5"] if args.with_t5 else [])], check=True, cwd=ROOT)
    params = json.loads((folder / "params.json").read_text())["params"]
    row: dict = {"layout": f"sd3.5-{layout}", "params": params,
                 "file_mib": round(model.stat().st_size / 2**20, 1),
                 "t5": (folder / "text_encoders" / "t5xxl_fp16.safetensors").exists()}
    res = 64 if args.tiny else args.res
    images = make_images(args.work / f"images{res}", 4, res)
    sets = [f"model.path={model}", f"data.path={images}", f"data.resolution={res}", f"data.min_size={res}",
            "data.max_aspect=1.0", "data.instance_prompt=a photo of sks dog", "train.mode=lora",
            "lora.rank=16",
            "train.batch_size=1", "train.grad_accum=1", f"train.steps={args.steps}", "train.lr=1e-4",
            "train.optimizer=adamw", "train.lr_scheduler=constant", "train.weighting_scheme=logit_normal",
            "train.seed=42", "train.gradient_checkpointing=true", "train.precision=full_bf16",
            "cache.latents=true", "cache.text=true", f"cache.dir={args.work / 'cache'}"]
    if args.tiny:
        sets.append("data.bucket_step=32")
    run_dir = args.work / f"run-{'tiny-' if args.tiny else ''}{layout}"
    row["vramfit"] = _trained(sets, run_dir)
    if "error" in row["vramfit"]:
        return row
    if args.example:
        row["example"] = _example(layout, model, images, res, args)
    for name, extra in args.variant:  # the same run with the memory savers the variant sets
        row.setdefault("variants", {})[name] = dict(_trained([*sets, *extra], run_dir.with_name(
            f"{run_dir.name}-{name}")), sets=extra)
    lora = run_dir / "bench.safetensors"
    me = str(Path(__file__).resolve())
    row["check"] = _result([sys.executable, me, "check", layout, str(folder), str(lora), *flags])
    if not args.no_stock:
        stock_row = _result([sys.executable, me, "stock", layout, *flags, "--steps", str(args.steps),
                             "--res", str(res)])
        if "error" not in stock_row:
            stock_row = {"peak_allocated_gib": _gib(stock_row.get("peak_allocated")),
                         "peak_reserved_gib": _gib(stock_row.get("peak_reserved")),
                         "step_s": stock_row["step_s"], "lora_rank": 4,
                         "optimizer": stock_row.get("optimizer")}
        row["stock"] = stock_row
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("build", "check", "stock"):
        ap = argparse.ArgumentParser()
        ap.add_argument("step")
        ap.add_argument("layout", choices=LAYOUTS)
        ap.add_argument("paths", nargs="*", type=Path)
        ap.add_argument("--tiny", action="store_true")
        ap.add_argument("--with-t5", action="store_true")
        ap.add_argument("--steps", type=int, default=4)
        ap.add_argument("--res", type=int, default=1024)
        a = ap.parse_args()
        if a.step == "build":
            build(a.layout, a.paths[0], a.tiny, a.with_t5)
        elif a.step == "check":
            check(a.layout, a.paths[0], a.paths[1], a.tiny)
        else:
            stock(a.layout, a.tiny, a.steps, a.res)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vramfit-bench-sd35"))
    ap.add_argument("--layouts", default="medium,large", help="comma-separated: medium, large")
    ap.add_argument("--tiny", action="store_true", help="the tiny SD3.5 architectures at 64x64 on the CPU")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--with-t5", action="store_true", help="write a T5-XXL text_encoders/t5xxl_fp16 file too")
    ap.add_argument("--no-stock", action="store_true", help="leave out the stock diffusers-recipe row")
    ap.add_argument("--example", action="store_true",
                    help="also run examples/sd35_<layout>_lora.toml as written (where there is one), a sample grid "
                    "at its last step, every phase's peaks in the row")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="also train with these settings (a run of its own per layout), e.g. "
                    "nf4:lora.base_quantization=nf4; repeatable")
    args = ap.parse_args()
    bad = [v for v in args.variant if ":" not in v or "=" not in v]
    if bad:
        raise SystemExit(f"--variant {bad[0]!r}: give NAME:KEY=VALUE[,KEY=VALUE...]")
    args.variant = [(v.split(":", 1)[0], v.split(":", 1)[1].split(",")) for v in args.variant]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: {', '.join(unknown)} unknown; use {', '.join(LAYOUTS)}")
    rows = []
    out = args.out / f"sd35_layouts{'_tiny' if args.tiny else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else None
    for layout in layouts:  # written after each layout: a run cut short keeps the layouts before it
        log(f"sd3.5-{layout}")
        rows.append(run_layout(layout, args))
        log(json.dumps(rows[-1]))
        out.write_text(json.dumps({"gpu": gpu, "steps": args.steps, "rows": rows}, indent=2))
    print(f"{'layout':<14}{'params':>10}{'vramfit GiB':>13}{'s/step':>9}{'stock GiB':>11}{'s/step':>9}"
          "  check")
    for r in rows:
        v, s, c = r.get("vramfit", {}), r.get("stock", {}), r.get("check", {})
        print(f"{r['layout']:<14}{r['params'] / 1e6:>9.1f}M{v.get('peak_allocated_gib') or '-':>13}"
              f"{v.get('step_s') or 'error':>9}{s.get('peak_allocated_gib') or '-':>11}"
              f"{s.get('step_s') or '-':>9}  "
              f"{'ok' if c.get('lora_matches') else c.get('error', 'failed')[-200:]}")
        if "example" in r:
            e = r["example"]
            print(f"  {'example':<12}{'':>10}{e.get('peak_allocated_gib') or '-':>13}"
                  f"{e.get('step_s') or e.get('error', 'error')[-200:]:>9}")
        for name, v in r.get("variants", {}).items():
            print(f"  {name:<12}{'':>10}{v.get('peak_allocated_gib') or '-':>13}"
                  f"{v.get('step_s') or v.get('error', 'error')[-200:]:>9}")
    print(f"written {out}")
    failed = any("error" in r.get(k, {}) or (k == "check" and not r[k].get("lora_matches"))
                 for r in rows for k in ("vramfit", "check", "stock", "example") if k in r) or \
        any("error" in v for r in rows for v in r.get("variants", {}).values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
