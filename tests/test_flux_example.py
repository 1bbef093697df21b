"""examples/flux1_dev_lora_8gb.toml as written, on tiny Flux parts kept the way the example names
them (transformer alone, ae, clip_l, fp8 T5 files): it trains and writes both LoRA formats."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vramfit.cli import main
from vramfit.config.load import load_config
from vramfit.models.registry import materialize_tiny

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flux1_dev_lora_8gb.toml"
FULL_EXAMPLE = EXAMPLE.with_name("flux1_dev_full_12gb.toml")
PARTS = {"flux1-dev": "model.diffusion_model.", "ae": "first_stage_model.",
         "clip_l": "text_encoders.clip_l.transformer.", "t5xxl_fp8_e4m3fn": "text_encoders.t5xxl.transformer."}


def split_tiny_flux(cache: Path, folder: Path) -> dict[str, Path]:
    """tiny:flux's single file as four files (the T5 in float8), tokenizers beside the transformer."""
    full = materialize_tiny("tiny:flux", cache / "flux-example-tiny")
    state = load_file(str(full))
    folder.mkdir()
    for name, prefix in PARTS.items():
        part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if name.startswith("t5"):
            part = {k: v.to(torch.float8_e4m3fn) for k, v in part.items()}
        save_file(part, str(folder / f"{name}.safetensors"))
    for tok in ("tokenizer", "tokenizer_2"):
        shutil.copytree(full.parent / tok, folder / tok)
    return {name: folder / f"{name}.safetensors" for name in PARTS}


def test_flux_example_parses_and_trains_on_tiny_parts(images, tmp_path, cache_root):
    files = split_tiny_flux(cache_root, tmp_path / "files")
    paths = [f"model.path={files['flux1-dev']}", f"model.vae={files['ae']}", f"model.clip_l={files['clip_l']}",
             f"model.t5={files['t5xxl_fp8_e4m3fn']}"]
    cfg = load_config(EXAMPLE, paths, need_data=False)
    assert cfg.train.mode == "lora" and cfg.lora.rank == 16 and cfg.model.max_sequence_length == 512
    assert cfg.memory.stream_weights and cfg.memory.stream_encoders and cfg.model.t5_precision == "int8"
    out = tmp_path / "run"
    args = ["train", str(EXAMPLE), "--no-progress"]
    for s in (*paths, f"data.path={images}", "data.resolution=64", "data.min_size=64", "data.bucket_step=32",
              f"cache.dir={cache_root / 'flux-example'}", "train.steps=2", "train.device=cpu", "save.every_steps=0",
              "model.max_sequence_length=16", f"output.dir={out}", "logging.tensorboard=false"):
        args += ["--set", s]
    assert main(args) == 0
    assert any(k.startswith("transformer.") for k in load_file(str(out / "model.safetensors")))
    assert any(k.startswith("lora_unet_double_blocks_") for k in load_file(str(out / "model-kohya.safetensors")))


def test_flux_full_example_parses_and_trains_streamed_on_tiny_parts(images, tmp_path, cache_root):
    """The full fine-tune example as written: streamed weights stepping inside backward with
    Adafactor, written as BFL's single file."""
    files = split_tiny_flux(cache_root, tmp_path / "files")
    paths = [f"model.path={files['flux1-dev']}", f"model.vae={files['ae']}", f"model.clip_l={files['clip_l']}",
             f"model.t5={files['t5xxl_fp8_e4m3fn']}"]
    cfg = load_config(FULL_EXAMPLE, paths, need_data=False)
    assert cfg.train.mode == "full" and cfg.train.optimizer == "adafactor" and cfg.train.optimizer_in_backward
    assert cfg.memory.stream_weights and cfg.save.formats == ["single_file"]
    out = tmp_path / "run"
    args = ["train", str(FULL_EXAMPLE), "--no-progress"]
    for s in (*paths, f"data.path={images}", "data.resolution=64", "data.min_size=64", "data.bucket_step=32",
              f"cache.dir={cache_root / 'flux-example'}", "train.steps=1", "train.device=cpu", "save.every_steps=0",
              "model.max_sequence_length=16", "memory.stream_encoders=false", f"output.dir={out}",
              "logging.tensorboard=false"):
        args += ["--set", s]
    assert main(args) == 0
    written = load_file(str(out / "model.safetensors"))
    source = load_file(str(files["flux1-dev"]))
    assert set(source) <= set(written)  # the transformer in BFL's keys
    assert any(not torch.equal(written[k], source[k].to(written[k].dtype)) for k in source)


class _Wrapped(torch.nn.Module):
    """A denoiser behind a wrapper with no diffusers config, as the CUDA graph replay is."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def test_flux_loss_needs_no_config_on_the_denoiser(cache_root):
    """The step engine may hand the family a wrapped denoiser: the loss is the same through it."""
    import dataclasses

    from vramfit.config.schema import RunConfig
    from vramfit.models.registry import FAMILIES
    from vramfit.models.sources import resolve_source

    family = FAMILIES["flux"]
    run = RunConfig.model_validate({"model": {"path": "tiny:flux"}})
    bundle = family.load(resolve_source(run.model, cache_root / "flux-example-tiny"))
    batch = family.synthetic_batch(dict(bundle.denoiser.config), 1, (64, 64), run)
    cfg = run.train
    inputs = family.loss_inputs(bundle, batch, cfg, torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    plain = family.loss_from(bundle, inputs, cfg, cpu, torch.float32)
    wrapped = dataclasses.replace(bundle, denoiser=_Wrapped(bundle.denoiser))
    assert torch.equal(family.loss_from(wrapped, inputs, cfg, cpu, torch.float32), plain)


def test_plan_reads_the_parts_kept_in_files_of_their_own(tmp_path, cache_root):
    """A transformer-only file with model.vae, model.clip_l and model.t5 plans, phase by phase, as the
    all-in-one file of the same parts (the T5 stored in float8 in both)."""
    from vramfit.fit.model_facts import read_facts
    from vramfit.fit.planner import predict

    files = split_tiny_flux(cache_root, tmp_path / "files")
    state = load_file(str(materialize_tiny("tiny:flux", cache_root / "flux-example-tiny")))
    t5 = PARTS["t5xxl_fp8_e4m3fn"]
    whole = tmp_path / "whole.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) if k.startswith(t5) else v for k, v in state.items()}, str(whole))
    shutil.copytree(files["flux1-dev"].parent / "tokenizer", tmp_path / "tokenizer")
    shutil.copytree(files["flux1-dev"].parent / "tokenizer_2", tmp_path / "tokenizer_2")
    split = [f"model.vae={files['ae']}", f"model.clip_l={files['clip_l']}", f"model.t5={files['t5xxl_fp8_e4m3fn']}"]
    plans = []
    for sets in ([f"model.path={files['flux1-dev']}", *split], [f"model.path={whole}"]):
        cfg = load_config(None, [*sets, "train.mode=lora", "data.resolution=512"], need_data=False)
        facts = read_facts(cfg)
        assert [e.kind for e in facts.encoders] == ["clip", "t5"] and facts.vae_params > 0
        plans.append({p.name: p.peak for p in predict(facts, cfg).phases})
    assert plans[0] == plans[1] and plans[0]["cache_text"] > 0
