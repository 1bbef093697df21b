"""LoRA training through the CLI for both families: what trains, what is saved, resume."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main

LORA = ("train.mode=lora", "lora.rank=4", "train.lr=1e-2", "save.name=m")


def _keys(path) -> list[str]:
    with safe_open(str(path), "pt") as fh:
        return list(fh.keys())


def test_lora_changes_only_the_adapter(images, tmp_path, cache_root):
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "l2", *LORA, "save.state_every_steps=1",
                           "train.steps=2", model="tiny:sdxl")) == 0
    first = load_file(str(out / "state" / "step-000001" / "weights.safetensors"))
    last = load_file(str(out / "state" / "step-000002" / "weights.safetensors"))
    ups = [k for k in first if "lora_B" in k]
    assert any(not torch.equal(first[k], last[k]) for k in ups)
    assert all(v.dtype == torch.float32 for v in last.values())  # fp32 LoRA over a bf16 base


def test_sd3_lora_and_resume(images, tmp_path, cache_root):
    sets = (*LORA, "train.steps=4", "save.state_every_steps=2", "train.precision=fp32")
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(train_args(images, full, cache_root / "l3", *sets, model="tiny:sd3")) == 0
    keys = _keys(full / "m.safetensors")
    assert keys and all(k.startswith("transformer.") for k in keys)
    assert {"to_q", "to_k", "to_v", "to_out"} <= {k.split(".attn.")[1].split(".")[0] for k in keys}
    args = train_args(images, part, cache_root / "l3", *sets, model="tiny:sd3")
    assert main(args + ["--resume", str(full / "state" / "step-000002")]) == 0
    ref = json.loads((full / "run.json").read_text())["losses"]
    assert json.loads((part / "run.json").read_text())["losses"] == ref
    a, b = load_file(str(full / "m.safetensors")), load_file(str(part / "m.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_all_linear_preset_adapts_more_modules(images, tmp_path, cache_root):
    counts = []
    for name, targets in (("a", "['to_q']"), ("b", "['all_linear']")):
        out = tmp_path / name
        assert main(train_args(images, out, cache_root / "l4", *LORA, f"lora.targets={targets}",
                               "train.steps=1", model="tiny:sd3")) == 0
        counts.append(len(_keys(out / "m.safetensors")))
    assert counts[1] > counts[0] > 0


@pytest.mark.parametrize("extra,message", [
    (("lora.targets=['no_such_layer']",), "match no linear layer"),
    (("save.formats=['lora_kohya']",), "lora_kohya is for SDXL-family"),
    (("save.formats=['single_file']",), "do not apply to train.mode = 'lora'"),
])
def test_lora_config_errors(images, tmp_path, cache_root, capsys, extra, message):
    assert main(train_args(images, tmp_path / "run", cache_root / "l5", *LORA, *extra, model="tiny:sd3")) == 2
    assert message in capsys.readouterr().err


def test_dreambooth_instance_prompt_needs_no_caption_files(tmp_path, cache_root):
    from vramfit.data.synth import make_synthetic_dataset

    images = tmp_path / "instance"
    make_synthetic_dataset(images, n=3, size=64, seed=4)
    for caption in images.glob("*.txt"):
        caption.unlink()
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "l6", *LORA, "data.instance_prompt=a photo of sks shape",
                           model="tiny:sd3")) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["items"] == 3 and run["skipped"] == []


def test_sd3_dreambooth_example_runs_on_the_tiny_model(images, tmp_path, cache_root):
    """examples/sd3m_dreambooth_lora.toml as written (8-bit Adam, int8 T5, LoRA), shrunk in size."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "sd3m_dreambooth_lora.toml"
    out = tmp_path / "run"
    args = ["train", str(example), "--no-progress"]
    for s in ("model.path=tiny:sd3", f"data.path={images}", "data.resolution=64", "data.min_size=64",
              "data.bucket_step=32", f"cache.dir={cache_root / 'l7'}", "train.steps=2", "train.batch_size=1",
              "train.grad_accum=2", "save.every_steps=0", "sample.every_steps=1", "sample.steps=2",
              f"output.dir={out}", "logging.tensorboard=false"):
        args += ["--set", s]
    assert main(args) == 0
    assert _keys(out / "model.safetensors")
    cfg = (out / "config.toml").read_text()
    assert 'optimizer = "adamw8bit"' in cfg and 't5_precision = "int8"' in cfg
    # the example's sample grids render with its int8 T5 (here at step 1 and at the end)
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step-000001.png", "step-000002.png"]
