"""SD3.5 Medium and SD3.5 Large through the CLI, on the tiny models of each layout written as
Stability ships them (MMDiT and VAE in one file, the text encoders in text_encoders/ beside it):
LoRA and full fine-tunes train and save, the exports load in diffusers and back in vramfit, and
SD3.5 Medium samples with its skip-layer guidance. One LoRA and one full run per layout are shared
by the tests."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import SIZE, train_args
from vramfit.cli import main
from vramfit.data.synth import make_synthetic_dataset
from vramfit.formats.safetensors_io import CheckpointError, read_header, save_atomic
from vramfit.models.adapter import Source
from vramfit.models.registry import FAMILIES
from vramfit.models.sd3.family import ENCODER_FILES_META, layout_name
from vramfit.models.sd3.mmdit import sd3_config_from_keys

LAYOUTS = ("sd3.5-medium", "sd3.5-large")
SD3 = FAMILIES["sd3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_root) -> dict:
    """{(layout, mode): output folder} of a 2-step LoRA and full fine-tune per tiny SD3.5 layout;
    the full runs save a single file and a diffusers folder in fp32."""
    root = tmp_path_factory.mktemp("sd35")
    images = root / "images"
    make_synthetic_dataset(images, n=4, size=SIZE, seed=1)
    out = {}
    for layout in LAYOUTS:
        for mode in ("lora", "full"):
            folder = root / f"{layout}-{mode}"
            sets = ["save.name=m", f"train.mode={mode}", "save.dtype=fp32"]
            if mode == "full":
                sets.append("save.formats=['single_file','diffusers']")
            assert main(train_args(images, folder, cache_root / "sd35", *sets, model=f"tiny:{layout}")) == 0
            out[layout, mode] = folder
    return out


def _source(layout: str, cache_root: Path) -> Path:
    """The tiny model's single file, where the runs' cache holds it (written if not yet)."""
    return SD3.materialize_tiny(layout, cache_root / "sd35" / "tiny")


def _encoders(folder: Path) -> dict:
    """The text encoders of a diffusers folder, as a user passes them to from_single_file with
    Stability's SD3.5 files (which hold none)."""
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    return {"text_encoder": CLIPTextModelWithProjection.from_pretrained(folder, subfolder="text_encoder"),
            "text_encoder_2": CLIPTextModelWithProjection.from_pretrained(folder, subfolder="text_encoder_2"),
            "text_encoder_3": T5EncoderModel.from_pretrained(folder, subfolder="text_encoder_3")}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tiny_sd35_is_written_and_inspected_as_stability_ships_it(layout, runs, cache_root, capsys):
    path = _source(layout, cache_root)
    with safe_open(str(path), "pt") as fh:
        keys, meta = set(fh.keys()), fh.metadata()
    assert {k.split(".")[0] for k in keys} == {"model", "first_stage_model"}
    assert all(k.startswith(("model.diffusion_model.", "first_stage_model.")) for k in keys)
    assert meta["modelspec.architecture"] == f"stable-diffusion-{layout[2:]}"
    encoders = path.parent / "text_encoders"
    assert sorted(p.name for p in encoders.iterdir()) == ["clip_g.safetensors", "clip_l.safetensors",
                                                          "t5xxl_fp16.safetensors"]
    clip_l = load_file(str(encoders / "clip_l.safetensors"))
    t5 = load_file(str(encoders / "t5xxl_fp16.safetensors"))
    assert "text_model.embeddings.token_embedding.weight" in clip_l and "text_projection.weight" not in clip_l
    assert {t.dtype for t in t5.values()} == {torch.float16} and "shared.weight" in t5
    config = sd3_config_from_keys({k: v for k, v in load_file(str(path)).items() if k.startswith("model.")})
    assert config["qk_norm"] == "rms_norm" and layout_name(config) == layout
    if layout == "sd3.5-medium":  # dual attention in the first blocks, SD3.5 Medium's doubled grid
        assert config["dual_attention_layers"] == (0, 1, 2, 3, 4) and config["pos_embed_max_size"] == 64
    else:
        assert config["dual_attention_layers"] == () and config["pos_embed_max_size"] == 32
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"] == layout and info["qk_norm"] == "rms_norm" and info["t5"] is True
    assert info["components"]["text_encoder_3 (T5)"]["file"] == str(encoders / "t5xxl_fp16.safetensors")
    assert info["components"]["text_encoder_3 (T5)"]["dtypes"] == {"F16": sum(t.numel() for t in t5.values())}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_fine_tune_exports_keep_the_layout_and_load_in_diffusers_and_back(layout, runs, cache_root):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    out = runs[layout, "full"]
    source = _source(layout, cache_root)
    saved, original = load_file(str(out / "m.safetensors")), load_file(str(source))
    assert set(saved) == set(original)  # the source's layout: attn2 / ln_q keys, no text encoders
    assert any(".attn.ln_q." in k for k in saved)
    assert any(".attn2." in k for k in saved) == (layout == "sd3.5-medium")
    trained = [k for k in saved if k.startswith("model.diffusion_model.")]
    assert any(not torch.equal(saved[k], original[k]) for k in trained)
    assert all(torch.equal(saved[k], original[k]) for k in saved if k.startswith("first_stage_model."))
    with safe_open(str(out / "m.safetensors"), "pt") as fh:
        meta = fh.metadata()
    assert meta["modelspec.architecture"] == f"stable-diffusion-{layout[2:]}"
    assert meta["vramfit.layout"] == layout
    assert json.loads(meta[ENCODER_FILES_META])["t5"] == str((source.parent / "text_encoders" /
                                                              "t5xxl_fp16.safetensors").resolve())

    folder = out / "m-diffusers"
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True)
    trained = pipe.transformer.state_dict()
    single = StableDiffusion3Pipeline.from_single_file(str(out / "m.safetensors"), config=str(folder),
                                                       local_files_only=True, **_encoders(folder))
    alone = SD3Transformer2DModel.from_single_file(str(out / "m.safetensors"), config=str(folder),
                                                   subfolder="transformer", local_files_only=True)
    for model in (single.transformer, alone):
        assert model.config.qk_norm == "rms_norm"
        assert all(torch.equal(t, trained[k]) for k, t in model.state_dict().items())

    # back in vramfit: the saved file (its text encoders found through its metadata) and the
    # diffusers folder as sources, the same weights as the run trained
    again = SD3.load(Source("single_file", out / "m.safetensors", tokenizers=out))
    from_folder = SD3.load(Source("diffusers", folder, tokenizers=folder))
    base = SD3.load(Source("single_file", source, tokenizers=source.parent))
    for bundle in (again, from_folder):
        assert bundle.layout == layout and len(bundle.text_encoders) == 3
        assert all(torch.equal(t, trained[k]) for k, t in bundle.denoiser.state_dict().items())
        for a, b in zip(bundle.text_encoders, base.text_encoders):
            assert all(torch.equal(t.float(), b.state_dict()[k].float()) for k, t in a.state_dict().items())


def test_a_diffusers_folder_of_tiny_sd35_trains_as_a_source(runs, tmp_path, cache_root, capsys):
    folder = runs["sd3.5-medium", "full"] / "m-diffusers"
    assert main(["inspect", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == "sd3.5-medium"
    images = tmp_path / "images"
    make_synthetic_dataset(images, n=2, size=SIZE, seed=2)
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "sd35-folder", "train.steps=1", "save.name=m",
                           model=str(folder))) == 0
    with safe_open(str(out / "m.safetensors"), "pt") as fh:
        assert fh.metadata()["vramfit.layout"] == "sd3.5-medium"
        assert any(".attn2." in k for k in fh.keys())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_loads_in_diffusers(layout, runs, cache_root):
    from diffusers import StableDiffusion3Pipeline

    lora = runs[layout, "lora"] / "m.safetensors"
    state = load_file(str(lora))
    with safe_open(str(lora), "pt") as fh:
        assert fh.metadata()["vramfit.layout"] == layout
    assert any(".attn2." in k for k in state) == (layout == "sd3.5-medium")
    folder = runs[layout, "full"] / "m-diffusers"  # its config and encoders; the weights are the base's
    pipe = StableDiffusion3Pipeline.from_single_file(str(_source(layout, cache_root)), config=str(folder),
                                                     local_files_only=True, **_encoders(folder))
    pipe.load_lora_weights(str(lora), adapter_name="trained")
    block = pipe.transformer.transformer_blocks[0]
    for module, key in ((block.attn.to_q, "transformer.transformer_blocks.0.attn.to_q"),
                        *(((block.attn2.to_q, "transformer.transformer_blocks.0.attn2.to_q"),)
                          if layout == "sd3.5-medium" else ())):
        assert torch.equal(module.lora_B["trained"].weight, state[key + ".lora_B.weight"])
        assert torch.count_nonzero(state[key + ".lora_B.weight"]) > 0  # trained, not the zero init


def test_sd35_medium_samples_with_skip_layer_guidance(runs, tmp_path, cache_root, transformer_skip_layers,
                                                     capsys):
    """`vramfit generate` on SD3.5 Medium runs a third prediction without layers 7-9 on the first
    steps (skip-layer guidance, as its model card recommends); SD3.5 Large never does."""
    seen = transformer_skip_layers
    for layout, want in (("sd3.5-medium", [7, 8, 9]), ("sd3.5-large", None)):
        seen.clear()
        args = ["generate", "--model", f"tiny:{layout}", "--prompt", "a red circle", "--steps", "10",
                "--guidance", "4", "--width", "64", "--height", "64", "--no-progress",
                "--out", str(tmp_path / layout), "--cache-dir", str(cache_root / "sd35")]
        assert main(args) == 0
        # classifier-free guidance: one batched call per step; skip-layer guidance adds one call on
        # step 1 (steps between 1% and 20% of 10)
        assert len(seen) == 10 + (want is not None)
        assert [s for s in seen if s is not None] == ([want] if want else [])
    capsys.readouterr()


def test_stability_encoder_files_are_needed_and_named(tmp_path, cache_root, capsys):
    """A Stability SD3.5 file without its text_encoders/ folder (or model.clip_l) is refused
    before training, saying where Stability's file goes."""
    source = _source("sd3.5-large", cache_root)
    lone = tmp_path / "lone" / "sd3.5_large.safetensors"
    lone.parent.mkdir()
    shutil.copy(source, lone)
    for sub in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        shutil.copytree(source.parent / sub, lone.parent / sub)
    images = tmp_path / "images"
    make_synthetic_dataset(images, n=2, size=SIZE, seed=2)
    assert main(train_args(images, tmp_path / "run", cache_root / "sd35-lone", model=str(lone))) == 2
    err = capsys.readouterr().err
    where = lone.parent / "text_encoders" / "clip_l.safetensors"
    assert f"put Stability's clip_l.safetensors at {where}" in err
    assert "model.clip_l" in err and "Traceback" not in err


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_size_sd35_layouts_are_read_from_keys_on_meta(layout):
    """The released SD3.5 Medium and Large transformers, built on the meta device and written
    with SAI keys, have the keys diffusers tells the releases apart by, and are read back as
    their config and named as their layout."""
    from diffusers import SD3Transformer2DModel

    from vramfit.models.sd3.family import release_transformer_config
    from vramfit.models.sd3.mmdit import diffusers_to_sai_mmdit, sai_to_diffusers_mmdit

    config = release_transformer_config(layout)
    with torch.device("meta"):
        model = SD3Transformer2DModel(**config)
    sai = diffusers_to_sai_mmdit(model.state_dict())
    if layout == "sd3.5-medium":  # diffusers: SD3's adaLN width, a 384 x 384 position grid
        assert sai["joint_blocks.0.context_block.adaLN_modulation.1.bias"].shape == (9216,)
        assert sai["pos_embed"].shape == (1, 147456, 1536)
        assert {k.split(".")[1] for k in sai if ".attn2." in k} == {str(i) for i in range(13)}
    else:  # diffusers: a 38th block
        assert "joint_blocks.37.x_block.mlp.fc1.weight" in sai
        assert sai["context_embedder.weight"].shape[0] == 2432
        assert not any(".attn2." in k for k in sai)
    assert all(f"joint_blocks.{i}.x_block.attn.ln_q.weight" in sai for i in range(config["num_layers"]))
    read = sd3_config_from_keys({"model.diffusion_model." + k: v for k, v in sai.items()})
    assert read == {**config, "dual_attention_layers": tuple(config["dual_attention_layers"])}
    assert layout_name(read) == layout
    assert set(sai_to_diffusers_mmdit(sai)) == set(model.state_dict())


def test_a_saved_file_whose_encoder_files_are_gone_names_them(runs, tmp_path, cache_root):
    """A file saved from an SD3.5 source names the encoder files it was trained with; where one
    has gone since, loading it says which, and what to give instead."""
    out = runs["sd3.5-large", "full"]
    saved = tmp_path / "m.safetensors"
    meta = read_header(out / "m.safetensors")[1]
    named = json.loads(meta[ENCODER_FILES_META])
    gone = tmp_path / "clip_l.safetensors"
    shutil.copy(named["clip_l"], gone)
    state = load_file(str(out / "m.safetensors"))
    save_atomic(state, saved, {**meta, ENCODER_FILES_META: json.dumps({**named, "clip_l": str(gone)})})
    assert SD3.load(Source("single_file", saved, tokenizers=out)).layout == "sd3.5-large"  # found there
    gone.unlink()
    with pytest.raises(CheckpointError) as exc:
        SD3.load(Source("single_file", saved, tokenizers=out))
    assert f"it was saved with {gone}, which is not there any more" in str(exc.value)
    assert "model.clip_l" in str(exc.value)


def test_plan_reads_the_text_encoders_in_text_encoders_folder(cache_root):
    """Stability's SD3.5 file holds MMDiT and VAE; `vramfit plan` finds the encoders beside it, so the
    caption phase is planned with CLIP-L, CLIP-G and T5."""
    from vramfit.config import load_config
    from vramfit.fit.model_facts import read_facts
    from vramfit.fit.planner import predict

    cfg = load_config(None, ["model.path=tiny:sd3.5-large", "train.mode=lora"], need_data=False)
    facts = read_facts(cfg, cache_root)
    assert [e.kind for e in facts.encoders] == ["clip", "clip", "t5"]
    assert {p.name: p.peak for p in predict(facts, cfg).phases}["cache_text"] > 0


def test_sd35_medium_example_trains_on_the_tiny_model(images, tmp_path, cache_root):
    """examples/sd35_medium_lora.toml as written (int8 T5 streamed, 8-bit Adam, LoRA rank 16, sample
    grids with skip-layer guidance), on tiny:sd3.5-medium and shrunk in size."""
    example = Path(__file__).resolve().parents[1] / "examples" / "sd35_medium_lora.toml"
    out = tmp_path / "run"
    args = ["train", str(example), "--no-progress"]
    for s in ("model.path=tiny:sd3.5-medium", f"data.path={images}", f"data.resolution={SIZE}",
              f"data.min_size={SIZE}", "data.bucket_step=32", f"cache.dir={cache_root / 'sd35-example'}",
              "train.steps=2", "save.every_steps=0", "sample.every_steps=2", "sample.steps=2",
              f"output.dir={out}", "logging.tensorboard=false"):
        args += ["--set", s]
    assert main(args) == 0
    config = (out / "config.toml").read_text()
    assert 'optimizer = "adamw8bit"' in config and 't5_precision = "int8"' in config and "rank = 16" in config
    lora = load_file(str(out / "model.safetensors"))
    assert any(".attn2.to_q.lora_A" in k for k in lora)  # Medium's second attention is adapted too
    assert (out / "samples" / "step-000002.png").is_file()
