"""Resumable training state: save, find, check and load it, keeping the newest N.

A state is a folder `output/state/step-NNNNNN/` holding the trainable weights (safetensors, in
the training precision), the optimizer and schedule (torch.save, read back with
weights_only=True), the random generators, the step, epoch and data position counters and the
config it was made with, the losses of the steps so far, and with [ema] the EMA of the trained
weights with its rounding generator (ema.safetensors). It is written to a temporary folder,
every file fsynced, then renamed into place, and only then does `output/state/latest` name it: a
crash or a full disk at any point leaves the previous state whole and `latest` pointing at it. Old
states are renamed away before they are deleted, and a state missing any of its files is never
resumed from.
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from vramfit.config.schema import RunConfig
from vramfit.formats.safetensors_io import (atomic_file, commit_folder, discard, save_atomic, temp_path,
                                            write_text_atomic, writing)

log = logging.getLogger("vramfit")

STATE_VERSION = 1
EMA_FILE = "ema.safetensors"  # with ema.enabled only
STATE_FILES = ("weights.safetensors", "optimizer.pt", "schedule.pt", "rng.safetensors", "trainer.json")
# Settings that must match for a resumed run to continue the same run. Steps may grow.
_MUST_MATCH = [("model", "path"), ("data", "resolution"), ("data", "bucket_step"), ("data", "random_crop"),
               ("data", "datasets"), ("data", "kohya"), ("validation", "seed"), ("validation", "timesteps"),
               ("train", "batch_size"), ("train", "grad_accum"), ("train", "optimizer"),
               ("train", "precision"), ("train", "seed"), ("train", "lr_scheduler"),
               ("train", "optimizer_class"), ("train", "lr_cycles"), ("train", "lr_power"),
               ("train", "text_encoders"), ("lora", "base_quantization"), ("lora", "targets"),
               ("lora", "text_encoder_rank"), ("prior", "class_prompt")]


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
    losses: list[float] = field(default_factory=list)  # of every step so far, resumed runs' included
    validation: list[list[float]] = field(default_factory=list)  # [step, validation loss] of each evaluation


def state_root(output_dir: Path) -> Path:
    return Path(output_dir) / "state"


def save_state(output_dir: Path, model: torch.nn.Module, optimizer, schedule, generator: torch.Generator,
               progress: Progress, config: dict, keep_last: int, ema: Optional[dict] = None) -> Path:
    """Write the state of `progress.step`; a full disk raises OutputWriteError saying what is kept.
    `ema`: the EMA's tensors (memory/ema.py state_dict), written as EMA_FILE."""
    root = state_root(output_dir)
    name = f"step-{progress.step:06d}"
    with writing(f"the training state {name}", root, lambda: kept_note(output_dir)):
        root.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(root / name)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            weights = {n: p.detach().to("cpu") for n, p in model.named_parameters() if p.requires_grad}
            save_atomic(weights, tmp / "weights.safetensors")
            rng = {"generator": generator.get_state(), "torch": torch.get_rng_state()}
            if torch.cuda.is_available():
                for i, s in enumerate(torch.cuda.get_rng_state_all()):
                    rng[f"cuda{i}"] = s
            save_atomic(rng, tmp / "rng.safetensors")
            if ema is not None:
                save_atomic(ema, tmp / EMA_FILE)
            _save_torch(tmp / "optimizer.pt", optimizer.state_dict())
            _save_torch(tmp / "schedule.pt", schedule.state_dict())
            meta = {"version": STATE_VERSION, "progress": asdict(progress), "config": config}
            write_text_atomic(tmp / "trainer.json", json.dumps(meta, indent=2))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = root / name
        commit_folder(tmp, final)  # a state of the same step from an earlier attempt is replaced whole
        write_text_atomic(root / "latest", name + "\n")
    prune(root, "step-", keep_last, newest=name)
    return final


class _KeepError:
    """A file wrapper that keeps the OSError of a failed write: torch.save reports a full disk as
    a RuntimeError about zip positions."""

    def __init__(self, fh):
        self.fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def _save_torch(path: Path, obj) -> None:
    with atomic_file(path) as fh:
        out = _KeepError(fh)
        try:
            torch.save(obj, out)
        except RuntimeError:
            if out.error is not None:
                raise out.error from None
            raise


def prune(folder: Path, prefix: str, keep: int, newest: Optional[str] = None) -> None:
    """Delete all but the newest `keep` entries named prefix + zero-padded step (each renamed away
    first, so a kill mid-delete leaves no half state under a state's name). With `newest` (the
    entry just written), entries named after it are left alone: they are an earlier run's (a new
    run in the same output.dir, or a resume from an older state), and pruning by name would
    delete the one just written in their favour."""
    entries = sorted(p for p in folder.iterdir() if p.name.startswith(prefix)
                     and (newest is None or p.name <= newest))
    for old in entries[:-keep] if keep else []:
        discard(old)


def missing_parts(path: Path) -> list[str]:
    """The files a state folder lacks (a save or a removal cut short); empty when it is complete."""
    return [f for f in STATE_FILES if not (Path(path) / f).is_file()]


def kept_note(output_dir: Path) -> str:
    """After a failed save: what a run can continue from, and what to do."""
    try:
        state = find_state(output_dir, "latest")
    except ResumeError:
        return ("No training state was saved before; free space (or set output.dir to another disk) and "
                "run again")
    return (f"The training state {state.name} is kept (state/latest names it); free space, then continue "
            "from it with --resume latest")


_warned: set[str] = set()  # incomplete states already named, so a second look says nothing new


def find_state(output_dir: Path, which: str) -> Path:
    """The state folder for `--resume latest` or `--resume PATH`; an incomplete one is refused, and
    `latest` passes over it (with a warning) to the newest complete one."""
    if which != "latest":
        path = Path(which).expanduser()
        if not path.exists():
            raise ResumeError(f"--resume {which}: {path} does not exist; give `latest` (the newest state "
                              "in output.dir/state) or the path of a state folder "
                              "(output.dir/state/step-NNNNNN)")
        missing = missing_parts(path)
        if len(missing) == len(STATE_FILES):
            raise ResumeError(f"--resume {which}: not a vramfit state folder (no trainer.json in it)")
        if missing:
            raise ResumeError(f"--resume {which}: the state is incomplete ({', '.join(missing)} missing: a "
                              "save or a removal was cut short); resume from another state or start without "
                              "--resume")
        return path
    root = state_root(output_dir)
    pointer = root / "latest"
    states = sorted(p for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []
    named = pointer.read_text(errors="replace").strip() if pointer.is_file() else ""
    if named.startswith("step-") and (root / named).is_dir() and not missing_parts(root / named):
        return root / named
    complete = [p for p in states if not missing_parts(p)]
    chosen = complete[-1] if complete else None
    for p in states:  # the incomplete ones newer than what is taken: say why they are passed over
        if (chosen is None or p.name > chosen.name) and str(p) not in _warned:
            _warned.add(str(p))
            log.warning("skipping the incomplete training state %s (%s missing: a save or a removal was cut "
                        "short)%s", p, ", ".join(missing_parts(p)),
                        f"; resuming from {chosen.name}" if chosen is not None else "")
    if chosen is not None:
        return chosen
    raise ResumeError(f"--resume latest: no saved state in {root}{' that is complete' if states else ''}; "
                      "start the run without --resume")


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "trainer.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResumeError(f"{path}: unreadable trainer.json ({exc})") from None
    if meta.get("version") != STATE_VERSION:
        raise ResumeError(f"{path}: state format {meta.get('version')} is not {STATE_VERSION}")
    return meta


def check_compatible(saved: dict, current: dict, path: Path) -> None:
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
    bases = list(schedule.base_lrs)  # this run's train.lr (and train.text_encoder_lr)
    schedule.load_state_dict(torch.load(path / "schedule.pt", weights_only=True))
    # the next step's rate by this run's schedule and learning rates: one resumed with more
    # train.steps has another curve than the saved run's, whose last rate the optimizer's state holds
    schedule.base_lrs = bases
    for group, base, rate in zip(optimizer.param_groups, bases, schedule.lr_lambdas):
        group["initial_lr"], group["lr"] = base, base * rate(schedule.last_epoch)
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


def load_ema(path: Path) -> Optional[dict]:
    """The EMA's tensors of the state folder `path`; None where it holds none (saved without [ema])."""
    file = Path(path) / EMA_FILE
    if not file.is_file():
        return None
    try:
        return load_file(str(file))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own errors for a torn or foreign file
        raise ResumeError(f"{file}: unreadable ({exc}); resume from another state, or remove the file to "
                          "start the EMA anew at the resumed weights") from None
