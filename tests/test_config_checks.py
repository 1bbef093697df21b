"""Config checks through the `vramfit` CLI: every bad setting stops with exit code 2 before any
weight loads, naming its key and what to do, in plain words and without a traceback."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import train_args
from vramfit.cli import main
from vramfit.config import load_config
from vramfit.models.registry import TINY_MODELS
from vramfit.models.sd3.tiny import materialize_sd3


def _refused(capsys, sets: list[str], *, config: Path | None = None, command: str = "train") -> str:
    """stderr of a command that must stop at the config check (exit code 2, no traceback)."""
    capsys.readouterr()
    args = [command, *([str(config)] if config else []), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err
    return err


@pytest.fixture
def base(images, tmp_path) -> list[str]:
    """Settings under which the checks pass: existing data, writable output and cache folders."""
    return [f"data.path={images}", f"output.dir={tmp_path / 'out'}", f"cache.dir={tmp_path / 'cache'}"]


@pytest.fixture(scope="module")
def sd3_cache(tmp_path_factory) -> Path:
    """One cache folder for this module's tiny SD3 runs, so the model is written once."""
    return tmp_path_factory.mktemp("sd3-cache")


@pytest.mark.parametrize("sets,line", [
    (["data.resolution=100"], "data.resolution: 100 is not a multiple of bucket_step (64)"),
    (["data.bucket_step=12", "data.resolution=96"], "data.bucket_step: 12 is not a multiple of 8"),
    (["train.steps=3", "train.warmup_steps=3"], "train.warmup_steps: 3 must be smaller than train.steps (3)"),
    (["sample.every_steps=1"], "sample.prompts: empty while sample.every_steps is set"),
    (["sample.seeds=[]"], "sample.seeds: empty"),
    (["sample.width=100"], "sample.width: 100 is not a multiple of 8"),
    (["data.instance_prompt=a dog", "data.metadata=m.jsonl"], "data.instance_prompt: data.metadata gives"),
    (["lora.rank=8", "lora.dropout=0.1"], "lora.dropout: given but train.mode is 'full'"),
    (["save.formats=['lora']"], "save.formats: ['lora'] do not apply to train.mode = 'full'"),
    (["prior.num_images=3"], "prior.num_images: given without prior.class_prompt"),
    (["train.compile=true", "memory.offload_activations=true"],
     "train.compile: cannot be used with memory.offload_activations"),
    (["train.gradient_checkpointing=1.5"], "train.gradient_checkpointing: a share of the blocks lies"),
])
def test_cross_field_checks_name_their_key_in_plain_words(capsys, base, sets, line):
    err = _refused(capsys, [*base, *sets])
    assert f"  - {line}" in err
    assert "(top level)" not in err and "Value error" not in err and "Assertion failed" not in err


def test_lora_settings_in_a_full_run_are_each_named(capsys, base):
    err = _refused(capsys, [*base, "lora.rank=8", "lora.alpha=4"])
    assert "lora.rank: given" in err and "lora.alpha: given" in err and "2 problem(s)" in err


def test_an_unknown_tiny_model_lists_every_tiny_model(capsys, base):
    expected = ", ".join(f"tiny:{name}" for name in TINY_MODELS)
    assert "tiny:sd3" in expected and "tiny:sdxl" in expected
    err = _refused(capsys, [*base, "model.path=tiny:sdxxl"])
    assert (f"model.path: tiny:sdxxl is not a tiny model; did you mean tiny:sdxl? (tiny models: {expected})"
            in err)
    # commands that take a model path without a config (inspect) resolve it the same way
    capsys.readouterr()
    assert main(["inspect", "tiny:sd4"]) == 2
    err = capsys.readouterr().err
    assert "tiny:sd4 is not a tiny model" in err and expected in err and "Traceback" not in err


def test_intervals_longer_than_the_run_warn_and_the_end_still_saves(images, tmp_path, sd3_cache, caplog):
    out = tmp_path / "run"
    sets = ("save.every_steps=5", "save.state_every_steps=7", "sample.every_steps=9",
            "sample.prompts=['a cat']", "sample.steps=2", "save.name=m")
    with caplog.at_level("WARNING"):
        assert main(train_args(images, out, sd3_cache, *sets, model="tiny:sd3")) == 0
    for key, value in (("save.every_steps", 5), ("save.state_every_steps", 7), ("sample.every_steps", 9)):
        assert f"{key} ({value}) is larger than train.steps (2)" in caplog.text
    assert sorted(p.name for p in out.glob("m*.safetensors")) == ["m.safetensors"]  # no step checkpoint
    assert [p.name for p in (out / "state").glob("step-*")] == ["step-000002"]  # the end's state only
    assert len(json.loads((out / "run.json").read_text())["samples"]) == 1  # the end's grid


def test_folders_that_are_files_or_under_files_are_named(capsys, base, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    err = _refused(capsys, [*base, f"output.dir={a_file}", f"cache.dir={a_file / 'cache'}"])
    assert f"output.dir: {a_file} is a file, not a folder" in err
    assert f"cache.dir: {a_file / 'cache'} lies under {a_file}, which is a file, not a folder" in err
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    err = _refused(capsys, [*base, f"output.dir={link / 'run'}", "prior.class_prompt=a dog",
                            "data.instance_prompt=a sks dog", f"prior.class_dir={a_file}"])
    assert f"output.dir: {link} is a link to nothing" in err
    assert f"prior.class_dir: {a_file} is a file, not a folder" in err
    assert not (tmp_path / "cache").exists()  # refused before anything was written


def test_a_read_only_folder_is_named_before_loading(capsys, base, read_only_folder):
    ro = read_only_folder
    err = _refused(capsys, [*base, f"output.dir={ro}", f"cache.dir={ro / 'cache'}"])
    assert f"output.dir: cannot write in {ro}: Read-only file system" in err
    assert f"cache.dir: cannot write in {ro} (where {ro / 'cache'} would be made): Read-only file system" in err


def test_a_config_path_that_is_no_readable_toml_file(capsys, tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "run.toml").write_text("[train]\nsteps = 3\n")
    err = _refused(capsys, [], config=folder)
    assert f"config file {folder} is a folder; give the .toml file itself (here: run.toml)" in err
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[data]\ninstance_prompt = "a café"\n'.encode("latin-1"))
    err = _refused(capsys, [], config=latin1)
    assert f"config file {latin1} is not UTF-8 text" in err and "save it as UTF-8" in err
    err = _refused(capsys, [], config=folder / "run.toml" / "x.toml")
    assert f"config file {folder / 'run.toml' / 'x.toml'} cannot be read: Not a directory" in err
    if os.geteuid() != 0:  # root reads a file whatever its mode
        locked = tmp_path / "locked.toml"
        locked.write_text("[train]\nsteps = 3\n")
        locked.chmod(0)
        assert "cannot be read: Permission denied" in _refused(capsys, [], config=locked)


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x", "cpu:0"])
def test_an_unknown_device_lists_the_valid_ones(capsys, base, device):
    err = _refused(capsys, [*base, f"train.device={device}"])
    assert f"train.device: {device!r} is not a device vramfit trains on; use auto, cpu, cuda or cuda:N" in err


@pytest.mark.gpu
def test_a_gpu_index_beyond_the_machine_is_named(capsys, base):
    count = torch.cuda.device_count()
    err = _refused(capsys, [*base, f"train.device=cuda:{count}"])
    assert f"train.device: cuda:{count} asked for but this machine shows {count} GPU(s)" in err


def test_sd3_resolution_must_be_a_multiple_of_16(capsys, images, tmp_path, sd3_cache):
    sets = ["data.resolution=72", "data.bucket_step=8", "data.min_size=64"]
    lines = ("data.resolution: 72 is not a multiple of 16, which the sd3 family needs",
             "data.bucket_step: 8 is not a multiple of 16, which the sd3 family needs")
    # the config names the family (a tiny model, or model.family): checked with the config
    err = _refused(capsys, train_args(images, tmp_path / "a", sd3_cache, *sets, model="tiny:sd3")[3::2])
    assert "error: config: 2 problem(s)" in err and all(line in err for line in lines)
    # the family is read from the file: checked once it is known, before any weight loads or caching
    single_file = materialize_sd3(sd3_cache / "tiny")
    fresh_cache = tmp_path / "cache"
    args = train_args(images, tmp_path / "b", fresh_cache, *sets, model=str(single_file))
    err = _refused(capsys, args[3::2])
    assert "error: config for this sd3 model: 2 problem(s)" in err and all(line in err for line in lines)
    assert not (fresh_cache / "entries").exists()
    # the SDXL family needs multiples of 8 only
    cfg = load_config(None, ["model.path=tiny:ssd1b", *sets], need_data=False)
    assert (cfg.data.resolution, cfg.data.bucket_step) == (72, 8)


@pytest.mark.parametrize("value,key", [
    ("train.lr=inf", "train.lr"), ("train.lr=nan", "train.lr"), ("train.lr=0", "train.lr"),
    ("train.lr=-1e-5", "train.lr"), ("train.lr=3.0", "train.lr"),
    ("train.betas=[2.0, 0.5]", "train.betas[0]"), ("train.betas=[0.9, 1.0]", "train.betas[1]"),
    ("train.betas=[0.9, nan]", "train.betas[1]"), ("train.eps=inf", "train.eps"), ("train.eps=0", "train.eps"),
    ("train.weight_decay=-0.1", "train.weight_decay"), ("train.weight_decay=inf", "train.weight_decay"),
    ("train.max_grad_norm=nan", "train.max_grad_norm"), ("train.max_grad_norm=-1", "train.max_grad_norm"),
    ("train.seed=99999999999999999999", "train.seed"), ("train.seed=-1", "train.seed"),
    ("train.seed=4294967296", "train.seed"), ("prior.seed=-3", "prior.seed"),
    ("sample.seeds=[0, 18446744073709551616]", "sample.seeds[1]"),
    ("train.steps=0", "train.steps"), ("train.batch_size=0", "train.batch_size"),
    ("train.grad_accum=0", "train.grad_accum"), ("train.noise_offset=nan", "train.noise_offset"),
    ("train.min_snr_gamma=inf", "train.min_snr_gamma"), ("train.logit_mean=-inf", "train.logit_mean"),
    ("train.logit_std=0", "train.logit_std"), ("train.mode_scale=5", "train.mode_scale"),
    ("train.gradient_checkpointing=nan", "train.gradient_checkpointing"),
    ("lora.alpha=inf", "lora.alpha"), ("lora.dropout=1.0", "lora.dropout"),
    ("prior.loss_weight=inf", "prior.loss_weight"), ("prior.guidance=nan", "prior.guidance"),
    ("sample.guidance=-1", "sample.guidance"), ("sample.steps=0", "sample.steps"),
    ("data.max_aspect=inf", "data.max_aspect"), ("data.min_size=0", "data.min_size"),
    ("memory.stream_unit_mib=inf", "memory.stream_unit_mib"),
    ("memory.vram_budget=inf GiB", "memory.vram_budget"),
    ("data.caption_extension=", "data.caption_extension"),
    ("data.caption_extension=.", "data.caption_extension"),
    ("data.caption_extension=.a/b", "data.caption_extension"),
    ("data.caption_extension=.a\\b", "data.caption_extension"),
])
def test_out_of_range_numbers_and_names_are_refused_by_key(capsys, base, value, key):
    err = _refused(capsys, [*base, value])
    assert f"  - {key}: " in err, err


def test_logging_progress_false_turns_the_bars_off(images, tmp_path, sd3_cache, capsys):
    def run(command: str, name: str, *extra: str, fresh: bool = True) -> str:
        if fresh:  # so the cache stage runs, with its bars
            shutil.rmtree(sd3_cache / "entries", ignore_errors=True)
        args = train_args(images, tmp_path / name, sd3_cache, *extra, model="tiny:sd3")
        capsys.readouterr()
        assert main([command, *(a for a in args[1:] if a != "--no-progress")]) == 0
        return capsys.readouterr().err

    for quiet in (run("cache", "quiet", "logging.progress=false"),
                  run("train", "quiet", "logging.progress=false", fresh=False)):
        assert "cache latents" not in quiet and "train:" not in quiet and "%|" not in quiet
    shown = run("train", "shown")
    assert "cache latents" in shown and "train:" in shown and "%|" in shown
