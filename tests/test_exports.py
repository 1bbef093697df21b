"""What vramfit writes and reads at the edges: the LoRA files a run saves by default (and what
ComfyUI, A1111 and diffusers read of them), `vramfit inspect` on LoRA files, and checkpoints
whose tensors do not fit the architecture they describe. Tiny models, CPU, through the CLI."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import train_args
from vramfit.cli import main
from vramfit.config.schema import ModelConfig
from vramfit.data.synth import make_synthetic_dataset
from vramfit.formats import lora as L
from vramfit.formats.safetensors_io import CheckpointError
from vramfit.models.registry import detect_family
from vramfit.models.sources import resolve_source
from vramfit.models.parts import shipped_config
from vramfit.models.sdxl.family import CLIP_G, UNET, SDXLFamily
from vramfit.models.sdxl.kohya import kohya_unet_names

LORA = ("train.mode=lora", "lora.rank=4", "lora.alpha=8", "train.lr=1e-2", "save.name=m")
ATTENTION = {f"attn{i}.to_{x}" for i in (1, 2) for x in ("q", "k", "v", "out.0")}


def _keys(path) -> list[str]:
    with safe_open(str(path), "pt") as fh:
        return list(fh.keys())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_root):
    """An SDXL LoRA run with the default save formats (3 steps, a save every step, keep 1) and an
    SD3 LoRA run, both through the CLI."""
    root = tmp_path_factory.mktemp("lora-runs")
    images = root / "images"
    make_synthetic_dataset(images, n=4, size=64, seed=1)
    with pytest.MonkeyPatch.context() as mp:  # what the autouse _isolated_cache does per test
        mp.setenv("XDG_CACHE_HOME", str(cache_root / "xdg"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_HOME", str(cache_root / "hf"))
        assert main(train_args(images, root / "sdxl", cache_root / "ex", *LORA, "train.steps=3",
                               "save.every_steps=1", "save.keep_last=1", model="tiny:sdxl")) == 0
        assert main(train_args(images, root / "sd3", cache_root / "ex", *LORA, "train.steps=1",
                               model="tiny:sd3")) == 0
    return root


@pytest.fixture(scope="module")
def sdxl(cache_root):
    source = resolve_source(ModelConfig(path="tiny:sdxl"), cache_root / "ex")  # the runs' tiny model
    return detect_family(source).load(source)


# ---- LoRA files a run writes -----------------------------------------------------------------
def test_sdxl_lora_default_is_a_kohya_file_with_the_diffusers_file_beside_it(runs, sdxl):
    from vramfit.generate import build_pipeline, load_loras

    out = runs / "sdxl"
    names = sorted(p.name for p in out.glob("*.safetensors"))
    # the final pair, and of the intermediate saves only the newest pair (keep_last = 1)
    assert names == ["m-diffusers.safetensors", "m-step000002-diffusers.safetensors",
                     "m-step000002.safetensors", "m.safetensors"], names
    kohya, diffusers = load_file(str(out / "m.safetensors")), load_file(str(out / "m-diffusers.safetensors"))
    assert all(k.startswith("unet.") for k in diffusers)
    # every module of the diffusers file under its kohya (SGM) name, which ComfyUI and A1111 map
    sgm_names = ("lora_unet_input_blocks_", "lora_unet_middle_block_", "lora_unet_output_blocks_")
    to_kohya = {d: k for k, d in kohya_unet_names(shipped_config("tiny_sdxl_unet")).items()
                if k.startswith(sgm_names)}
    modules = {k[len("unet."):-len(".lora_A.weight")] for k in diffusers if k.endswith(".lora_A.weight")}
    assert {k.rsplit(".", 1)[0].rsplit(".", 1)[0] for k in kohya if k.endswith("lora_down.weight")} == \
        {to_kohya[m] for m in modules}
    assert {L.module_kind(m, 2) for m in modules} == ATTENTION and len(modules) == 136
    parts = ("lora_down.weight", "lora_up.weight", "alpha")
    assert set(kohya) == {f"{to_kohya[m]}.{part}" for m in modules for part in parts}
    assert all(float(v) == 8.0 for k, v in kohya.items() if k.endswith(".alpha"))
    assert not any(".kohya." in p.name for p in out.iterdir())
    # diffusers loads the diffusers file, and generate --lora the kohya file, to the same weights
    pipe = build_pipeline(sdxl)
    pipe.load_lora_weights(str(out / "m-diffusers.safetensors"), adapter_name="d")
    (kohya_adapter,) = load_loras(pipe, [(out / "m.safetensors", 1.0)])
    layers = [m for m in pipe.unet.modules() if hasattr(m, "lora_A") and "d" in m.lora_A]
    assert len(layers) == 136
    def delta(layer, name):
        return layer.scaling[name] * layer.lora_B[name].weight @ layer.lora_A[name].weight

    for layer in layers:
        torch.testing.assert_close(delta(layer, "d"), delta(layer, kohya_adapter))
        assert layer.scaling[kohya_adapter] == 2.0  # alpha 8 / rank 4, from the .alpha tensors
    assert any(bool(layer.lora_B["d"].weight.abs().sum() > 0) for layer in layers)  # it trained
    pipe.delete_adapters(["d", kohya_adapter])


def test_sd3_lora_default_is_one_diffusers_file(runs):
    out = runs / "sd3"
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["m.safetensors"]
    assert all(k.startswith("transformer.") for k in _keys(out / "m.safetensors"))


# ---- vramfit inspect -----------------------------------------------------------------------------
@pytest.mark.parametrize("name,lines", [
    ("sdxl/m.safetensors", ["format: kohya", "rank: 4", "alpha: 8.0", "targets: 136 modules (attn1.to_k 17,",
                            "for: SDXL-family UNet"]),
    ("sdxl/m-diffusers.safetensors", ["format: diffusers", "rank: 4",
                                      "alpha: 4.0 (trained with alpha 8.0, folded into lora_B)",
                                      "attn2.to_v 17)", "for: SDXL-family UNet"]),
    ("sd3/m.safetensors", ["format: diffusers", "alpha: 4.0 (trained with alpha 8.0",
                           "for: SD3 MMDiT (64 wide",
                           "targets: 8 modules (attn.to_k 2, attn.to_out.0 2, attn.to_q 2, attn.to_v 2)"]),
])
def test_inspect_describes_lora_files(runs, capsys, name, lines):
    assert main(["inspect", str(runs / name)]) == 0
    text = capsys.readouterr().out
    assert "a LoRA" in text and "no known model family" not in text
    for line in lines:
        assert line in text, (line, text)
    assert main(["inspect", str(runs / name), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "lora" and info["rank"] == 4 and sum(info["targets"]["kinds"].values()) == \
        info["targets"]["modules"]


def test_inspect_a_missing_file_names_the_path_only(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nope.safetensors'} does not exist" in err and "model.path" not in err


# ---- checkpoints whose tensors do not fit -------------------------------------------------------
def test_one_wrong_shaped_tensor_is_named_before_caching(images, tmp_path, cache_root, sdxl, capsys):
    state = load_file(str(sdxl.source.path))
    key = UNET + "input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight"
    state[key] = torch.zeros(64, 65)
    bad = tmp_path / "bad.safetensors"
    save_file(state, str(bad))
    cache = tmp_path / "cache"
    assert main(train_args(images, tmp_path / "out", cache, f"model.tokenizers={sdxl.source.path.parent}",
                           model=str(bad))) == 2
    err = capsys.readouterr().err
    assert f"{bad}: tensor {key} has shape [64, 65]" in err and "needs [64, 64]" in err, err
    assert not any(cache.rglob("*.safetensors"))  # refused at load: nothing was cached


def test_a_diffusers_folder_tensor_of_the_wrong_shape_is_named(sdxl, tmp_path):
    folder = tmp_path / "folder"
    SDXLFamily().save_diffusers(sdxl, folder, torch.float32)
    file = folder / "text_encoder_2" / "model.safetensors"
    state = load_file(str(file))
    key = next(k for k in state if k.endswith("layers.0.self_attn.q_proj.weight"))
    state[key] = torch.zeros(64, 65)
    save_file(state, str(file), metadata={"format": "pt"})
    message = rf"{file}: tensor {key} has shape \[64, 65\].*needs \[64, 64\]"
    with pytest.raises(CheckpointError, match=message):
        SDXLFamily()._load_diffusers(folder)


def test_size_embedding_width_is_read_and_an_impossible_one_refused(sdxl, tmp_path):
    """label_emb's input width = pooled (64 here) + 6 x addition_time_embed_dim: a file with 6 x 264
    loads with 264 and trains on SDXL's conditioning; one with no whole width is refused at load."""
    state = load_file(str(sdxl.source.path))
    assert state[CLIP_G + "text_projection"].shape[1] == 64
    wide = tmp_path / "wide.safetensors"
    state[UNET + "label_emb.0.0.weight"] = torch.randn(128, 64 + 6 * 264) * 0.02
    save_file(state, str(wide))
    unet, _, _ = SDXLFamily()._load_single_file(wide)
    assert unet.config.addition_time_embed_dim == 264
    out = unet(torch.zeros(1, 4, 8, 8), torch.tensor([10]), encoder_hidden_states=torch.zeros(1, 77, 128),
               added_cond_kwargs={"text_embeds": torch.zeros(1, 64), "time_ids": torch.ones(1, 6)}).sample
    assert out.shape == (1, 4, 8, 8)
    state[UNET + "label_emb.0.0.weight"] = torch.zeros(128, 64 + 6 * 264 + 1)
    odd = tmp_path / "odd.safetensors"
    save_file(state, str(odd))
    with pytest.raises(CheckpointError, match=rf"{odd}: label_emb.0.0.weight takes 1649 inputs"):
        SDXLFamily()._load_single_file(odd)
