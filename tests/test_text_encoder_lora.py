"""Text-encoder LoRA (lora.text_encoder_rank): trained through the CLI on tiny:sdxl with its own
learning rate, resumed exactly, exported in kohya and diffusers keys that diffusers and `vramfit
generate --lora` apply, planned, and refused beside what cannot work with it."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main
from vramfit.fit.resolve import Environment, with_automatic_values
from vramfit.config.load import ConfigError, load_config
from vramfit.config.rules import process_problems
from vramfit.fit.model_facts import facts_for_layout
from vramfit.fit.planner import plan_report, predict, with_values
from vramfit.models.registry import FAMILIES
from vramfit.models.sources import resolve_source

TE = ("train.mode=lora", "lora.text_encoder_rank=4", "lora.text_encoder_alpha=2", "train.optimizer=adamw",
      "train.lr=1e-2")


def _te_keys(state: dict, prefix: str) -> dict:
    return {k: v for k, v in state.items() if k.startswith(prefix)}


def _loaded_encoders(cache_root):
    family = FAMILIES["sdxl"]
    model = load_config(None, ["model.path=tiny:sdxl"], need_data=False).model
    return family, family.load(resolve_source(model, cache_root))


def test_encoder_lora_trains_resumes_and_exports(tmp_path, images, cache_root, caplog, capsys):
    """4 steps, and 2 then 2 more resumed: identical LoRA weights of UNet and both encoders (another
    lora.text_encoder_rank is refused for the resume); the
    encoders' LoRA moved; the files carry lora_te1_/lora_te2_ and text_encoder(_2). keys, which
    diffusers' load_lora_weights applies, giving the trained encoder's output."""
    sets = (*TE, "train.steps=4", "save.state_every_steps=1", "save.keep_last=10")
    whole = tmp_path / "whole"
    caplog.set_level("INFO", logger="vramfit")
    assert main(train_args(images, whole, cache_root, *sets, model="tiny:sdxl")) == 0
    assert "text encoders: LoRA rank 4" in caplog.text and "cache.text is off" in caplog.text
    assert "learning rate 0.01" in caplog.text
    part = tmp_path / "part"
    shutil.copytree(whole / "state" / "step-000002", part / "state" / "step-000002")
    (part / "state" / "latest").write_text("step-000002\n")
    assert main([*train_args(images, part, cache_root, *sets, model="tiny:sdxl"), "--resume", "latest"]) == 0
    other = [*train_args(images, part, cache_root, *sets, "lora.text_encoder_rank=8", model="tiny:sdxl"),
             "--resume", "latest"]
    capsys.readouterr()
    assert main(other) != 0 and "lora.text_encoder_rank" in capsys.readouterr().err  # refused before loading
    a, b = (load_file(str(o / "state" / "step-000004" / "weights.safetensors")) for o in (whole, part))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    for i in (0, 1):
        assert any(k.startswith(f"text_encoder_{i}.") and "lora_A" in k for k in a)
    start = load_file(str(whole / "state" / "step-000001" / "weights.safetensors"))
    ups = [k for k in a if k.startswith("text_encoder_") and "lora_B" in k]
    assert ups and any(not torch.equal(a[k], start[k]) for k in ups)  # the encoders' LoRA moved

    kohya = load_file(str(whole / "model.safetensors"))  # the primary file: kohya keys
    assert _te_keys(kohya, "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.")
    assert _te_keys(kohya, "lora_te2_text_model_encoder_layers_0_mlp_fc1.")
    assert any(k.startswith("lora_unet_") for k in kohya)
    assert float(kohya["lora_te1_text_model_encoder_layers_0_self_attn_q_proj.alpha"]) == 2.0
    diff = load_file(str(whole / "model-diffusers.safetensors"))
    assert any(k.startswith("text_encoder.text_model.") for k in diff)
    assert any(k.startswith("text_encoder_2.text_model.") for k in diff)

    # the trained (peft) encoders, rebuilt from the final state, against each file loaded by diffusers
    from vramfit.generate import build_pipeline, load_loras
    from vramfit.train.lora import apply_text_encoder_lora, merge_trained_encoders
    from vramfit.config.schema import LoraSettings

    family, bundle = _loaded_encoders(cache_root)
    ids = bundle.tokenizers[0](["a red cube"], padding="max_length", max_length=77,
                               return_tensors="pt").input_ids
    with torch.no_grad():
        frozen = [e(ids, output_hidden_states=True).hidden_states[-2] for e in bundle.text_encoders]
    final = load_file(str(whole / "state" / "step-000004" / "weights.safetensors"))
    trained, copies = [], []
    for i, enc in enumerate(bundle.text_encoders):
        copy = type(enc)(enc.config)
        copy.load_state_dict(enc.state_dict())
        apply_text_encoder_lora(copy, LoraSettings(text_encoder_rank=4, text_encoder_alpha=2))
        prefix = f"text_encoder_{i}."
        ours = {k[len(prefix):]: v for k, v in final.items() if k.startswith(prefix)}
        missing = copy.load_state_dict(ours, strict=False)
        assert not missing.unexpected_keys
        with torch.no_grad():
            trained.append(copy(ids, output_hidden_states=True).hidden_states[-2])
        assert not torch.allclose(trained[i], frozen[i], atol=1e-5)  # the encoder's output changed
        copies.append(copy)
    # a sample grid's fresh encoders with the trained LoRA merged in encode as the trained ones do
    fresh = [type(e)(e.config) for e in bundle.text_encoders]
    for f, e in zip(fresh, bundle.text_encoders):
        f.load_state_dict(e.state_dict())
    merge_trained_encoders(fresh, copies)
    for f, want in zip(fresh, trained):
        with torch.no_grad():
            assert torch.allclose(f(ids, output_hidden_states=True).hidden_states[-2], want, atol=1e-5)
    for name in ("model.safetensors", "model-diffusers.safetensors"):
        _, bundle = _loaded_encoders(cache_root)
        pipe = build_pipeline(bundle)
        assert load_loras(pipe, [(whole / name, 1.0)])  # what `vramfit generate --lora` does
        for i, enc in enumerate((pipe.text_encoder, pipe.text_encoder_2)):
            with torch.no_grad():
                got = enc(ids, output_hidden_states=True).hidden_states[-2]
            assert torch.allclose(got, trained[i], atol=1e-5), name


def test_encoder_lr_zero_keeps_the_encoders(tmp_path, images, cache_root):
    """train.text_encoder_lr = 0: the encoders' LoRA stays at its init while the UNet's moves. The
    final sample grid renders with the trained encoders merged into fresh copies."""
    out = tmp_path / "out"
    sets = (*TE, "train.text_encoder_lr=0", "save.state_every_steps=1", "save.keep_last=10",
            "sample.every_steps=5", "sample.prompts=['a cat']", "sample.steps=2")
    assert main(train_args(images, out, cache_root, *sets, model="tiny:sdxl")) == 0
    assert (out / "samples" / "step-000002.png").is_file()
    schedule = torch.load(out / "state" / "step-000002" / "schedule.pt", weights_only=True)
    assert schedule["base_lrs"] == [1e-2, 0.0]  # the schedule scales both groups
    first, last = (load_file(str(out / "state" / f"step-00000{s}" / "weights.safetensors")) for s in (1, 2))
    te = [k for k in first if k.startswith("text_encoder_")]
    unet = [k for k in first if not k.startswith("text_encoder_") and "lora_B" in k]
    assert te and all(torch.equal(first[k], last[k]) for k in te)
    assert any(not torch.equal(first[k], last[k]) for k in unet)


@pytest.mark.parametrize("sets, key", [
    (("train.optimizer_in_backward=true",), "lora.text_encoder_rank"),
    (("memory.stream_encoders=true",), "lora.text_encoder_rank"),
    (("train.cuda_graphs=true",), "train.cuda_graphs"),
    (("cache.text=true",), "cache.text"),
])
def test_refusals_name_the_key(sets, key):
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["train.mode=lora", "lora.text_encoder_rank=4", *sets], need_data=False)
    assert any(p.startswith(key) for p in exc.value.problems), exc.value.problems
    assert "text_encoder_rank" in str(exc.value)


def test_several_processes_refuse_it():
    cfg = load_config(None, ["train.mode=lora", "lora.text_encoder_rank=4"], need_data=False)
    lines = process_problems(cfg, 2)
    assert [line.split(":")[0] for line in lines] == ["lora.text_encoder_rank"]
    assert not process_problems(cfg, 1)


def test_lr_without_rank_is_refused():
    for key in ("train.text_encoder_lr=1e-4", "lora.text_encoder_alpha=8"):
        with pytest.raises(ConfigError, match=key.split("=")[0] + ": given without lora.text_encoder_rank"):
            load_config(None, ["train.mode=lora", key], need_data=False)
    cfg = load_config(None, ["train.mode=lora", "lora.text_encoder_rank=4"], need_data=False)
    # turned off when the run is resolved, not refused, where it was left at its default
    resolved = with_automatic_values(cfg, Environment(torch.device("cpu")))
    assert cfg.cache.text is True and resolved.cache.text is False
    assert "text" not in resolved.cache.model_fields_set
    for name in ("sdxl", "sd3", "flux"):  # every family trains its CLIP encoders
        assert not any(p.startswith("lora.text_encoder_rank") for p in FAMILIES[name].config_problems(cfg))


@pytest.mark.parametrize("layout", ["sdxl", "sd3m", "flux1-dev"])
def test_plan_counts_the_trained_encoders(layout):
    """The train phase holds the CLIP encoders (weights, LoRA, activations) and no frozen T5 (SD3,
    Flux.1), whose outputs are cached in a caption phase where only it is on the device (as
    train/data.py caches them); the plan says so."""
    facts = facts_for_layout(layout)
    plain = load_config(None, ["train.mode=lora", "cache.text=false"], need_data=False)
    te = with_values(plain, {"lora.text_encoder_rank": 16})
    before, after = ({p.name: p for p in predict(facts, c).phases} for c in (plain, te))
    assert after["train"].parts["text encoders trained"] > 0 and after["train"].parts["text encoder lora"] > 0
    assert after["train"].parts["text encoder activations"] > 0
    assert "text encoder" not in after["train"].parts  # no live encoder beyond the trained ones
    t5 = [e for e in facts.encoders if e.kind == "t5"]
    assert ("cache_text" in after) == bool(t5) and "cache_text" not in before
    if t5:
        assert set(after["cache_text"].parts) >= {t5[0].name, "hidden states"}
        assert not any(e.name in after["cache_text"].parts for e in facts.encoders if e.kind == "clip")
        assert before["train"].parts["text encoder"] >= after["cache_text"].parts[t5[0].name]  # T5, live before
        assert "T5's outputs are cached" in plan_report(te, facts, None)
    else:
        assert after["train"].peak > before["train"].peak
    assert "lora.text_encoder_rank" in plan_report(te, facts, None)


# SD3 trains CLIP-L and CLIP-G, Flux.1 CLIP-L; their T5 is never trained. Each family's LoRA files
# with the keys its loaders read: {file: [(key prefix of an encoder's module, encoder index)]}
FLOW_FILES = {
    "sd3": {"model.safetensors": [("text_encoder.text_model.", 0), ("text_encoder_2.text_model.", 1)]},
    "flux": {"model.safetensors": [("text_encoder.text_model.", 0)],
             "model-kohya.safetensors": [("lora_te1_text_model_encoder_layers_0_", 0)]},
}


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_flow_families_train_their_clip_encoders(name, tmp_path, images, cache_root, caplog):
    """SD3 and Flux.1 through the CLI: 4 steps, and 2 then 2 more resumed, give identical LoRA weights
    of the transformer and the CLIP encoders (and none of T5); the encoders' LoRA moved and their
    output changed; the final sample grid renders; each exported file loaded by diffusers gives the
    trained encoders' output."""
    model = f"tiny:{name}"
    sets = (*TE, "train.steps=4", "save.state_every_steps=2", "save.keep_last=10")
    whole, part = tmp_path / "whole", tmp_path / "part"
    grid = ("sample.every_steps=5", "sample.prompts=['a cat']", "sample.steps=2")  # the final grid only
    assert main(train_args(images, whole, cache_root, *sets, *grid, model=model)) == 0
    assert (whole / "samples" / "step-000004.png").is_file()  # rendered with the trained encoders merged
    shutil.copytree(whole / "state" / "step-000002", part / "state" / "step-000002")
    (part / "state" / "latest").write_text("step-000002\n")
    assert main([*train_args(images, part, cache_root, *sets, model=model), "--resume", "latest"]) == 0
    a, b = (load_file(str(o / "state" / "step-000004" / "weights.safetensors")) for o in (whole, part))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    files = FLOW_FILES[name]
    count = 1 + max(i for keys in files.values() for _, i in keys)
    assert {k.split(".")[0] for k in a if k.startswith("text_encoder_")} == {f"text_encoder_{i}"
                                                                             for i in range(count)}
    start = load_file(str(whole / "state" / "step-000002" / "weights.safetensors"))
    ups = [k for k in a if k.startswith("text_encoder_") and "lora_B" in k]
    assert all(any(not torch.equal(a[k], start[k]) for k in ups if k.startswith(f"text_encoder_{i}."))
               for i in range(count))  # each encoder's LoRA moved

    from vramfit.generate import build_pipeline, load_loras
    from vramfit.train.lora import apply_text_encoder_lora
    from vramfit.config.schema import LoraSettings

    family = FAMILIES[name]
    source = resolve_source(load_config(None, [f"model.path={model}"], need_data=False).model, cache_root)
    bundle = family.load(source)
    assert len(bundle.text_encoders) == count + 1  # and T5, left alone
    ids = bundle.tokenizers[0](["a red cube"], padding="max_length", max_length=77,
                               return_tensors="pt").input_ids
    trained = []
    for i, enc in enumerate(bundle.text_encoders[:count]):
        with torch.no_grad():
            frozen = enc(ids, output_hidden_states=True).hidden_states[-2]
        apply_text_encoder_lora(enc, LoraSettings(text_encoder_rank=4, text_encoder_alpha=2))
        ours = {k[len(f"text_encoder_{i}."):]: v for k, v in a.items() if k.startswith(f"text_encoder_{i}.")}
        assert not enc.load_state_dict(ours, strict=False).unexpected_keys
        with torch.no_grad():
            trained.append(enc(ids, output_hidden_states=True).hidden_states[-2])
        assert not torch.allclose(trained[i], frozen, atol=1e-5)  # the encoder's output changed
    for file, keys in files.items():
        tensors = load_file(str(whole / file))
        assert all(any(k.startswith(prefix) for k in tensors) for prefix, _ in keys), file
        pipe = build_pipeline(family.load(source))
        caplog.clear()
        assert load_loras(pipe, [(whole / file, 1.0)])  # what `vramfit generate --lora` does
        assert "left out" not in caplog.text  # every layer of the file, the encoders' too, found
        for i, enc in enumerate((pipe.text_encoder, getattr(pipe, "text_encoder_2", None))[:count]):
            with torch.no_grad():
                got = enc(ids, output_hidden_states=True).hidden_states[-2]
            assert torch.allclose(got, trained[i], atol=1e-5), (file, i)


def test_cache_and_data_say_captions_are_not_cached_while_the_encoders_train(tmp_path, images, cache_root,
                                                                             capsys):
    """`vramfit cache` and `vramfit data` with text-encoder training: no caption is cached, and both
    say why, naming the key (not a count of text entries that will never be made)."""
    args = train_args(images, tmp_path / "out", cache_root, "train.mode=lora", "lora.rank=2",
                      "lora.text_encoder_rank=2", model="tiny:sdxl")
    capsys.readouterr()
    assert main(["cache", *args[1:]]) == 0
    out = capsys.readouterr().out
    assert "text_cached 0" in out and "latents_cached" in out
    assert "captions not cached: lora.text_encoder_rank trains the text encoders" in out
    assert main(["data", *args[1:], "--per-bucket", "0"]) == 0
    out = capsys.readouterr().out
    assert "text cache entries: none (lora.text_encoder_rank: the text encoders train" in out


@pytest.mark.parametrize("optimizer", ["prodigy", "schedulefree_adamw", "came"])
def test_whole_step_optimizers_train_the_encoders_in_a_group_of_their_own(tmp_path, images, cache_root,
                                                                          optimizer):
    """The optimizers that step every parameter at once (optim/wrapped.py) take the text encoders'
    LoRA as a second group at train.text_encoder_lr: the encoders' LoRA moves, and 4 steps equal 2
    then 2 more resumed (the wrapped optimizer's state of both groups in the training state)."""
    sets = (*TE, f"train.optimizer={optimizer}", "train.steps=4", "save.state_every_steps=2",
            "save.keep_last=5", *(("train.lr=1.0", "train.text_encoder_lr=0.5") if optimizer == "prodigy" else ()))
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(train_args(images, whole, cache_root, *sets, model="tiny:sdxl")) == 0
    shutil.copytree(whole / "state" / "step-000002", part / "state" / "step-000002")
    (part / "state" / "latest").write_text("step-000002\n")
    assert main([*train_args(images, part, cache_root, *sets, model="tiny:sdxl"), "--resume", "latest"]) == 0
    a, b = (load_file(str(o / "state" / "step-000004" / "weights.safetensors")) for o in (whole, part))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    groups = torch.load(whole / "state" / "step-000004" / "optimizer.pt", weights_only=True)["wrapped"]["param_groups"]
    assert len(groups) == 2
    if optimizer == "prodigy":
        assert [g["lr"] for g in groups] == [1.0, 0.5]
    start = load_file(str(whole / "state" / "step-000002" / "weights.safetensors"))
    for i in (0, 1):
        ups = [k for k in a if k.startswith(f"text_encoder_{i}.") and "lora_B" in k]
        assert ups and any(not torch.equal(a[k], start[k]) for k in ups)


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_t5_outputs_are_cached_while_the_clip_encoders_train(name, tmp_path, images, cache_root, capsys,
                                                            monkeypatch):
    """SD3 and Flux.1 with lora.text_encoder_rank: T5 never trains, so its outputs are cached before
    training (the cache stage writes an entry per caption) and T5 does not run in any training step;
    a second run reuses the entries. The conditioning built from a cached T5 part equals the one
    encoded live."""
    from transformers import T5EncoderModel

    calls = {"n": 0}
    forward = T5EncoderModel.forward

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(T5EncoderModel, "forward", counted)
    import vramfit.run as run

    kept = []
    fill = run.fill_cache

    def then_look(cfg, loaded, *args, **kwargs):
        out = fill(cfg, loaded, *args, **kwargs)
        kept.append([type(e).__name__ for e in loaded.bundle.text_encoders])
        return out

    monkeypatch.setattr(run, "fill_cache", then_look)
    model = f"tiny:{name}"
    sets = (*TE, "train.steps=3", "sample.every_steps=0")
    cache = cache_root / f"frozen-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    capsys.readouterr()
    assert main(["cache", *train_args(images, tmp_path / "c", cache, *sets, model=model)[1:]]) == 0
    out = capsys.readouterr().out
    captions = len({p.read_text() for p in images.glob("*.txt")})
    assert f"text_cached {captions}" in out and "only T5's outputs are cached" in out
    cached_calls = calls["n"]
    assert cached_calls >= 1
    assert main(train_args(images, tmp_path / "run", cache, *sets, model=model)) == 0
    assert calls["n"] == cached_calls  # reused: no T5 call while caching again nor in any step
    assert kept and kept[-1] and not any("T5" in name for name in kept[-1])  # let go of after caching
    # the joined conditioning equals the live one
    family = FAMILIES[name]
    bundle = family.load(resolve_source(load_config(None, [f"model.path={model}"], need_data=False).model,
                                        cache_root))
    texts = ["a red cube", "two dogs"]
    live = family.encode_text(bundle, texts, torch.device("cpu"), torch.bfloat16)
    frozen = family.encode_frozen_text(bundle, texts, torch.device("cpu"), torch.bfloat16)
    joined = family.encode_text(bundle, texts, torch.device("cpu"), torch.bfloat16, frozen=frozen)
    assert set(live) == set(joined) and all(torch.equal(live[k], joined[k]) for k in live)


def test_data_says_only_t5_outputs_are_cached_while_sd3s_clips_train(tmp_path, images, capsys):
    args = train_args(images, tmp_path / "out", tmp_path / "cache", "train.mode=lora", "lora.rank=2",
                      "lora.text_encoder_rank=2", model="tiny:sd3")
    capsys.readouterr()
    assert main(["data", *args[1:], "--per-bucket", "0"]) == 0
    out = capsys.readouterr().out
    assert "distinct caption variants, T5's outputs only, where the model has a T5 (lora.text_encoder_rank" in out


def test_the_planner_lowers_t5s_precision_for_the_caption_phase_while_the_clips_train(capsys):
    """With the CLIPs training, T5 runs in the caption phase only: a budget its bf16 weights do not fit
    there is met by storing T5 in int8, as without text-encoder training."""
    assert main(["plan", "--model", "flux1-dev", "--vram", "10GiB", "--set", "train.mode=lora",
                 "--set", "lora.text_encoder_rank=8"]) == 0
    out = capsys.readouterr().out
    assert 'model.t5_precision = "int8": with "bf16" the cache_text phase is predicted' in out


def test_a_t5_entry_gone_while_the_clips_train_skips_its_micro_batch(tmp_path, images, cache_root, caplog,
                                                                     monkeypatch):
    """A T5 entry lost after the cache stage (SD3, CLIPs training): its micro-batches are skipped and
    named, T5 does not come back to the device mid-run, and the run goes on."""
    from transformers import T5EncoderModel

    from vramfit.train.data import TrainingData

    fill = TrainingData.cache_text

    def then_lose_one(self, progress=False):
        fill(self, progress)
        self.cache.path("text", next(iter(self.text_entries()))).unlink()
        calls["cached"] = calls["n"]

    calls = {"n": 0, "cached": None}
    forward = T5EncoderModel.forward

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TrainingData, "cache_text", then_lose_one)
    cache = cache_root / "frozen-lost"
    shutil.rmtree(cache, ignore_errors=True)
    caplog.set_level("WARNING", logger="vramfit")
    monkeypatch.setattr(T5EncoderModel, "forward", counted)
    assert main(train_args(images, tmp_path / "run", cache, *TE, "train.steps=6", "train.batch_size=1",
                           model="tiny:sd3")) == 0
    assert calls["cached"] and calls["n"] == calls["cached"]  # T5 ran in the cache stage only
    assert "skipping a micro-batch" in caplog.text
