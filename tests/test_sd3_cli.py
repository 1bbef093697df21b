"""SD3 through the same CLI path as the SDXL family: train, save, resume, inspect."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from conftest import train_args
from vramfit.cli import main
from vramfit.lora_tools import load_model
from vramfit.memory.quantize import quantize_base
from vramfit.models.registry import FAMILIES
from vramfit.models.sd3.family import TRANSFORMER


def test_sd3_full_finetune_saves_single_file_and_diffusers(images, tmp_path, cache_root):
    out = tmp_path / "run"
    args = train_args(images, out, cache_root / "s1", "save.formats=['single_file','diffusers']",
                      "save.dtype=fp32", "save.name=m", "train.weighting_scheme=cosmap", model="tiny:sd3")
    assert main(args) == 0
    run = json.loads((out / "run.json").read_text())
    assert len(run["losses"]) == 2 and all(l > 0 for l in run["losses"])
    saved = load_file(str(out / "m.safetensors"))
    source = load_file(str(next((cache_root / "s1" / "tiny").glob("tiny-sd3-*/tiny-sd3.safetensors"))))
    assert set(saved) == set(source)
    moved = [k for k in source if k.startswith("model.diffusion_model.") and not torch.equal(saved[k], source[k])]
    assert moved
    assert all(torch.equal(saved[k], source[k]) for k in source if not k.startswith("model.diffusion_model."))
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(out / "m-diffusers", local_files_only=True)
    assert pipe.transformer.config.num_layers == 2


def test_sd3_resume_is_exact(images, tmp_path, cache_root):
    sets = ("train.steps=4", "save.state_every_steps=2", "train.precision=fp32", "save.name=m")
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(train_args(images, full, cache_root / "s2", *sets, model="tiny:sd3")) == 0
    args = train_args(images, part, cache_root / "s2", *sets, model="tiny:sd3")
    assert main(args + ["--resume", str(full / "state" / "step-000002")]) == 0
    ref = json.loads((full / "run.json").read_text())["losses"]
    assert json.loads((part / "run.json").read_text())["losses"] == ref


def test_sdxl_only_options_are_refused_for_sd3(images, tmp_path, cache_root, capsys):
    args = train_args(images, tmp_path / "run", cache_root / "s3", "train.prediction_type=v_prediction",
                      model="tiny:sd3")
    assert main(args) == 2
    assert "train.prediction_type: applies to the SDXL" in capsys.readouterr().err


def test_inspect_sd3(capsys):
    assert main(["inspect", "tiny:sd3", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "sd3" and info["t5"] is True
    assert info["components"]["text_encoder_3 (T5)"]["dtypes"] == {"F8_E4M3": info["components"]["text_encoder_3 (T5)"]["params"]}


def test_sd3_only_options_are_refused_for_sdxl(images, tmp_path, cache_root, capsys):
    args = train_args(images, tmp_path / "run", cache_root / "s4", "train.weighting_scheme=mode",
                      "model.max_sequence_length=256")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "train.weighting_scheme" in err and "model.max_sequence_length" in err


def test_quantized_t5_is_close_to_bf16_and_smaller(cache_root):
    import copy

    from vramfit.config.schema import ModelConfig
    from vramfit.memory.quantize import storage_bytes
    from vramfit.models.registry import detect_family
    from vramfit.models.sources import resolve_source

    source = resolve_source(ModelConfig(path="tiny:sd3"), cache_root / "q")
    family = detect_family(source)
    base = family.load(source)
    base.extra["t5_precision"] = "bf16"
    family.prepare_encoders(base)
    captions = ["a red circle on a blue background", "a green square"]
    ref = family.encode_text(base, captions, torch.device("cpu"), torch.float32)["prompt_embeds"][:, 77:]
    # Stated tolerance (relative Frobenius error of the T5 tokens against bf16): int8 2%, fp8 6%.
    for mode, tol in (("int8", 0.02), ("fp8", 0.06)):
        bundle = copy.deepcopy(base)
        bundle.text_encoders[2] = copy.deepcopy(family.load(source).text_encoders[2])
        bundle.extra["t5_precision"] = mode
        family.prepare_encoders(bundle)
        out = family.encode_text(bundle, captions, torch.device("cpu"), torch.float32)["prompt_embeds"][:, 77:]
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < tol, (mode, err)
        assert storage_bytes(bundle.text_encoders[2]) < 0.8 * storage_bytes(base.text_encoders[2])
    none = copy.deepcopy(base)
    none.extra["t5_precision"] = "none"
    family.prepare_encoders(none)
    out = family.encode_text(none, captions, torch.device("cpu"), torch.float32)["prompt_embeds"]
    assert out.shape == (2, 154, 256) and torch.count_nonzero(out[:, 77:]) == 0


def test_t5_precision_trains_and_keys_the_cache(images, tmp_path, cache_root, capsys):
    cache = cache_root / "s5"
    for mode in ("bf16", "int8"):
        args = train_args(images, tmp_path / mode, cache, f"model.t5_precision={mode}", model="tiny:sd3")
        args[0] = "cache"
        assert main(args) == 0
        assert "text_cached 4" in capsys.readouterr().out  # each precision has its own entries
    assert main(train_args(images, tmp_path / "run", cache, "model.t5_precision=int8", model="tiny:sd3")) == 0


def test_text_encoders_as_files_of_their_own(images, tmp_path, cache_root, capsys):
    """sd3_medium.safetensors holds transformer and VAE only; ComfyUI keeps clip_l, clip_g and
    t5xxl in files of their own (bare HF keys, or with a wrapper prefix). Given with model.clip_l /
    clip_g / t5 they are the same encoders as in the full file: the text cache is reused and the
    losses are identical."""
    import shutil

    from safetensors.torch import save_file

    cache = cache_root / "s-split"
    full_out = tmp_path / "full"
    assert main(train_args(images, full_out, cache, "save.name=m", model="tiny:sd3")) == 0
    full = next((cache / "tiny").glob("tiny-sd3-*/tiny-sd3.safetensors"))
    state = load_file(str(full))
    parts = {"clip_l": "text_encoders.clip_l.transformer.", "clip_g": "text_encoders.clip_g.transformer.",
             "t5": "text_encoders.t5xxl.transformer."}
    split = tmp_path / "split"
    split.mkdir()
    core = {k: v for k, v in state.items() if not k.startswith("text_encoders.")}
    save_file(core, str(split / "sd3_core.safetensors"))
    wrappers = {"clip_l": "", "clip_g": "transformer.", "t5": ""}  # both layouts seen in the wild
    for part, prefix in parts.items():
        save_file({wrappers[part] + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)},
                  str(split / f"{part}.safetensors"))
    for tok in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        shutil.copytree(full.parent / tok, split / tok)

    out = tmp_path / "out"
    base = train_args(images, out, cache, "save.name=m", model=str(split / "sd3_core.safetensors"))
    assert main(base) != 0  # without the encoder files the message says what to give
    assert "model.clip_l" in capsys.readouterr().err
    sets = [f"model.{p}={split / f'{p}.safetensors'}" for p in parts]
    assert main(base + [a for s in sets for a in ("--set", s)]) == 0
    run = json.loads((out / "run.json").read_text())
    ref = json.loads((full_out / "run.json").read_text())
    assert run["cache"]["text_cached"] == 0 and run["cache"]["text_reused"] == ref["cache"]["text_cached"]
    assert run["losses"] == ref["losses"]
    assert main(train_args(images, out, cache, f"model.t5={split / 'missing.safetensors'}",
                           model="tiny:sd3")) != 0
    assert "model.t5" in capsys.readouterr().err


def test_fp8_transformer_file_generates(tmp_path, cache_root):
    """An SD3 single file whose transformer is stored in float8_e4m3fn (an fp8 save): its weights
    load widened to bf16, so `vramfit generate` renders (no matmul takes float8)."""
    source = FAMILIES["sd3"].materialize_tiny("sd3", cache_root / "fp8-sd3")
    state = {k: v.to(torch.float8_e4m3fn) if k.startswith(TRANSFORMER) and v.ndim == 2 else v
             for k, v in load_file(str(source)).items()}
    path = source.with_name("fp8.safetensors")
    save_file(state, str(path))
    out = tmp_path / "out"
    assert main(["generate", "--model", str(path), "--prompt", "a red circle", "--steps", "1", "--width", "64",
                 "--height", "64", "--no-progress", "--out", str(out)]) == 0
    assert (out / "0-0.png").is_file()
    # an fp8 LoRA base over it keeps the file's codes (scale 1), as over Flux.1's fp8 files
    denoiser = load_model(str(path))[1].denoiser
    linears = {n: m for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)}
    codes = {n: m.weight.detach().to(torch.float8_e4m3fn) for n, m in linears.items()}
    quantize_base(denoiser.requires_grad_(False), "fp8")
    for name, want in codes.items():
        got = denoiser.get_submodule(name).weight
        assert torch.equal(got.qdata.view(torch.uint8), want.view(torch.uint8)) and bool((got.scale == 1).all())
