"""The optimizers and schedules beyond AdamW and Adafactor: Lion (vramfit's own), Prodigy,
schedule-free AdamW and CAME (pytorch-optimizer, behind optim/wrapped.py), a custom class by dotted
path, and the linear, cosine-with-restarts and polynomial schedules."""
from __future__ import annotations

import io
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main
from vramfit.config.schema import TrainConfig
from vramfit.fit.planner import _Tensor, optimizer_state_bytes
from vramfit.optim.build import build_optimizer, build_schedule
from vramfit.optim.wrapped import WrappedOptimizer



def _losses(out):
    return json.loads((out / "run.json").read_text())["losses"]


@pytest.mark.parametrize("name", ["prodigy", "schedulefree_adamw"])
def test_each_optimizer_trains_bf16_weights_and_resumes_exactly(images, tmp_path, cache_root, name):
    """Through the CLI (full_bf16 with stochastic rounding): 4 steps in one run against 2, then a
    resume for 2 more: the same losses and bit-identical weights; the weights moved in between.
    (Lion, CAME and a custom class: the same in-process below, which is cheaper; CAME steps through
    the same wrapper as these two.)"""
    sets = (f"train.optimizer={name}", "train.steps=4", "save.state_every_steps=2", "save.name=m",
            "save.keep_last=5")
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(train_args(images, full, cache_root / "opt", *sets)) == 0
    resume = ["--resume", str(full / "state/step-000002")]
    assert main(train_args(images, part, cache_root / "opt", *sets) + resume) == 0
    losses = _losses(full)
    assert _losses(part) == losses and len(set(losses)) == len(losses)
    a, b = (load_file(str(out / "state/step-000004/weights.safetensors")) for out in (full, part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = load_file(str(full / "state/step-000002/weights.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    assert sum(not torch.equal(a[k], start[k]) for k in a) > len(a) // 4  # Prodigy's first steps are small
    # the checkpoint holds the trained weights; schedule-free's, the average: other values (but where
    # a tensor's average rounds back to its trained bf16 values: 16% here)
    kept = {_fingerprint(t) for t in load_file(str(full / "m.safetensors")).values()}
    found = sum(_fingerprint(t) in kept for t in a.values()) / len(a)
    assert (found < 0.5 if name == "schedulefree_adamw" else found > 0.9), found


def _fingerprint(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def _run(train: TrainConfig, steps: int, saved: bytes = b"") -> tuple[list[torch.Tensor], bytes]:
    """`steps` steps of a small bf16 model on seeded gradients, from a saved optimizer state (the
    bytes of its weights and state dict, through torch.save and weights_only loading as
    train/state.py does) or from the start; returns the weights and the state saved after."""
    torch.manual_seed(0)
    shapes = ((32, 16, 3, 3), (24, 40), (40,))
    params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in shapes]
    opt = build_optimizer(params, train)
    start = 0
    if saved:
        loaded = torch.load(io.BytesIO(saved), weights_only=True)
        with torch.no_grad():
            for p, w in zip(params, loaded["weights"]):
                p.copy_(w)
        opt.load_state_dict(loaded["optimizer"])
        start = loaded["step"]
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        opt.step()
    buffer = io.BytesIO()
    torch.save({"weights": [p.detach().clone() for p in params], "optimizer": opt.state_dict(),
                "step": start + steps}, buffer)
    return [p.detach() for p in params], buffer.getvalue()


@pytest.mark.parametrize("cfg", [dict(optimizer="lion"), dict(optimizer="came"), dict(optimizer="custom",
                                                               optimizer_class="torch.optim.Adam",
                                                               optimizer_args={"amsgrad": True})])
def test_lion_came_and_a_custom_class_resume_exactly(cfg):
    train = TrainConfig(lr=1e-3, **cfg)
    whole, _ = _run(train, 4)
    first, saved = _run(train, 2)
    resumed, _ = _run(train, 2, saved)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))
    assert all(not torch.equal(a, b) for a, b in zip(first, whole))


def _rounded_mean(opt_factory, n: int = 200_000) -> tuple[float, float]:
    """(mean of the bf16 weights after one step from 1.0, the exact fp32 step) of a step smaller
    than bf16's spacing at 1.0."""
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    opt = opt_factory([p])
    opt.step()
    return p.float().mean().item(), 1.0 - 1e-4


@pytest.mark.parametrize("cfg", [dict(optimizer="lion", weight_decay=0.0),
                                 dict(optimizer="custom", optimizer_class="torch.optim.SGD")])
def test_bf16_updates_below_the_spacing_round_stochastically_to_the_fp32_step_on_average(cfg):
    """Lion (vramfit's own) and a wrapped class step 1.0 by -1e-4, a 20th of bf16's spacing there:
    with rounding the weights' mean is the fp32 step's; to nearest they would all stay 1.0."""
    for rounding in (True, False):
        train = TrainConfig(lr=1e-4, stochastic_rounding=rounding, **cfg)
        mean, exact = _rounded_mean(lambda ps: build_optimizer(ps, train))
        if rounding:
            assert abs(mean - exact) < 2e-6, (mean, exact)
        else:
            assert mean == 1.0


def test_schedule_free_samples_and_saves_the_average_and_puts_the_trained_weights_back():
    """averaged(): the weights inside the block are x = y + (1 - 1/b1)(z - y) (to nearest in bf16);
    after it, y bit for bit."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 32).to(torch.bfloat16))
    opt = build_optimizer([p], TrainConfig(optimizer="schedulefree_adamw", lr=1e-2))
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    y = p.detach().clone()
    z = opt.inner.state[opt.shadows[0]]["z"]
    with opt.averaged():
        inside = p.detach().clone()
    assert torch.equal(inside, y.float().lerp(z, 1 - 1 / 0.9).to(torch.bfloat16))
    assert not torch.equal(inside, y) and torch.equal(p.detach(), y)


def test_state_bytes_the_planner_counts_are_the_state_each_optimizer_allocates():
    shapes = [(64, 32, 3, 3), (48, 40), (40,)]
    for name in ("lion", "prodigy", "schedulefree_adamw", "came"):
        params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in shapes]
        opt = build_optimizer(params, TrainConfig(optimizer=name))
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        state = opt.inner.state if isinstance(opt, WrappedOptimizer) else opt.state
        allocated = sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
                        if torch.is_tensor(v) and v.numel() > 1)
        counted = sum(optimizer_state_bytes(name, _Tensor("", s, math.prod(s), 2, True)) for s in shapes)
        assert counted == allocated, name


@pytest.mark.parametrize("key,sets", [
    ("train.optimizer_in_backward", ["train.optimizer=prodigy", "train.optimizer_in_backward=true"]),
    ("train.optimizer_in_backward", ["train.optimizer=schedulefree_adamw",
                                     "train.optimizer_in_backward=true"]),
    ("train.optimizer_class", ["train.optimizer=custom"]),
    ("train.optimizer_class", ["train.optimizer=custom", "train.optimizer_class=nowhere.Optimizer"]),
    ("train.optimizer_args", ["train.optimizer=custom", "train.optimizer_class=torch.optim.SGD",
                              "train.optimizer_args={colour = 1}"]),
    ("train.optimizer_args", ["train.optimizer=prodigy", "train.optimizer_args={lr = 0.5}"]),
])
def test_a_refused_optimizer_setting_names_its_key(images, tmp_path, cache_root, capsys, key, sets):
    assert main(train_args(images, tmp_path / "out", cache_root / "opt", *sets)) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


def _lrs(scheduler: str, steps: int = 10, warmup: int = 2, **keys) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1))
    train = TrainConfig(lr=1.0, steps=steps, warmup_steps=warmup, lr_scheduler=scheduler, optimizer="adamw",
                        **keys)
    optimizer = build_optimizer([p], train)
    schedule = build_schedule(optimizer, train)
    out = []
    for _ in range(steps):
        out.append(schedule.get_last_lr()[0])
        optimizer.step()  # no gradient: nothing moves, and torch sees the order it expects
        schedule.step()
    return out


@pytest.mark.parametrize("scheduler,keys,after", [
    ("constant", {}, lambda f: 1.0),
    ("cosine", {}, lambda f: 0.5 * (1 + math.cos(math.pi * f))),
    ("linear", {}, lambda f: 1 - f),
    ("cosine_with_restarts", {"lr_cycles": 2}, lambda f: 0.5 * (1 + math.cos(math.pi * ((2 * f) % 1.0)))),
    ("polynomial", {"lr_power": 2.0}, lambda f: (1 - f) ** 2),
])
def test_each_schedule_warms_up_then_follows_its_curve(scheduler, keys, after):
    """Hand values: a linear rise over the 2 warm-up steps, then the curve of the fraction f of
    the 8 steps after them."""
    got = _lrs(scheduler, **keys)
    want = [0.0, 0.5] + [after((s - 2) / 8) for s in range(2, 10)]
    assert got == pytest.approx(want, abs=1e-12)


def test_a_wrapped_step_that_is_not_finite_is_not_taken():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 8).to(torch.bfloat16))
    opt = build_optimizer([p], TrainConfig(optimizer="prodigy", lr=1.0))
    p.grad = torch.randn_like(p)
    opt.step(finite=torch.tensor(True))
    before, state = p.detach().clone(), io.BytesIO()
    torch.save(opt.state_dict(), state)
    p.grad = torch.randn_like(p)
    opt.step(finite=torch.tensor(False))
    opt.take_back()
    after = io.BytesIO()
    torch.save(opt.state_dict(), after)
    assert torch.equal(p.detach(), before) and after.getvalue() == state.getvalue()


def test_a_custom_class_that_cannot_be_imported_is_refused_before_anything_is_cached(images, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert main(train_args(images, tmp_path / "out", cache, "train.optimizer=custom",
                           "train.optimizer_class=nowhere.Optimizer")) == 2
    err = capsys.readouterr().err
    assert "train.optimizer_class = 'nowhere.Optimizer': cannot import it" in err and "Traceback" not in err
    assert not any(cache.rglob("*.safetensors"))  # refused with the config, before the cache stage
