"""Compose a run from a RunConfig: load, scan, cache, train, save, report.

Each phase is measured (memory/accounting.py). Only the denoiser is on the device while
training when both caches are on: the VAE and the text encoders are freed after caching and
read again from the source when a checkpoint is written.
"""
from __future__ import annotations

import json
import logging
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from vramfit.config.load import dump_config
from vramfit.config.schema import RunConfig
from vramfit.data.cache import DiskCache
from vramfit.data.scan import ScanResult, scan_dataset
from vramfit.formats.safetensors_io import write_text_atomic
from vramfit.memory.accounting import MemoryReport, MemoryTracker
from vramfit.models.registry import detect_family
from vramfit.models.sources import default_cache_root, resolve_source
from vramfit.optim.build import build_optimizer, build_schedule
from vramfit.train.data import DTYPES, TrainingData, free_device_memory, make_records
from vramfit.train.loop import LoopResult, run_loop
from vramfit.train.logs import RunLogger

log = logging.getLogger("vramfit")
SAVE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class RunResult:
    output_dir: Path
    checkpoints: list[Path]
    report: MemoryReport
    loop: LoopResult
    scan: ScanResult
    cache_stats: dict


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cache_root(cfg: RunConfig) -> Path:
    return Path(cfg.cache.dir).expanduser() if cfg.cache.dir else default_cache_root()


def scan(cfg: RunConfig) -> ScanResult:
    result = scan_dataset(Path(cfg.data.path).expanduser(),
                          metadata=Path(cfg.data.metadata).expanduser() if cfg.data.metadata else None,
                          caption_extension=cfg.data.caption_extension, min_size=cfg.data.min_size)
    for p in result.problems:
        log.warning("skipping %s: %s", p.path, p.reason)
    if not result.items:
        raise ValueError(f"data.path: no usable images in {cfg.data.path} "
                         f"({len(result.problems)} skipped; see the warnings above)")
    return result


def prepare(cfg: RunConfig, tracker: MemoryTracker, device: torch.device, progress: bool):
    """Load the model, scan the data and fill the cache; returns (family, bundle, data, scan)."""
    result = scan(cfg)
    with tracker.phase("load"):
        source = resolve_source(cfg.model, cache_root(cfg))
        family = detect_family(source, cfg.model.family)
        bundle = family.load(source)
    data = TrainingData(family, bundle, make_records(result.items, cfg.data, cfg.train.seed), cfg.data,
                        cfg.cache, DiskCache(cache_root(cfg) / "entries"), device)
    # The VAE runs in the precision asked for whatever the file stores (SDXL's overflows in fp16);
    # half-precision text encoders are kept on GPUs but widened for the CPU, which lacks fast fp16.
    bundle.vae.to(DTYPES[cfg.cache.vae_dtype])
    if device.type == "cpu":
        for enc in bundle.text_encoders:
            enc.to(torch.float32)
    data.assign_keys()
    with tracker.phase("cache_latents"):
        if cfg.cache.latents:
            data.cache_latents(progress)
    with tracker.phase("cache_text"):
        if cfg.cache.text:
            data.cache_text(progress)
    if cfg.cache.latents and cfg.cache.text:
        bundle.drop_encoders()
    else:  # live encoding: the encoders that are still needed stay on the device
        if not cfg.cache.latents:
            bundle.vae.to(device)
        for enc in bundle.text_encoders if not cfg.cache.text else []:
            enc.to(device)
    free_device_memory(device)
    return family, bundle, data, result


def place_denoiser(bundle, cfg: RunConfig, device: torch.device) -> None:
    unet = bundle.denoiser
    unet.to(device, torch.bfloat16 if cfg.train.precision == "full_bf16" else torch.float32)
    unet.requires_grad_(True)
    if cfg.train.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    else:
        unet.disable_gradient_checkpointing()


def save_checkpoint(family, bundle, cfg: RunConfig, step: Optional[int]) -> list[Path]:
    """Write the formats asked for; `step` None means the final save."""
    out = cfg.output_dir
    name = cfg.save.name if step is None else f"{cfg.save.name}-step{step:06d}"
    dtype = SAVE_DTYPES[cfg.save.dtype]
    meta = {"vramfit.version": _version(), "vramfit.config": dump_config(cfg),
            "vramfit.step": str(step if step is not None else cfg.train.steps),
            "vramfit.base_model": bundle.source.label, "modelspec.architecture": "stable-diffusion-xl-v1-base",
            "vramfit.layout": bundle.layout}
    paths = []
    if "single_file" in cfg.save.formats:
        path = out / f"{name}.safetensors"
        family.save_single_file(bundle, path, dtype, meta)
        paths.append(path)
    if "diffusers" in cfg.save.formats:
        folder = out / f"{name}-diffusers"
        family.save_diffusers(bundle, folder, dtype)
        paths.append(folder)
    return paths


def train_run(cfg: RunConfig, *, progress: bool = True) -> RunResult:
    device = pick_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "config.toml", dump_config(cfg))
    tracker = MemoryTracker(device)
    family, bundle, data, scanned = prepare(cfg, tracker, device, progress)
    place_denoiser(bundle, cfg, device)
    optimizer = build_optimizer(bundle.denoiser.parameters(), cfg.train)
    schedule = build_schedule(optimizer, cfg.train)
    saved: list[Path] = []
    logger = RunLogger(cfg, out, progress, device)
    with tracker.phase("train") as phase:
        result = run_loop(family, bundle, data, optimizer, schedule, cfg.train, device,
                          on_step=logger.step, save_every=cfg.save.every_steps,
                          on_save=lambda s: saved.extend(save_checkpoint(family, bundle, cfg, s)))
        phase.steps = len(result.losses)
        phase.step_seconds = result.median_step
    logger.close()
    del optimizer
    free_device_memory(device)
    with tracker.phase("save"):
        saved += save_checkpoint(family, bundle, cfg, None)
    report = tracker.report
    report.write(out / f"{cfg.save.name}.memory.json")
    write_text_atomic(out / "run.json", json.dumps(
        {"versions": _versions(), "seed": cfg.train.seed, "items": len(scanned.items),
         "skipped": [{"path": p.path, "reason": p.reason} for p in scanned.problems],
         "cache": data.stats, "losses": result.losses, "nonfinite_steps_skipped": result.skipped,
         "checkpoints": [str(p) for p in saved]}, indent=2))
    return RunResult(out, saved, report, result, scanned, data.stats)


def _version() -> str:
    from vramfit import __version__

    return __version__


def _versions() -> dict:
    import diffusers
    import transformers

    return {"vramfit": _version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}
