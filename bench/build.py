"""Shared parts of the bench scripts: real-size checkpoints with random weights, synthetic images,
and one `python -m vramfit train` run read back through its memory report.

The checkpoints are built from the architecture configs vramfit ships (models/configs/), written
as the single files users have (SGM layout for the SDXL family, SAI layout for SD3-Medium), with
byte-level stand-in tokenizers beside them: memory and speed of training do not depend on the
weight values or the vocabulary. `--tiny` runs use vramfit's own tiny:<name> models instead.

usage (one build in a fresh process, so the caller holds no GPU memory):
    python bench/build.py {ssd1b,sdxl,sd3m} PATH
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
REPORT_NAME = "bench"  # save.name of every bench run: the report is <run dir>/bench.memory.json


def log(msg: str) -> None:
    """A progress line with a UTC timestamp (the GPU commands have a 10-minute limit)."""
    print(time.strftime("[%H:%M:%S] ", time.gmtime()) + msg, flush=True)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_sdxl_single_file(path: Path, layout: str = "ssd1b") -> None:
    """An SGM single file (UNet, VAE, CLIP-L, bigG) of the SDXL or SSD-1B layout, random weights."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from vramfit.formats.clip import hf_to_openclip, to_sgm_clip_keys
    from vramfit.formats.ldm_vae import diffusers_to_ldm_vae
    from vramfit.formats.safetensors_io import save_atomic
    from vramfit.models.parts import shipped_config
    from vramfit.models.sdxl.sgm_unet import diffusers_to_sgm_unet
    from vramfit.models.tiny import write_tiny_tokenizers

    dev = _device()
    torch.manual_seed(0)
    cfg = shipped_config(f"{layout}_unet")
    with torch.device(dev):
        unet = UNet2DConditionModel(**cfg).half()
    state = {"model.diffusion_model." + k: v.cpu() for k, v in diffusers_to_sgm_unet(unet.state_dict(), cfg).items()}
    del unet
    with torch.device(dev):
        vae = AutoencoderKL(**shipped_config("sdxl_vae"))
        clip_l = CLIPTextModel(CLIPTextConfig(**shipped_config("clip_l"))).half()
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(**shipped_config("clip_g"))).half()
    state.update({"first_stage_model." + k: v.cpu() for k, v in diffusers_to_ldm_vae(vae.state_dict()).items()})
    state.update({"conditioner.embedders.0.transformer." + k: v.cpu()
                  for k, v in to_sgm_clip_keys(clip_l.state_dict()).items()})
    state.update({"conditioner.embedders.1.model." + k: v.cpu() for k, v in hf_to_openclip(clip_g.state_dict()).items()})
    save_atomic(state, path)
    write_tiny_tokenizers(path.parent)


def build_sd3_single_file(path: Path) -> None:
    """An SAI single file of SD3-Medium (MMDiT, 16-channel VAE, CLIP-L, CLIP-G; no T5, as
    Stability's sd3_medium_incl_clips), random weights."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from vramfit.formats.clip import to_sgm_clip_keys
    from vramfit.formats.ldm_vae import diffusers_to_ldm_vae
    from vramfit.formats.safetensors_io import save_atomic
    from vramfit.models.parts import shipped_config
    from vramfit.models.sd3.mmdit import diffusers_to_sai_mmdit
    from vramfit.models.tiny import write_tiny_tokenizers

    dev = _device()
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
    write_tiny_tokenizers(path.parent)


BUILDERS = {"ssd1b": lambda p: build_sdxl_single_file(p, "ssd1b"),
            "sdxl": lambda p: build_sdxl_single_file(p, "sdxl"),
            "sd3m": build_sd3_single_file}


def ensure_model(kind: str, work: Path, in_process: bool = False) -> Path:
    """The random-weight single file of `kind` under work/model/, built once (in a fresh process
    unless in_process) and reused by later runs on the same machine."""
    path = work / "model" / f"{kind}-random.safetensors"
    if path.exists() and (path.parent / "tokenizer_2").is_dir():
        log(f"model {path} already built")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if in_process:
        BUILDERS[kind](path)
    else:
        subprocess.run([sys.executable, str(Path(__file__).resolve()), kind, str(path)], check=True, cwd=ROOT)
    log(f"built {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.time() - t0:.0f} s")
    return path


def make_images(folder: Path, n: int, size: int) -> Path:
    from vramfit.data.synth import make_synthetic_dataset

    if not folder.is_dir() or len(list(folder.glob("*.png"))) != n:
        shutil.rmtree(folder, ignore_errors=True)
        make_synthetic_dataset(folder, n=n, size=size, seed=0)
    return folder


def train_command(config: Optional[Path], sets: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "vramfit", "train"] + ([str(config)] if config else []) + ["--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def run_train(config: Optional[Path], sets: list[str], run_dir: Path, timeout: Optional[float] = None,
              echo: bool = True) -> dict:
    """Run `python -m vramfit train` with output in run_dir; return its memory report (plus the
    command, wall time, return code and the output's tail). A failed run returns "error"."""
    sets = [*sets, f"output.dir={run_dir}", f"save.name={REPORT_NAME}", "logging.tensorboard=false"]
    cmd = train_command(config, sets)
    if echo:
        log(" ".join(cmd))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, text=True, capture_output=True, cwd=ROOT, timeout=timeout)
        rc, tail, logged = proc.returncode, (proc.stdout[-4000:] + proc.stderr[-4000:]), proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, tail, logged = "timeout", str(exc)[-2000:], ""
    path = run_dir / f"{REPORT_NAME}.memory.json"
    report = json.loads(path.read_text()) if rc == 0 and path.exists() else {}
    report.update(command=" ".join(cmd), wall_seconds=round(time.time() - t0, 1), returncode=rc,
                  log_lines=[line for line in logged.splitlines() if line.startswith(("INFO vramfit", "WARNING"))][-40:])
    if rc != 0:
        report["error"] = tail
    elif echo:
        print(tail, flush=True)
    return report


def train_phase(report: dict) -> Optional[dict]:
    return next((p for p in report.get("phases", []) if p["name"] == "train"), None)


def finish_single_run(report: dict, out_file: Path) -> None:
    """The tail of the single-workload scripts: write the report, print it, exit with the run's code."""
    report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if report.get("error"):
        print(report["error"], file=sys.stderr)
    sys.exit(0 if report["returncode"] == 0 else 1)


if __name__ == "__main__":
    BUILDERS[sys.argv[1]](Path(sys.argv[2]))
