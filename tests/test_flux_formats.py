"""Flux.1 files as they are released and shared: float8-stored transformers (flux1-dev-fp8, ComfyUI's
scaled fp8), a t5xxl fp8 file as model.t5, kohya LoRAs read and inspected, the schnell variant, and
the planner at full size. Every file is built from the tiny model."""
from __future__ import annotations

import json
import math
import shutil
import struct

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from conftest import train_args
from vramfit.cli import main
from vramfit.config.load import load_config
from vramfit.config.schema import ModelConfig, RunConfig
from vramfit.fit.model_facts import T5_XXL, read_facts
from vramfit.fit.planner import predict
from vramfit.formats.clip import to_sgm_clip_keys
from vramfit.formats.ldm_vae import diffusers_to_ldm_vae
from vramfit.formats.lora import load_lora
from vramfit.formats.safetensors_io import CheckpointError
from vramfit.models.adapter import t5_tokens
from vramfit.memory.quantize import QuantizedLinear, dequantize, quantize_base
from vramfit.models.flux.bfl import bfl_to_diffusers, diffusers_to_bfl, flux_config_from_keys
from vramfit.models.parts import shipped_config
from vramfit.models.registry import FAMILIES, detect_family
from vramfit.models.sources import resolve_source
from vramfit.train.setup import place_denoiser

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
    for tok in ("tokenizer", "tokenizer_2"):
        shutil.copytree(src.parent / tok, folder / tok)


KEPT = "img_in.weight"  # left in the scaled file's precision, as ComfyUI's files keep some layers


def _scaled_fp8(state: dict) -> tuple[dict, dict]:
    """`state` as ComfyUI's scaled fp8 file holds it (each linear weight but KEPT as codes, with one
    scale, or one per row for every third, under either key name; input scales; the marker), and
    {weight (prefix stripped): (codes, scale per row as [rows, 1])}."""
    scaled, codes = dict(state), {}
    for i, (key, w) in enumerate(sorted((k, v) for k, v in state.items()
                                        if k.startswith(CORE) and k.endswith(".weight") and v.ndim == 2
                                        and k != CORE + KEPT)):
        scale = (w.abs().amax(dim=1) if i % 3 == 2 else w.abs().amax()) / 448 * (1.5 if i % 2 else 1.0)
        q = (w / scale.reshape(-1, 1)).to(torch.float8_e4m3fn)
        scaled[key] = q
        name = "scale_weight" if i % 2 else "weight_scale"
        scaled[key[:-len("weight")] + name] = scale.reshape(-1) if scale.ndim else scale.reshape(())
        scaled[key[:-len("weight")] + ("scale_input" if i % 2 else "input_scale")] = torch.ones(())
        codes[key[len(CORE):]] = (q, scale.reshape(-1, 1).expand(q.shape[0], 1))
    scaled[CORE + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return scaled, codes


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

    scaled, codes = _scaled_fp8(state)
    want = {k: (q.float() * scale).to(torch.bfloat16) for k, (q, scale) in codes.items()}
    save_file(scaled, str(folder / "scaled.safetensors"))
    bundle = _load(folder / "scaled.safetensors", tmp_path / "c")
    entries = FAMILIES["flux"].transformer_bfl_entries(bundle, torch.bfloat16)
    bfl = {k: e.produce() for k, e in entries.items()}
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
    int8 = dict(scaled)
    int8[CORE + key] = scaled[CORE + key].float().to(torch.int8)
    save_file(int8, str(folder / "int8.safetensors"))
    with pytest.raises(CheckpointError, match=rf"int8\.safetensors: tensor {CORE}{key} is stored as int8 "
                                              "with a scale"):
        _load(folder / "int8.safetensors", tmp_path / "c")
    odd = dict(scaled)
    for name in ("scale_weight", "weight_scale"):
        if CORE + key[:-len("weight")] + name in odd:
            odd[CORE + key[:-len("weight")] + name] = torch.ones(3, 5)
    save_file(odd, str(folder / "odd.safetensors"))
    with pytest.raises(CheckpointError, match=r"odd\.safetensors: tensor .* has a scale of shape \[3, 5\]"):
        _load(folder / "odd.safetensors", tmp_path / "c")


def test_fp8_lora_base_keeps_the_file_values(tiny_file, tmp_path, images, cache_root):
    """lora.base_quantization = fp8 over a float8_e4m3fn transformer keeps the file's codes and scales
    (1 for a plain fp8 file; ComfyUI's, per tensor or per row, for a scaled one; through the split
    qkv and the swapped norm_out): each base weight dequantizes to the file's value times its scale
    exactly, in bf16 and fp32 training, where quantizing the widened weight again rounds it a second
    time. A linear a file does not store in fp8 is quantized as before, and a LoRA trains over the
    scaled file's base."""
    state = load_file(str(tiny_file))
    core = sorted(k for k, v in state.items() if k.startswith(CORE) and k.endswith(".weight") and v.ndim == 2)
    plain = {k: v.to(torch.float8_e4m3fn) if k.startswith(CORE) else v for k, v in state.items()}
    scaled, codes = _scaled_fp8(state)
    ones = {k[len(CORE):]: (plain[k], torch.ones(plain[k].shape[0], 1)) for k in core}
    files = {"plain": (ones, "full_bf16"),
             "scaled": (codes, "mixed_bf16")}
    folder = tmp_path / "files"
    folder.mkdir()
    _copy_tokenizers(tiny_file, folder)
    save_file(plain, str(folder / "plain.safetensors"))
    save_file(scaled, str(folder / "scaled.safetensors"))

    def placed(path, precision):
        cfg = load_config(None, [f"model.path={path}", f"cache.dir={tmp_path / 'c'}", "train.device=cpu",
                                 "train.mode=lora", "lora.base_quantization=fp8", "lora.rank=4",
                                 f"train.precision={precision}", "train.gradient_checkpointing=false"],
                          need_data=False)
        bundle = _load(path, tmp_path / "c")
        widened = {n: m.weight.detach().clone() for n, m in bundle.denoiser.named_modules()
                   if isinstance(m, torch.nn.Linear)}
        place_denoiser(bundle, cfg, torch.device("cpu"))
        return {n.removesuffix(".base_layer"): m for n, m in bundle.denoiser.named_modules()
                if isinstance(m, QuantizedLinear)}, widened

    def requantized(weight: torch.Tensor) -> torch.Tensor:
        """`weight` stored as an fp8 base by quantize_base, as a weight not read from fp8 is."""
        fresh = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False)).requires_grad_(False)
        fresh[0].weight.data = weight
        quantize_base(fresh, "fp8")
        return fresh[0].weight

    config = flux_config_from_keys({k[len(CORE):]: v for k, v in state.items() if k.startswith(CORE)})
    for name, (file_codes, precision) in files.items():
        layers, widened = placed(folder / f"{name}.safetensors", precision)
        dtype = torch.bfloat16 if precision == "full_bf16" else torch.float32
        # the file's codes and per-row scales, under the transformer's own (split, swapped) names
        rows = bfl_to_diffusers({k: q.float() for k, (q, _) in file_codes.items()}, config)
        scales = bfl_to_diffusers({k: s.reshape(-1) for k, (_, s) in file_codes.items()}, config)
        assert set(layers) == {k.removesuffix(".weight") for k in {*rows, "x_embedder.weight"}}, name
        if name == "scaled":  # a linear the file keeps in float32 is quantized as before
            kept = layers.pop("x_embedder")
            want = requantized(widened["x_embedder"].to(dtype))
            assert torch.equal(kept.weight.qdata, want.qdata) and torch.equal(kept.weight.scale, want.scale)
        again = 0
        for module, layer in layers.items():
            q, s = rows[module + ".weight"], scales[module + ".weight"].reshape(-1, 1)
            assert torch.equal(layer.weight.qdata.float(), q) and torch.equal(layer.weight.scale, s), module
            torch.testing.assert_close(dequantize(layer.weight), (q * s).to(dtype), rtol=0, atol=0)
            fresh = requantized(widened[module].to(dtype))
            again += not torch.equal(dequantize(fresh), dequantize(layer.weight))
        assert again > len(layers) / 2, name  # quantized afresh, most weights would differ

    layers, widened = placed(tiny_file, "full_bf16")  # a float32 file: no codes to keep
    for module, layer in layers.items():
        want = requantized(widened[module].to(torch.bfloat16))
        assert torch.equal(layer.weight.qdata, want.qdata) and torch.equal(layer.weight.scale, want.scale)

    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "flux-fp8", *LORA, "lora.base_quantization=fp8",
                           f"model.tokenizers={folder}", model=str(folder / "scaled.safetensors"))) == 0
    assert (out / "m.safetensors").is_file()


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
    t5_file = folder / "t5xxl_fp8_e4m3fn.safetensors"
    bundle = _load(folder / "no-t5.safetensors", tmp_path / "c", t5=str(t5_file))
    assert len(bundle.text_encoders) == 2
    t5 = bundle.text_encoders[1].state_dict()
    assert torch.equal(t5["encoder.block.0.layer.0.SelfAttention.q.weight"],
                       state[T5 + "encoder.block.0.layer.0.SelfAttention.q.weight"].to(torch.float8_e4m3fn)
                       .to(torch.bfloat16))
    bundle.text_encoders[1].float()
    out = FAMILIES["flux"].encode_text(bundle, ["a red circle"], torch.device("cpu"), torch.float32)
    assert out["prompt_embeds"].abs().sum() > 0


def test_kohya_flux_lora_is_read_inspected_and_rendered_as_the_peft_file(images, tmp_path, cache_root,
                                                                         capsys):
    """A trained tiny Flux LoRA's kohya export (BFL names, fused qkv and linear1) reads back through
    load_lora as the same update of every transformer module as its diffusers/PEFT file, `vramfit
    inspect` says what each is (format, rank, Flux.1 at its width), and `vramfit generate --lora`
    renders the same image from either."""
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


_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}


def _header_only_file(path, parts: dict) -> None:
    """A safetensors file with every key and shape of `parts` ({prefix: (dtype, state)}) whose data
    is a hole (a sparse file): what the planner reads of a released checkpoint."""
    header, offset = {}, 0
    for prefix, (dtype, state) in parts.items():
        for key, t in state.items():
            n = math.prod(t.shape) * _BYTES[dtype]
            header[prefix + key] = {"dtype": dtype, "shape": list(t.shape),
                                    "data_offsets": [offset, offset + n]}
            offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        fh.truncate(8 + len(blob) + offset)


def test_full_size_flux_dev_plan_weighs_its_parameters(tmp_path):
    """A Flux.1 dev all-in-one file at its released size (built on meta, written header-only as
    ComfyUI's flux1-dev-fp8 holds it: the transformer in float8, the T5 in float8) is planned
    from its headers: the transformer's 11.9 B parameters are the train phase's weights (2 bytes
    each under a bf16 LoRA base, about 1 under int8, a few blocks when streamed)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    dev = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
               num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
               guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**dev)
        vae = AutoencoderKL(**{**shipped_config("tiny_flux_vae"), "block_out_channels": [128, 256, 512, 512],
                               "layers_per_block": 2, "norm_num_groups": 32})
        clip = CLIPTextModel(CLIPTextConfig(**shipped_config("clip_l")))
        t5 = T5EncoderModel(T5Config(**T5_XXL))
    params = sum(p.numel() for p in transformer.parameters())
    assert params == pytest.approx(11.9e9, rel=0.01)
    path = tmp_path / "flux1-dev-fp8.safetensors"
    _header_only_file(path, {CORE: ("F8_E4M3", diffusers_to_bfl(transformer.state_dict())),
                             "first_stage_model.": ("BF16", diffusers_to_ldm_vae(vae.state_dict())),
                             "text_encoders.clip_l.transformer.": ("F16",
                                                                   to_sgm_clip_keys(clip.state_dict())),
                             T5: ("F8_E4M3", t5.state_dict())})
    base = {"model": {"path": str(path)}, "data": {"resolution": 1024, "max_aspect": 1.0}}
    facts = read_facts(RunConfig.model_validate(base), tmp_path / "cache")
    assert facts.family == "flux" and facts.config["guidance_embeds"] is True
    assert sum(p.numel() for p in facts.denoiser.parameters()) == params

    def train(**sections):
        cfg = RunConfig.model_validate({**base, **sections})
        return next(p for p in predict(facts, cfg).phases if p.name == "train").parts

    GIB = 2**30
    lora = {"mode": "lora", "optimizer": "adamw"}
    bf16 = train(train=lora)
    assert bf16["weights"] / GIB == pytest.approx(params * 2 / GIB, rel=0.02)  # ~22.2 GiB
    int8 = train(train=lora, lora={"base_quantization": "int8"})
    assert int8["weights"] / GIB == pytest.approx(params / GIB, rel=0.05)  # ~11.1 GiB
    streamed = train(train=lora, memory={"stream_weights": True})
    assert streamed["weights"] < bf16["weights"] / 10
    assert 0 < bf16["saved"] < 24 * GIB  # the 1024 activations, checkpointed: a few GiB
    # dev's 512 T5 tokens (model.max_sequence_length unset) beside the 4096 image tokens, not 77
    short = train(train=lora, model={"path": str(path), "max_sequence_length": 77})
    assert bf16["saved"] / short["saved"] == pytest.approx((4096 + 512) / (4096 + 77), rel=0.01)


def test_t5_tokens_default_per_family_and_variant(tmp_path):
    """model.max_sequence_length unset: captions get the model's own T5 length (Flux.1 dev 512,
    schnell 256, SD3 77, as before), in the tokenizers training encodes with, the loaded bundle and
    the planner's activations; set, it is used for every family."""
    def cfg(path, **model):
        return RunConfig.model_validate({"model": {"path": path, **model}, "data": {"resolution": 64}})

    for path, family, want in (("tiny:flux", "flux", 512), ("tiny:flux-schnell", "flux", 256),
                               ("tiny:sd3", "sd3", 77)):
        source = resolve_source(ModelConfig(path=path), tmp_path)
        tokenizers = FAMILIES[family].caption_tokenizers(source, cfg(path))
        assert tokenizers[-1].model_max_length == want, path
        assert FAMILIES[family].caption_tokenizers(source, cfg(path, max_sequence_length=40))[-1] \
            .model_max_length == 40
        facts = read_facts(cfg(path), tmp_path)
        assert t5_tokens(FAMILIES[family], cfg(path), facts.config) == want
        if family == "flux":
            assert detect_family(source).load(source).extra["max_sequence_length"] == want
            hidden = [next(p for p in predict(facts, c).phases if p.name == "cache_text")
                      .parts["hidden states"] for c in (cfg(path), cfg(path, max_sequence_length=want // 2))]
            assert hidden[0] == 2 * hidden[1]
