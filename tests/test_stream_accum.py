"""Gradient accumulation of streamed weights that step on the device (memory/offload/grads.py):
the sums of the earlier micro-batches kept on the device (memory.streamed_grad_sums = "device")
or moved home ("home") give the resident run's result; the sums are zero after each step and
no gradient is left behind; a skipped step's sums do not leak into the next; the config refuses
"device" where nothing steps on the device; the planner counts the sums' bytes."""
from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from conftest import train_args
from vramfit.cli import main
from vramfit.config import ConfigError
from vramfit.config.load import load_config
from vramfit.fit.model_facts import read_facts
from vramfit.fit import probe
from vramfit.fit.planner import MARGIN, host_prediction, predict, with_values
from vramfit.fit.resolve import Environment, with_grad_sums
from vramfit.memory.offload import WeightStreamer
from vramfit.memory.offload.grads import GradsHome
from vramfit.optim.adafactor import Adafactor
from vramfit.optim.base import RoundingGenerators
from vramfit.optim.in_backward import BackwardSteps

ACCUM = 3
STREAMED = ("memory.stream_weights=true", "train.optimizer_in_backward=true", "train.optimizer=adafactor",
            f"train.grad_accum={ACCUM}")
CUDA = torch.cuda.is_available()


# ---- the mechanism, on a toy model of four streamed blocks ---------------------------------------

class _Toy(nn.Module):
    """Four linear blocks; the last runs only while `extra` is set (a weight whose gradient comes
    from earlier micro-batches only)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4)).to(dtype)
        self.extra = True

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i < 3 or self.extra:
                x = torch.tanh(block(x))
        return x


def _toy_inputs(steps: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(4, 32, generator=g).to(dtype) for _ in range(ACCUM)] for _ in range(steps)]


def _toy_run(sums, dtype=torch.float32, round_sums=False, steps=2, after_step=None, skipped=None,
             shared=False):
    """Train the toy: resident (`sums` None) or streamed with its sums "home" or on the "device";
    the last block runs in the earlier micro-batches only. `skipped`: inputs of micro-batches run
    first as a step whose last backward is skipped (as train/engine.py does for a non-finite loss:
    the hooks' `discard`, then zero_grad). Returns the weights, the streamer and the step hooks."""
    model = _Toy(dtype)
    streamer = None
    if sums is not None:
        streamer = WeightStreamer(model, torch.device("cpu"), blocks=("blocks",), stream=True,
                                  stream_trainable=True, max_unit_bytes=2**20, offload_activations=False,
                                  sums_on_device=sums == "device")
    params = list(model.parameters())
    opt = Adafactor(params, lr=1e-2, rounding=RoundingGenerators(0) if round_sums else None)
    hooks = BackwardSteps(params, opt, in_backward=True, round_sums=round_sums, device=torch.device("cpu"))
    if streamer is not None:
        streamer.step_on_device(hooks)
        if shared:
            streamer.share_home_sums()
    if skipped is not None:
        for x in skipped:
            hooks.begin(last=False)
            model(x).float().pow(2).mean().backward()
        hooks.discard()
        opt.zero_grad(set_to_none=True)
    for batch in _toy_inputs(steps, dtype):
        for i, x in enumerate(batch):
            model.extra = i < ACCUM - 1
            hooks.begin(last=i == ACCUM - 1)
            (model(x).float().pow(2).mean() / ACCUM).backward()
        hooks.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(model, streamer)
    return [p.detach().clone() for p in params], streamer, hooks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_sums_give_the_home_and_resident_weights_bit_for_bit(dtype):
    """Sums added in the order autograd adds them (fp32; bf16 rounded to nearest) give the same
    bits on the device, at home and resident, the weight used only in earlier micro-batches too;
    on the device no gradient goes home and every earlier one is summed there."""
    resident, _, _ = _toy_run(None, dtype)
    home, at_home, _ = _toy_run("home", dtype)
    device, on_device, _ = _toy_run("device", dtype)
    assert all(torch.equal(a, b) for a, b in zip(home, resident))
    assert all(torch.equal(a, b) for a, b in zip(device, resident))
    trained = len(on_device.trainable)
    assert at_home.stats.grads_moved > 0 and at_home.stats.grads_summed == 0
    # two steps: two earlier micro-batches of the 8 weights, of which the last block's 2 run
    assert on_device.stats.grads_moved == 0 and on_device.stats.grads_summed == 2 * 2 * trained
    assert on_device.stats.stepped_on_device == 2 * (trained - 2)  # the last block's step in `finish`


def test_stochastically_rounded_sums_on_the_device_track_the_resident_run():
    """bf16 sums with stochastic rounding: the same values up to the rounding's draws."""
    resident, _, _ = _toy_run(None, torch.bfloat16, round_sums=True)
    device, _, _ = _toy_run("device", torch.bfloat16, round_sums=True)
    for a, b in zip(device, resident):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.02)


def test_after_each_step_the_sums_are_zero_and_no_gradient_is_left():
    seen = []

    def check(model, streamer):
        buffers = streamer.grads.sum_buffers()
        seen.append(len(buffers))
        assert buffers and all(not b.any() for b in buffers)
        assert all(p.grad is None for p in model.parameters())

    _toy_run("device", after_step=check)
    assert seen == [4, 4]  # a kept buffer per unit, the same ones each step


def test_a_skipped_steps_sums_do_not_reach_the_next_step():
    """The last backward of a step is skipped (a non-finite loss): the next step's sums are its own."""
    reference, _, _ = _toy_run("device", steps=1)
    skipped = [torch.full((4, 32), 3.0) for _ in range(ACCUM - 1)]
    got, streamer, hooks = _toy_run("device", steps=1, skipped=skipped)
    assert hooks.discarded == 1
    assert all(torch.equal(a, b) for a, b in zip(got, reference))


# ---- runs of the CLI on the smallest tiny model ---------------------------------------------------

def _run(images, out, cache, *sets: str, args: tuple = ()) -> tuple[int, list[float], dict]:
    code = main(train_args(images, out, cache, "save.name=m", "train.steps=3", *sets, model="tiny:sd3")
                + list(args))
    if code:
        return code, [], {}
    return code, json.loads((out / "run.json").read_text())["losses"], load_file(str(out / "m.safetensors"))


@pytest.fixture
def streamers(monkeypatch):
    """The streamers the runs make, and their kept sums when they are dropped: the bytes on the
    device and the devices they are on, the bytes at home and whether they are pinned."""
    made, kept = [], []
    init, drop = WeightStreamer.__init__, GradsHome.drop

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    def dropping(self):
        kept.append((self.sum_bytes(), {b.device.type for b in self.sum_buffers()}, self.home_sum_bytes(),
                     {b.is_pinned() for b in self.home_sum_buffers()}))
        drop(self)

    monkeypatch.setattr(WeightStreamer, "__init__", spy)
    monkeypatch.setattr(GradsHome, "drop", dropping)
    return made, kept


def test_cli_device_sums_match_home_and_resident_and_the_planner_counts_them(images, tmp_path, cache_root,
                                                                             streamers, caplog):
    """fp32: losses and saved weights equal bit for bit; the planner's train phase grows by exactly
    the bytes of the sums the run kept."""
    made, kept = streamers
    both = (*STREAMED[1:], "train.precision=fp32")
    _, ref_losses, ref = _run(images, tmp_path / "resident", cache_root / "off", *both)
    _, home_losses, home = _run(images, tmp_path / "home", cache_root / "off", *STREAMED,
                                "train.precision=fp32", "memory.streamed_grad_sums=home")
    assert made[-1].stats.grads_summed == 0 and made[-1].grads.sum_bytes() == 0
    _, losses, got = _run(images, tmp_path / "device", cache_root / "off", *STREAMED, "train.precision=fp32")
    assert made[-1].stats.grads_moved == 0 and made[-1].stats.grads_summed > 0
    assert losses == home_losses == ref_losses
    assert got.keys() == home.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) and torch.equal(home[k], ref[k]) for k in ref)
    # unset, it was resolved to "device" (no budget, no GPU to fit); the run's config.toml says so and
    # leaves it unset, to be decided afresh where the file is given again
    written = tmp_path / "device" / "config.toml"
    assert "# streamed_grad_sums: unset, resolved for this run: device\n" in written.read_text()
    assert load_config(written, [], need_data=False).memory.streamed_grad_sums is None
    assert 'streamed_grad_sums = "home"\n' in (tmp_path / "home" / "config.toml").read_text()  # as set
    sums = kept[-1][0]
    assert sums == sum(p.numel() * p.element_size() for p in made[-1].trainable) > 0
    cfg = load_config(None, train_args(images, tmp_path / "x", cache_root / "off", *STREAMED,
                                       "train.precision=fp32", model="tiny:sd3")[3::2])
    facts = read_facts(cfg, cache_root / "off")
    train = {s: next(p for p in predict(facts, with_values(cfg, {"memory.streamed_grad_sums": s})).phases
                     if p.name == "train") for s in ("home", "device")}
    assert train["device"].peak - train["home"].peak == sums == train["device"].parts["gradient sums"]
    # with a budget that fits the run without the sums only, unset resolves to "home"
    usable = (train["home"].peak + train["device"].peak) // 2
    budgeted = with_values(cfg, {"memory.vram_budget": str(int(usable / (1 - MARGIN)))})
    env = Environment(torch.device("cpu"))
    caplog.set_level(logging.INFO, logger="vramfit")
    assert with_grad_sums(budgeted, env, cache_root / "off").memory.streamed_grad_sums == "home"
    limit = int(int(usable / (1 - MARGIN)) * (1 - MARGIN))
    assert ("memory.streamed_grad_sums (unset): home, the streamed weights' gradient sums of earlier "
            "micro-batches in CPU memory: the train phase with them is predicted at "
            f"{train['device'].peak / 2**30:.2f} GiB, over the {limit / 2**30:.2f} GiB usable of "
            "memory.vram_budget") in caplog.text
    assert with_grad_sums(cfg, env, cache_root / "off").memory.streamed_grad_sums == "device"
    single = with_values(cfg, {"train.grad_accum": 1})
    assert with_grad_sums(single, env, cache_root / "off").memory.streamed_grad_sums is None  # no sums to keep


def test_cli_bf16_device_sums_with_stochastic_rounding_track_home(images, tmp_path, cache_root):
    """full_bf16 with stochastic_rounding (the default): the sums' draws come in another order at
    home (summed after backward), so the weights agree to bf16's rounding, not bit for bit."""
    _, home_losses, home = _run(images, tmp_path / "home", cache_root / "off", *STREAMED,
                                "memory.streamed_grad_sums=home")
    _, losses, got = _run(images, tmp_path / "device", cache_root / "off", *STREAMED,
                          "memory.streamed_grad_sums=device")
    assert losses == pytest.approx(home_losses, rel=1e-3)
    for key in home:
        torch.testing.assert_close(got[key].float(), home[key].float(), rtol=0.02, atol=0.02, msg=key)


def test_cli_a_stop_in_the_middle_of_accumulation_resumes_exactly(images, tmp_path, cache_root, streamers):
    """A real SIGINT during the second micro-batch of step 2: the step finishes with its sums, the
    state is saved, and the resumed run ends where the uninterrupted one does, bit for bit."""
    made, _ = streamers
    sets = (*STREAMED, "train.precision=fp32", "memory.streamed_grad_sums=device")
    _, ref_losses, ref = _run(images, tmp_path / "full", cache_root / "off", *sets)
    calls = []
    init = WeightStreamer.__init__

    def stop_in_step_two(self, *args, **kwargs):
        init(self, *args, **kwargs)

        def forward(module, inputs):
            calls.append(1)
            if len(calls) == ACCUM + 2:  # step 2, micro-batch 2: its sums hold micro-batch 1
                os.kill(os.getpid(), signal.SIGINT)

        self._handles.append(self.model.register_forward_pre_hook(forward))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WeightStreamer, "__init__", stop_in_step_two)
        code, _, _ = _run(images, tmp_path / "part", cache_root / "off", *sets)
    assert code == 130 and len(calls) == 2 * ACCUM  # stopped after step 2
    assert made[-1].grads.sum_bytes() == 0  # closed: its sums went
    code, losses, got = _run(images, tmp_path / "part", cache_root / "off", *sets,
                             args=("--resume", "latest"))
    assert code == 0 and losses == ref_losses
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def test_device_sums_where_nothing_steps_on_the_device_are_refused_naming_the_keys(images, tmp_path,
                                                                                   cache_root):
    args = train_args(images, tmp_path, cache_root, "memory.stream_weights=true", "train.grad_accum=2",
                      "memory.streamed_grad_sums=device", model="tiny:sd3")
    with pytest.raises(ConfigError) as caught:
        load_config(None, args[3::2])
    text = str(caught.value)
    assert "memory.streamed_grad_sums" in text and "train.optimizer_in_backward = true" in text
    assert "memory.stream_weights" not in text.split("needs")[1]  # it is on: not asked for


# ---- on a GPU: the sums on the device against the sums at home -----------------------------------

@pytest.mark.gpu
def test_on_a_gpu_device_sums_match_home(images, tmp_path, cache_root, streamers):
    """CUDA: the sums stay on the GPU (no gradient copied home), rounded to nearest the result is
    home's to an ulp of the backward kernels' order, and the kept sums sit on the GPU."""
    made, kept = streamers
    sets = (*STREAMED, "train.stochastic_rounding=false", "train.device=cuda", "memory.fit_probe=false",
            "train.cuda_graphs=false")
    _, home_losses, home = _run(images, tmp_path / "home", cache_root / "gpu", *sets,
                                "memory.streamed_grad_sums=home")
    assert made[-1].stats.grads_moved > 0
    _, losses, got = _run(images, tmp_path / "device", cache_root / "gpu", *sets,
                          "memory.streamed_grad_sums=device")
    assert made[-1].stats.grads_moved == 0 and made[-1].stats.grads_summed > 0
    assert kept[-1][0] > 0 and kept[-1][1] == {"cuda"}
    assert losses == pytest.approx(home_losses, rel=1e-3)
    for key in home:
        torch.testing.assert_close(got[key].float(), home[key].float(), rtol=1e-2, atol=1e-2, msg=key)


# ---- the sums at home: fp32, exact -----------------------------------------------------------------

def test_home_sums_of_bf16_gradients_are_exact_fp32_sums(monkeypatch):
    """With stochastic rounding the earlier micro-batches' bf16 gradients are summed at home in fp32:
    each step receives exactly the fp32 sum of the micro-batches' gradients (no rounding on the way),
    the weight used only in earlier micro-batches too; without it, bf16 sums as autograd's."""
    seen: dict[int, torch.Tensor] = {}
    step_params = Adafactor.step_params

    def spy(self, pending, **kwargs):
        seen.update({id(p): g.clone() for p, g in pending})
        return step_params(self, pending, **kwargs)

    monkeypatch.setattr(Adafactor, "step_params", spy)
    _, at_home, _ = _toy_run("home", torch.bfloat16, round_sums=True, steps=1)
    trained = at_home.trainable
    # the reference: each micro-batch's gradients alone, at the first step's weights, summed in fp32
    model = _Toy(torch.bfloat16)
    params = list(model.parameters())
    expected: dict[int, torch.Tensor] = {}
    for i, x in enumerate(_toy_inputs(1, torch.bfloat16)[0]):
        model.extra = i < ACCUM - 1
        grads = torch.autograd.grad((model(x).float().pow(2).mean() / ACCUM), params, allow_unused=True)
        for k, g in enumerate(grads):
            if g is not None:
                expected[k] = g.float() if k not in expected else expected[k] + g.float()
    assert len(seen) == len(trained) == len(expected)
    for k, p in enumerate(trained):  # the toy's parameters, in its order
        assert torch.equal(seen[id(p)], expected[k]), k
    assert at_home.grads.home_sum_bytes() == 4 * sum(p.numel() for p in trained)
    _, rounded_to_nearest, _ = _toy_run("home", torch.bfloat16, steps=1)
    assert rounded_to_nearest.grads.home_sum_bytes() == 2 * sum(p.numel() for p in trained)


def test_shared_home_sums_hold_the_largest_units_and_the_steps_still_run():
    """`share_home_sums` (the fit probe's stand-in): one fp32 buffer as large as the largest unit's
    trained values serves every unit; the steps run, every weight stepped and finite."""
    before = _Toy(torch.bfloat16)
    weights, streamer, _ = _toy_run("home", torch.bfloat16, round_sums=True, steps=2, shared=True)
    units = [sum(p.numel() for p in u.params if p.requires_grad) for u in streamer.units]
    assert len(units) == 4 and streamer.grads.home_sum_bytes() == 4 * max(units) < 4 * sum(units)
    assert len(streamer.grads.home_sum_buffers()) == 1
    for w, p in zip(weights, before.parameters()):
        assert torch.isfinite(w).all() and not torch.equal(w, p.detach())


def test_home_sums_with_stochastic_rounding_track_the_resident_and_device_runs():
    """Exact sums at home against the resident run's and the device's stochastically rounded ones."""
    resident, _, _ = _toy_run(None, torch.bfloat16, round_sums=True)
    home, _, _ = _toy_run("home", torch.bfloat16, round_sums=True)
    device, _, _ = _toy_run("device", torch.bfloat16, round_sums=True)
    for a, b, c in zip(home, resident, device):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.02)
        torch.testing.assert_close(a.float(), c.float(), rtol=0.02, atol=0.02)


def test_a_skipped_steps_home_sums_do_not_reach_the_next_step():
    reference, _, _ = _toy_run("home", torch.bfloat16, round_sums=True, steps=1)
    skipped = [torch.full((4, 32), 3.0).to(torch.bfloat16) for _ in range(ACCUM - 1)]
    got, _, hooks = _toy_run("home", torch.bfloat16, round_sums=True, steps=1, skipped=skipped)
    assert hooks.discarded == 1
    assert all(torch.equal(a, b) for a, b in zip(got, reference))


# ---- the fit probe: sums on the device that do not fit go home -------------------------------------

GIB = 2**30


@pytest.fixture
def probe_over_with_device_sums(streamers, monkeypatch):
    """The real fit probe on the CPU, its measurement standing in for CUDA's: over the 1 GiB limit
    where the stand-in's streamer summed gradients on the device. Returns what each probe found."""
    made, _ = streamers
    found: list[str] = []
    real = probe.fit_probe

    def measure(run):
        run()
        on_device = made[-1].stats.grads_summed > 0
        found.append("device" if on_device else "home")
        return 3 * GIB if on_device else GIB // 2

    monkeypatch.setattr(probe, "fit_probe", lambda *args, **kwargs: real(*args, limit=GIB, measure=measure))
    return found


def test_device_sums_by_default_that_do_not_fit_go_home(images, tmp_path, cache_root, caplog, streamers,
                                                        probe_over_with_device_sums):
    """Unset, resolved to "device", over the probe's limit: probed again with the sums at home, which
    fits; the run trains so (its sums at home, fp32 under full_bf16 with stochastic rounding, as
    fit/host.py predicts them) and its config.toml says so."""
    made, kept = streamers
    with caplog.at_level(logging.INFO, logger="vramfit"):
        code, losses, _ = _run(images, tmp_path / "run", cache_root / "off", *STREAMED)
    assert code == 0 and len(losses) == 3
    assert probe_over_with_device_sums == ["device", "home"]
    assert ("memory.streamed_grad_sums (auto): the step with the streamed weights' gradient sums on the "
            "device does not fit (fit probe: two training steps") in caplog.text
    assert "probing it with the sums in CPU memory" in caplog.text
    assert "memory.streamed_grad_sums (auto): home, the step fits with the sums in CPU memory" in caplog.text
    run = made[-1]
    assert run.stats.grads_summed == 0 and run.stats.grads_moved > 0 and kept[-1][0] == 0
    cfg = load_config(tmp_path / "run" / "config.toml", [], need_data=False)
    assert cfg.memory.streamed_grad_sums == "home"
    host = host_prediction(read_facts(cfg, cache_root / "off"), cfg).phase("train").parts
    assert kept[-1][2] == host["streamed gradient sums"] == 4 * sum(p.numel() for p in run.trainable) > 0
    assert kept[-1][3] == {False}  # on the CPU nothing is pinned


def test_the_probes_stand_in_sums_at_home_in_one_set_as_large_as_the_largest_units(
        images, tmp_path, cache_root, streamers, probe_over_with_device_sums):
    """The fit probe's stand-in with its sums at home: every unit's sums share the largest unit's
    buffers (its sums' values matter to nothing, a sum per value would double the streamed weights in
    CPU memory); the run after it keeps a sum per value."""
    made, kept = streamers
    code, losses, _ = _run(images, tmp_path / "run", cache_root / "off", *STREAMED)
    assert code == 0 and len(losses) == 3 and probe_over_with_device_sums == ["device", "home"]
    run = made[-1]
    per_unit = [4 * sum(p.numel() for p in u.params if p.requires_grad) for u in run.units]
    assert len([n for n in per_unit if n]) > 1
    at_home = {k[2] for k in kept if k[2]}  # bytes of the sums at home when each streamer's sums went
    assert at_home == {max(per_unit), sum(per_unit)}


def test_device_sums_the_user_wrote_that_do_not_fit_stop_the_run(images, tmp_path, cache_root, capsys,
                                                                  probe_over_with_device_sums):
    code, _, _ = _run(images, tmp_path / "run", cache_root / "off", *STREAMED,
                      "memory.streamed_grad_sums=device")
    err = capsys.readouterr().err
    assert code != 0 and probe_over_with_device_sums == ["device"]
    assert "fit probe" in err and 'With memory.streamed_grad_sums = "device" this counts' in err
    assert not (tmp_path / "run" / "run.json").exists()


def test_when_neither_fits_the_error_gives_both_measurements(images, tmp_path, cache_root, capsys,
                                                             monkeypatch):
    probed = []

    def over(family, bundle, cfg, device, buckets, **kwargs):
        probed.append(cfg.memory.streamed_grad_sums)
        peak = "9.00" if cfg.memory.streamed_grad_sums == "device" else "8.50"
        raise probe.FitProbeError(f"fit probe: two training steps at the largest bucket peaked at {peak} "
                                  "GiB, more than the 8.00 GiB of the GPU; nothing was cached. ...")

    monkeypatch.setattr(probe, "fit_probe", over)
    code, _, _ = _run(images, tmp_path / "run", cache_root / "off", *STREAMED)
    err = capsys.readouterr().err
    assert code != 0 and probed == ["device", "home"]
    assert 'with memory.streamed_grad_sums = "device" (auto): fit probe' in err and "9.00 GiB" in err
    assert 'With "home": fit probe' in err and "8.50 GiB" in err


@pytest.mark.gpu
def test_on_a_gpu_home_sums_are_pinned_fp32_and_track_the_device_sums(images, tmp_path, cache_root,
                                                                       streamers):
    """CUDA, full_bf16 with stochastic rounding: the earlier micro-batches' sums at home are pinned
    fp32 buffers (twice the bf16 gradients' bytes), and the result tracks the sums on the device."""
    made, kept = streamers
    sets = (*STREAMED, "train.device=cuda", "memory.fit_probe=false", "train.cuda_graphs=false")
    _, home_losses, home = _run(images, tmp_path / "home", cache_root / "gpu", *sets,
                                "memory.streamed_grad_sums=home")
    run = made[-1]
    assert run.stats.grads_moved > 0 and run.stats.grads_summed == 0
    assert kept[-1][2] == 4 * sum(p.numel() for p in run.trainable) > 0
    assert kept[-1][3] == {True}
    _, losses, got = _run(images, tmp_path / "device", cache_root / "gpu", *sets,
                          "memory.streamed_grad_sums=device")
    assert losses == pytest.approx(home_losses, rel=1e-3)
    for key in home:
        torch.testing.assert_close(got[key].float(), home[key].float(), rtol=0.02, atol=0.02, msg=key)


def test_the_sums_stay_unset_where_they_do_not_apply_and_plan_resolves_them_as_train_does(capsys):
    """A LoRA run (or one without accumulation) keeps memory.streamed_grad_sums unset, so its config.toml
    carries no note of it; `vramfit plan` without a budget predicts the sums `train` would choose."""
    env = Environment(torch.device("cpu"))
    lora = load_config(None, ["model.path=tiny:sdxl", "train.mode=lora", "train.grad_accum=4"], need_data=False)
    assert with_grad_sums(lora, env).memory.streamed_grad_sums is None
    sets = ["model.path=tiny:sdxl", "train.mode=full", "memory.stream_weights=true", "train.optimizer=adafactor",
            "train.optimizer_in_backward=true", "train.grad_accum=4", "train.device=cpu"]
    assert main(["plan", "--no-progress", *[a for s in sets for a in ("--set", s)]]) == 0
    train_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("train "))
    assert "gradient sums" in train_row


def test_no_resident_block_is_accepted_without_streaming():
    """memory.resident_blocks = 0 (what a streamed run's config.toml records) stays valid with
    streaming turned off; a count above 0 is refused."""
    load_config(None, ["memory.resident_blocks=0"], need_data=False)
    with pytest.raises(ConfigError, match="memory.resident_blocks"):
        load_config(None, ["memory.resident_blocks=2"], need_data=False)
