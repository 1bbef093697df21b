"""The training objectives: SDXL's DDPM schedule (epsilon and v prediction, zero terminal SNR, offset
noise, input perturbation), the SNR loss weightings and Huber losses of every family, the flow
families' shift, and which of their settings refuse which."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from diffusers import DDPMScheduler

from safetensors import safe_open

from vramfit.cli import main
from vramfit.config.rules import config_problems
from vramfit.config.schema import ModelConfig, RunConfig, TrainConfig
from vramfit.models.flow import flow_snr, mu_for, shifted, time_shift
from vramfit.models.flux.objective import SCHEDULER, flux_sigmas
from vramfit.models.objectives import (
    debiased_weights, elementwise_loss, huber_thresholds, min_snr_weights, objective_terms, weighted_loss,
    weighted_mse,
)
from vramfit.models.parts import shipped_config
from vramfit.models.registry import FAMILIES
from vramfit.models.sd3.flow import lookup_sigmas, sd3_sigmas, shifted_sigmas
from vramfit.models.sdxl import objective as sdxl
from vramfit.models.sources import resolve_source

from conftest import train_args


def _sched(prediction="epsilon", zero_snr=False):
    return sdxl.noise_scheduler(prediction, zero_snr)


def _inputs(x, sched, seed: int, offset: float, perturbation: float = 0.0):
    draws = sdxl.ddpm_draws(x.shape, sched, torch.Generator().manual_seed(seed), offset,
                            input_perturbation=perturbation)
    return sdxl.ddpm_inputs(x, sched, draws, offset, perturbation)


def test_noisy_latents_follow_the_ddpm_schedule_and_are_seeded():
    sched = _sched()
    x = torch.randn(3, 4, 8, 8)
    a = _inputs(x, sched, 0, 0.0)
    b = _inputs(x, sched, 0, 0.0)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    noisy, noise, t = a
    ab = sched.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(noisy, ab.sqrt() * x + (1 - ab).sqrt() * noise)
    assert sched.config.prediction_type == "epsilon" and sched.config.beta_schedule == "scaled_linear"


def test_noise_offset_and_input_perturbation_follow_the_hand_formulas():
    sched = _sched()
    x = torch.randn(2, 4, 16, 16)
    noisy, target, t = _inputs(x, sched, 7, 0.05, 0.1)
    g = torch.Generator().manual_seed(7)  # the draws in their order: noise, offset, timesteps, perturbation
    noise = torch.randn(x.shape, generator=g)
    offset = torch.randn(2, 4, 1, 1, generator=g)
    steps = torch.randint(0, 1000, (2,), generator=g)
    perturbation = torch.randn(x.shape, generator=g)
    assert torch.equal(t, steps)
    noise = noise + 0.05 * offset  # one constant per sample and channel
    ab = sched.alphas_cumprod[steps].view(-1, 1, 1, 1)
    torch.testing.assert_close(target, noise)  # the target keeps the unperturbed noise
    torch.testing.assert_close(noisy, ab.sqrt() * x + (1 - ab).sqrt() * (noise + 0.1 * perturbation))
    # without the perturbation the same draws give the same noise, and the input follows it
    plain, target0, t0 = _inputs(x, sched, 7, 0.05)
    assert torch.equal(target0, target) and torch.equal(t0, t)
    torch.testing.assert_close(plain, ab.sqrt() * x + (1 - ab).sqrt() * noise)


def test_v_target_and_zero_snr_betas_equal_diffusers():
    ours = _sched("v_prediction", True)
    c = shipped_config("sdxl_scheduler")
    ref = DDPMScheduler(num_train_timesteps=1000, beta_start=c["beta_start"], beta_end=c["beta_end"],
                        beta_schedule="scaled_linear", prediction_type="v_prediction", rescale_betas_zero_snr=True)
    torch.testing.assert_close(ours.betas, ref.betas, rtol=0, atol=0)
    # by hand (Lin et al., algorithm 1): sqrt(alpha_bar) shifted to 0 at the end, scaled to keep the start
    betas = torch.linspace(c["beta_start"] ** 0.5, c["beta_end"] ** 0.5, 1000, dtype=torch.float32) ** 2
    root = torch.cumprod(1 - betas, 0).sqrt()
    first, last = root[0].clone(), root[-1].clone()
    root = (root - last) * first / (first - last)
    bar = root ** 2
    hand = torch.cat([bar[:1], bar[1:] / bar[:-1]])
    torch.testing.assert_close(ours.betas, 1 - hand, rtol=1e-5, atol=1e-6)
    assert ours.alphas_cumprod[-1] == 0 and ours.betas[-1] == 1
    x = torch.randn(3, 4, 8, 8)
    draws = {"noise": torch.randn(x.shape), "timesteps": torch.tensor([0, 500, 999])}
    noisy, target, t = sdxl.ddpm_inputs(x, ours, draws, 0.0)
    torch.testing.assert_close(target, ref.get_velocity(x, draws["noise"], t), rtol=0, atol=0)
    torch.testing.assert_close(noisy[2], draws["noise"][2])  # the last timestep is pure noise
    torch.testing.assert_close(target[2], -x[2])  # where v is minus the image


def test_min_snr_weights_per_prediction_type():
    snr = torch.tensor([0.0, 0.5, 5.0, 40.0])
    assert torch.equal(min_snr_weights(snr, "epsilon", 0.0), torch.ones(4))
    torch.testing.assert_close(min_snr_weights(snr, "epsilon", 5.0), torch.tensor([1.0, 1.0, 1.0, 5 / 40]))
    torch.testing.assert_close(min_snr_weights(snr, "v_prediction", 5.0),
                               torch.tensor([0.0, 0.5 / 1.5, 5 / 6, 5 / 41]))
    # flow: min(snr, gamma) * sigma^2 with snr = ((1 - sigma) / sigma)^2
    sigmas = torch.tensor([1.0, 0.5, 0.2, 0.9])
    snr = flow_snr(sigmas)
    torch.testing.assert_close(snr, torch.tensor([0.0, 1.0, 16.0, 1 / 81]))
    torch.testing.assert_close(min_snr_weights(snr, "flow", 5.0),
                               torch.tensor([0.0, 0.25, 5 * 0.04, 0.81 / 81]))
    # SDXL's timesteps: the weights of its schedule's SNR
    sched = _sched()
    t = torch.tensor([0, 500, 999])
    w = sdxl.min_snr_weights(sched, t, 5.0)
    ab = sched.alphas_cumprod[t]
    snr = ab / (1 - ab)
    torch.testing.assert_close(w, torch.clamp(snr, max=5.0) / snr)
    assert w[0] < 0.01 and w[2] == 1.0
    torch.testing.assert_close(sdxl.min_snr_weights(_sched("v_prediction"), t, 5.0),
                               torch.clamp(snr, max=5.0) / (snr + 1))
    # add_noise moves the scheduler's alphas_cumprod to the latents' device; the weights never read it
    moved = _sched()
    moved.alphas_cumprod = moved.alphas_cumprod.to("meta")
    assert torch.equal(sdxl.min_snr_weights(moved, t, 5.0), w)


def test_debiased_weights_per_prediction_type():
    snr = torch.tensor([0.25, 4.0, 1e6])
    torch.testing.assert_close(debiased_weights(snr, "epsilon"), torch.tensor([2.0, 0.5, 1 / math.sqrt(1000)]))
    torch.testing.assert_close(debiased_weights(snr, "v_prediction"), torch.tensor([0.8, 0.2, 1 / 1001]))
    sigmas = torch.tensor([0.5, 0.2, 0.9])
    torch.testing.assert_close(debiased_weights(flow_snr(sigmas), "flow"), sigmas * (1 - sigmas))


def test_terms_multiply_the_family_weights_and_give_huber_thresholds():
    snr = torch.tensor([0.25, 4.0])
    base = torch.tensor([2.0, 3.0])
    plain = objective_terms(snr, "epsilon", TrainConfig(), base)
    assert plain.keys() == {"weights"} and plain["weights"] is base  # unset keys change nothing
    cfg = TrainConfig(debiased_estimation=True, loss="huber", huber_c=0.2, huber_schedule="constant")
    terms = objective_terms(snr, "epsilon", cfg, base)
    torch.testing.assert_close(terms["weights"], base * torch.tensor([2.0, 0.5]))
    torch.testing.assert_close(terms["huber_c"], torch.tensor([0.2, 0.2]))
    # kohya's "snr" schedule: c at pure noise (snr 0), c + (1 - c) / (1 + 1/sqrt(snr))^2 between
    torch.testing.assert_close(huber_thresholds(torch.tensor([0.0, 4.0, 1e12]), 0.1, "snr"),
                               torch.tensor([0.1, 0.1 + 0.9 / 2.25, 1.0]))


def test_huber_and_smooth_l1_by_hand():
    pred = torch.tensor([[3.0, 0.0], [0.5, -0.5]]).view(2, 2, 1, 1)
    target = torch.zeros_like(pred)
    c = torch.tensor([1.0, 0.5])
    d2 = pred.view(2, 2) ** 2
    cc = c.view(2, 1)
    huber = 2 * cc * (torch.sqrt(d2 + cc ** 2) - cc)
    torch.testing.assert_close(elementwise_loss(pred, target, "huber", c).view(2, 2), huber)
    torch.testing.assert_close(elementwise_loss(pred, target, "smooth_l1", c).view(2, 2), huber / cc)
    w = torch.tensor([1.0, 2.0])
    expect = (huber.mean(1) * w).mean()
    torch.testing.assert_close(weighted_loss(pred, target, w, loss="huber", huber_c=c), expect)
    # large errors grow linearly (2c|d|), small ones as the square (d^2)
    big = elementwise_loss(torch.full((1, 1), 1000.0), torch.zeros(1, 1), "huber", torch.tensor([0.1]))
    assert abs(big.item() - 2 * 0.1 * 1000) < 0.1
    small = elementwise_loss(torch.full((1, 1), 0.05), torch.zeros(1, 1), "huber", torch.tensor([1.0]))
    assert abs(small.item() / 0.05 ** 2 - 1) < 1e-3
    assert torch.equal(weighted_mse(pred, target, w), weighted_loss(pred, target, w))


def test_flow_shift_fixed_and_by_resolution():
    u = torch.tensor([0.1, 0.5, 0.9])
    sched = SimpleNamespace(num_train_timesteps=1000, shift=3.0)
    # SD3's default stays the shift-3 table; a set flow_shift is that table's shift
    default = sd3_sigmas(u, 4096, sched, TrainConfig())
    for got, want in zip(default, lookup_sigmas(u, shifted_sigmas(1000, 3.0))):
        assert torch.equal(got, want)
    sigmas, _ = sd3_sigmas(u, 4096, sched, TrainConfig(flow_shift=1.0))
    torch.testing.assert_close(sigmas, 1 - (u * 1000).long() / 1000)  # unshifted: the plain table
    sigmas, timesteps = sd3_sigmas(u, 1024, sched, TrainConfig(flow_shift_mode="resolution"))
    mu = 1024 * (1.15 - 0.5) / (4096 - 256) + 0.5 - 256 * (1.15 - 0.5) / (4096 - 256)
    torch.testing.assert_close(sigmas, math.exp(mu) / (math.exp(mu) + 1 / u - 1))
    torch.testing.assert_close(timesteps, sigmas * 1000)
    # Flux: resolution by default (as before), a fixed shift s u / (1 + (s - 1) u) when asked
    flux = SimpleNamespace(**SCHEDULER)
    assert torch.equal(flux_sigmas(u, 1024, flux, TrainConfig()), shifted(u, mu_for(1024, flux)))
    torch.testing.assert_close(flux_sigmas(u, 1024, flux, TrainConfig(flow_shift=2.0)), 2 * u / (1 + u))
    torch.testing.assert_close(flux_sigmas(u, 1024, flux, TrainConfig(flow_shift_mode="fixed")),
                               time_shift(u, 3.0))


def test_checkpoints_say_their_prediction_type(tmp_path):
    assert sdxl.single_file_settings({"model.diffusion_model.x"}) == ("epsilon", False)
    assert sdxl.single_file_settings({"v_pred", "ztsnr"}) == ("v_prediction", True)
    assert sdxl.single_file_settings({"v_pred"}) == ("v_prediction", False)
    assert sdxl.single_file_settings({"ztsnr"}) == ("epsilon", False)
    assert sdxl.folder_settings(tmp_path) == ("epsilon", False)
    (tmp_path / "scheduler").mkdir()
    config = tmp_path / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({"prediction_type": "v_prediction", "rescale_betas_zero_snr": True}))
    assert sdxl.folder_settings(tmp_path) == ("v_prediction", True)
    config.write_text(json.dumps({"prediction_type": "sample"}))
    with pytest.raises(ValueError, match="scheduler_config.json: prediction_type 'sample'"):
        sdxl.folder_settings(tmp_path)
    # "auto" keeps the checkpoint's; a set key replaces it; the sampler follows
    v = _sched("v_prediction", True)
    assert sdxl.wanted_settings(v, TrainConfig()) == ("v_prediction", True)
    assert sdxl.wanted_settings(_sched(), TrainConfig(prediction_type="v_prediction")) == ("v_prediction", False)
    with pytest.raises(ValueError, match="train.zero_terminal_snr"):
        sdxl.wanted_settings(v, TrainConfig(prediction_type="epsilon"))
    sampling = sdxl.sampling_config(v)
    assert (sampling["prediction_type"], sampling["rescale_betas_zero_snr"], sampling["timestep_spacing"]) == \
        ("v_prediction", True, "trailing")
    assert sdxl.sampling_config(_sched())["timestep_spacing"] == "leading"
    assert set(sdxl.single_file_markers(v)) == {"v_pred", "ztsnr"} and sdxl.single_file_markers(_sched()) == {}


def test_each_objective_rule_refuses_its_key():
    cases = {
        "train.zero_terminal_snr": {"zero_terminal_snr": True, "prediction_type": "epsilon"},
        "train.debiased_estimation": {"debiased_estimation": True, "min_snr_gamma": 5.0},
        "train.weighting_scheme": {"weighting_scheme": "cosmap", "debiased_estimation": True},
        "train.huber_c": {"huber_c": 0.3},
        "train.huber_schedule": {"huber_schedule": "constant"},
        "train.flow_shift": {"flow_shift": 2.0, "flow_shift_mode": "resolution"},
    }
    # (tests/test_rules.py checks that every rule of the table is tried)
    for key, values in cases.items():
        cfg = RunConfig.model_construct(train=TrainConfig.model_construct(**{**TrainConfig().model_dump(),
                                                                             **values}))
        assert [k for k, _ in config_problems(cfg)] == [key], key
    # the allowed neighbours
    for values in ({"zero_terminal_snr": True, "prediction_type": "v_prediction"}, {"loss": "huber", "huber_c": 0.3},
                   {"flow_shift": 2.0, "flow_shift_mode": "fixed"}, {"min_snr_gamma": 5.0}):
        RunConfig(train=values)


def _family_inputs(name: str, cfg, scheduler):
    bundle = SimpleNamespace(noise_scheduler=scheduler)
    channels = 4 if name == "sdxl" else 16
    batch = {"mean": torch.zeros(2, channels, 8, 8), "logvar": torch.full((2, channels, 8, 8), -20.0),
             "prompt_embeds": torch.zeros(2, 3, 8), "pooled": torch.zeros(2, 8), "time_ids": torch.zeros(2, 6)}
    return FAMILIES[name].loss_inputs(bundle, batch, cfg, torch.Generator().manual_seed(3)), bundle


@pytest.mark.parametrize("name", ["sdxl", "sd3", "flux"])
def test_every_family_weights_its_loss_by_snr_and_passes_huber_thresholds(name):
    flow = {"sd3": SimpleNamespace(config=SimpleNamespace(num_train_timesteps=1000, shift=3.0)),
            "flux": SimpleNamespace(config=SimpleNamespace(**SCHEDULER))}
    sched = flow.get(name) or _sched("v_prediction")
    plain, _ = _family_inputs(name, TrainConfig(), sched)
    cfg = TrainConfig(min_snr_gamma=5.0, loss="huber", huber_schedule="constant", huber_c=0.2)
    weighted, _ = _family_inputs(name, cfg, sched)
    if name == "sdxl":  # the same draws; v's min-SNR weights of the drawn timesteps
        assert torch.equal(plain["timesteps"], weighted["timesteps"])
        ab = sched.alphas_cumprod[plain["timesteps"]]
        snr = ab / (1 - ab)
        torch.testing.assert_close(weighted["weights"], torch.clamp(snr, max=5.0) / (snr + 1))
        assert torch.equal(plain["weights"], torch.ones(2))
    else:  # the family's own weights (logit_normal: ones) times min(snr, 5) * sigma^2
        sigmas = plain["sigmas"]
        assert torch.equal(sigmas, weighted["sigmas"])
        snr = ((1 - sigmas) / sigmas) ** 2
        torch.testing.assert_close(weighted["weights"], plain["weights"] * torch.clamp(snr, max=5.0) * sigmas ** 2)
    assert "huber_c" not in plain and torch.equal(weighted["huber_c"], torch.full((2,), 0.2))


def test_sdxl_trains_the_prediction_type_asked_and_the_bundle_follows():
    inputs, bundle = _family_inputs("sdxl", TrainConfig(prediction_type="v_prediction", zero_terminal_snr=True),
                                    _sched())
    assert sdxl.scheduler_settings(bundle.noise_scheduler) == ("v_prediction", True)
    same, kept = _family_inputs("sdxl", TrainConfig(), bundle.noise_scheduler)  # auto keeps what it has
    assert kept.noise_scheduler is bundle.noise_scheduler
    assert torch.equal(same["timesteps"], inputs["timesteps"])


@pytest.mark.parametrize("name, key, value", [
    ("sdxl", "flow_shift", 2.0), ("sdxl", "flow_shift_mode", "resolution"),
    ("sd3", "input_perturbation", 0.1), ("sd3", "prediction_type", "epsilon"),
    ("flux", "zero_terminal_snr", False), ("flux", "noise_offset", 0.1)])
def test_a_key_of_another_familys_objective_is_refused_by_name(name, key, value):
    problems = FAMILIES[name].config_problems(RunConfig(train={key: value}))
    assert [p for p in problems if p.startswith(f"train.{key}: applies to ")], problems
    assert not FAMILIES[name].config_problems(RunConfig(train={"min_snr_gamma": 5.0, "loss": "huber"}))


def test_weighted_mse_weights_each_sample():
    pred, target = torch.ones(2, 1, 2, 2), torch.zeros(2, 1, 2, 2)
    assert weighted_mse(pred, target, torch.tensor([1.0, 0.0])).item() == 0.5


def test_a_v_prediction_zero_snr_run_renders_and_saves_what_loaders_read(images, tmp_path, cache_root,
                                                                         capsys):
    out = tmp_path / "v"
    args = train_args(images, out, cache_root / "obj", "train.prediction_type=v_prediction",
                      "train.zero_terminal_snr=true", "train.min_snr_gamma=5", "sample.every_steps=2",
                      "sample.prompts=['a circle']", "sample.steps=2", "save.formats=['single_file', 'diffusers']",
                      "save.name=m", model="tiny:sdxl")
    assert main(args) == 0
    assert [p.name for p in (out / "samples").glob("*.png")] == ["step-000002.png"]
    with safe_open(str(out / "m.safetensors"), "pt") as f:  # ComfyUI's markers of a v-pred zero-SNR SDXL
        assert {"v_pred", "ztsnr"} <= set(f.keys())
    config = json.loads((out / "m-diffusers" / "scheduler" / "scheduler_config.json").read_text())
    assert (config["prediction_type"], config["rescale_betas_zero_snr"], config["timestep_spacing"]) == \
        ("v_prediction", True, "trailing")
    # each saved model loads back as what it was trained as; its sampler (vramfit generate's) follows
    for path in (out / "m.safetensors", out / "m-diffusers"):
        bundle = FAMILIES["sdxl"].load(resolve_source(ModelConfig(path=str(path)), cache_root / "obj"))
        assert sdxl.scheduler_settings(bundle.noise_scheduler) == ("v_prediction", True), path
        pipe = FAMILIES["sdxl"].pipeline(bundle, bundle.vae, bundle.text_encoders, bundle.tokenizers)
        assert (pipe.scheduler.config.prediction_type, pipe.scheduler.config.timestep_spacing) == \
            ("v_prediction", "trailing")
    # a folder whose scheduler pairs zero terminal SNR with epsilon: "auto" takes both, which is refused
    config.update(prediction_type="epsilon")
    (out / "m-diffusers" / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    again = train_args(images, tmp_path / "eps", cache_root / "obj", "train.steps=1",
                       model=str(out / "m-diffusers"))
    assert main(again) == 2
    assert "train.zero_terminal_snr: zero terminal SNR with epsilon prediction" in capsys.readouterr().err


def test_resume_is_exact_with_every_objective_setting(images, tmp_path, cache_root):
    sets = ("train.steps=4", "save.state_every_steps=2", "train.precision=fp32", "save.name=m",
            "train.prediction_type=v_prediction", "train.zero_terminal_snr=true", "train.noise_offset=0.05",
            "train.input_perturbation=0.1", "train.debiased_estimation=true", "train.loss=huber")
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(train_args(images, full, cache_root / "obj2", *sets, model="tiny:sdxl")) == 0
    args = train_args(images, part, cache_root / "obj2", *sets, model="tiny:sdxl")
    assert main(args + ["--resume", str(full / "state" / "step-000002")]) == 0
    ref = json.loads((full / "run.json").read_text())["losses"]
    assert len(ref) == 4 and json.loads((part / "run.json").read_text())["losses"] == ref


def test_a_v_prediction_zero_snr_run_trains_on_diffusers_velocity(images, tmp_path, cache_root, monkeypatch):
    """Through `vramfit train` (tiny:sdxl, v-prediction with zero terminal SNR): every training step's
    target is what diffusers' DDPMScheduler with the same settings gives as the velocity of those
    latents, noise and timesteps."""
    import vramfit.models.sdxl.family as sdxl_family

    seen = []
    real = sdxl_family.ddpm_inputs

    def spy(latents, scheduler, draws, noise_offset, input_perturbation=0.0):
        out = real(latents, scheduler, draws, noise_offset, input_perturbation)
        seen.append((latents.detach().float().clone(), draws["noise"].clone(), out[2].clone(), out[1].clone()))
        return out

    monkeypatch.setattr(sdxl_family, "ddpm_inputs", spy)
    assert main(train_args(images, tmp_path / "run", cache_root, "train.steps=2", "train.mode=lora",
                           "train.prediction_type=v_prediction", "train.zero_terminal_snr=true",
                           model="tiny:sdxl")) == 0
    assert len(seen) >= 2
    c = shipped_config("sdxl_scheduler")
    ref = DDPMScheduler(num_train_timesteps=1000, beta_start=c["beta_start"], beta_end=c["beta_end"],
                        beta_schedule="scaled_linear", prediction_type="v_prediction", rescale_betas_zero_snr=True)
    for latents, noise, timesteps, target in seen:
        torch.testing.assert_close(target, ref.get_velocity(latents, noise, timesteps), rtol=1e-6, atol=1e-6)
        assert not torch.allclose(target, noise)  # not epsilon's
