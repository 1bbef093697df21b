"""Stopping a command: real SIGINT and SIGTERM sent to `python -m vramfit` in each phase, start-up
time and what a command prints besides its own messages, and the CPU thread setting."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main
from vramfit.data.synth import make_synthetic_dataset
from vramfit.train import setup
from vramfit.train.state import find_state, read_meta

# What the libraries print about optional kernels and deprecations; a vramfit command prints none.
LIBRARY_NOISE = ("Failed to load", "Detected no triton", "is an Enum subclass", "FutureWarning",
                 "DeprecationWarning")


class Command:
    """`python -m vramfit ARGS` in a real process, its stdout and stderr read line by line as they come."""

    def __init__(self, args: list[str], cwd: Path):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "vramfit", *args], env=env, cwd=cwd, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=lambda pipe=pipe, into=into: into.extend(pipe), daemon=True)
                        for pipe, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def wait_for(self, ready: Callable[[], bool], what: str, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while not ready():
            assert self.proc.poll() is None, f"ended before {what}:\n{self.stderr}"
            assert time.time() < deadline, f"no {what} after {timeout} s:\n{self.stderr}"
            time.sleep(0.01)

    def logged(self, text: str) -> Callable[[], bool]:
        return lambda: any(text in line for line in list(self.err))

    def finish(self, timeout: float = 180) -> int:
        code = self.proc.wait(timeout=timeout)
        for reader in self.readers:
            reader.join(timeout=10)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def _run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def _temporaries(*folders: Path) -> list[str]:
    return [p.name for folder in folders if folder.is_dir() for p in folder.rglob("*") if ".tmp" in p.name]


def _entries(cache: Path, kind: str) -> list[Path]:
    return list((cache / "entries" / kind).rglob("*.safetensors"))


PHASES = ["loading", "caching", "second_sigint_in_training", "final_save"]


@pytest.mark.parametrize("phase", PHASES)
def test_a_stop_signal_in_any_phase_ends_the_command_cleanly_and_keeps_its_work(phase, images, tmp_path,
                                                                               cache_root, capsys):
    """A real signal in each phase: exit code 130 (SIGINT) or 143 (SIGTERM), no traceback, a message
    naming the phase and what was kept, no temporary files; what was kept is whole, and the next run
    reuses it (the cache entries a stopped cache stage wrote)."""
    out, cache = tmp_path / "run", cache_root / f"signals-{phase}"
    sets = ["save.name=m"]
    if phase == "caching":  # enough images at a larger size that caching lasts a while
        images = tmp_path / "many"
        make_synthetic_dataset(images, n=24, size=96, seed=3)
        sets += ["data.resolution=96", "data.min_size=96"]
    if phase == "second_sigint_in_training":  # steps long enough for two signals within one
        sets += ["train.steps=400", "train.grad_accum=2", "save.state_every_steps=2"]
    if phase == "final_save":  # a longer save (two formats); progress bars on, to see log lines beside them
        sets += ["save.formats=['single_file','diffusers']"]
    args = train_args(images, out, cache, *sets)
    cmd = Command([a for a in args if a != "--no-progress"] if phase == "final_save" else args, tmp_path)
    sig = signal.SIGTERM if phase == "final_save" else signal.SIGINT
    if phase == "loading":
        cmd.wait_for(cmd.logged("train.cuda_graphs"), "start of the run")  # logged just before scan and load
        cmd.proc.send_signal(sig)
    elif phase == "caching":
        cmd.wait_for(lambda: len(_entries(cache, "latents")) >= 1, "latent cache entry")
        cmd.proc.send_signal(sig)
    elif phase == "second_sigint_in_training":
        cmd.wait_for(lambda: (out / "state" / "latest").exists(), "saved training state")
        cmd.proc.send_signal(sig)
        cmd.wait_for(cmd.logged("SIGINT received"), "the first signal's warning")
        cmd.proc.send_signal(sig)
    else:
        cmd.wait_for(cmd.logged("trained 2 steps"), "end of training")  # logged as the final save begins
        cmd.proc.send_signal(sig)
    code = cmd.finish()
    err = cmd.stderr
    assert code == (143 if sig == signal.SIGTERM else 130), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not [n for n in LIBRARY_NOISE if n in err], err
    assert not _temporaries(out, cache), err
    stopped = err[err.index(f"stopped by {sig.name} "):]

    if phase == "loading":
        assert re.match(r"stopped by SIGINT (while scanning the dataset|while loading the model|"
                        r"before training began|while preparing the cache)", stopped), stopped
        assert not _entries(cache, "latents") and not (out / "state").exists()  # the next run starts afresh
    elif phase == "caching":
        found = re.match(r"stopped by SIGINT while caching latents: (\d+) of (\d+) entries cached and kept",
                         stopped)
        assert found, stopped
        done, todo = int(found.group(1)), int(found.group(2))
        assert 1 <= done < todo == 24 and len(_entries(cache, "latents")) >= done
        capsys.readouterr()
        assert main(["cache", *args[2:]]) == 0  # the same settings, cache only: the rest is cached now
        stats = dict(re.findall(r"(\w+) (\d+)", capsys.readouterr().out.split("cache: ")[1].splitlines()[0]))
        reused, cached = int(stats["latents_reused"]), int(stats["latents_cached"])
        assert reused >= done and reused + cached == 24 and len(_entries(cache, "latents")) == 24
    elif phase == "second_sigint_in_training":
        state = find_state(out, "latest")
        assert stopped.startswith("stopped by SIGINT a second time"), stopped
        # at once, inside the step (the usual case), or in the save that ended the step
        assert (f"the last saved training state, {state.name}" in stopped
                or "files from before it are kept" in stopped), stopped
        # the state it names is whole (resuming from one is tested in test_reliability.py)
        assert read_meta(state)["progress"]["step"] >= 2 and load_file(str(state / "weights.safetensors"))
    else:  # the save was finished first: whole files, the run's records, a state to extend the run from
        assert stopped.startswith("stopped by SIGTERM while saving the checkpoint, the training state and "
                                  "the run's records: that was finished first"), stopped
        with safe_open(str(out / "m.safetensors"), "pt") as fh:
            assert fh.keys()
        assert (out / "m-diffusers" / "unet").is_dir()
        assert _run_json(out)["end_step"] == 2
        assert read_meta(find_state(out, "latest"))["progress"]["step"] == 2
        # log lines stand on lines of their own, not inside a progress bar's
        logs = [line for line in err.splitlines() if "vramfit:" in line]
        assert logs and all(line.startswith(("INFO", "WARNING")) for line in logs), err


def test_a_bad_config_fails_fast_without_importing_torch(tmp_path):
    """The error comes before any heavy import (torch and diffusers take seconds to import)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nstesp = 3\n")
    code = ("import sys; from vramfit.cli import main; code = main(sys.argv[1:]); "
            "print('torch imported:', 'torch' in sys.modules); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code, "train", str(bad)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "train.stesp: unknown key; did you mean train.steps?" in done.stderr, done.stderr
    assert "torch imported: False" in done.stdout, done.stdout


def test_cpu_threads_reach_torch_and_auto_follows_omp_num_threads(images, tmp_path, cache_root, monkeypatch):
    seen = []

    def scan(cfg):  # the setting is applied before the dataset is scanned; stop the run there
        seen.append(torch.get_num_threads())
        raise ValueError("stopped here by the test")

    before = torch.get_num_threads()
    monkeypatch.setattr(setup, "scan_datasets", scan)
    args = train_args(images, tmp_path / "run", cache_root / "threads", "train.device=cpu",
                      "train.cpu_threads=3")
    assert main(["cache", *args[2:]]) == 2
    assert seen == [3] and torch.get_num_threads() == before  # the command gives the caller's back
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert setup.cpu_threads("auto") == 2 and setup.cpu_threads(5) == 5
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert 1 <= setup.cpu_threads("auto") <= 4


def test_a_stop_landing_where_python_ignores_exceptions_is_delivered_again():
    """A signal that arrives inside the import machinery's module-lock callback (where an exception
    is printed as "Exception ignored" and dropped, as a SIGINT during loading once was) is not
    raised there: the same signal comes again a moment later, where it stops the command."""
    from vramfit import cli

    scope: dict = {}
    exec(compile("import sys\ndef cb():\n    return sys._getframe()\n", "<frozen importlib._bootstrap>", "exec"),
         scope)
    inside_callback = scope["cb"]()
    received = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.set())
    try:
        try:
            cli._raise_stop(signal.SIGUSR1, inside_callback)  # no KeyboardInterrupt here...
        except KeyboardInterrupt:
            pytest.fail("the stop was raised inside the callback, where Python would drop it")
        deadline = time.time() + 5
        while not received.is_set() and time.time() < deadline:
            time.sleep(0.01)
        assert received.is_set()  # ...but the signal again, a moment later
    finally:
        signal.signal(signal.SIGUSR1, previous)
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):  # anywhere else: raised at once
        cli._raise_stop(signal.SIGINT, sys._getframe())
