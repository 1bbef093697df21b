"""Losing nothing: exact resume, interruption, kills mid-save, NaN, damaged or full caches."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main
from vramfit.train.state import find_state, read_meta

RESUME_SETS = ("train.steps=6", "train.batch_size=2", "train.grad_accum=2", "train.lr_scheduler=cosine",
               "train.warmup_steps=2", "save.state_every_steps=2", "save.name=m", "save.keep_last=5",
               "save.dtype=fp32", "train.precision=fp32")


def _run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def test_resume_gives_the_same_run_after_any_number_of_resumes(images, tmp_path, cache_root):
    cache = cache_root / "r1"
    full = tmp_path / "full"
    assert main(train_args(images, full, cache, *RESUME_SETS)) == 0
    ref = _run_json(full)
    # 12 micro-batches over 4 images in several aspect buckets: the run crosses epoch boundaries
    assert len(ref["losses"]) == 6 and ref["epoch"] >= 2
    # first resume: from the state at step 2 of the full run, into another folder
    part = tmp_path / "part"
    assert main(train_args(images, part, cache, *RESUME_SETS) + ["--resume", str(full / "state/step-000002")]) == 0
    first = _run_json(part)
    # run.json holds the whole run's losses: those before the resume come from the training state
    assert first["start_step"] == 2 and first["losses"] == ref["losses"]
    # second resume: from the resumed run's own state at step 4
    assert main(train_args(images, part, cache, *RESUME_SETS) + ["--resume", str(part / "state/step-000004")]) == 0
    second = _run_json(part)
    assert second["start_step"] == 4 and second["losses"] == ref["losses"]
    for key in ("end_step", "epoch", "micro_batches"):
        assert second[key] == ref[key], key
    assert second["resumes"] == 2
    a, b = load_file(str(full / "m.safetensors")), load_file(str(part / "m.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_latest_and_extending_a_finished_run(images, tmp_path, cache_root):
    out = tmp_path / "run"
    sets = [s for s in RESUME_SETS if not s.startswith("train.steps")]
    assert main(train_args(images, out, cache_root / "r2", *sets, "train.steps=4")) == 0
    assert (out / "state" / "latest").read_text().strip() == "step-000004"
    first = _run_json(out)["losses"]
    assert main(train_args(images, out, cache_root / "r2", *sets, "train.steps=6") + ["--resume", "latest"]) == 0
    run = _run_json(out)
    assert (run["start_step"], run["end_step"], len(run["losses"])) == (4, 6, 6)
    assert run["losses"][:4] == first


def test_resume_with_other_settings_is_refused_before_loading(images, tmp_path, cache_root, capsys):
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "r3", *RESUME_SETS)) == 0
    capsys.readouterr()
    args = train_args(images, out, cache_root / "r3", *RESUME_SETS, "train.batch_size=1") + ["--resume", "latest"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "train.batch_size: saved 2, now 1" in err
    assert main(train_args(images, tmp_path / "empty", cache_root / "r3") + ["--resume", "latest"]) == 2
    assert "no saved state" in capsys.readouterr().err


def test_only_the_newest_states_and_checkpoints_are_kept(images, tmp_path, cache_root):
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "r4", "train.steps=7", "save.every_steps=1",
                           "save.keep_last=2", "save.name=m")) == 0
    assert sorted(p.name for p in (out / "state").glob("step-*")) == ["step-000006", "step-000007"]
    assert sorted(p.name for p in out.glob("m-step*.safetensors")) == ["m-step000005.safetensors",
                                                                      "m-step000006.safetensors"]


def _spawn(args: list[str], tmp_path: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "vramfit", *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_state_at_a_step_boundary_and_resume_finishes(images, tmp_path, cache_root, sig, code):
    out = tmp_path / "run"
    args = train_args(images, out, cache_root / "r5", "train.steps=400", "save.state_every_steps=1",
                      "save.name=m")
    proc = _spawn(args, tmp_path)
    deadline = time.time() + 120
    while not (out / "state" / "latest").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "timeout"
        time.sleep(0.05)
    proc.send_signal(sig)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == code, output
    assert "training state is saved" in output and "Traceback" not in output
    run = _run_json(out)
    assert run["interrupted"] == sig.name and 1 <= run["end_step"] < 400
    assert not (out / "m.safetensors").exists()  # an unfinished run writes no final checkpoint
    state = find_state(out, "latest")
    assert read_meta(state)["progress"]["step"] == run["end_step"]
    done = train_args(images, out, cache_root / "r5", f"train.steps={run['end_step'] + 2}",
                      "save.state_every_steps=1", "save.name=m")
    assert main(done + ["--resume", "latest"]) == 0
    assert _run_json(out)["start_step"] == run["end_step"] and (out / "m.safetensors").is_file()


def _tmp_files(out: Path) -> list[Path]:
    found = []
    for folder in (out, out / "state"):
        if folder.is_dir():
            found += [p for p in folder.iterdir() if ".tmp" in p.name]
    return found


def test_sigkill_during_a_save_leaves_the_previous_files_loadable(images, tmp_path, cache_root):
    """Kill a real training process while it is writing a checkpoint or state."""
    out = tmp_path / "run"
    args = train_args(images, out, cache_root / "r6", "train.steps=400", "save.every_steps=1",
                      "save.formats=['single_file','diffusers']", "save.name=m", "save.keep_last=2")
    killed_mid_save = False
    for _attempt in range(3):
        proc = _spawn(args, tmp_path)
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            if (out / "state" / "latest").exists() and _tmp_files(out):
                proc.send_signal(signal.SIGKILL)
                killed_mid_save = True
                break
        proc.wait(timeout=60)
        if killed_mid_save:
            break
    assert killed_mid_save, "never caught the process inside a save"
    for ckpt in out.glob("*.safetensors"):  # every file under its final name is whole
        with safe_open(str(ckpt), "pt") as fh:
            assert fh.keys()
    state = find_state(out, "latest")
    for part in ("weights.safetensors", "rng.safetensors"):
        load_file(str(state / part))
    resumed = train_args(images, out, cache_root / "r6", f"train.steps={read_meta(state)['progress']['step'] + 1}",
                         "save.every_steps=1", "save.formats=['single_file','diffusers']", "save.name=m",
                         "save.keep_last=2")
    assert main(resumed + ["--resume", "latest"]) == 0


def _poison_one_latent(images: Path, tmp_path: Path, cache: Path) -> str:
    """Cache the dataset, then replace one item's latent entry by NaNs (a VAE overflow, say)."""
    from vramfit.data.cache import DiskCache

    args = train_args(images, tmp_path / "c", cache)
    args[0] = "cache"
    assert main(args) == 0
    disk = DiskCache(cache / "entries")
    entries = sorted((cache / "entries" / "latents").rglob("*.safetensors"))
    key = entries[0].stem
    with safe_open(str(entries[0]), "pt") as fh:
        item = fh.metadata()["vramfit.item"]
    entry = disk.get("latents", key)
    entry["mean"] = torch.full_like(entry["mean"], float("nan"))
    disk.put("latents", key, entry, {"vramfit.item": item})
    return item


def test_nonfinite_loss_is_skipped_and_never_saved(images, tmp_path, cache_root):
    cache = tmp_path / "cache"
    _poison_one_latent(images, tmp_path, cache)
    out = tmp_path / "run"
    assert main(train_args(images, out, cache, "train.steps=8", "save.name=m")) == 0
    run = _run_json(out)
    assert run["nonfinite_steps_skipped"] >= 1
    sd = load_file(str(out / "m.safetensors"))
    assert all(torch.isfinite(t).all() for t in sd.values() if t.is_floating_point())


def test_nonfinite_stop_names_the_step_and_files(images, tmp_path, capsys):
    cache = tmp_path / "cache"
    item = _poison_one_latent(images, tmp_path, cache)
    capsys.readouterr()
    assert main(train_args(images, tmp_path / "run", cache, "train.steps=8", "train.nonfinite=stop")) == 2
    err = capsys.readouterr().err
    assert "step " in err and item in err and "not finite" in err


def test_damaged_cache_entries_are_detected_by_checksum_and_rebuilt(images, tmp_path, capsys):
    cache = tmp_path / "cache"
    args = train_args(images, tmp_path / "c", cache)
    args[0] = "cache"
    assert main(args) == 0
    entry = sorted((cache / "entries" / "text").rglob("*.safetensors"))[0]
    data = bytearray(entry.read_bytes())
    data[-3] ^= 0xFF  # flip bits inside a tensor: same size, valid header
    entry.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(args) == 0
    assert "text_cached 1, text_reused 3" in capsys.readouterr().out


def test_two_runs_sharing_a_cache_do_not_corrupt_it(images, tmp_path, capsys):
    cache = tmp_path / "shared"
    procs = []
    for name in ("a", "b"):
        args = train_args(images, tmp_path / name, cache)
        args[0] = "cache"
        procs.append(_spawn(args, tmp_path))
    for p in procs:
        out = p.communicate(timeout=180)[0]
        assert p.returncode == 0, out
    args = train_args(images, tmp_path / "c", cache)
    args[0] = "cache"
    assert main(args) == 0
    assert "latents_cached 0, latents_reused 4" in capsys.readouterr().out


def test_pickle_checkpoints_need_explicit_permission(images, tmp_path, cache_root, capsys):
    from vramfit.config.schema import ModelConfig
    from vramfit.models.sources import resolve_source

    source = resolve_source(ModelConfig(path="tiny:sdxl"), cache_root / "p")
    ckpt = tmp_path / "model.ckpt"
    torch.save({"state_dict": load_file(str(source.path)), "global_step": 10}, ckpt)
    tok = f"model.tokenizers={source.tokenizers}"
    assert main(train_args(images, tmp_path / "a", cache_root / "p", tok, model=str(ckpt))) == 2
    assert "model.allow_pickle" in capsys.readouterr().err
    assert main(train_args(images, tmp_path / "b", cache_root / "p", tok, "model.allow_pickle=true",
                           model=str(ckpt))) == 0


def test_long_captions_are_truncated_with_a_warning(images, tmp_path, cache_root, caplog):
    long = sorted(images.glob("*.txt"))[0]
    long.write_text(" ".join(["word"] * 120))
    with caplog.at_level("WARNING"):
        assert main(train_args(images, tmp_path / "run", cache_root / "t")) == 0
    assert f"caption of {long.with_suffix('.png').name}" in caplog.text and "keeps the first 77" in caplog.text


def test_every_kind_of_odd_image_trains_or_is_named(tmp_path, cache_root, caplog):
    """One dataset holding each odd or bad input, trained through the CLI."""
    import numpy as np
    from PIL import Image

    root = tmp_path / "odd"
    root.mkdir()
    rgb = Image.new("RGB", (80, 64), (200, 30, 30))

    def put(name: str, image=None, caption: "str | bytes | None" = "a picture", raw: bytes = None):
        path = root / name
        if raw is not None:
            path.write_bytes(raw)
        else:
            image.save(path)
        if caption is not None:
            cap = path.with_suffix(".txt")
            cap.write_bytes(caption) if isinstance(caption, bytes) else cap.write_text(caption)

    put("cmyk.jpg", rgb.convert("CMYK"))
    put("rgba.png", Image.new("RGBA", (64, 80), (0, 0, 255, 100)))
    put("palette.png", rgb.convert("P"))
    put("gray.png", rgb.convert("L"))
    put("deep.png", Image.fromarray(np.full((64, 64), 40000, dtype=np.uint16)))
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = root / "rotated.jpg"
    Image.new("RGB", (96, 64), (10, 200, 10)).save(rotated, exif=exif)
    rotated.with_suffix(".txt").write_text("a rotated picture")
    good = (root / "cmyk.jpg").read_bytes()
    put("truncated.jpg", raw=good[: len(good) // 2])
    put("zero.png", raw=b"")
    put("text.png", raw=b"just some words")
    put("tiny.png", Image.new("RGB", (16, 16)))
    put("latin1.png", rgb, caption="caf\xe9".encode("latin-1"))
    put("empty.png", rgb.rotate(90, expand=True), caption="   ")
    put("bomb.png", Image.new("RGB", (4000, 4000)))
    out = tmp_path / "run"
    with caplog.at_level("WARNING"):
        code = main(train_args(root, out, cache_root / "odd", "data.max_pixels=1000000"))
    assert code == 0
    run = _run_json(out)
    skipped = {s["path"]: s["reason"] for s in run["skipped"]}
    assert set(skipped) == {"truncated.jpg", "zero.png", "text.png", "tiny.png", "latin1.png", "empty.png",
                            "bomb.png"}
    assert "over the limit" in skipped["bomb.png"]
    assert run["items"] == 6  # cmyk, rgba, palette, gray, 16-bit and the EXIF-rotated one
    for name in skipped:
        assert name in caplog.text


def test_resume_refuses_other_base_storage_and_reads_old_states(tmp_path):
    """A state from an int8-base run does not continue with a bf16 base; a state written before
    a setting existed counts as that setting's default."""
    from vramfit.config.schema import RunConfig
    from vramfit.train.state import ResumeError, check_compatible

    lora = {"train": {"mode": "lora"}}
    saved = RunConfig.model_validate({**lora, "lora": {"base_quantization": "int8"}}).model_dump(mode="json")
    now = RunConfig.model_validate(lora).model_dump(mode="json")
    with pytest.raises(ResumeError, match="lora.base_quantization: saved 'int8', now 'none'"):
        check_compatible(saved, now, tmp_path)
    old = RunConfig.model_validate(lora).model_dump(mode="json")
    del old["lora"]["base_quantization"], old["prior"]
    check_compatible(old, now, tmp_path)
