"""Adapter types (lora.type, lora.conv_rank): each exports tensors that ComfyUI's formulas turn into
exactly peft's merged weights, trains and resumes exactly, renders in `vramfit generate`, and the
combinations without a file format are refused up front, naming the key."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import SIZE, train_args
from test_lora_formats import _forward, _pipeline
from vramfit.cli import main
from vramfit.config.rules import config_problems
from vramfit.config.schema import LoraSettings, ModelConfig, RunConfig
from vramfit.formats import lora as L
from vramfit.models.registry import FAMILIES, detect_family
from vramfit.models.sdxl import kohya as K
from vramfit.models.sources import resolve_source
from vramfit.train.lora import apply_lora, lora_state

RANK, ALPHA, CONV_RANK, CONV_ALPHA = 4, 6.0, 2, 3.0  # every scale != 1, convs' != linears'
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def sdxl(cache_root):
    source = resolve_source(ModelConfig(path="tiny:sdxl"), cache_root)
    return detect_family(source).load(source)


def _adapted(bundle, kind: str):
    """The tiny SDXL UNet (fp32) with an adapter of `kind` as training adds it, every trainable
    tensor moved off its initial value (LoKr's w1 and LoRA's B start at zero)."""
    model = copy.deepcopy(bundle.denoiser).float()
    settings = LoraSettings(type=kind, rank=RANK, alpha=ALPHA, conv_rank=CONV_RANK, conv_alpha=CONV_ALPHA)
    apply_lora(model, settings)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def _comfy_weight(weight: torch.Tensor, parts: dict) -> torch.Tensor:
    """One module of a kohya file applied at strength 1 the way ComfyUI does (comfy/weight_adapter/
    lora.py, loha.py, lokr.py and base.py's weight_decompose), written here from that source."""
    alpha = float(parts["alpha"]) if "alpha" in parts else None
    dim = None
    if "lora_down.weight" in parts:  # mm of the flattened up and down, reshaped to the weight
        down, up = parts["lora_down.weight"], parts["lora_up.weight"]
        dim = down.shape[0]
        diff = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
    elif "hada_w1_a" in parts:
        dim = parts["hada_w1_b"].shape[0]
        diff = ((parts["hada_w1_a"] @ parts["hada_w1_b"]) * (parts["hada_w2_a"] @ parts["hada_w2_b"]))
        diff = diff.reshape(weight.shape)
    else:
        if "lokr_w1" in parts:
            w1 = parts["lokr_w1"]
        else:
            dim, w1 = parts["lokr_w1_b"].shape[0], parts["lokr_w1_a"] @ parts["lokr_w1_b"]
        if "lokr_w2" in parts:
            w2 = parts["lokr_w2"]
        else:
            dim, w2 = parts["lokr_w2_b"].shape[0], parts["lokr_w2_a"] @ parts["lokr_w2_b"]
        if w2.dim() == 4:
            w1 = w1.unsqueeze(2).unsqueeze(2)
        diff = torch.kron(w1, w2).reshape(weight.shape)
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    calc = weight + scale * diff
    if "dora_scale" not in parts:
        return calc
    dora = parts["dora_scale"]
    assert dora.shape[0] == weight.shape[0]  # the output-axis branch: norms of the frozen weight
    norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
    norm = norm.reshape(weight.shape[0], *[1] * (weight.dim() - 1)) + EPS
    return calc * (dora / norm)


@pytest.mark.parametrize("kind", ["lora", "dora", "lokr", "loha"])
def test_kohya_export_applied_as_comfyui_does_is_peft_merged_weight(sdxl, kind, tmp_path):
    model = _adapted(sdxl, kind)
    config = dict(model.config)
    kohya = K.to_kohya_sdxl(lora_state(model), config, ALPHA)  # as a run's save does: lora.alpha
    L.save_lora(tmp_path / "k.safetensors", kohya)
    told = L.describe_lora(tmp_path / "k.safetensors", FAMILIES.values())  # what `vramfit inspect` says
    assert told["format"] == "kohya" and told.get("adapter", "lora") == kind
    assert told["targets"]["modules"] == len({k.partition(".")[0] for k in kohya})
    names = K.kohya_unet_names(config)
    modules: dict[str, dict] = {}
    for key, t in kohya.items():
        name, _, part = key.partition(".")
        modules.setdefault(names[name], {})[part] = t
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "merge") and hasattr(m, "get_base_layer")}
    assert modules.keys() == layers.keys()
    convs = [n for n, m in layers.items() if isinstance(m.get_base_layer(), torch.nn.Conv2d)]
    assert convs and all(".resnets." in n or "samplers." in n for n in convs)
    part_names = {p for parts in modules.values() for p in parts}
    expect = {"lora": {"lora_down.weight", "lora_up.weight", "alpha"},
              "dora": {"lora_down.weight", "lora_up.weight", "alpha", "dora_scale"},
              "loha": {*L.LOHA_PARTS, "alpha"},
              # rank 4 leaves the small linears' factors whole, the convs' w2 factored
              "lokr": {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha"}}[kind]
    assert part_names == expect
    if kind == "lora":
        assert modules[convs[0]]["lora_down.weight"].shape[0] == CONV_RANK  # 4-D, with the kernel
        assert modules[convs[0]]["lora_down.weight"].dim() == 4
    for name, layer in layers.items():
        base = layer.get_base_layer().weight.detach().clone()
        want = _comfy_weight(base, modules[name])
        layer.merge()
        torch.testing.assert_close(want, layer.get_base_layer().weight.detach(), rtol=1e-5, atol=1e-6)


def test_dora_diffusers_file_loads_in_the_pipeline_as_trained(sdxl, tmp_path):
    model = _adapted(sdxl, "dora")
    tensors = L.to_diffusers(lora_state(model), "unet", ALPHA)
    assert any(k.endswith(".lora_magnitude_vector") for k in tensors)
    L.save_lora(tmp_path / "d.safetensors", tensors)
    pipe = _pipeline(sdxl)
    pipe.load_lora_weights(str(tmp_path / "d.safetensors"), adapter_name="x")
    torch.testing.assert_close(_forward(pipe.unet.float()), _forward(model), rtol=1e-4, atol=1e-5)


def test_lokr_with_convs_trains_and_resumes_exactly_and_renders(images, tmp_path, cache_root, capsys):
    sets = ("train.mode=lora", "lora.type=lokr", "lora.rank=4", "lora.conv_rank=2", "lora.lokr_factor=4",
            "train.lr=1e-2", "train.steps=4", "save.state_every_steps=2", "save.name=m")
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(train_args(images, full, cache_root / "ad1", *sets, model="tiny:sdxl")) == 0
    args = train_args(images, part, cache_root / "ad1", *sets, model="tiny:sdxl")
    assert main(args + ["--resume", str(full / "state" / "step-000002")]) == 0
    a, b = load_file(str(full / "m.safetensors")), load_file(str(part / "m.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((part / "run.json").read_text())["start_step"] == 2  # it did resume
    assert any(k.endswith(".lokr_w2_b") for k in a)
    first = load_file(str(full / "state" / "step-000002" / "weights.safetensors"))
    assert any(not torch.equal(first[k], v) for k, v in
               load_file(str(full / "state" / "step-000004" / "weights.safetensors")).items())
    assert not (full / "m-diffusers.safetensors").exists()  # no diffusers layout for LoKr
    capsys.readouterr()
    out = tmp_path / "gen"
    assert main(["generate", "--no-progress", "--model", "tiny:sdxl", "--prompt", "a", "--steps", "2",
                 "--width", str(SIZE), "--height", str(SIZE), "--lora", str(full / "m.safetensors"),
                 "--out", str(out)]) == 0
    assert len(list(out.glob("*.png"))) >= 1


def test_lycoris_file_as_lora_gives_the_same_update(sdxl):
    model = _adapted(sdxl, "loha")
    config = dict(model.config)
    kohya = K.to_kohya_sdxl(lora_state(model), config, ALPHA)
    names = K.kohya_unet_names(config)
    shapes = {n: tuple(m.get_base_layer().weight.shape) for n, m in model.named_modules()
              if hasattr(m, "get_base_layer") and hasattr(m, "merge")}
    plain = L.lycoris_to_lora(kohya, {k: v for k, v in names.items() if v in shapes}, shapes, "unet")
    for module, shape in shapes.items():
        a, b = plain[f"unet.{module}.lora_A.weight"], plain[f"unet.{module}.lora_B.weight"]
        if a.dim() == 4:  # the identity conv unfolds each patch; the 1x1 lora_B mixes it
            got = (b.flatten(1) @ a.flatten(1)).reshape(shape)
        else:
            got = b @ a
        want = _comfy_weight(torch.zeros(shape), {p: t for k, t in kohya.items()
                                                  for n, _, p in [k.partition(".")] if names[n] == module})
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("lora, save, key", [
    ({"conv_alpha": 2.0}, {}, "lora.conv_alpha"),
    ({"lokr_factor": 4}, {}, "lora.lokr_factor"),
    ({"type": "loha", "dropout": 0.1}, {}, "lora.dropout"),
    ({"type": "lokr"}, {"formats": ["lora"]}, "lora.type"),
    ({"type": "dora", "base_quantization": "int8"}, {}, "lora.type"),
])
def test_adapter_settings_that_need_another_are_refused(lora, save, key):
    cfg = RunConfig.model_construct(train=RunConfig().train.model_copy(update={"mode": "lora"}),
                                    lora=LoraSettings(**lora), save=RunConfig().save.model_copy(update=save))
    assert [k for k, _ in config_problems(cfg)] == [key]  # (tests/test_rules.py tries every rule)


def test_loha_default_formats_leave_diffusers_out():
    cfg = RunConfig.model_validate({"train": {"mode": "lora"}, "lora": {"type": "loha"}})
    assert cfg.save_formats == ["lora_kohya"]
    assert RunConfig.model_validate({"train": {"mode": "lora"}}).save_formats == ["lora", "lora_kohya"]


@pytest.mark.parametrize("model, extra, message", [
    ("tiny:sd3", ("lora.type=lokr",), "lora.type: 'lokr' is written in kohya/LyCORIS keys for SDXL-family"),
    ("tiny:sd3", ("lora.conv_rank=2",), "lora.conv_rank: SD3's transformer blocks have no convolutions"),
    ("tiny:flux", ("lora.type=dora",), "lora.type: 'dora' has no kohya Flux.1 layout"),
    ("tiny:sdxl", ("lora.type=loha", "save.formats=['lora']"), "lora.type: 'loha' has no diffusers layout"),
])
def test_combinations_without_a_format_are_refused_before_training(images, tmp_path, cache_root, capsys,
                                                                   model, extra, message):
    assert main(train_args(images, tmp_path / "run", cache_root / "ad2", "train.mode=lora", *extra,
                           model=model)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "run.json").exists()


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_conv_adapter_runs_over_a_bf16_base(sdxl, kind):
    """full_bf16: linears' adapters compute in bf16 (memory/lora_compute.py); a conv's keeps peft's
    cast of its input to its fp32 weights."""
    from vramfit.memory.lora_compute import lora_in_base_dtype

    model = copy.deepcopy(sdxl.denoiser).to(torch.bfloat16)
    apply_lora(model, LoraSettings(type=kind, conv_rank=2))
    lora_in_base_dtype(model)
    conv = model.down_blocks[0].resnets[0].conv1
    x = torch.randn(1, conv.get_base_layer().in_channels, 8, 8, dtype=torch.bfloat16)
    assert conv(x).dtype == torch.bfloat16


@pytest.mark.parametrize("model", ["tiny:sd3", "tiny:flux"])
def test_transformer_dora_file_is_read_by_comfyui_and_diffusers_as_trained(images, tmp_path, cache_root, model):
    """SD3 and Flux.1 DoRA, trained through the CLI and saved as their "lora" file (the one ComfyUI
    reads for them): applied as ComfyUI applies lora_A/lora_B and dora_scale, every module gives
    peft's merged weight; diffusers' loader takes the same file (it drops dora_scale and reads the
    magnitude)."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from vramfit.lora_tools import load_model

    out = tmp_path / "run"
    sets = ("train.mode=lora", "lora.type=dora", "lora.rank=2", "train.steps=2", "train.lr=1e-2",
            "save.formats=['lora']", "save.name=m")
    assert main(train_args(images, out, cache_root / "ad3", *sets, model=model)) == 0
    saved = load_file(str(out / "m.safetensors"))
    modules: dict[str, dict] = {}
    for key, t in saved.items():
        comp, rest = key.split(".", 1)
        assert comp == "transformer"
        for part in ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector", "dora_scale"):
            if rest.endswith("." + part):
                modules.setdefault(rest[:-len(part) - 1], {})[part] = t
    assert modules and all(len(parts) == 4 for parts in modules.values())
    _, bundle = load_model(model, t5=False)
    base = dict(bundle.denoiser.named_modules())
    # peft's merge of the same file into the same base, through diffusers' loader
    cls = SD3Transformer2DModel if model == "tiny:sd3" else FluxTransformer2DModel
    merged = cls.from_config(bundle.denoiser.config).to(bundle.denoiser.dtype)
    merged.load_state_dict(bundle.denoiser.state_dict())
    merged.load_lora_adapter({k: v for k, v in saved.items() if not k.endswith("dora_scale")},
                             prefix="transformer", adapter_name="x")
    merged.fuse_lora()
    fused = dict(merged.named_modules())
    for name, parts in modules.items():
        weight = base[name].weight.detach().float()
        comfy = _comfy_weight(weight, {"lora_down.weight": parts["lora_A.weight"].float(),
                                       "lora_up.weight": parts["lora_B.weight"].float(),
                                       "dora_scale": parts["dora_scale"].float()})
        torch.testing.assert_close(comfy, fused[name].weight.detach().float(), rtol=1e-3, atol=1e-4, msg=name)
