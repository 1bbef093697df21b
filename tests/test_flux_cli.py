"""Flux.1 through the same CLI path as the other families: LoRA and full training, resume,
generate, inspect; its BFL key map checked against diffusers' own converter."""
from __future__ import annotations

import json

import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main

LORA = ("train.mode=lora", "lora.rank=4", "train.lr=1e-2", "save.name=m")


def test_flux_lora_trains_and_generate_renders(images, tmp_path, cache_root):
    out = tmp_path / "run"
    samples = ("sample.every_steps=2", "sample.prompts=['a red circle']", "sample.seeds=[1]", "sample.steps=1")
    assert main(train_args(images, out, cache_root / "f1", *LORA, *samples, model="tiny:flux")) == 0
    assert list((out / "samples").glob("*.png"))
    run = json.loads((out / "run.json").read_text())
    assert len(run["losses"]) == 2 and all(l > 0 for l in run["losses"])
    lora = load_file(str(out / "m.safetensors"))
    assert any(k.startswith("transformer.single_transformer_blocks.") for k in lora)
    assert any(k.startswith("transformer.transformer_blocks.") for k in lora)
    pics = tmp_path / "pics"
    assert main(["generate", "--model", "tiny:flux", "--prompt", "a red circle", "--steps", "2",
                 "--width", "64", "--height", "64", "--out", str(pics),
                 "--cache-dir", str(cache_root / "f1")]) == 0
    (png,) = pics.glob("*.png")
    assert (Image.open(png).text["steps"], Image.open(png).text["guidance"]) == ("2", "3.5")


def test_flux_full_finetune_saves_and_resumes_exactly(images, tmp_path, cache_root):
    """4 steps in one run, and 2 + a resume of 2: the same losses. The single file keeps the BFL
    layout (the VAE and text encoders byte for byte) and loads back; the diffusers folder loads
    in FluxPipeline."""
    sets = ("train.steps=4", "save.state_every_steps=2", "train.precision=fp32", "save.name=m",
            "save.formats=['single_file','diffusers']", "save.dtype=fp32", "train.guidance=3.5")
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(train_args(images, full, cache_root / "f2", *sets, model="tiny:flux")) == 0
    args = train_args(images, part, cache_root / "f2", *sets, model="tiny:flux")
    assert main(args + ["--resume", str(full / "state" / "step-000002")]) == 0
    ref = json.loads((full / "run.json").read_text())["losses"]
    assert len(ref) == 4 and json.loads((part / "run.json").read_text())["losses"] == ref

    saved = load_file(str(full / "m.safetensors"))
    source = load_file(str(next((cache_root / "f2" / "tiny").glob("tiny-flux-*/tiny-flux.safetensors"))))
    assert set(saved) == set(source)
    core = "model.diffusion_model."
    assert any(not torch.equal(saved[k], source[k]) for k in source if k.startswith(core))
    assert all(torch.equal(saved[k], source[k]) for k in source if not k.startswith(core))

    from diffusers import FluxPipeline

    from vramfit.config.schema import ModelConfig
    from vramfit.models.registry import detect_family
    from vramfit.models.sources import resolve_source

    pipe = FluxPipeline.from_pretrained(full / "m-diffusers", local_files_only=True)
    folder = resolve_source(ModelConfig(path=str(full / "m-diffusers")), cache_root / "f2")
    assert detect_family(folder).name == "flux" and detect_family(folder).load(folder).layout == "flux-custom"
    model = ModelConfig(path=str(full / "m.safetensors"), tokenizers=str(full / "m-diffusers"))
    source = resolve_source(model, cache_root / "f2")
    family = detect_family(source)
    reloaded = family.load(source).denoiser.state_dict()
    assert family.name == "flux" and set(reloaded) == set(pipe.transformer.state_dict())
    assert all(torch.equal(reloaded[k], v) for k, v in pipe.transformer.state_dict().items())


def test_bfl_key_map_matches_diffusers_converter_at_released_width():
    """diffusers' converter (what from_single_file runs) fixes the released 3072 width, so the map is
    checked there, on one double and one single block of stand-in tensors (row r of every tensor
    holds a number naming that row: no memory, and a wrong split or swap moves the numbers)."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
    from accelerate import init_empty_weights

    from vramfit.models.flux.bfl import bfl_to_diffusers, diffusers_to_bfl, flux_config_from_keys

    config = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                  guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    with init_empty_weights():
        model = FluxTransformer2DModel(**config)
    shapes = {k: v.shape for k, v in diffusers_to_bfl(model.state_dict()).items()}  # meta: keys and shapes
    start, bfl = 0, {}
    for key, shape in sorted(shapes.items()):
        rows = torch.arange(start, start + shape[0], dtype=torch.float32)
        bfl[key] = rows if len(shape) == 1 else rows[:, None].expand(*shape)
        start += shape[0]
    assert flux_config_from_keys(bfl) == {**config, "out_channels": 64, "axes_dims_rope": [16, 56, 56]}
    ours = bfl_to_diffusers(bfl, config)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    assert set(ours) == set(theirs) == set(model.state_dict())
    for key, t in theirs.items():
        assert ours[key].shape == t.shape, key
        assert torch.equal(ours[key].reshape(t.shape[0], -1)[:, 0], t.reshape(t.shape[0], -1)[:, 0]), key


def test_bfl_key_map_round_trips_the_tiny_model():
    from diffusers import FluxTransformer2DModel

    from vramfit.models.flux.bfl import bfl_to_diffusers, diffusers_to_bfl, flux_config_from_keys
    from vramfit.models.parts import shipped_config

    config = shipped_config("tiny_flux_transformer")
    sd = FluxTransformer2DModel(**config).state_dict()
    bfl = diffusers_to_bfl(sd)
    assert flux_config_from_keys(bfl) == config
    back = bfl_to_diffusers(bfl, config)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_transformer_only_file_with_vae_and_encoders_as_files(images, tmp_path, cache_root, capsys):
    """flux1-dev.safetensors holds the transformer alone (bare BFL keys); BFL's ae.safetensors the
    VAE (bare LDM keys); ComfyUI's clip_l and t5xxl files the encoders. Given with model.vae,
    model.clip_l and model.t5 they are the tiny model's own parts: the text cache is reused, the
    losses are the same, and the trained file is saved transformer-only again."""
    import shutil

    from safetensors.torch import save_file

    cache = cache_root / "f-split"
    full_out = tmp_path / "full"
    assert main(train_args(images, full_out, cache, "save.name=m", model="tiny:flux")) == 0
    full = next((cache / "tiny").glob("tiny-flux-*/tiny-flux.safetensors"))
    state = load_file(str(full))
    split = tmp_path / "split"
    split.mkdir()
    parts = {"core": "model.diffusion_model.", "vae": "first_stage_model.",
             "clip_l": "text_encoders.clip_l.transformer.", "t5": "text_encoders.t5xxl.transformer."}
    for part, prefix in parts.items():
        save_file({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)},
                  str(split / f"{part}.safetensors"))
    for tok in ("tokenizer", "tokenizer_2"):
        shutil.copytree(full.parent / tok, split / tok)

    out = tmp_path / "out"
    base = train_args(images, out, cache, "save.name=m", "save.dtype=fp32",
                      model=str(split / "core.safetensors"))
    assert main(base) != 0  # without the VAE file the message says what to give
    assert "model.vae" in capsys.readouterr().err
    sets = [f"model.{p}={split / f'{p}.safetensors'}" for p in ("vae", "clip_l", "t5")]
    assert main(base + [a for s in sets for a in ("--set", s)]) == 0
    run = json.loads((out / "run.json").read_text())
    ref = json.loads((full_out / "run.json").read_text())
    assert run["cache"]["text_cached"] == 0 and run["cache"]["text_reused"] == ref["cache"]["text_cached"]
    assert run["losses"] == ref["losses"]
    assert set(load_file(str(out / "m.safetensors"))) == set(load_file(str(split / "core.safetensors")))


def test_lora_exports_load_in_flux_pipeline(images, tmp_path, cache_root):
    """A LoRA run writes diffusers/PEFT keys (<name>.safetensors), which FluxPipeline.load_lora_weights
    reads and which change the transformer's output, and kohya's BFL names (<name>-kohya.safetensors),
    whose update of each BFL weight (fused qkv and linear1 included) is exactly the BFL layout of the
    diffusers LoRA merged into the transformer; the family's FluxPipeline reads it back (diffusers'
    own kohya Flux reader fixes the released 3072 width) to the same output."""
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "f3", *LORA, "lora.targets=['all_linear']",
                           model="tiny:flux")) == 0
    kohya = load_file(str(out / "m-kohya.safetensors"))
    assert {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
            "lora_unet_single_blocks_1_linear1.alpha",
            "lora_unet_double_blocks_1_txt_mlp_2.lora_up.weight"} <= set(kohya)
    assert not any("to_q" in k for k in kohya)

    from vramfit.config.schema import ModelConfig
    from vramfit.models.flux.bfl import diffusers_to_bfl
    from vramfit.models.flux.objective import image_ids
    from vramfit.models.registry import detect_family
    from vramfit.models.sources import resolve_source

    source = resolve_source(ModelConfig(path="tiny:flux"), cache_root / "f3")
    family = detect_family(source)
    bundle = family.load(source)
    base = {k: v.clone() for k, v in bundle.denoiser.state_dict().items()}
    merged = dict(base)
    lora = load_file(str(out / "m.safetensors"))
    for key in lora:
        if key.endswith(".lora_A.weight"):
            module = key[len("transformer."):-len(".lora_A.weight")]
            delta = lora[key.replace("lora_A", "lora_B")] @ lora[key]
            merged[module + ".weight"] = merged[module + ".weight"] + delta
    want, was = diffusers_to_bfl(merged), diffusers_to_bfl(base)
    moved = {k for k in want if not torch.equal(want[k], was[k])}
    names = {k.split(".")[0] for k in kohya}
    assert {"lora_unet_" + k[:-len(".weight")].replace(".", "_") for k in moved} == names
    for name in names:
        key = name[len("lora_unet_"):]
        bfl = next(k for k in moved if k[:-len(".weight")].replace(".", "_") == key)
        scale = kohya[f"{name}.alpha"] / kohya[f"{name}.lora_down.weight"].shape[0]
        delta = kohya[f"{name}.lora_up.weight"] @ kohya[f"{name}.lora_down.weight"] * scale
        assert torch.allclose(was[bfl] + delta, want[bfl], atol=1e-6), name

    pipe = family.pipeline(bundle, bundle.vae, bundle.text_encoders, bundle.tokenizers)
    g = torch.Generator().manual_seed(0)
    x = dict(hidden_states=torch.randn(1, 16, 64, generator=g), timestep=torch.tensor([0.5]),
             guidance=torch.tensor([3.5]), pooled_projections=torch.randn(1, 64, generator=g),
             encoder_hidden_states=torch.randn(1, 7, 256, generator=g), txt_ids=torch.zeros(7, 3),
             img_ids=image_ids(8, 8), return_dict=False)
    with torch.no_grad():
        before = pipe.transformer(**x)[0]
        after = []
        for name in ("m.safetensors", "m-kohya.safetensors"):
            pipe.load_lora_weights(str(out / name), adapter_name="t")
            after.append(pipe.transformer(**x)[0])
            pipe.delete_adapters("t")
    assert (after[0] - before).abs().max() > 1e-4
    torch.testing.assert_close(after[1], after[0], rtol=1e-4, atol=1e-6)


def test_memory_techniques_train_tiny_flux_as_without_them(images, tmp_path, cache_root, caplog, monkeypatch):
    """On the CPU: half the blocks checkpointed (double- and single-stream blocks alike), the
    weights streamed block by block (transformer_blocks and single_transformer_blocks) and an
    int8 base under the LoRA train as a plain run does: the same losses, int8's close."""
    import logging

    caplog.set_level(logging.INFO, logger="vramfit")
    base = (*LORA, "lora.targets=['all_linear']", "train.precision=fp32", "train.optimizer=adamw")

    def losses(name, *sets):
        out = tmp_path / name
        assert main(train_args(images, out, cache_root / "f4", *base, *sets, model="tiny:flux")) == 0
        return json.loads((out / "run.json").read_text())["losses"]

    plain = losses("plain", "train.gradient_checkpointing=false")
    half = losses("half", "train.gradient_checkpointing=0.5")
    told = [r.getMessage() for r in caplog.records if "checkpointable blocks" in r.getMessage()]
    assert told and "2 of the denoiser's 4 checkpointable blocks" in told[0]
    torch.testing.assert_close(half, plain, rtol=1e-5, atol=0)
    from vramfit.memory import offload

    streamers = []
    init = offload.WeightStreamer.__init__
    monkeypatch.setattr(offload.WeightStreamer, "__init__",
                        lambda self, *a, **k: init(self, *a, **k) or streamers.append(self))
    torch.testing.assert_close(losses("streamed", "memory.stream_weights=true"), plain, rtol=1e-5, atol=0)
    (streamer,) = streamers
    streamed = {u.name.split(".")[0] for u in streamer.units}
    assert streamed == {"transformer_blocks", "single_transformer_blocks"}
    int8 = losses("int8", "lora.base_quantization=int8")
    assert int8 != plain
    torch.testing.assert_close(int8, plain, rtol=2e-2, atol=0)


def test_inspect_tiny_flux(capsys):
    assert main(["inspect", "tiny:flux", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "flux" and info["guidance_embeds"] is True and info["t5"] is True
    assert info["variant"] == "dev"
    assert (info["num_layers"], info["num_single_layers"], info["width"]) == (2, 2, 64)


def test_schnell_lora_trains_and_generate_renders(images, tmp_path, cache_root, capsys):
    """tiny:flux-schnell has no guidance embedding (no guidance_in keys): inspect says schnell,
    train.guidance is refused naming the key, a LoRA trains (samples rendered) and generate renders."""
    from safetensors import safe_open

    cache = cache_root / "f-schnell"
    assert main(["inspect", "tiny:flux-schnell", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["variant"], info["guidance_embeds"], info["layout"]) == ("schnell", False, "flux-custom")
    path = info["source"]["path"]
    with safe_open(path, framework="pt") as fh:
        assert not any("guidance_in" in k for k in fh.keys())
        assert fh.metadata()["modelspec.architecture"] == "flux-1-schnell"
    out = tmp_path / "run"
    assert main(train_args(images, out, cache, *LORA, "train.guidance=3.5", model="tiny:flux-schnell")) == 2
    assert "train.guidance: applies to Flux.1 dev's guidance embedding" in capsys.readouterr().err
    samples = ("sample.every_steps=2", "sample.prompts=['a red circle']", "sample.seeds=[1]",
               "sample.steps=1")
    assert main(train_args(images, out, cache, *LORA, *samples, model="tiny:flux-schnell")) == 0
    assert list((out / "samples").glob("*.png"))
    assert any("single_transformer_blocks" in k for k in load_file(str(out / "m.safetensors")))
    pics = tmp_path / "pics"
    assert main(["generate", "--model", "tiny:flux-schnell", "--prompt", "a red circle",
                 "--lora", str(out / "m.safetensors"), "--out", str(pics), "--cache-dir", str(cache)]) == 0
    (png,) = pics.glob("*.png")
    # schnell's own defaults where none are given: 4 steps, no guidance (dev: 28 and 3.5)
    assert (Image.open(png).text["steps"], Image.open(png).text["guidance"]) == ("4", "0.0")


def test_plan_for_tiny_flux(capsys):
    """`vramfit plan` reads the tiny Flux file's headers and predicts each phase (with SD3's
    constants standing in: Flux's are not fitted, fit/calibration.json says so)."""
    assert main(["plan", "--set", "model.path=tiny:flux", "--set", "train.mode=lora", "--vram", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "train" in out


def test_what_flux_cannot_take_is_refused_with_the_key(images, tmp_path, cache_root, capsys):
    gen = ["generate", "--model", "tiny:flux", "--prompt", "a red circle", "--steps", "1",
           "--out", str(tmp_path / "pics"), "--cache-dir", str(cache_root / "f5")]
    assert main(gen + ["--width", "72", "--height", "64"]) == 2
    assert "width 72 is not a multiple of 16" in capsys.readouterr().err
    assert main(gen + ["--width", "64", "--height", "64", "--negative", "blue"]) == 2
    assert "no negative prompt" in capsys.readouterr().err
    a_file = next(images.glob("*.png"))
    negative = ("sample.every_steps=1", "sample.prompts=['a circle']", "sample.negative_prompt=blurry")
    for sets, said in ((negative, "sample.negative_prompt: Flux.1 takes no negative prompt"),
                       (("train.noise_offset=0.1",), "train.noise_offset: applies to the SDXL"),
                       ((f"model.clip_g={a_file}",), "model.clip_g: Flux.1 has no CLIP-G")):
        assert main(train_args(images, tmp_path / "run", cache_root / "f5", *sets, model="tiny:flux")) == 2
        assert said in capsys.readouterr().err
    for model in ("tiny:ssd1b", "tiny:sd3"):  # Flux's own keys are not ignored elsewhere
        args = train_args(images, tmp_path / "run", cache_root / "f5", "train.guidance=3.5",
                          f"model.vae={a_file}", model=model)
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "train.guidance: applies to Flux.1" in err and "model.vae: a VAE file of its own" in err


def test_a_streamed_base_draws_the_grids_of_an_unstreamed_one(images, tmp_path, cache_root, monkeypatch, capsys):
    """memory.stream_weights with sample grids (captions cached): the grid streams the denoiser as
    training does, only the VAE placed for it; the same grids as without streaming, and no streamed
    weight is moved by the grid (each is its home in CPU memory after it) and the final grid's slots
    go before the save; without cached captions (live ones, or trained text encoders) the pair is
    refused, naming the keys."""
    from vramfit.memory.offload import WeightStreamer
    from vramfit.train import samples as samples_module

    samples = ("sample.every_steps=1", "sample.prompts=['a red circle']", "sample.seeds=[1]", "sample.steps=2",
               "train.steps=2", "train.gradient_checkpointing=true")
    streamers: list = []
    made = WeightStreamer.__init__

    def keep(self, *args, **kwargs):
        made(self, *args, **kwargs)
        streamers.append(self)

    monkeypatch.setattr(WeightStreamer, "__init__", keep)
    homes_after_grids: list[bool] = []
    render = samples_module.SampleGrids.render

    def render_and_look(self, step):
        path = render(self, step)
        for streamer in streamers:
            homes_after_grids.append(all(p.data_ptr() == h.data_ptr() for u in streamer.units
                                         for p, h in zip(u.params, u.homes)))
        return path

    monkeypatch.setattr(samples_module.SampleGrids, "render", render_and_look)
    grids = {}
    for streamed in ("false", "true"):
        out = tmp_path / streamed
        assert main(train_args(images, out, cache_root / "fs", *LORA, *samples, f"memory.stream_weights={streamed}",
                               "memory.stream_unit_mib=0.01", model="tiny:flux")) == 0
        grids[streamed] = [torch.tensor(list(Image.open(p).convert("RGB").getdata()), dtype=torch.int16)
                           for p in sorted((out / "samples").glob("*.png"))]
    assert streamers and streamers[-1].units and homes_after_grids and all(homes_after_grids)
    assert streamers[-1].slot_bytes() == 0  # the final grid's slots are not held through the save
    assert len(grids["true"]) == len(grids["false"]) == 2  # after step 1, and the final one
    for a, b in zip(grids["true"], grids["false"]):
        assert (a - b).abs().max() <= 1
    for refused, key in (("cache.text=false", "cache.text"), ("lora.text_encoder_rank=4", "lora.text_encoder_rank")):
        capsys.readouterr()
        code = main(train_args(images, tmp_path / "no", cache_root / "fs", *LORA, *samples,
                               "memory.stream_weights=true", refused, model="tiny:flux"))
        assert code == 2 and key in capsys.readouterr().err
