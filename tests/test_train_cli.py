"""End-to-end runs through the `vramfit` CLI on tiny models: what a user's run does, on CPU."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main


def _run(args: list[str]) -> int:
    return main(args)


def test_train_writes_checkpoint_report_and_config(images, tmp_path, cache_root, capsys):
    out = tmp_path / "run"
    assert _run(train_args(images, out, cache_root / "c1", "save.every_steps=1", "save.name=m")) == 0
    printed = capsys.readouterr().out
    assert "memory by phase" in printed and "m.safetensors" in printed
    assert (out / "m.safetensors").is_file() and (out / "m-step000001.safetensors").is_file()
    report = json.loads((out / "m.memory.json").read_text())
    assert [p["name"] for p in report["phases"]] == ["load", "cache_latents", "cache_text", "train", "save"]
    assert all(p["rss_peak"] > 0 for p in report["phases"])
    assert report["phases"][3]["steps"] == 2
    assert "[train]" in (out / "config.toml").read_text()
    run = json.loads((out / "run.json").read_text())
    assert len(run["losses"]) == 2 and all(l > 0 for l in run["losses"])
    # the run is reproducible from its folder: the resolved config trains again as it is
    again = tmp_path / "again"
    assert _run(["train", str(out / "config.toml"), "--no-progress", "--set", f"output.dir={again}"]) == 0
    assert json.loads((again / "run.json").read_text())["losses"] == run["losses"]


def test_trained_unet_changes_and_the_rest_is_carried_over(images, tmp_path, cache_root):
    out = tmp_path / "run"
    assert _run(train_args(images, out, cache_root / "c2", "save.dtype=fp32", "save.name=m")) == 0
    saved = load_file(str(out / "m.safetensors"))
    source = load_file(str(cache_root / "c2" / "tiny" / "tiny-ssd1b-v1" / "tiny-ssd1b.safetensors"))
    assert set(saved) == set(source)
    changed = [k for k in source if k.startswith("model.diffusion_model.")
               and not torch.equal(saved[k], source[k])]
    assert len(changed) > 10
    for k in source:
        if not k.startswith("model.diffusion_model."):
            assert torch.equal(saved[k], source[k]), k


def test_saved_single_file_trains_again_as_a_source(images, tmp_path, cache_root, capsys):
    first = tmp_path / "a"
    assert _run(train_args(images, first, cache_root / "c3", "save.name=m")) == 0
    ckpt = first / "m.safetensors"
    # the tokenizers are written beside the checkpoint: it trains again with no other setting
    assert _run(train_args(images, tmp_path / "b", cache_root / "c3", model=str(ckpt))) == 0
    # the file copied alone has none: a clear error says what to provide
    alone = tmp_path / "alone" / "m.safetensors"
    alone.parent.mkdir()
    alone.write_bytes(ckpt.read_bytes())
    capsys.readouterr()
    assert _run(train_args(images, tmp_path / "c", cache_root / "c3", model=str(alone))) == 2
    err = capsys.readouterr().err
    assert "model.tokenizers" in err and "tokenizer_2" in err and "m.safetensors" in err
    tok = cache_root / "c3" / "tiny" / "tiny-ssd1b-v1"
    assert _run(train_args(images, tmp_path / "c", cache_root / "c3", f"model.tokenizers={tok}",
                           model=str(alone))) == 0


def test_cached_and_live_encoding_train_identically(images, tmp_path, cache_root):
    """Training from the disk cache sees the same inputs as encoding every step."""
    losses = []
    for name, latents, text in (("cached", "true", "true"), ("live", "false", "false")):
        out = tmp_path / name
        assert _run(train_args(images, out, cache_root / f"c5{name}", f"cache.latents={latents}",
                               f"cache.text={text}", "train.precision=fp32", "train.steps=3",
                               "train.batch_size=2", "save.name=m")) == 0
        losses.append(json.loads((out / "run.json").read_text())["losses"])
    # Same latents, noise, timesteps and embeddings, to float32 rounding: the cache encodes
    # captions 64 at a time and the live path one batch at a time, and BLAS blocking then differs
    # in the last bit (how much depends on the thread count); Adafactor's first updates are
    # nearly sign updates, which can carry such a bit into one parameter's step.
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert len(set(losses[0])) == 3


def test_bad_files_are_skipped_and_named(images, tmp_path, cache_root, caplog):
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    (images / "broken.txt").write_text("a broken file")
    (images / "empty.jpg").write_bytes(b"")
    (images / "empty.txt").write_text("an empty file")
    (images / "notes.png").write_text("this is text, not an image")
    (images / "notes.txt").write_text("notes")
    good = sorted(images.glob("000*.png"))[0]
    (images / "nocaption.png").write_bytes(good.read_bytes())
    out = tmp_path / "run"
    with caplog.at_level("WARNING"):
        assert _run(train_args(images, out, cache_root / "c6")) == 0
    run = json.loads((out / "run.json").read_text())
    skipped = {s["path"] for s in run["skipped"]}
    assert {"broken.png", "empty.jpg", "notes.png", "nocaption.png"} <= skipped
    assert run["items"] == 4
    for name in ("broken.png", "empty.jpg", "notes.png", "nocaption.png"):
        assert name in caplog.text


def test_config_errors_are_all_listed_before_loading(images, tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[train]\nlr = "fast"\nstepz = 3\n[data]\nresolution = 1000\n[modle]\npath = "x"\n')
    code = main(["train", str(cfg), "--set", "train.optimizer=sgd", "--set", f"data.path={images}",
                 "--set", "model.path=./nowhere.safetensors"])
    err = capsys.readouterr().err
    assert code == 2
    for expected in ("train.lr", "train.stepz", "did you mean train.steps", "modle", "did you mean model",
                     "train.optimizer", "data.resolution: 1000", "nowhere.safetensors does not exist"):
        assert expected in err, expected


def test_missing_paths_are_reported_together(tmp_path, capsys):
    code = main(["train", "--set", f"data.path={tmp_path / 'nope'}", "--set",
                 f"model.path={tmp_path / 'missing.safetensors'}"])
    err = capsys.readouterr().err
    assert code == 2 and "data.path" in err and "model.path" in err and "missing.safetensors" in err


def test_example_config_parses():
    from vramfit.config import load_config

    import tomllib

    for example in Path(__file__).resolve().parents[1].glob("examples/*.toml"):
        if set(tomllib.loads(example.read_text()).get("model", {})) & {"vae", "clip_l", "clip_g", "t5"}:
            continue  # it names its part files: its own test parses it with them (tests/test_flux_example.py)
        cfg = load_config(example, ["model.path=tiny:ssd1b"], need_data=False)
        assert cfg.train.steps > 0


def test_ssd1b_example_is_the_write_up_recipe():
    from vramfit.config import load_config

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples/ssd1b_full_8gb.toml", ["model.path=tiny:ssd1b"], need_data=False)
    t = cfg.train
    assert (t.batch_size, t.grad_accum, t.optimizer, t.precision, t.gradient_checkpointing) == (
        1, 32, "adafactor", "full_bf16", True)
    assert cfg.cache.latents and cfg.cache.text and cfg.data.resolution == 1024
    assert cfg.save.formats == ["single_file"]


def test_demo_runs(tmp_path, capsys):
    assert main(["demo", "--output", str(tmp_path / "demo"), "--steps", "4", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "tiny-ssd1b-demo.safetensors" in printed and "memory by phase" in printed
    run = tmp_path / "demo" / "run"
    assert (run / "tiny-ssd1b-demo.safetensors").is_file()
    assert list((run / "logs").glob("events.out.tfevents.*"))  # TensorBoard is on by default
    from safetensors import safe_open

    with safe_open(str(run / "tiny-ssd1b-demo.safetensors"), "pt") as fh:
        meta = fh.metadata()
    assert "[train]" in meta["vramfit.config"] and meta["vramfit.step"] == "4"


def test_inspect_reads_layout_from_keys(capsys, cache_root):
    assert main(["inspect", "tiny:ssd1b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "sdxl" and info["mid_block_type"] == "UNetMidBlock2D"
    assert info["reverse_transformer_layers_per_block"] == [[2, 2, 3], [1, 1, 1], 1]
    assert info["components"]["unet"]["params"] > 1_000_000
    assert main(["inspect", "tiny:sdxl"]) == 0
    text = capsys.readouterr().out
    assert "UNetMidBlock2DCrossAttn" in text and "unet" in text


@pytest.mark.parametrize("fmt", ["diffusers"])
def test_diffusers_output_loads_in_diffusers_and_trains_again(images, tmp_path, cache_root, fmt):
    from diffusers import StableDiffusionXLPipeline

    out = tmp_path / "a"
    assert _run(train_args(images, out, cache_root / "c7", f"save.formats=['{fmt}']", "save.name=m",
                           "save.dtype=fp32")) == 0
    folder = out / "m-diffusers"
    pipe = StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True)
    assert pipe.unet.config.mid_block_type == "UNetMidBlock2D"
    assert _run(train_args(images, tmp_path / "b", cache_root / "c7", "save.name=m2",
                           model=str(folder))) == 0
    # a diffusers source saved as a single file gets SGM keys for every component
    sd = load_file(str(tmp_path / "b" / "m2.safetensors"))
    assert any(k.startswith("conditioner.embedders.1.model.transformer.resblocks.") for k in sd)
    assert any(k.startswith("first_stage_model.encoder.down.") for k in sd)
    tiny = load_file(str(cache_root / "c7" / "tiny" / "tiny-ssd1b-v1" / "tiny-ssd1b.safetensors"))
    assert set(sd) == set(tiny)  # same key set as a single file made by the usual tools


def test_impossible_combinations_are_config_errors(images, capsys, caplog):
    code = main(["train", "--set", f"data.path={images}", "--set", "train.steps=10", "--set",
                 "train.warmup_steps=10", "--set", "save.every_steps=50", "--set", "train.device=cuda"])
    err = capsys.readouterr().err
    assert code == 2
    assert "train.warmup_steps: 10 must be smaller than train.steps (10)" in err
    if not torch.cuda.is_available():
        assert "train.device: cuda asked for but no CUDA GPU is visible" in err
    from vramfit.config import load_config

    with caplog.at_level("WARNING"):  # a save interval longer than the run: a warning, not an error
        load_config(None, [f"data.path={images}", "train.steps=10", "save.every_steps=50"])
    assert "save.every_steps (50) is larger than train.steps (10)" in caplog.text


@pytest.mark.parametrize("shuffle", [False, True])
def test_data_shuffle_decides_the_order(images, tmp_path, cache_root, monkeypatch, shuffle):
    """data.shuffle = false trains every epoch in the order the scan found (it was read and not used)."""
    from vramfit.train.data import TrainingData

    orders, batches = [], TrainingData.batches

    def spy(self, batch_size, generator, shuffle_arg, epoch):
        groups = list(batches(self, batch_size, generator, shuffle_arg, epoch))
        orders.append([r.item.key for g in groups for r in g])
        return iter(groups)

    monkeypatch.setattr(TrainingData, "batches", spy)
    assert _run(train_args(images, tmp_path / "run", cache_root / "shuffle", f"data.shuffle={str(shuffle).lower()}",
                           "train.steps=8", "train.batch_size=1")) == 0
    assert len(orders) >= 2  # two epochs of four images
    found = sorted(orders[0])
    if shuffle:
        assert any(order != found for order in orders)
    else:
        assert all(order == found for order in orders)



def test_a_cuda_run_leaves_cudnn_attention_out():
    """cuDNN's fused attention faults on Flux.1's shapes under the torch build this project runs on
    (train/setup.py `use_attention_kernels`): a CUDA run turns it off; a CPU run leaves torch's choice."""
    from vramfit.train.setup import use_attention_kernels

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        use_attention_kernels(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        use_attention_kernels(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
