"""Resumable training state: save, find, check and load it, keeping the newest N.

A state is a folder `output/state/step-NNNNNN/` holding the trainable weights (safetensors, in
the training precision), the optimizer and schedule (torch.save, read back with
weights_only=True), the random generators, the step, epoch and data position counters and the
config it was made with. It is written to a temporary folder, every file fsynced, then renamed
into place, and only then does `output/state/latest` name it: a crash at any point leaves the
previous state whole and `latest` pointing at it.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from vramfit.formats.safetensors_io import save_atomic, write_text_atomic

STATE_VERSION = 1
# Settings that must match for a resumed run to continue the same run. Steps may grow.
_MUST_MATCH = [("model", "path"), ("data", "resolution"), ("data", "bucket_step"), ("data", "random_crop"),
               ("train", "batch_size"), ("train", "grad_accum"), ("train", "optimizer"),
               ("train", "precision"), ("train", "seed"), ("train", "lr_scheduler"),
               ("lora", "base_quantization"), ("lora", "targets"), ("prior", "class_prompt")]


class ResumeError(ValueError):
    """A --resume that cannot continue this run; the message says why and what to do."""


@dataclass
class Progress:
    """Where a run is: optimizer steps done, epochs done, micro-batches used in this epoch."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    micro_batches: int = 0
    nonfinite_skipped: int = 0
    resumed_from: Optional[str] = None
    resumes: int = 0


def state_root(output_dir: Path) -> Path:
    return Path(output_dir) / "state"


def save_state(output_dir: Path, model: torch.nn.Module, optimizer, schedule, generator: torch.Generator,
               progress: Progress, config: dict, keep_last: int) -> Path:
    root = state_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{progress.step:06d}"
    tmp = root / f".{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights = {n: p.detach().to("cpu") for n, p in model.named_parameters() if p.requires_grad}
    save_atomic(weights, tmp / "weights.safetensors")
    rng = {"generator": generator.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda{i}"] = s
    save_atomic(rng, tmp / "rng.safetensors")
    _save_torch(tmp / "optimizer.pt", optimizer.state_dict())
    _save_torch(tmp / "schedule.pt", schedule.state_dict())
    meta = {"version": STATE_VERSION, "progress": asdict(progress), "config": config}
    write_text_atomic(tmp / "trainer.json", json.dumps(meta, indent=2))
    final = root / name
    if final.exists():  # a state of the same step from an earlier attempt: replace it whole
        old = root / f".{name}.old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    write_text_atomic(root / "latest", name + "\n")
    prune(root, "step-", keep_last)
    return final


def _save_torch(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def prune(folder: Path, prefix: str, keep: int) -> None:
    """Delete all but the newest `keep` entries named prefix + zero-padded step."""
    entries = sorted(p for p in folder.iterdir() if p.name.startswith(prefix))
    for old in entries[:-keep] if keep else []:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def find_state(output_dir: Path, which: str) -> Path:
    """The state folder for `--resume latest` or `--resume PATH`."""
    if which != "latest":
        path = Path(which).expanduser()
        if (path / "trainer.json").is_file():
            return path
        raise ResumeError(f"--resume {which}: not a vramfit state folder (no trainer.json in it)")
    root = state_root(output_dir)
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "trainer.json").is_file():
            return candidate
    states = sorted(p for p in root.glob("step-*") if (p / "trainer.json").is_file()) if root.is_dir() else []
    if states:
        return states[-1]
    raise ResumeError(f"--resume latest: no saved state in {root}; start the run without --resume")


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "trainer.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResumeError(f"{path}: unreadable trainer.json ({exc})") from None
    if meta.get("version") != STATE_VERSION:
        raise ResumeError(f"{path}: state format {meta.get('version')} is not {STATE_VERSION}")
    return meta


def check_compatible(saved: dict, current: dict, path: Path) -> None:
    from vramfit.config.schema import RunConfig

    default = RunConfig().model_dump(mode="json")  # what a state saved before a key existed meant
    diffs = [f"{s}.{k}: saved {saved.get(s, {}).get(k, default[s][k])!r}, now {current[s][k]!r}"
             for s, k in _MUST_MATCH if saved.get(s, {}).get(k, default[s][k]) != current.get(s, {}).get(k)]
    if diffs:
        raise ResumeError(f"{path} was saved by a run with other settings; resuming would not continue "
                          "it. Use the same config (train.steps may grow) or start a new run:\n  "
                          + "\n  ".join(diffs))


def load_state(path: Path, model: torch.nn.Module, optimizer, schedule, generator: torch.Generator) -> Progress:
    meta = read_meta(path)
    weights = load_file(str(path / "weights.safetensors"))
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in weights]
    if missing or any(n not in params for n in weights):
        raise ResumeError(f"{path}: its weights do not match this model (missing {missing[:3]})")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    # vramfit's optimizers (optim/base.py) restore each state tensor's own dtype and device and
    # the rounding generators themselves
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
    schedule.load_state_dict(torch.load(path / "schedule.pt", weights_only=True))
    rng = load_file(str(path / "rng.safetensors"))
    generator.set_state(rng["generator"])
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available():
        states = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda"))]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    progress = Progress(**meta["progress"])
    progress.resumed_from = str(path)
    progress.resumes += 1
    return progress
