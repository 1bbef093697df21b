"""The EMA of the trained weights (memory/ema.py, [ema]): its arithmetic against diffusers' EMAModel
and by hand, bf16 stochastic rounding, the CPU placement, exact resume, the -ema files, sample
grids with the EMA and the planner's bytes."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.training_utils import EMAModel
from PIL import Image
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main
from vramfit.config.schema import RunConfig
from vramfit.data.synth import make_synthetic_dataset
from vramfit.fit.model_facts import read_facts
from vramfit.fit.planner import ema_host_bytes, plan_report, predict, with_values
from vramfit.memory.ema import EMA, ema_decay
from vramfit.train.lora import target_modules


def _params(n: int = 3, seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.nn.Parameter(torch.randn(5, 7, generator=g)) for i in range(n)}


def _move(params: dict, g: torch.Generator) -> None:
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("warmup", [True, False])
def test_fp32_equals_diffusers_ema_model(warmup):
    params = _params()
    ours = EMA(params, decay=0.8, warmup=warmup)
    ref = EMAModel(list(params.values()), decay=0.8, use_ema_warmup=False)
    if not warmup:  # EMAModel always ramps; without warmup the decay is constant from the first update
        ref.get_decay = lambda step: 0.8
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        _move(params, g)
        ours.update()
        ref.step(list(params.values()))
    for s, r in zip(ours.shadows.values(), ref.shadow_params):
        assert torch.equal(s, r)
    assert (ema_decay(0.8, 0, True), ema_decay(0.8, 1, True), ema_decay(0.8, 0, False)) == (0.0, 2 / 11, 0.8)


def test_update_every_n_steps_and_cpu_placement_match_by_hand():
    params = _params()
    start = {n: p.detach().clone() for n, p in params.items()}
    beside = EMA(params, decay=0.75, update_every=2, warmup=False)
    # in CPU memory: the worker thread and the staging copy
    in_cpu = EMA(params, decay=0.75, update_every=2, warmup=False, device="cpu")
    expected = dict(start)
    g = torch.Generator().manual_seed(2)
    for step in range(1, 6):
        _move(params, g)
        assert beside.maybe_update(step) == in_cpu.maybe_update(step) == (step % 2 == 0)
        if step % 2 == 0:
            expected = {n: 0.75 * expected[n] + 0.25 * p.detach() for n, p in params.items()}
    in_cpu.wait()
    for n in params:
        torch.testing.assert_close(beside.shadows[n], expected[n], rtol=1e-6, atol=1e-6)
        assert torch.equal(in_cpu.shadows[n], beside.shadows[n])
    assert beside.updates == in_cpu.updates == 2
    in_cpu.close()


def test_bf16_updates_round_stochastically_unbiased():
    # 1.0 moved a tenth of the way to 1 + 2**-7 (bf16's next value): to nearest it never moves
    weight = torch.nn.Parameter(torch.full((1 << 20,), 1 + 2**-7))
    ema = EMA({"w": weight}, decay=0.9, warmup=False, dtype="bf16", seed=3)
    ema.shadows["w"].fill_(1.0)
    ema.update()
    moved = ema.shadows["w"].float() - 1.0
    assert set(moved.unique().tolist()) == {0.0, 2**-7}
    assert moved.mean().item() == pytest.approx(0.1 * 2**-7, rel=0.03)
    nearest = torch.ones(4, dtype=torch.bfloat16)
    nearest.sub_(0.1 * (nearest - torch.full((4,), 1 + 2**-7, dtype=torch.bfloat16)))
    assert torch.equal(nearest, torch.ones(4, dtype=torch.bfloat16)), "to nearest the EMA would not move"


def test_state_dict_resumes_the_same_draws_and_swap_restores():
    params = _params()
    a = EMA(params, decay=0.9, dtype="bf16", device="cpu", seed=4)
    g = torch.Generator().manual_seed(5)
    _move(params, g)
    a.update()
    b = EMA(params, decay=0.9, dtype="bf16", device="cpu", seed=99)
    b.load_state_dict(a.state_dict(), "ema.safetensors")
    _move(params, g)
    a.update()
    b.update()
    a.wait()
    b.wait()
    assert all(torch.equal(a.shadows[n], b.shadows[n]) for n in params) and a.updates == b.updates == 2
    trained = {n: p.detach().clone() for n, p in params.items()}
    with pytest.raises(RuntimeError, match="inside"), a.swapped():
        assert all(torch.equal(p.detach(), a.shadows[n].float()) for n, p in params.items())
        raise RuntimeError("inside")
    assert all(torch.equal(p.detach(), trained[n]) for n, p in params.items())
    with pytest.raises(ValueError, match="ema.safetensors: its EMA weights do not match"):
        EMA(_params(2), decay=0.9).load_state_dict(a.state_dict(), "ema.safetensors")
    a.close()
    b.close()


def test_config_refuses_what_cannot_work():
    with pytest.raises(ValueError, match=r"ema\.device: \"gpu\" cannot be used with memory\.stream_weights"):
        RunConfig.model_validate({"memory": {"stream_weights": True}, "ema": {"enabled": True}})
    RunConfig.model_validate({"memory": {"stream_weights": True}, "ema": {"enabled": True, "device": "cpu"}})
    with pytest.raises(ValueError, match=r"ema\.decay: given without ema\.enabled = true"):
        RunConfig.model_validate({"ema": {"decay": 0.99}})


def test_planner_counts_the_ema_bytes(cache_root):
    cfg = RunConfig.model_validate({"model": {"path": "tiny:sdxl"}, "train": {"mode": "lora"},
                                    "data": {"resolution": 64}})
    facts = read_facts(cfg, cache_root)
    linears = [facts.denoiser.get_submodule(n) for n in target_modules(facts.denoiser, cfg.lora)]
    lora = sum(cfg.lora.rank * (m.in_features + m.out_features) for m in linears)
    base = {p.name: p for p in predict(facts, cfg).phases}
    on_gpu = {p.name: p for p in predict(facts, with_values(cfg, {"ema.enabled": True})).phases}
    trained = on_gpu["train"].parts["ema"]
    assert trained == 4 * lora > 0  # the fp32 EMA of every LoRA matrix
    for phase in ("train", "save"):
        assert on_gpu[phase].peak - base[phase].peak == trained
    half = with_values(cfg, {"ema.enabled": True, "ema.dtype": "bf16"})
    assert predict(facts, half).phases[-1].parts["ema"] == trained // 2
    in_cpu = with_values(cfg, {"ema.enabled": True, "ema.device": "cpu"})
    assert [p.peak for p in predict(facts, in_cpu).phases] == [p.peak for p in base.values()]
    assert ema_host_bytes(facts, in_cpu) == 2 * trained  # the fp32 EMA and the staging copy of the LoRA
    assert "host memory: the EMA" in plan_report(facts=facts, cfg=in_cpu, budget=None)
    # the trained text encoders' LoRA is averaged too: 18 * rank * hidden values a CLIP layer
    te = with_values(cfg, {"ema.enabled": True, "lora.text_encoder_rank": 2, "cache.text": False})
    clips = [e for e in facts.encoders if e.kind == "clip"]
    values = sum(18 * 2 * e.hidden * e.layers for e in clips)
    assert values > 0 and predict(facts, te).phase("train").parts["ema"] == trained + 4 * values


# ---- through the CLI on tiny:sdxl ----------------------------------------------------------------

def _states(out: Path) -> dict[int, Path]:
    return {int(p.name[5:]): p for p in (out / "state").glob("step-*")}


def _hand_ema(states: dict[int, Path], steps: list[int], decay: float) -> dict[str, torch.Tensor]:
    """The EMA with warmup from the trained weights the states saved at `steps`, by hand."""
    ema = None
    for n, step in enumerate(steps):
        w = {k: v.float() for k, v in load_file(str(states[step] / "weights.safetensors")).items()}
        d = 0.0 if n == 0 else min(decay, (1 + n) / (10 + n))
        ema = dict(w) if ema is None else {k: d * ema[k] + (1 - d) * w[k] for k in w}
    return ema


def _assert_shadows(state: Path, expected: dict[str, torch.Tensor]) -> None:
    saved = load_file(str(state / "ema.safetensors"))
    assert {k[len("shadow."):] for k in saved if k.startswith("shadow.")} == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(saved["shadow." + k], v, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, cache_root):
    """Two LoRA runs of 3 steps, a state at each, a final grid: the grid without and with the EMA."""
    root = tmp_path_factory.mktemp("ema-lora")
    make_synthetic_dataset(root / "images", n=4, size=64, seed=1)
    runs = {}
    for with_ema in (False, True):
        out = root / f"ema-{with_ema}"
        assert main(train_args(root / "images", out, cache_root, "train.mode=lora", "train.steps=3",
                               "ema.enabled=true", "save.state_every_steps=1", "save.keep_last=10",
                               "sample.prompts=[\"a red square\"]", "sample.every_steps=3", "sample.steps=2",
                               f"ema.sample_with_ema={str(with_ema).lower()}", model="tiny:sdxl")) == 0
        runs[with_ema] = out
    return runs


def test_lora_ema_equals_the_hand_computed_and_its_file_renders(lora_runs, tmp_path):
    out = lora_runs[False]
    states = _states(out)
    _assert_shadows(states[3], _hand_ema(states, [1, 2, 3], 0.9999))
    ema_file, trained = (load_file(str(out / f"model{s}.safetensors")) for s in ("-ema", ""))
    assert set(ema_file) == set(trained) and any(not torch.equal(ema_file[k], trained[k]) for k in trained)
    assert (out / "model-ema-diffusers.safetensors").is_file()  # every LoRA format the run writes
    assert main(["generate", "--no-progress", "--model", "tiny:sdxl", "--lora",
                 str(out / "model-ema.safetensors"), "--prompt", "a red square", "--steps", "1",
                 "--width", "64", "--height", "64", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "0-0.png").is_file()


def test_sample_with_ema_renders_the_ema_and_puts_the_trained_weights_back(lora_runs):
    grids = [np.asarray(Image.open(lora_runs[w] / "samples" / "step-000003.png")) for w in (False, True)]
    assert grids[0].shape == grids[1].shape and not np.array_equal(grids[0], grids[1])
    assert Image.open(lora_runs[True] / "samples" / "step-000003.png").text["weights"] == "ema"
    # the grid renders before the final save: what both runs saved as trained is the same
    for name in ("model.safetensors", "model-ema.safetensors"):
        a, b = (load_file(str(lora_runs[w] / name)) for w in (False, True))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_full_fine_tune_ema_every_2_steps_in_cpu_memory(tmp_path, images, cache_root):
    out = tmp_path / "out"
    assert main(train_args(images, out, cache_root, "train.steps=4", "ema.enabled=true", "ema.device=cpu",
                           "ema.update_every=2", "ema.decay=0.5", "save.state_every_steps=2",
                           "save.keep_last=2", "save.every_steps=1", "save.dtype=fp32", model="tiny:sdxl")) == 0
    states = _states(out)
    _assert_shadows(states[4], _hand_ema(states, [2, 4], 0.5))
    # intermediate EMA files beside the trained ones, pruned alike (save.keep_last)
    for name in ("model", "model-ema"):
        assert sorted(p.name for p in out.glob(f"{name}-step*")) == [
            f"{name}-step00000{i}.safetensors" for i in (2, 3)]
    assert main(["generate", "--no-progress", "--model", str(out / "model-ema.safetensors"),
                 "--prompt", "a cat", "--steps", "1", "--width", "64", "--height", "64",
                 "--out", str(tmp_path / "gen")]) == 0
    assert (tmp_path / "gen" / "0-0.png").is_file()


def test_resume_gives_the_same_ema(tmp_path, images, cache_root, caplog, capsys):
    """4 steps at once, and 2 then 2 more resumed: the same bf16 EMA (its rounding draws included).
    A state without an EMA file resumes with a warning; a torn one is refused, naming it."""
    sets = ("train.mode=lora", "train.steps=4", "ema.enabled=true", "ema.dtype=bf16", "ema.device=cpu",
            "ema.decay=0.9", "save.state_every_steps=1", "save.keep_last=10")
    whole = tmp_path / "whole"
    assert main(train_args(images, whole, cache_root, *sets, model="tiny:sdxl")) == 0
    part = tmp_path / "part"
    shutil.copytree(whole / "state" / "step-000002", part / "state" / "step-000002")
    (part / "state" / "latest").write_text("step-000002\n")
    assert main([*train_args(images, part, cache_root, *sets, model="tiny:sdxl"), "--resume", "latest"]) == 0
    a, b = (load_file(str(o / "state" / "step-000004" / "ema.safetensors")) for o in (whole, part))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert int(a["updates"][0]) == 4
    ema_file, trained = (load_file(str(part / f"model{s}.safetensors")) for s in ("-ema", ""))
    assert ema_file.keys() == trained.keys()
    torn = tmp_path / "torn" / "state" / "step-000002"
    shutil.copytree(whole / "state" / "step-000002", torn)
    (torn.parent / "latest").write_text("step-000002\n")
    data = (torn / "ema.safetensors").read_bytes()
    (torn / "ema.safetensors").write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    assert main([*train_args(images, tmp_path / "torn", cache_root, *sets, model="tiny:sdxl"), "--resume",
                 "latest"]) == 2
    err = capsys.readouterr().err
    assert f"{torn / 'ema.safetensors'}: unreadable" in err and "Traceback" not in err
    (torn / "ema.safetensors").unlink()  # a state saved before [ema] was turned on
    assert main([*train_args(images, tmp_path / "torn", cache_root, *sets, model="tiny:sdxl"), "--resume",
                 "latest"]) == 0
    assert "holds no EMA (it was saved without [ema]); the EMA starts at the resumed weights" in caplog.text


def test_text_encoder_lora_is_averaged_with_the_denoisers_and_saved_in_the_ema_file(tmp_path, images, cache_root):
    """[ema] beside lora.text_encoder_rank: the EMA holds the encoders' LoRA too (named as the
    training state names them), equal to the hand-computed EMA of the saved states; the -ema file
    carries the encoders' LoRA, averaged, in both formats' keys."""
    out = tmp_path / "out"
    assert main(train_args(images, out, cache_root, "train.mode=lora", "train.steps=3", "train.lr=1e-2",
                           "lora.text_encoder_rank=2", "ema.enabled=true", "ema.decay=0.5",
                           "save.state_every_steps=1", "save.keep_last=10", model="tiny:sdxl")) == 0
    states = _states(out)
    expected = _hand_ema(states, [1, 2, 3], 0.5)
    assert any(k.startswith("text_encoder_0.") for k in expected) and any(
        k.startswith("text_encoder_1.") for k in expected)
    _assert_shadows(states[3], expected)
    ema_file, trained = (load_file(str(out / f"model{s}.safetensors")) for s in ("-ema", ""))
    te = [k for k in trained if k.startswith(("lora_te1_", "lora_te2_")) and "lora_up" in k]
    assert te and set(ema_file) == set(trained)
    assert any(not torch.equal(ema_file[k], trained[k]) for k in te)
    diffusers = load_file(str(out / "model-ema-diffusers.safetensors"))
    assert any(k.startswith("text_encoder.") for k in diffusers)


def test_a_grid_sampled_with_the_ema_uses_the_text_encoders_ema_too(tmp_path, images, cache_root, monkeypatch):
    """ema.sample_with_ema with trained text encoders: the grid's encoders get the EMA of their LoRA
    (what the step's state saves as the EMA), not the trained values."""
    import vramfit.train.samples as samples

    seen = {}
    real = samples.merge_trained_encoders

    def spy(targets, trained):
        seen.update({f"text_encoder_{i}.{n}": p.detach().clone() for i, enc in enumerate(trained)
                     for n, p in enc.named_parameters() if p.requires_grad})
        return real(targets, trained)

    monkeypatch.setattr(samples, "merge_trained_encoders", spy)
    out = tmp_path / "out"
    assert main(train_args(images, out, cache_root, "train.mode=lora", "train.steps=2", "train.lr=1e-2",
                           "lora.text_encoder_rank=2", "ema.enabled=true", "ema.decay=0.5",
                           "ema.sample_with_ema=true", "sample.prompts=[\"a red square\"]", "sample.every_steps=2",
                           "sample.steps=1", "save.state_every_steps=1", "save.keep_last=5", model="tiny:sdxl")) == 0
    shadows = load_file(str(_states(out)[2] / "ema.safetensors"))
    weights = load_file(str(_states(out)[2] / "weights.safetensors"))
    assert seen and all(k.startswith("text_encoder_") for k in seen)
    for k, v in seen.items():
        torch.testing.assert_close(v.float(), shadows["shadow." + k].float(), rtol=0, atol=0)
    assert any(not torch.equal(weights[k], shadows["shadow." + k]) for k in seen)
