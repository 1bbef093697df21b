"""Flux.1 files as they are released and shared: float8-stored transformers (flux1-dev-fp8, ComfyUI's
scaled fp8), a t5xxl fp8 file as model.t5, kohya LoRAs read and inspected, the schnell variant, and
the planner at full size. Every file is built from the tiny model."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import train_args
from vramfit.cli import main
from vramfit.config.schema import ModelConfig
from vramfit.formats.safetensors_io import CheckpointError
from vramfit.models.registry import FAMILIES, detect_family
from vramfit.models.sources import resolve_source

CORE = "model.diffusion_model."
T5 = "text_encoders.t5xxl.transformer."
LORA = ("train.mode=lora", "lora.rank=4", "train.lr=1e-2", "save.name=m")


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux-formats")
    source = resolve_source(ModelConfig(path="tiny:flux"), root)
    return source.path


def _load(path, cache, **model):
    source = resolve_source(ModelConfig(path=str(path), tokenizers=str(path.parent), **model), cache)
    return detect_family(source).load(source)


def _copy_tokenizers(src, folder):
    import shutil

    for tok in ("tokenizer", "tokenizer_2"):
        shutil.copytree(src.parent / tok, folder / tok)


def test_fp8_transformer_files_load_widened(tiny_file, tmp_path):
    """A transformer stored float8_e4m3fn loads as its values widened to bf16; a scaled-fp8 file
    (ComfyUI's scale_weight and weight_scale keys) as weight * scale; a layer in a quantized format
    this version does not read is refused naming the file and the tensor."""
    state = load_file(str(tiny_file))
    plain = {k: v.to(torch.float8_e4m3fn) if k.startswith(CORE) else v for k, v in state.items()}
    folder = tmp_path / "files"
    folder.mkdir()
    _copy_tokenizers(tiny_file, folder)
    save_file(plain, str(folder / "fp8.safetensors"))
    base = _load(tiny_file, tmp_path / "c").denoiser.state_dict()
    loaded = _load(folder / "fp8.safetensors", tmp_path / "c").denoiser.state_dict()
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    assert all(torch.equal(loaded[k], base[k].to(torch.float8_e4m3fn).to(torch.bfloat16)) for k in base)

    scaled, want = dict(state), {}
    for i, (key, w) in enumerate(sorted((k, v) for k, v in state.items()
                                        if k.startswith(CORE) and k.endswith(".weight") and v.ndim == 2)):
        scale = w.abs().amax() / 448 * (1.5 if i % 2 else 1.0)
        q = (w / scale).to(torch.float8_e4m3fn)
        scaled[key] = q
        name = "scale_weight" if i % 2 else "weight_scale"
        scaled[key[:-len("weight")] + name] = scale.reshape(())
        scaled[key[:-len("weight")] + ("scale_input" if i % 2 else "input_scale")] = torch.ones(())
        want[key[len(CORE):]] = (q.float() * scale).to(torch.bfloat16)
    scaled[CORE + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(scaled, str(folder / "scaled.safetensors"))
    bundle = _load(folder / "scaled.safetensors", tmp_path / "c")
    bfl = FAMILIES["flux"].transformer_bfl_state(bundle, torch.bfloat16)
    assert want and all(torch.equal(bfl[k], v) for k, v in want.items())
    # the scales matter: without them the weights are hundreds of times smaller
    assert any(not torch.equal(bfl[k], scaled[CORE + k].to(torch.bfloat16)) for k in want)

    key = sorted(want)[0]
    nvfp4 = dict(scaled)
    nvfp4[CORE + key[:-len("weight")] + "comfy_quant"] = torch.tensor(list(b'{"format": "nvfp4"}'),
                                                                       dtype=torch.uint8)
    save_file(nvfp4, str(folder / "nvfp4.safetensors"))
    with pytest.raises(CheckpointError, match=r"nvfp4\.safetensors: tensor .*weight is stored as nvfp4"):
        _load(folder / "nvfp4.safetensors", tmp_path / "c")


def test_fp8_t5xxl_file_as_model_t5(tiny_file, tmp_path):
    """ComfyUI's t5xxl_fp8_e4m3fn.safetensors given as model.t5 beside a file without T5: T5's
    weights are its float8 values widened, and captions encode with it."""
    state = load_file(str(tiny_file))
    folder = tmp_path / "files"
    folder.mkdir()
    _copy_tokenizers(tiny_file, folder)
    save_file({k: v for k, v in state.items() if not k.startswith(T5)}, str(folder / "no-t5.safetensors"))
    save_file({k[len(T5):]: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v
               for k, v in state.items() if k.startswith(T5)}, str(folder / "t5xxl_fp8_e4m3fn.safetensors"))
    bundle = _load(folder / "no-t5.safetensors", tmp_path / "c", t5=str(folder / "t5xxl_fp8_e4m3fn.safetensors"))
    assert len(bundle.text_encoders) == 2
    t5 = bundle.text_encoders[1].state_dict()
    assert torch.equal(t5["encoder.block.0.layer.0.SelfAttention.q.weight"],
                       state[T5 + "encoder.block.0.layer.0.SelfAttention.q.weight"].to(torch.float8_e4m3fn)
                       .to(torch.bfloat16))
    bundle.text_encoders[1].float()
    out = FAMILIES["flux"].encode_text(bundle, ["a red circle"], torch.device("cpu"), torch.float32)
    assert out["prompt_embeds"].abs().sum() > 0


def test_kohya_flux_lora_is_read_inspected_and_rendered_as_the_peft_file(images, tmp_path, cache_root, capsys):
    """A trained tiny Flux LoRA's kohya export (BFL names, fused qkv and linear1) reads back through
    load_lora as the same update of every transformer module as its diffusers/PEFT file, `vramfit
    inspect` says what each is (format, rank, Flux.1 at its width), and `vramfit generate --lora`
    renders the same image from either."""
    import numpy as np
    from PIL import Image

    from vramfit.formats.lora import load_lora

    out = tmp_path / "run"
    cache = cache_root / "flux-kohya"
    assert main(train_args(images, out, cache, *LORA, "lora.targets=['all_linear']", model="tiny:flux")) == 0
    peft, kohya = out / "m.safetensors", out / "m-kohya.safetensors"
    assert any(k.startswith("lora_unet_single_blocks_") for k in load_file(str(kohya)))
    capsys.readouterr()

    said = {}
    for path in (peft, kohya):
        assert main(["inspect", str(path), "--json"]) == 0
        said[path] = json.loads(capsys.readouterr().out)
    assert said[kohya]["format"] == "kohya" and said[peft]["format"] == "diffusers"
    assert all(s["for"] == "Flux.1 transformer (64 wide)" for s in said.values())
    # a fused module's rank is its parts' together: qkv 3 x 4, linear1 (q, k, v, MLP) 4 x 4
    assert said[peft]["rank"] == 4 and said[kohya]["rank"] == [4, 12, 16]

    def deltas(path):
        loaded = load_lora(path, FAMILIES.values())
        assert loaded.family == "flux"
        state = loaded.state
        return {k[:-len(".lora_A.weight")]: state[k.replace("lora_A", "lora_B")] @ state[k]
                * loaded.alphas[k[:-len(".lora_A.weight")]] / state[k].shape[0]
                for k in state if k.endswith(".lora_A.weight")}

    want, got = deltas(peft), deltas(kohya)
    assert set(got) == set(want) and any("single_transformer_blocks" in m for m in want)
    assert any(want[m].abs().max() > 0 for m in want)
    for module, delta in want.items():
        torch.testing.assert_close(got[module], delta, rtol=1e-4, atol=1e-7, msg=module)

    pics = {}
    for path in (peft, kohya):
        folder = tmp_path / f"pics-{path.stem}"
        assert main(["generate", "--model", "tiny:flux", "--prompt", "a red circle", "--steps", "2",
                     "--lora", str(path), "--out", str(folder), "--cache-dir", str(cache)]) == 0
        (png,) = folder.glob("*.png")
        pics[path] = np.asarray(Image.open(png), dtype=np.int16)
    plain = tmp_path / "pics-plain"
    assert main(["generate", "--model", "tiny:flux", "--prompt", "a red circle", "--steps", "2",
                 "--out", str(plain), "--cache-dir", str(cache)]) == 0
    base = np.asarray(Image.open(next(plain.glob("*.png"))), dtype=np.int16)
    assert np.abs(pics[peft] - base).max() > 0  # the LoRA changes the image
    assert np.abs(pics[kohya] - pics[peft]).max() <= 1
