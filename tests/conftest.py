"""Shared fixtures: a per-session cache root (tiny models are written once), small datasets."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel

from vramfit.data.synth import make_synthetic_dataset

# Under pytest-xdist every worker is a process; with torch's default of one thread per core, two
# workers on two cores oversubscribe and OpenMP's spin-waits slow the tiny models many times over.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the subprocesses some tests start

SIZE = 64  # image side for training tests: 8x8 latents keep each step in milliseconds


def pytest_collection_modifyitems(config, items):
    """Every test that needs a GPU carries @pytest.mark.gpu: skipped here, in one place, without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vramfit-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(cache_root, monkeypatch):
    # Nothing a test does may read or write the user's ~/.cache/vramfit or the hub.
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_root / "xdg"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(cache_root / "hf"))


@pytest.fixture
def images(tmp_path) -> Path:
    root = tmp_path / "images"
    make_synthetic_dataset(root, n=4, size=SIZE, seed=1)
    return root


def train_args(images: Path, out: Path, cache: Path, *extra: str, model: str = "tiny:ssd1b") -> list[str]:
    """CLI arguments of a small, fast training run."""
    sets = [f"model.path={model}", f"data.path={images}", f"data.resolution={SIZE}", f"data.min_size={SIZE}",
            "data.bucket_step=32", f"cache.dir={cache}", "train.steps=2", "train.lr=1e-3",
            f"output.dir={out}", "logging.tensorboard=false", *extra]
    args = ["train", "--no-progress"]
    for s in sets:
        args += ["--set", s]
    return args


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder on a read-only tmpfs mount: writes fail there even for root."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a read-only tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def transformer_skip_layers(monkeypatch) -> list:
    """The `skip_layers` argument of every SD3 transformer call a test makes, in order (None where
    the call skips none): what skip-layer guidance did."""
    seen: list = []
    forward = SD3Transformer2DModel.forward

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("skip_layers"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(SD3Transformer2DModel, "forward", spy)
    return seen
