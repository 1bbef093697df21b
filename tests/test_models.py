"""Loading and saving real formats with tiny models of the real classes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vramfit.config.schema import ModelConfig, TrainConfig
from vramfit.formats.safetensors_io import CheckpointError
from vramfit.models.registry import detect_family
from vramfit.models.sources import SourceError, resolve_source


def _load(path: str, **kw):
    source = resolve_source(ModelConfig(path=path, **kw))
    family = detect_family(source)
    return family, family.load(source)


@pytest.mark.parametrize("name,mid", [("sdxl", "UNetMidBlock2DCrossAttn"), ("ssd1b", "UNetMidBlock2D")])
def test_single_file_round_trip_is_exact(name, mid, tmp_path):
    family, bundle = _load(f"tiny:{name}")
    assert bundle.denoiser.config.mid_block_type == mid
    out = tmp_path / "saved.safetensors"
    family.save_single_file(bundle, out, torch.float32, {"k": "v"})
    original, saved = load_file(str(bundle.source.path)), load_file(str(out))
    assert set(original) == set(saved)
    for key in original:
        assert torch.equal(original[key], saved[key]), key
    # and the saved file loads back to the same modules
    shutil.copytree(bundle.source.path.parent / "tokenizer", tmp_path / "tokenizer")
    shutil.copytree(bundle.source.path.parent / "tokenizer_2", tmp_path / "tokenizer_2")
    _, again = _load(str(out))
    for a, b in ((bundle.denoiser, again.denoiser), (bundle.vae, again.vae),
                 *zip(bundle.text_encoders, again.text_encoders)):
        sa, sb = a.state_dict(), b.state_dict()
        assert set(sa) == set(sb)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_unet_conversion_matches_diffusers_single_file_loader(tmp_path):
    from diffusers import UNet2DConditionModel

    family, bundle = _load("tiny:sdxl")
    config_dir = tmp_path / "cfg" / "unet"
    config_dir.mkdir(parents=True)
    (config_dir / "config.json").write_text(json.dumps(dict(bundle.denoiser.config)))
    theirs = UNet2DConditionModel.from_single_file(str(bundle.source.path), config=str(tmp_path / "cfg"),
                                                   subfolder="unet", local_files_only=True)
    ours, ref = bundle.denoiser.state_dict(), theirs.state_dict()
    assert set(ours) == set(ref)
    for k in ours:
        assert torch.equal(ours[k], ref[k].to(ours[k].dtype)), k


def test_text_encoding_shapes_and_pooled_from_bigG():
    family, bundle = _load("tiny:ssd1b")
    out = family.encode_text(bundle, ["a red circle", ""], torch.device("cpu"), torch.float32)
    assert out["prompt_embeds"].shape == (2, 77, 128)  # 64 (CLIP-L) + 64 (bigG), penultimate layers
    assert out["pooled"].shape == (2, 64)
    assert not torch.equal(out["prompt_embeds"][0], out["prompt_embeds"][1])


def test_gradient_checkpointing_gives_the_same_gradients():
    from vramfit.train.engine import micro_step_loss

    family, bundle = _load("tiny:sdxl")
    unet = bundle.denoiser.float().train()
    text = family.encode_text(bundle, ["a blue square", "a red circle"], torch.device("cpu"), torch.float32)
    pixels = torch.rand(2, 3, 64, 64) * 2 - 1
    enc = family.encode_images(bundle, pixels, torch.device("cpu"), torch.float32, tiling=False)
    batch = {**enc, **text, "time_ids": torch.tensor([[64, 64, 0, 0, 64, 64]] * 2, dtype=torch.float32)}
    cfg = TrainConfig(precision="fp32")
    grads = []
    for checkpointing in (False, True):
        unet.enable_gradient_checkpointing() if checkpointing else unet.disable_gradient_checkpointing()
        unet.zero_grad(set_to_none=True)
        loss = micro_step_loss(family, bundle, batch, cfg, torch.Generator().manual_seed(3),
                               torch.device("cpu"), torch.float32)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in unet.named_parameters()})
    assert unet.is_gradient_checkpointing
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7)


def test_refuses_pickle_and_truncated_files(tmp_path):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"not really")
    with pytest.raises(SourceError, match="allow_pickle"):
        _load(str(ckpt))
    with pytest.raises(SourceError, match="could not be read as a weights-only pickle"):
        _load(str(ckpt), allow_pickle=True)
    _, bundle = _load("tiny:sdxl")
    data = bundle.source.path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        _load(str(cut))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(CheckpointError, match="malformed"):
        _load(str(junk))


def test_other_families_are_named_not_misloaded(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "flux.safetensors"  # a family vramfit trains now: a damaged one is named so
    save_file({"model.diffusion_model.double_blocks.0.img_attn.qkv.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(CheckpointError, match="not a Flux transformer: missing key 'img_in.weight'"):
        _load(str(path))
    sd15 = tmp_path / "sd15.safetensors"
    save_file({"cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": torch.zeros(2, 2)},
              str(sd15))
    with pytest.raises(CheckpointError, match="Stable Diffusion 1.x"):
        _load(str(sd15))


def _fake_hub_cache(hf_home: Path, repo: str, folder: Path) -> None:
    """Lay out a diffusers folder the way huggingface_hub's cache stores a snapshot."""
    commit = "0" * 40
    base = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    shutil.copytree(folder, base / "snapshots" / commit)


def test_repo_id_offline_uses_local_cache_or_says_what_to_do(tmp_path, cache_root, monkeypatch):
    family, bundle = _load("tiny:ssd1b")
    folder = tmp_path / "diffusers"
    family.save_diffusers(bundle, folder, torch.float32)
    hf_home = tmp_path / "hf"
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    _fake_hub_cache(hf_home, "someone/tiny-ssd1b", folder)
    source = resolve_source(ModelConfig(path="someone/tiny-ssd1b"))
    assert source.kind == "diffusers" and (source.path / "model_index.json").is_file()
    again = detect_family(source).load(source)
    assert again.layout == bundle.layout
    with pytest.raises(SourceError, match="not in the local Hugging Face cache"):
        resolve_source(ModelConfig(path="someone/not-downloaded"))


def test_a_repo_id_without_its_weights_fetches_only_configs_and_tokenizers(tmp_path, monkeypatch):
    """`vramfit data` counts caption tokens of a repo id: configs and tokenizers, never the weights."""
    from vramfit.models import sources

    asked = []

    def fake_download(repo_id, revision=None, allow_patterns=None, local_files_only=False):
        asked.append(allow_patterns)
        (tmp_path / "snap").mkdir(exist_ok=True)
        (tmp_path / "snap" / "model_index.json").write_text("{}")
        return str(tmp_path / "snap")

    monkeypatch.setattr(sources, "snapshot_download", fake_download)
    light = resolve_source(ModelConfig(path="someone/big-model"), weights=False)
    assert light.kind == "diffusers" and not any(p.endswith(".safetensors") for p in asked[0])
    assert "tokenizer*/*" in asked[0] and "model_index.json" in asked[0]
    resolve_source(ModelConfig(path="someone/big-model"))  # a run: the weights too
    assert "*/*.safetensors" in asked[1]


@pytest.mark.parametrize("projection,dtype", [(False, torch.float32), (True, torch.float16)])
def test_text_encoders_are_built_from_the_file_without_random_initialisation(projection, dtype, monkeypatch):
    """The CLIP of a single file is made on the meta device and given the file's tensors in the
    file's precision: the same model as one built the usual way, position ids included, and no
    random initialisation runs (it took 10 s for bigG)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from vramfit.models.parts import clip_text_model, shipped_config

    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    torch.manual_seed(0)
    config = CLIPTextConfig(**shipped_config("tiny_clip_l"))
    reference = cls(config).to(dtype).eval()
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    def no_real_init(t, *args, **kwargs):  # on the meta device an initialiser costs nothing
        return t if t.device.type == "meta" else pytest.fail("random initialisation ran on real memory")

    monkeypatch.setattr(torch.Tensor, "normal_", no_real_init)
    built = clip_text_model(state, config.hidden_act, projection, Path("model.safetensors"))
    monkeypatch.undo()
    assert built.dtype == dtype
    ids = torch.randint(0, config.vocab_size, (2, 77), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(built(ids).last_hidden_state, reference(ids).last_hidden_state, rtol=0, atol=0)
    positions = [b for name, b in built.named_buffers() if name.endswith("position_ids")]
    assert positions and all(torch.equal(b, torch.arange(b.shape[-1]).expand(b.shape)) for b in positions)
