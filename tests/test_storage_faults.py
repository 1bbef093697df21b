"""Storage faults, reproduced for real: a full disk (a small tmpfs, or a file size limit where
mounting is not allowed), kills while old states are pruned, temporaries left by killed runs,
cache entries damaged during training, swapped or replaced by a folder, and malformed
safetensors headers."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main
from vramfit.data.synth import make_synthetic_dataset
from vramfit.formats.safetensors_io import clean_stale_temps
from vramfit.train.state import find_state, missing_parts, read_meta

MiB = 2**20
STATE_SETS = ("save.name=m", "save.keep_last=5", "save.state_every_steps=1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_root) -> dict:
    """One 2-step run with a state after each step: the cache, the images, the output folder."""
    root = tmp_path_factory.mktemp("storage")
    images = root / "images"
    make_synthetic_dataset(images, n=4, size=64, seed=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("XDG_CACHE_HOME", str(cache_root / "xdg"))
        assert main(train_args(images, root / "out", root / "cache", *STATE_SETS)) == 0
    return {"images": images, "cache": root / "cache", "out": root / "out"}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _temps(*folders: Path) -> list[Path]:
    return [p for f in folders if f.is_dir() for p in f.iterdir()
            if ".tmp-" in p.name or ".deleting-" in p.name]


# ---- a real full disk ---------------------------------------------------------------------------
def _mount(folder: Path, size: int, remount: bool = False) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    opts = f"remount,size={size}" if remount else f"size={size}"
    cmd = ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(folder)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


@contextmanager
def small_disk(folder: Path, size: int):
    """`folder` on a real tmpfs of `size` bytes (as root on Linux); yields False where mounting is
    not allowed, and the runs then go through `run_limited` instead."""
    mounted = sys.platform == "linux" and _mount(folder, size)
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=True)


def _limit_files(limit: int):
    def apply():  # in the child: writes past `limit` bytes fail with EFBIG instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def run_small(args: list[str], mounted: bool, folder: Path, size: int, file_limit: int,
              capsys) -> tuple[int, str]:
    """Run the CLI on the small disk: in process on the tmpfs (resized to `size`), or in a
    subprocess whose files may not grow past `file_limit` bytes."""
    if mounted:
        assert _mount(folder, size, remount=True)
        capsys.readouterr()
        code = main(args)
        return code, capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "vramfit", *args], capture_output=True, text=True,
                          preexec_fn=_limit_files(file_limit), env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc.returncode, proc.stderr


NO_ROOM = ("No space left on device", "File too large")


def test_full_disk_while_caching_is_a_clear_error_and_keeps_the_cache_consistent(trained, tmp_path, capsys):
    cache = tmp_path / "cache"
    _copy(trained["cache"] / "tiny", cache / "tiny")  # the model stays off the small disk
    entries = cache / "entries"
    args = train_args(trained["images"], tmp_path / "out", cache)
    args[0] = "cache"
    with small_disk(entries, 24 * 1024) as mounted:
        # the 4 latent entries (2.4 kB each) fit, a text entry (40 kB) does not
        code, err = run_small(args, mounted, entries, 24 * 1024, 24 * 1024, capsys)
        assert code == 2 and "Traceback" not in err, err
        assert f"cannot write the cache in {entries}" in err and any(r in err for r in NO_ROOM)
        assert "Entries written so far are kept" in err and "cache.dir" in err
        assert not [p for p in entries.rglob("*") if ".tmp-" in p.name]
        written = {kind: len(list((entries / kind).rglob("*.safetensors"))) for kind in ("latents", "text")}
        assert 0 < sum(written.values()) < 8
        if mounted:
            assert _mount(entries, MiB, remount=True)
        capsys.readouterr()
        assert main(args) == 0  # with room: what was written is reused, checksums and keys hold
        out = capsys.readouterr().out
    for kind, n in written.items():
        assert f"{kind}_cached {4 - n}, {kind}_reused {n}" in out


def test_full_disk_while_saving_stops_cleanly_and_keeps_the_last_state(trained, tmp_path, capsys):
    """The output folder fills at an intermediate checkpoint, then at a state, then at the final
    checkpoint: each run stops with exit code 2 naming what was kept; nothing partial remains."""
    out = tmp_path / "out"
    base = train_args(trained["images"], out, trained["cache"], *STATE_SETS)
    with small_disk(out, 20 * MiB) as mounted:
        # a state (16 MiB) fits, the checkpoint of step 2 (18 MiB) does not
        code, err = run_small(base + ["--set", "train.steps=3", "--set", "save.every_steps=2"],
                              mounted, out, 20 * MiB, 17 * MiB, capsys)
        assert code == 2 and "Traceback" not in err, err
        assert f"cannot write the checkpoint m-step000002 in {out}" in err and any(r in err for r in NO_ROOM)
        assert "step-000001 is kept" in err and "--resume latest" in err
        assert not (out / "m-step000002.safetensors").exists()
        assert not _temps(out, out / "state")
        assert find_state(out, "latest").name == "step-000001"
        # the state of step 2 does not fit beside that of step 1
        code, err = run_small(base + ["--set", "train.steps=3", "--resume", "latest"],
                              mounted, out, 20 * MiB, 1 * MiB, capsys)
        assert code == 2 and "Traceback" not in err, err
        assert f"cannot write the training state step-000002 in {out / 'state'}" in err
        assert "step-000001 is kept" in err
        assert not _temps(out, out / "state") and not (out / "state" / "step-000002").exists()
        state = find_state(out, "latest")
        assert state.name == "step-000001" and not missing_parts(state)
        load_file(str(state / "weights.safetensors"))
        # more room: the state of step 2 fits, the final checkpoint beside two states does not
        code, err = run_small(base + ["--set", "train.steps=2", "--resume", "latest"],
                              mounted, out, 36 * MiB, 17 * MiB, capsys)
        assert code == 2 and "Traceback" not in err, err
        assert f"cannot write the checkpoint m in {out}" in err and "step-000002 is kept" in err
        assert not (out / "m.safetensors").exists() and not _temps(out, out / "state")
        assert find_state(out, "latest").name == "step-000002"


# ---- prune, incomplete states, stale temporaries ------------------------------------------------
KILL_MID_PRUNE = """
import os, signal, sys
from pathlib import Path
import vramfit.formats.safetensors_io as io
from vramfit.train.state import prune

real = io._remove
def remove(path):
    if ".deleting-" in path.name and path.is_dir():
        for part in sorted(path.iterdir())[:2]:
            part.unlink()
        os.kill(os.getpid(), signal.SIGKILL)  # killed half way through deleting the old state
    real(path)
io._remove = remove
prune(Path(sys.argv[1]), "step-", 1)
"""


def test_a_kill_while_pruning_leaves_no_half_state_under_a_state_name(trained, tmp_path, caplog):
    root = _copy(trained["out"] / "state", tmp_path / "state")
    proc = subprocess.run([sys.executable, "-c", KILL_MID_PRUNE, str(root)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (half,) = root.glob(".step-000001.deleting-*")
    assert missing_parts(half)  # the half-deleted state is under a hidden name
    for state in root.glob("step-*"):
        assert not missing_parts(state), state
    assert find_state(tmp_path, "latest").name == "step-000002"
    with caplog.at_level("INFO"):
        clean_stale_temps([root])  # its writer is gone: the next start removes it, and says so
    assert not half.exists() and half.name in caplog.text


def test_incomplete_states_are_refused_or_passed_over_and_stale_temps_removed(trained, tmp_path, capsys,
                                                                              caplog, monkeypatch):
    import vramfit.run as run

    out = _copy(trained["out"], tmp_path / "out")
    (out / "state" / "step-000002" / "optimizer.pt").unlink()  # a save or a removal cut short
    args = train_args(trained["images"], out, trained["cache"], *STATE_SETS)
    capsys.readouterr()
    with monkeypatch.context() as mp:
        mp.setattr(run, "load_data", lambda *a, **k: pytest.fail("the model was loaded"))
        assert main(args + ["--resume", str(out / "state" / "step-000002")]) == 2
    err = capsys.readouterr().err
    assert "incomplete (optimizer.pt missing" in err and "Traceback" not in err
    # temporaries of a writer that is gone and of one that runs, in output.dir and state/
    dead, live = _dead_pid(), os.getppid()
    planted = {}
    for pid in (dead, live):
        planted[pid] = [out / f".m.safetensors.tmp-{pid}", out / f".config.toml.tmp-{pid}",
                        out / f".m-diffusers.old-{pid}", out / "state" / f".step-000009.tmp-{pid}",
                        out / "state" / f".step-000000.deleting-{pid}"]
        for p in planted[pid]:
            p.mkdir() if p.name.startswith(".step") or "diffusers" in p.name else p.write_bytes(b"x")
    (out / "m-diffusers").mkdir()  # the swapped-out copy above is an old one: removed
    only_copy = out / f".m-step000001-diffusers.old-{dead}"  # a kill mid-swap: the only copy, put back
    only_copy.mkdir()
    (only_copy / "part").write_bytes(b"x")
    with caplog.at_level("INFO"):
        assert main(args + ["--resume", "latest"]) == 0
    assert "skipping the incomplete training state" in caplog.text
    assert "resuming from step-000001" in caplog.text
    run = json.loads((out / "run.json").read_text())
    assert run["start_step"] == 1 and run["end_step"] == 2
    assert not any(p.exists() for p in planted[dead]) and all(p.exists() for p in planted[live])
    assert (out / "m-step000001-diffusers" / "part").is_file() and not only_copy.exists()
    assert "cleaned up 4 temporary file(s) left in" in caplog.text and planted[dead][0].name in caplog.text


def test_swapped_cache_entries_a_folder_in_place_of_one_and_stale_temps(trained, tmp_path, capsys, caplog):
    cache = _copy(trained["cache"], tmp_path / "cache")
    text = sorted((cache / "entries" / "text").rglob("*.safetensors"))
    a, b = text[0].read_bytes(), text[1].read_bytes()
    text[0].write_bytes(b)  # two valid entries, each under the other's key
    text[1].write_bytes(a)
    latent = sorted((cache / "entries" / "latents").rglob("*.safetensors"))[0]
    latent.unlink()
    latent.mkdir()
    (latent / "notes.txt").write_text("something a user kept here")
    dead, live = _dead_pid(), os.getppid()  # another running process
    stale = {pid: [latent.parent / f".{latent.name}.tmp-{pid}", text[2].parent / f".{text[2].name}.tmp-{pid}"]
             for pid in (dead, live)}
    for p in stale[dead] + stale[live]:
        p.write_bytes(b"partial")
        os.utime(p, (1e9, 1e9))  # long ago: the cache spares young temporaries of other machines' writers
    args = train_args(trained["images"], tmp_path / "out", cache)
    args[0] = "cache"
    capsys.readouterr()
    with caplog.at_level("INFO"):
        assert main(args) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert "latents_cached 1, latents_reused 3" in out.out and "text_cached 2, text_reused 2" in out.out
    assert f"{text[0]} is damaged (it holds the entry written for key {text[1].stem[:16]}" in caplog.text
    assert f"{latent} is a folder" in caplog.text and "not-a-cache-entry" in caplog.text
    assert latent.is_file() and (latent.parent / f"{latent.name}.not-a-cache-entry" / "notes.txt").is_file()
    assert not any(p.exists() for p in stale[dead]) and all(p.exists() for p in stale[live])


# ---- cache entries damaged while training -------------------------------------------------------
def _after_step_at(monkeypatch, step: int, action) -> None:
    """Run `action` right after optimizer step `step` (the loop's own hook point)."""
    import vramfit.train.loop as loop

    real = loop._after_step

    def after(hooks, progress, value, schedule, cfg):
        if progress.step == step:
            action()
        real(hooks, progress, value, schedule, cfg)

    monkeypatch.setattr(loop, "_after_step", after)


def test_a_cache_entry_damaged_while_training_skips_its_micro_batches(trained, tmp_path, monkeypatch, caplog):
    cache = _copy(trained["cache"], tmp_path / "cache")
    entries = sorted((cache / "entries" / "latents").rglob("*.safetensors"))[:3]

    def damage():
        for entry in entries:
            data = bytearray(entry.read_bytes())
            data[-3] ^= 0xFF  # same size, valid header: only the checksum tells
            entry.write_bytes(bytes(data))

    import vramfit.run as run

    place = run.place_denoiser

    def damaged_after_caching(*args, **kwargs):  # the cache stage found it whole; training reads it
        damage()
        return place(*args, **kwargs)

    monkeypatch.setattr(run, "place_denoiser", damaged_after_caching)
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):  # 2 micro-batches over 4 items, 3 damaged: one at least is met
        assert main(train_args(trained["images"], out, cache, "train.steps=2")) == 0
    run = json.loads((out / "run.json").read_text())
    met = [e for e in entries if f"cache entry {e} is damaged" in caplog.text]
    assert len(run["losses"]) == 2 and run["cache"]["micro_batches_skipped"] >= len(met) >= 1
    skips = [m for m in caplog.messages if m.startswith("skipping a micro-batch")]
    for entry in met:  # named where the skip is announced, and deleted, not trusted: the next run rebuilds it
        assert any(str(entry) in m for m in skips) and not entry.exists()


def test_a_damaged_entry_is_rebuilt_in_place_while_its_encoder_is_loaded(trained, tmp_path, monkeypatch, caplog):
    """With the text cache off the VAE stays loaded: a damaged latent entry is encoded again and
    written back, and the run uses every micro-batch."""
    import vramfit.run as run
    from vramfit.data.cache import DiskCache

    cache = _copy(trained["cache"], tmp_path / "cache")
    disk = DiskCache(cache / "entries")
    entries = sorted((cache / "entries" / "latents").rglob("*.safetensors"))
    whole = {e: {k: v.clone() for k, v in disk.get("latents", e.stem).items()} for e in entries}
    place = run.place_denoiser

    def damaged_after_caching(*args, **kwargs):
        for e in entries:
            e.write_bytes(e.read_bytes()[:100])  # truncated
        return place(*args, **kwargs)

    monkeypatch.setattr(run, "place_denoiser", damaged_after_caching)
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):
        assert main(train_args(trained["images"], out, cache, "train.steps=1", "cache.text=false")) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["cache"]["cache_entries_rebuilt"] == 1 and "micro_batches_skipped" not in run["cache"]
    assert "encoding it again" in caplog.text
    rebuilt = [e for e in entries if e.is_file() and e.stat().st_size > 100]
    assert len(rebuilt) == 1
    assert all(torch.equal(v, whole[rebuilt[0]][k]) for k, v in disk.get("latents", rebuilt[0].stem).items())


def test_a_cache_removed_while_training_stops_with_the_state_saved(trained, tmp_path, monkeypatch, capsys):
    cache = _copy(trained["cache"], tmp_path / "cache")
    _after_step_at(monkeypatch, 1, lambda: shutil.rmtree(cache / "entries" / "latents"))
    out = tmp_path / "out"
    args = train_args(trained["images"], out, cache, "train.steps=2", "train.grad_accum=2")
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "training cannot go on" in err and "--resume latest" in err and "Traceback" not in err
    state = find_state(out, "latest")
    progress = read_meta(state)["progress"]
    # stopped inside step 2 (its first micro-batch was made before the cache went): saved at step
    # 1, with neither that micro-batch nor the skipped ones counted as used
    assert "training state at step 1 is saved" in err
    assert (progress["step"], progress["micro_batches"], len(progress["losses"])) == (1, 2, 1)
    monkeypatch.undo()
    assert main(args + ["--resume", "latest"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["cache"]["latents_cached"] == 4 and len(run["losses"]) == 2


# ---- malformed safetensors headers --------------------------------------------------------------
def _with_header(path: Path, header: dict, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


GOOD = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
BAD_HEADERS = {
    "not an object": ({"a": 1}, "tensor 'a' is 1, not an object"),
    "no data_offsets": ({"w": {"dtype": "F32", "shape": [2]}}, "tensor 'w' has no data_offsets"),
    "offsets not two ints": ({"w": {**GOOD, "data_offsets": [0, "8"]}},
                             "tensor 'w': data_offsets [0, \"8\"]"),
    "shape not ints": ({"w": {**GOOD, "shape": [2.0]}}, "tensor 'w': shape [2.0] is not a list"),
    "unknown dtype": ({"w": {**GOOD, "dtype": "F31"}}, "tensor 'w' has the unknown dtype \"F31\""),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_malformed_headers_are_named_by_train_and_inspect(case, images, tmp_path, capsys):
    header, expected = BAD_HEADERS[case]
    bad = _with_header(tmp_path / "bad.safetensors", header, bytes(8))
    capsys.readouterr()
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and expected in err and "Traceback" not in err, err
    assert main(train_args(images, tmp_path / "out", tmp_path / "cache", model=str(bad))) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and expected in err and "Traceback" not in err, err


def test_a_well_formed_header_still_reads(tmp_path):
    from vramfit.formats.safetensors_io import read_header

    path = _with_header(tmp_path / "ok.safetensors", {"w": GOOD, "__metadata__": {"k": "v"}},
                        torch.ones(2).numpy().tobytes())
    assert read_header(path) == ({"w": GOOD}, {"k": "v"})
    assert torch.equal(load_file(str(path))["w"], torch.ones(2))
