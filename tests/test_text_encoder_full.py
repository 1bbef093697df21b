"""Full fine-tune of the CLIP text encoders (train.text_encoders = "full"): trained through the CLI on
tiny:sdxl at their own learning rate, resumed exactly, written into the single file and the diffusers
folder that vramfit's loader reads back, planned, and refused beside what cannot work with it."""
from __future__ import annotations

import json
import shutil
import tomllib
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import train_args
from vramfit.cli import main
from vramfit.config.load import ConfigError, load_config
from vramfit.config.rules import process_problems
from vramfit.fit.model_facts import facts_for_layout
from vramfit.fit.planner import host_prediction, plan_report, predict
from vramfit.fit.resolve import Environment, with_automatic_values
from vramfit.formats.safetensors_io import load_prefixed
from vramfit.models.registry import FAMILIES
from vramfit.models.sources import resolve_source
from vramfit.train.lora import merge_trained_encoders, place_text_encoders

FULL = ("train.text_encoders=full", "train.optimizer=adamw", "train.lr=1e-3", "train.text_encoder_lr=1e-2")
PROMPT = "a red cube"


def _encoders(path, cache_root, family: str = "sdxl"):
    """The model at `path` as vramfit's loader builds it."""
    model = load_config(None, [f"model.path={path}"], need_data=False).model
    source = resolve_source(model, cache_root)
    return FAMILIES[family].load(source)


def _hidden(bundle) -> list[torch.Tensor]:
    ids = bundle.tokenizers[0]([PROMPT], padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        return [e.float()(ids, output_hidden_states=True).hidden_states[-2] for e in bundle.text_encoders]


def _trained(state: dict, index: int) -> dict:
    prefix = f"text_encoder_{index}."
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def test_full_encoders_train_resume_and_save(tmp_path, images, cache_root, caplog, capsys):
    """2 steps, and 1 then 1 more resumed: identical weights of the UNet and both encoders (bf16, as
    the UNet's); a resume with the encoders frozen is refused. Every encoder weight trains; the single file and the diffusers folder carry the
    trained encoders, which vramfit's loader reads back value for value, and whose output differs
    from the base's."""
    sets = (*FULL, "save.state_every_steps=1", "save.keep_last=10")
    whole, part = tmp_path / "whole", tmp_path / "part"
    caplog.set_level("INFO", logger="vramfit")
    formats = "save.formats=['single_file', 'diffusers']"
    assert main(train_args(images, whole, cache_root, *sets, formats, model="tiny:sdxl")) == 0
    assert "text encoders: every weight (full_bf16) of 2 encoders" in caplog.text
    assert "learning rate 0.01" in caplog.text and "cache.text is off" in caplog.text
    assert tomllib.loads((whole / "config.toml").read_text())["cache"]["text"] is False
    shutil.copytree(whole / "state" / "step-000001", part / "state" / "step-000001")
    (part / "state" / "latest").write_text("step-000001\n")
    assert main([*train_args(images, part, cache_root, *sets, model="tiny:sdxl"), "--resume", "latest"]) == 0
    a, b = (load_file(str(o / "state" / "step-000002" / "weights.safetensors")) for o in (whole, part))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    frozen = [*train_args(images, part, cache_root, "train.steps=3", model="tiny:sdxl"), "--resume", "latest"]
    capsys.readouterr()
    assert main(frozen) != 0  # refused before anything loads
    assert "train.text_encoders: saved 'full', now 'frozen'" in capsys.readouterr().err

    base = _encoders("tiny:sdxl", cache_root)
    start = load_file(str(whole / "state" / "step-000001" / "weights.safetensors"))
    for i, enc in enumerate(base.text_encoders):
        names = {n for n, _ in enc.named_parameters()}
        trained = _trained(a, i)
        assert set(trained) == names  # every weight trains
        assert all(v.dtype == torch.bfloat16 for v in trained.values())
        moved = [n for n in names if not torch.equal(trained[n], _trained(start, i)[n])]
        assert len(moved) > len(names) // 2, moved  # the second step's update reached most of them
    before = _hidden(base)
    for saved in (whole / "model.safetensors", whole / "model-diffusers"):
        loaded = _encoders(saved, cache_root)
        for i, enc in enumerate(loaded.text_encoders):
            trained = _trained(a, i)
            for name, p in enc.named_parameters():
                assert torch.equal(p.detach().to(torch.bfloat16), trained[name]), (saved.name, i, name)
        after = _hidden(loaded)
        assert all(not torch.allclose(x, y, atol=1e-4) for x, y in zip(before, after)), saved.name
    index = json.loads((whole / "model-diffusers" / "model_index.json").read_text())
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    # the single file has the source's key set (SGM and OpenCLIP names, logit_scale, position ids)
    assert set(load_file(str(whole / "model.safetensors"))) == set(load_file(str(base.source.path)))
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(whole / "model-diffusers", local_files_only=True)
    for i, enc in enumerate((pipe.text_encoder, pipe.text_encoder_2)):
        trained = _trained(a, i)
        assert all(torch.equal(p.detach().to(torch.bfloat16), trained[n]) for n, p in enc.named_parameters())


def test_encoder_lr_zero_keeps_the_encoders(tmp_path, images, cache_root):
    """train.text_encoder_lr = 0: the encoders stay as loaded while the UNet moves (a second optimizer
    group, which the schedule scales); the final sample grid renders with the trained encoders."""
    out = tmp_path / "out"
    sets = (*FULL, "train.text_encoder_lr=0", "save.state_every_steps=1", "save.keep_last=10",
            "sample.every_steps=5", "sample.prompts=['a cat']", "sample.steps=1")
    assert main(train_args(images, out, cache_root, *sets, model="tiny:sdxl")) == 0
    assert (out / "samples" / "step-000002.png").is_file()
    schedule = torch.load(out / "state" / "step-000002" / "schedule.pt", weights_only=True)
    assert schedule["base_lrs"] == [1e-3, 0.0]
    first, last = (load_file(str(out / "state" / f"step-00000{s}" / "weights.safetensors")) for s in (1, 2))
    base = _encoders("tiny:sdxl", cache_root)
    for i, enc in enumerate(base.text_encoders):
        for name, p in enc.named_parameters():
            want = p.detach().to(torch.bfloat16)
            assert torch.equal(_trained(first, i)[name], want) and torch.equal(_trained(last, i)[name], want)
    unet = [k for k in first if not k.startswith("text_encoder_")]
    assert any(not torch.equal(first[k], last[k]) for k in unet)


@pytest.mark.parametrize("name, clips", [("sd3", 2), ("flux", 1)])
def test_flow_families_save_their_trained_clip_encoders(name, clips, tmp_path, images, cache_root, caplog):
    """SD3 trains CLIP-L and CLIP-G, Flux.1 CLIP-L (T5 stays frozen and out of the state); the single
    file and the diffusers folder carry them as trained, read back by vramfit's loader."""
    out = tmp_path / "out"
    caplog.set_level("INFO", logger="vramfit")
    sets = (*FULL, "train.steps=1", "save.formats=['single_file', 'diffusers']")
    assert main(train_args(images, out, cache_root, *sets, model=f"tiny:{name}")) == 0
    assert f"every weight (full_bf16) of {clips} encoders" in caplog.text and "T5 stays frozen" in caplog.text
    state = load_file(str(out / "state" / "step-000001" / "weights.safetensors"))
    assert {k.split(".")[0] for k in state if k.startswith("text_encoder_")} == {
        f"text_encoder_{i}" for i in range(clips)}
    base = _encoders(f"tiny:{name}", cache_root, name)
    for saved in (out / "model.safetensors", out / "model-diffusers"):
        loaded = _encoders(saved, cache_root, name)
        assert len(loaded.text_encoders) == len(base.text_encoders)
        for i in range(clips):
            trained = _trained(state, i)
            params = dict(loaded.text_encoders[i].named_parameters())
            assert set(params) == set(trained)
            assert all(torch.equal(p.detach().to(torch.bfloat16), trained[n])
                       for n, p in params.items()), saved
            old = dict(base.text_encoders[i].named_parameters())
            assert any(not torch.equal(old[n].detach().to(torch.bfloat16), trained[n]) for n in params)
    # model.clip_l naming another file is obeyed, and the log says the file's own trained one is not used
    clip_l = tmp_path / "clip_l.safetensors"
    save_file(load_prefixed(base.source.path, "text_encoders.clip_l.transformer."), str(clip_l))
    caplog.clear()
    model = load_config(None, [f"model.path={out / 'model.safetensors'}", f"model.clip_l={clip_l}"],
                        need_data=False).model
    named = FAMILIES[name].load(resolve_source(model, cache_root)).text_encoders[0]
    assert f"model.clip_l: {clip_l} is used, not the clip_l that model.safetensors holds" in caplog.text
    old = dict(base.text_encoders[0].named_parameters())
    assert all(torch.equal(p, old[n]) for n, p in named.named_parameters())


@pytest.mark.parametrize("sets, key, says", [
    (("train.mode=lora",), "train.text_encoders", "lora.text_encoder_rank"),
    (("train.optimizer_in_backward=true",), "train.text_encoders", "train.optimizer_in_backward"),
    (("memory.stream_encoders=true",), "train.text_encoders", "memory.stream_encoders"),
    (("train.cuda_graphs=true",), "train.cuda_graphs", "train.text_encoders = 'full'"),
    (("cache.text=true",), "cache.text", "train.text_encoders = 'full'"),
])
def test_refusals_name_the_key(sets, key, says):
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["train.text_encoders=full", *sets], need_data=False)
    problems = [p for p in exc.value.problems if p.startswith(key)]
    assert problems and says in problems[0], exc.value.problems


def test_lr_needs_trained_encoders_and_the_cache_is_turned_off():
    with pytest.raises(ConfigError, match="train.text_encoder_lr: given without lora.text_encoder_rank .*"
                                          "train.text_encoders = 'full'"):
        load_config(None, ["train.text_encoder_lr=1e-5"], need_data=False)
    cfg = load_config(None, ["train.text_encoders=full", "train.text_encoder_lr=1e-5"], need_data=False)
    resolved = with_automatic_values(cfg, Environment(torch.device("cpu")))
    assert cfg.cache.text is True and resolved.cache.text is False
    assert [line.split(":")[0] for line in process_problems(cfg, 2)] == ["train.text_encoders"]
    assert not process_problems(cfg, 1)


@pytest.mark.parametrize("sets, dtype, checkpointed", [
    ((), torch.bfloat16, True),
    (("train.precision=mixed_bf16", "train.gradient_checkpointing=0.5"), torch.float32, True),
    (("train.gradient_checkpointing=false",), torch.bfloat16, False),
])
def test_placed_encoders_train_in_the_run_precision(sets, dtype, checkpointed, cache_root):
    """Every CLIP weight trainable in the training precision, checkpointed where the denoiser is;
    a backward through the encoders reaches every weight."""
    bundle = _encoders("tiny:sdxl", cache_root)
    cfg = load_config(None, ["train.text_encoders=full", *sets], need_data=False)
    params = place_text_encoders(bundle, cfg, torch.device("cpu"))
    assert bundle.extra["text_encoders_trained"] == 2 and bundle.extra["text_encoder_training"] == "full"
    assert len(params) == sum(len(list(e.parameters())) for e in bundle.text_encoders)
    for enc in bundle.text_encoders:
        on = getattr(enc, "is_activation_checkpointing", None)  # transformers >= 5; earlier its old name
        assert (on if on is not None else enc.is_gradient_checkpointing) is checkpointed and enc.training
        assert all(p.dtype == dtype and p.requires_grad for p in enc.parameters())
    out = FAMILIES["sdxl"].encode_text(bundle, [PROMPT], torch.device("cpu"), torch.float32)
    (out["prompt_embeds"].square().mean() + out["pooled"].square().mean()).backward()
    unused = [(i, n) for i, e in enumerate(bundle.text_encoders)
              for n, p in e.named_parameters() if p.grad is None]
    # SDXL reads CLIP-L's penultimate hidden state only: its last layer and final norm get no gradient
    assert unused and all(i == 0 and (".layers.2." in n or "final_layer_norm" in n)
                          for i, n in unused), unused
    # a sample grid's fresh encoders take the trained weights (train/samples.py)
    with torch.no_grad():
        for enc in bundle.text_encoders:
            for p in enc.parameters():
                p.add_(0.5)
    fresh = _encoders("tiny:sdxl", cache_root).text_encoders
    merge_trained_encoders(fresh, bundle.text_encoders)
    for copy, enc in zip(fresh, bundle.text_encoders):
        ours = dict(enc.named_parameters())
        assert all(torch.equal(p.to(ours[n].dtype), ours[n]) for n, p in copy.named_parameters())


def test_a_model_without_clip_encoders_is_refused():
    """Only T5 among the text encoders: nothing to train, said with the key."""
    from transformers import T5Config, T5EncoderModel

    t5 = T5EncoderModel(T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    bundle = SimpleNamespace(text_encoders=[t5], extra={})
    cfg = load_config(None, ["train.text_encoders=full"], need_data=False)
    with pytest.raises(ValueError, match="train.text_encoders: this model has no CLIP text encoder"):
        place_text_encoders(bundle, cfg, torch.device("cpu"))
    assert all(p.requires_grad is True for p in t5.parameters()) and not bundle.extra


@pytest.mark.parametrize("layout", ["sdxl", "sd3m"])
def test_plan_counts_the_trained_encoders(layout):
    """The train phase grows by the CLIP encoders' weights, gradients, optimizer state and
    activations (and holds no live encoder beside them: SD3's T5 is cached before training);
    AdamW's state of them is larger than Adafactor's."""
    facts = facts_for_layout(layout)
    plain = load_config(None, ["cache.text=false"], need_data=False)
    full = load_config(None, ["train.text_encoders=full"], need_data=False)
    adamw = load_config(None, ["train.text_encoders=full", "train.optimizer=adamw"], need_data=False)
    phases = [next(p for p in predict(facts, c).phases if p.name == "train") for c in (plain, full, adamw)]
    assert "text encoder" not in phases[1].parts
    assert phases[1].peak > phases[0].peak - phases[0].parts["text encoder"]
    clips = sum(e.params for e in facts.encoders if e.kind == "clip")
    assert phases[1].parts["text encoders trained"] == 2 * clips  # bf16 under full_bf16
    assert phases[1].parts["text encoder gradients"] == 2 * clips
    state = [p.parts["text encoder optimizer state"] for p in phases[1:]]
    assert state[1] > state[0] > 0
    assert "train.text_encoders = 'full'" in plan_report(full, facts, None)
    # they stay on the device through the sample grids and the saves
    grids = load_config(None, ["train.text_encoders=full", "sample.every_steps=5", "sample.prompts=[\"a\"]"],
                        need_data=False)
    by_name = {p.name: p for p in predict(facts, grids).phases}
    for phase in ("samples", "save"):
        assert by_name[phase].parts["text encoders trained"] == 2 * clips
        assert by_name[phase].parts["text encoder optimizer state"] == state[0]
    # on the host: the trained CLIPs are not waiting in CPU memory; the training state copies them
    host = host_prediction(facts, full, for_gpu=True)
    waiting = host_prediction(facts, plain, for_gpu=True).phase("train").parts["text encoders"]  # all of them
    assert host.phase("train").parts.get("text encoders", 0) < waiting
    assert host.phase("save").parts["written state"] >= 2 * clips
