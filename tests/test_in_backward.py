"""Optimizer step inside backward and bf16 gradient accumulation with stochastic rounding:
same result as the normal step, per-tensor clipping, non-finite tensors held back, gradients
freed during backward, and runs and resumes through the CLI."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main
from vramfit.optim.adafactor import Adafactor
from vramfit.optim.adamw import AdamW, AdamW8bit
from vramfit.optim.base import RoundingGenerators, state_bytes
from vramfit.optim.in_backward import BackwardSteps, RecordedStep

OPTIMIZERS = [Adafactor, AdamW, AdamW8bit]


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(8, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.SiLU(),
                         nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.SiLU(),
                         nn.Conv2d(32, 32, 3, stride=2, padding=1),
                         nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.SiLU(), nn.Linear(64, 8)).to(dtype)


class _Deep(torch.nn.Module):
    """Six 64 x 64 layers: tensors of one shape, 4096 values each (8-bit moments under AdamW8bit)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
        self.to(dtype)

    def forward(self, x):
        h = x.flatten(1)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return h


def _inputs(accum, steps, dtype, shape=(2, 8, 8, 8)):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(*shape, generator=g).to(dtype) for _ in range(accum)] for _ in range(steps)]


def _loss(model, x):
    return model(x).float().pow(2).mean()


def _train(cls, dtype, accum, in_backward, max_grad_norm=0.0, steps=4, round_sums=True, watch=None, deep=False,
           min_pack=None, updates=None):
    """A small loop shaped as train/loop.py's: accumulation, then the step after or in backward.
    `deep`: the _Deep model; `min_pack`: the optimizer's MIN_PACK_NUMEL; `updates`: a list that
    gets one entry per `_update` call."""
    model = _Deep(dtype) if deep else _model(dtype)
    params = list(model.parameters())
    opt = cls(params, lr=1e-3, rounding=RoundingGenerators(0))
    # AdamW's in-place fp32 step through its foreach fallback: the operations of the packs inside
    # backward, so the two compare bitwise (torch's fused kernel is an ulp apart: test_optim.py)
    opt.fused = False
    if min_pack is not None:
        opt.MIN_PACK_NUMEL = min_pack
    if updates is not None:
        update = opt._update
        opt._update = lambda *a, **k: updates.append(a[0].shape) or update(*a, **k)
    if watch is not None:
        watch(params, lambda: hooks)  # hooks: made below, before any backward
    hooks = BackwardSteps(params, opt, in_backward=in_backward, round_sums=round_sums,
                          max_grad_norm=max_grad_norm)
    for batch in _inputs(accum, steps, dtype, shape=(2, 64) if deep else (2, 8, 8, 8)):
        for i, x in enumerate(batch):
            hooks.begin(last=i == accum - 1)
            (_loss(model, x) / accum).backward()
        hooks.finish()
        if not in_backward:
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
        opt.zero_grad(set_to_none=True)
    hooks.remove()
    return model, opt


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_in_backward_gives_the_normal_step_on_fp32_weights(cls, accum):
    normal, opt_n = _train(cls, torch.float32, accum, in_backward=False)
    inside, opt_i = _train(cls, torch.float32, accum, in_backward=True)
    # Same gradients and the same per-parameter math: equal to the bit here; the stated
    # tolerance is 1e-6 relative.
    for (name, a), b in zip(normal.named_parameters(), inside.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=0, msg=name)
    assert state_bytes(opt_i) == state_bytes(opt_n)  # in backward keeps the same state


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_in_backward_with_bf16_weights_and_accumulation_tracks_the_normal_step(cls):
    ref, _ = _train(cls, torch.float32, 3, in_backward=False)
    inside, _ = _train(cls, torch.bfloat16, 3, in_backward=True)
    normal, _ = _train(cls, torch.bfloat16, 3, in_backward=False)
    start = _model()
    for (name, a), b, c, s in zip(ref.named_parameters(), inside.parameters(), normal.parameters(),
                                  start.parameters()):
        moved = (a - s).norm()
        # the random roundings differ (other draw order, unrounded last sum); both stay within a
        # few bf16 spacings of the fp32 run, which moved 4 steps of lr 1e-3
        assert (b.float() - a).norm() < 0.5 * moved + 1e-2 * a.norm(), name
        assert (c.float() - a).norm() < 0.5 * moved + 1e-2 * a.norm(), name


def test_bf16_accumulation_keeps_small_gradients_on_average():
    """Micro-batch gradients 1.0 then 15 x 1e-3: round-to-nearest in bf16 loses every small one."""
    sums = {}
    for round_sums in (False, True):
        p = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
        opt = AdamW([p], rounding=RoundingGenerators(0))
        hooks = BackwardSteps([p], opt, in_backward=False, round_sums=round_sums)
        for i, scale in enumerate([1.0] + [1e-3] * 15):
            hooks.begin(last=i == 15)
            (p.float() * scale).sum().backward()
        hooks.finish()
        sums[round_sums] = p.grad.float()
        hooks.remove()
    assert torch.equal(sums[False], torch.ones(4096))  # autograd's += rounds to nearest
    # mean of 4096 unbiased sums: standard deviation below 0.01 / 64; tolerance 0.001
    assert sums[True].mean().item() == pytest.approx(1.015, abs=1e-3)


def test_kept_sums_stay_put_and_lend_only_what_a_step_added_into():
    """keep_sums (CUDA graphs): the buffers are the same tensors step after step, zeroed between
    steps; a weight the step did not reach gets no gradient, as without kept buffers."""
    a = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    opt = AdamW([a, b], rounding=RoundingGenerators(0))
    hooks = BackwardSteps([a, b], opt, in_backward=False, round_sums=True)
    assert hooks.keep_sums([a, b]) == {id(a), id(b)}
    kept = dict(hooks._buffers)
    for step, used in enumerate([(a, b), (a,)]):
        for i in range(2):
            hooks.begin(last=i == 1)
            sum(p.float().sum() * (step + 1) for p in used).backward()
        hooks.finish()
        assert torch.equal(a.grad.float(), torch.full((64,), 2.0 * (step + 1)))  # zeroed, then two adds
        assert a.grad is kept[id(a)]
        assert (b.grad is None) == (step == 1)
        opt.zero_grad(set_to_none=True)
    hooks.remove()


def test_per_tensor_clipping_gives_each_tensor_its_share_of_the_budget():
    accum = 2
    model, _ = _train(AdamW, torch.float32, accum, in_backward=False, steps=1)  # warm weights, any
    params = list(model.parameters())
    batch = _inputs(accum, 1, torch.float32)[0]
    for x in batch:
        (_loss(model, x) / accum).backward()
    unclipped = {id(p): p.grad.norm().item() for p in params}
    # a budget of the global norm itself: tensors with more than their share of it are clipped
    max_norm = math.sqrt(sum(v * v for v in unclipped.values()))
    model.zero_grad(set_to_none=True)
    total = sum(p.numel() for p in params)
    seen = {}
    opt = AdamW(params, lr=1e-3)
    opt.step_params = lambda pairs, finite=None: seen.update(
        (id(p), grad.norm().item()) for p, grad in pairs)
    hooks = BackwardSteps(params, opt, in_backward=True, round_sums=True, max_grad_norm=max_norm)
    for i, x in enumerate(batch):
        hooks.begin(last=i == accum - 1)
        (_loss(model, x) / accum).backward()
    hooks.finish()
    clipped = 0
    for p in params:
        share = max_norm * math.sqrt(p.numel() / total)
        norm = unclipped[id(p)]  # clip_grad_norm_'s rule: scale by min(1, limit / (norm + 1e-6))
        assert seen[id(p)] == pytest.approx(norm * min(1.0, share / (norm + 1e-6)), rel=1e-5)
        clipped += unclipped[id(p)] > share
    assert 0 < clipped < len(params)  # the budget binds some tensors and not others
    # the clipped gradients' global norm stays within the global budget
    assert math.sqrt(sum(v * v for v in seen.values())) <= max_norm * (1 + 1e-4)


def test_a_large_budget_clips_nothing():
    a, _ = _train(AdamW, torch.float32, 2, in_backward=False)
    b, _ = _train(AdamW, torch.float32, 2, in_backward=True, max_grad_norm=1e6)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_non_finite_gradient_tensor_is_held_back_and_counted():
    model = _model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    hooks = BackwardSteps(params, AdamW(params, lr=1e-2), in_backward=True, round_sums=True)
    model[0].bias.register_hook(lambda g: g * float("nan"))
    hooks.begin(last=True)
    _loss(model, _inputs(1, 1, torch.float32)[0][0]).backward()
    assert hooks.finish() == 1
    assert torch.equal(model[0].bias, before[1])
    assert all(not torch.equal(p, b) for p, b in zip(params, before) if p is not model[0].bias)
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_in_backward_packs_tensors_of_one_shape_and_matches_the_normal_step(cls):
    calls = []
    normal, opt_n = _train(cls, torch.float32, 2, in_backward=False, deep=True)
    inside, opt_i = _train(cls, torch.float32, 2, in_backward=True, deep=True, updates=calls)
    count = len(list(inside.parameters()))
    # 4 steps of 12 tensors: one pack of the weights (stacked or concatenated), one of the biases
    assert 0 < len(calls) <= 2 * 4 < count * 4
    for (name, a), b in zip(normal.named_parameters(), inside.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=0, msg=name)
    assert state_bytes(opt_i) == state_bytes(opt_n)


def _state(opt, p):
    """A parameter's state tensors as plain tensors: an 8-bit moment's codes and scales apart."""
    out = {}
    for key, value in opt.state[p].items():
        if hasattr(value, "codes"):
            out[key + ".codes"], out[key + ".scale"] = value.codes.clone(), value.scale.clone()
        elif torch.is_tensor(value):
            out[key] = value.clone()
    return out


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_non_finite_tensor_holds_back_only_itself_in_its_pack(cls):
    """Four kernels of 16 x 16 x 4 x 4 (4096 values, 8-bit moments under AdamW8bit) in one pack:
    stacked for Adafactor, concatenated for the AdamWs. The second step poisons one gradient."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 16, 4, 4)) for _ in range(4)]
    alone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = cls(params, lr=1e-2), cls(alone, lr=1e-2)
    calls = []
    update = opt._update
    opt._update = lambda *a, **k: calls.append(a[0].shape) or update(*a, **k)
    hooks = BackwardSteps(params, opt, in_backward=True, round_sums=True)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        weights = [torch.randn(16, 16, 4, 4, generator=g) for _ in params]
        poison = params[1].register_hook(lambda grad: grad * float("nan")) if step else None
        before = [p.detach().clone() for p in params]
        state = _state(opt, params[1]) if step else None
        hooks.begin(last=True)
        sum((p * w).sum() for p, w in zip(params, weights)).backward()
        assert hooks.finish() == step  # the poisoned tensor, counted once
        for i, (p, w) in enumerate(zip(alone, weights)):  # the one-parameter path, 0-dim flag
            ref.step_param(p, w, finite=torch.tensor(not (step and i == 1)))
        if poison is not None:
            poison.remove()
        assert len(calls) == step + 1  # one update for the four tensors
    assert torch.equal(params[1], before[1])
    held = _state(opt, params[1])
    assert held.keys() == state.keys() and all(torch.equal(held[k], state[k]) for k in state)
    assert all(not torch.equal(p, b) for i, (p, b) in enumerate(zip(params, before)) if i != 1)
    for p, a in zip(params, alone):  # the finite members step as they would alone
        torch.testing.assert_close(p, a, rtol=1e-6, atol=0)
        ours, theirs = _state(opt, p), _state(ref, a)
        assert ours.keys() == theirs.keys()
        for key in ours:  # 8-bit moments: quantized the same way from the same values
            torch.testing.assert_close(ours[key].float(), theirs[key].float(), rtol=1e-6, atol=0, msg=key)
    hooks.remove()


def test_in_backward_holds_at_most_one_pack_limit_of_gradients(monkeypatch):
    """It saves: bytes of gradients alive at each parameter's hook (in p.grad and waiting to
    step), the peak over a backward; the pending values at each flush stay within the limit and
    the gradient that passed it."""
    limit = 2 * 4096
    pending = []
    flush = BackwardSteps._flush

    def recording_flush(self, key=None):
        if self._pending:  # finish() flushes also when nothing waits
            pending.append(self._pending_numel)
        flush(self, key)

    monkeypatch.setattr(BackwardSteps, "_flush", recording_flush)
    peaks = {}
    for in_backward in (False, True):
        peak = [0]

        def watch(params, hooks):
            def count(_p):
                peak[0] = max(peak[0], hooks().grad_bytes())
            for p in params:  # registered first, so it runs before the step's hook
                p.register_post_accumulate_grad_hook(count)

        model, _ = _train(AdamW, torch.float32, 1, in_backward=in_backward, steps=1, watch=watch, deep=True,
                          min_pack=limit)
        peaks[in_backward] = peak[0]
    grads = [p.numel() * 4 for p in model.parameters()]
    assert peaks[False] == sum(grads)  # every gradient alive at the last hook
    assert len(pending) >= 3 and all(0 < n <= limit + max(p.numel() for p in model.parameters()) for n in pending)
    assert peaks[True] <= 4 * limit + max(grads)  # the documented bound: the limit and one gradient
    assert peaks[True] < peaks[False] / 2


_CHUNKS, _STEP_CHUNKED = Adafactor.chunks, Adafactor.step_chunked


def _chunked_train(chunk: bool, monkeypatch, **kw):
    """_train with Adafactor on the _Deep model, its 64 x 64 weights (4096 values) over a pack
    limit of 1000 values: stepped in row chunks from their hooks, or (`chunk` False) whole.
    Returns the model, the optimizer and the number of chunks of each chunked step."""
    monkeypatch.setattr(Adafactor, "chunks", _CHUNKS if chunk else lambda self, p: False)
    calls = []
    monkeypatch.setattr(Adafactor, "step_chunked", lambda self, p, grad, max_norm: calls.append(
        len(grad.spans(self.MIN_PACK_NUMEL))) or _STEP_CHUNKED(self, p, grad, max_norm))
    model, opt = _train(Adafactor, kw.pop("dtype", torch.float32), kw.pop("accum"), in_backward=True,
                        deep=True, min_pack=1000, **kw)
    return model, opt, calls


@pytest.mark.parametrize("accum,max_grad_norm", [(1, 0.0), (3, 0.0), (3, 0.05)])
def test_adafactor_in_backward_steps_large_tensors_in_chunks_as_it_steps_them_whole(accum, max_grad_norm,
                                                                                      monkeypatch):
    whole, opt_w, none = _chunked_train(False, monkeypatch, accum=accum, max_grad_norm=max_grad_norm)
    chunked, opt_c, calls = _chunked_train(True, monkeypatch, accum=accum, max_grad_norm=max_grad_norm)
    assert not none and len(calls) == 6 * 4 and all(spans == 5 for spans in calls)  # 6 weights, 4 steps
    for (name, a), b in zip(whole.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)
    assert state_bytes(opt_c) == state_bytes(opt_w)


@pytest.mark.parametrize("accum", [1, 3])
def test_adamw_in_backward_steps_large_tensors_in_chunks_as_it_steps_them_whole(accum, monkeypatch):
    calls = []
    stepped = AdamW.step_chunked
    monkeypatch.setattr(AdamW, "step_chunked", lambda self, p, grad, max_norm: calls.append(
        p.shape) or stepped(self, p, grad, max_norm))
    chunked, _ = _train(AdamW, torch.bfloat16, accum, in_backward=True, deep=True, min_pack=1000,
                        max_grad_norm=0.05)
    assert len(calls) == 6 * 4  # six 64 x 64 bf16 weights, four steps
    monkeypatch.setattr(AdamW, "chunks", lambda self, p: False)
    whole, _ = _train(AdamW, torch.bfloat16, accum, in_backward=True, deep=True, min_pack=1000,
                      max_grad_norm=0.05)
    start = _Deep(torch.bfloat16)
    for (name, a), b, s in zip(whole.named_parameters(), chunked.parameters(), start.parameters()):
        # stochastic rounding draws other bits in chunks: the two runs agree to a small part of
        # how far the weights moved
        assert (b.float() - a.float()).norm() < 0.25 * (a.float() - s.float()).norm() + 1e-3 * a.float().norm(), name


def test_only_tensors_on_the_compute_device_step_in_chunks(monkeypatch):
    """A streamed weight's home lives in CPU memory while the run computes on the GPU: with the
    run's device given as another one than the weights', nothing is chunked (and it still
    trains as the chunked run does)."""
    results = {}
    for device in (torch.device("cpu"), torch.device("meta")):
        calls = []
        monkeypatch.setattr(Adafactor, "step_chunked", lambda self, p, grad, max_norm: calls.append(
            p.shape) or _STEP_CHUNKED(self, p, grad, max_norm))
        model = _Deep()
        params = list(model.parameters())
        opt = Adafactor(params, lr=1e-2)
        opt.MIN_PACK_NUMEL = 1000
        hooks = BackwardSteps(params, opt, in_backward=True, round_sums=True, device=device)
        for x in _inputs(1, 2, torch.float32, shape=(2, 64)):
            hooks.begin(last=True)
            _loss(model, x[0]).backward()
            hooks.finish()
        results[device.type] = (model, len(calls))
    assert results["cpu"][1] == 6 * 2 and results["meta"][1] == 0
    for a, b in zip(results["cpu"][0].parameters(), results["meta"][0].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_gradient_from_earlier_micro_batches_only_steps_in_finish(chunked, monkeypatch):
    """fp32 weights, accumulation 2, a layer used only by the first micro-batch: autograd keeps its
    gradient in p.grad, and finish() steps it (clipped and checked as every tensor is) instead of
    leaving it to a later optimizer.step()."""
    monkeypatch.setattr(Adafactor, "MIN_PACK_NUMEL", 1000 if chunked else Adafactor.MIN_PACK_NUMEL)
    results = {}
    for in_backward in (False, True):
        model = _Deep()
        params = list(model.parameters())
        opt = Adafactor(params, lr=1e-2)
        hooks = BackwardSteps(params, opt, in_backward=in_backward, round_sums=True)
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
        for i, layers in enumerate((model.layers, model.layers[:3])):  # the second skips layers 3 to 5
            hooks.begin(last=i == 1)
            h = x
            for layer in layers:
                h = h + torch.tanh(layer(h))
            (h.pow(2).mean() / 2).backward()
        hooks.finish()
        if in_backward:
            assert all(p.grad is None for p in params)  # every gradient used inside finish()
        else:
            opt.step()
        results[in_backward] = model
    start = _Deep()
    for (name, a), b, s in zip(results[False].named_parameters(), results[True].parameters(), start.parameters()):
        assert not torch.equal(b, s), name  # layers 3 to 5 stepped too
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)


def test_adafactor_in_backward_holds_back_a_non_finite_chunked_tensor(monkeypatch):
    monkeypatch.setattr(Adafactor, "MIN_PACK_NUMEL", 1000)
    model = _Deep()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    opt = Adafactor(params, lr=1e-2)
    hooks = BackwardSteps(params, opt, in_backward=True, round_sums=True)
    poisoned = model.layers[2].weight
    assert opt.chunks(poisoned)
    poisoned.register_hook(lambda g: g * float("nan"))
    hooks.begin(last=True)
    _loss(model, torch.randn(2, 64)).backward()
    assert hooks.finish() == 1
    assert torch.equal(poisoned, before[4])
    assert all(not torch.equal(p, b) for p, b in zip(params, before) if p is not poisoned)


def test_adafactor_in_backward_chunks_keep_the_temporaries_small(monkeypatch):
    """It saves: the peak of new storages over a backward with the steps in it (bf16 weights, the
    state made by an earlier step), chunked against whole."""
    from test_optim import _NewStorages

    peaks = {}
    for chunk in (False, True):
        monkeypatch.setattr(Adafactor, "chunks", _CHUNKS if chunk else lambda self, p: False)
        model = _Deep(torch.bfloat16)
        params = list(model.parameters())
        opt = Adafactor(params, lr=1e-3, rounding=RoundingGenerators(0))
        opt.MIN_PACK_NUMEL = 1000
        hooks = BackwardSteps(params, opt, in_backward=True, round_sums=True)
        x = torch.randn(2, 64).bfloat16()
        tracker = _NewStorages()
        for measured in (False, True):
            hooks.begin(last=True)
            if measured:
                tracker.__enter__()
            _loss(model, x).backward()
            hooks.finish()
            if measured:
                tracker.__exit__(None, None, None)
        hooks.remove()
        peaks[chunk] = tracker.peak
    # whole: a 4096-value weight's fp32 copy, fp32 gradient, g^2 buffer and rounding (about 70 KB);
    # chunked: a chunk of at most 1000 values beside the 8 KB bf16 gradient
    assert peaks[True] < peaks[False] / 2, peaks


def _losses(out):
    return json.loads((out / "run.json").read_text())["losses"]


@pytest.mark.parametrize("min_pack", [None, 256])
def test_cli_in_backward_trains_and_matches_the_normal_step(images, tmp_path, cache_root, min_pack, monkeypatch):
    """Adafactor; with `min_pack` its pack limit is 256 values, so that in backward every tiny
    UNet tensor of more values steps in row chunks from its hook. That variant runs one step: the
    tiny UNet's time-embedding projections get gradients of about 1e-9 (float noise), which
    Adafactor scales to full-size updates, so from the second step the chunks' float rounding
    shows there as a few percent (the unit tests hold the chunked step to 1e-6 over four steps)."""
    # on the CPU: a GPU's convolution backward may pick another algorithm from one run to the next,
    # which moves the second step's loss by about 1e-5 whichever way the optimizer steps
    sets = ("train.grad_accum=2", "train.precision=fp32", "train.max_grad_norm=0", "save.dtype=fp32",
            "save.name=m", "train.optimizer=adafactor", f"train.steps={1 if min_pack else 2}", "train.device=cpu")
    chunked = []
    if min_pack:
        monkeypatch.setattr(Adafactor, "MIN_PACK_NUMEL", min_pack)
        monkeypatch.setattr(Adafactor, "step_chunked", lambda self, p, grad, max_norm: chunked.append(
            p.numel()) or _STEP_CHUNKED(self, p, grad, max_norm))
    outs = {}
    for flag in ("false", "true"):
        outs[flag] = tmp_path / flag
        assert main(train_args(images, outs[flag], cache_root / "ib", *sets,
                               f"train.optimizer_in_backward={flag}")) == 0
    assert _losses(outs["true"]) == pytest.approx(_losses(outs["false"]), rel=1e-6)
    assert bool(chunked) == bool(min_pack) and all(n > 256 for n in chunked)
    a, b = load_file(str(outs["false"] / "m.safetensors")), load_file(str(outs["true"] / "m.safetensors"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5 if min_pack else 1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize("in_backward", ["true", "false"])
def test_cli_bf16_with_stochastic_rounding_resumes_exactly(images, tmp_path, cache_root, in_backward):
    """full_bf16 with grad_accum 2: the rounding generators (weights written back, and in the
    normal step also the gradient sums) are part of the saved state."""
    sets = (f"train.optimizer_in_backward={in_backward}", "train.grad_accum=2", "train.steps=4",
            "save.state_every_steps=2", "save.name=m", "save.keep_last=5")
    full = tmp_path / "full"
    assert main(train_args(images, full, cache_root / "ibr", *sets)) == 0
    part = tmp_path / "part"
    resume = ["--resume", str(full / "state/step-000002")]
    assert main(train_args(images, part, cache_root / "ibr", *sets) + resume) == 0
    assert _losses(part) == _losses(full)
    a, b = load_file(str(full / "m.safetensors")), load_file(str(part / "m.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_in_backward_keeps_the_nonfinite_policy(images, tmp_path, capsys):
    from test_reliability import _poison_one_latent

    cache = tmp_path / "cache"
    item = _poison_one_latent(images, tmp_path, cache)
    out = tmp_path / "skip"
    assert main(train_args(images, out, cache, "train.steps=8", "train.optimizer_in_backward=true",
                           "save.name=m")) == 0
    assert json.loads((out / "run.json").read_text())["nonfinite_steps_skipped"] >= 1
    assert all(torch.isfinite(t).all() for t in load_file(str(out / "m.safetensors")).values())
    capsys.readouterr()
    assert main(train_args(images, tmp_path / "stop", cache, "train.steps=8", "train.optimizer_in_backward=true",
                           "train.nonfinite=stop")) == 2
    err = capsys.readouterr().err
    assert item in err and "not finite" in err and "Nothing of this step was applied" in err


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_on_a_gpu_chunks_follow_the_run_device_and_match_the_whole_step(device, monkeypatch):
    """The run's device as the loop names it ("cuda" or "cuda:0") and weights on the current GPU:
    the 64 x 64 weights step in chunks, and the run equals the one with chunks off."""
    monkeypatch.setattr(Adafactor, "MIN_PACK_NUMEL", 1000)
    results = {}
    for chunk in (True, False):
        calls = []
        monkeypatch.setattr(Adafactor, "chunks", _CHUNKS if chunk else lambda self, p: False)
        monkeypatch.setattr(Adafactor, "step_chunked", lambda self, p, grad, max_norm: calls.append(
            p.shape) or _STEP_CHUNKED(self, p, grad, max_norm))
        model = _Deep().cuda()
        params = list(model.parameters())
        opt = Adafactor(params, lr=1e-2)
        hooks = BackwardSteps(params, opt, in_backward=True, round_sums=True, max_grad_norm=0.05,
                              device=torch.device(device))
        for x in _inputs(1, 3, torch.float32, shape=(2, 64)):
            hooks.begin(last=True)
            _loss(model, x[0].cuda()).backward()
            assert hooks.finish() == 0
        results[chunk] = model
        assert len(calls) == (6 * 3 if chunk else 0)
    for a, b in zip(results[False].parameters(), results[True].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


class _Graph:
    """Stands in for torch.cuda.CUDAGraph where RecordedStep registers the rounding generator."""

    def __init__(self):
        self.generators: list = []

    def register_generator_state(self, generator):
        self.generators.append(generator)


@pytest.mark.parametrize("fails", [False, True])
def test_a_recorded_step_is_set_up_before_the_recording_and_counted_back_after(fails):
    """What RecordedStep does around a recording (train/graphs.py), on the CPU, where the
    "recorded" hooks run at once (their kernels read places of zeros): state and the held-back
    count exist first, the generator is registered, the last pack steps inside, the step counts
    go back; a failed recording leaves no pending gradient and no p.grad."""
    model = _Deep(torch.bfloat16)
    params = list(model.parameters())
    opt = Adafactor(params, lr=1e-2, rounding=RoundingGenerators(0))
    opt.MIN_PACK_NUMEL = 9000  # two 64 x 64 weights (and their biases) a pack: some wait at the end
    hooks = BackwardSteps(params, opt, in_backward=True, round_sums=True)
    step, graph, cpu = RecordedStep(hooks, params, torch.device("cpu")), _Graph(), torch.device("cpu")
    assert not any(opt.state[p] for p in params)
    step.begin(graph)
    assert all(opt.state[p]["step"] == 0 for p in params)  # made before: never inside the recording
    assert graph.generators == [opt.rounding(cpu)] and cpu in hooks._held_back
    _loss(model, _inputs(1, 1, torch.bfloat16, shape=(2, 64))[0][0]).backward()
    assert hooks._pending  # the last pack waits for the end of backward
    if fails:
        model.layers[0].weight.grad = torch.ones(64, 64, dtype=torch.bfloat16)  # as a half-done recording may leave
        step.close(failed=True)
        assert not hooks._pending and all(p.grad is None for p in params)
    else:
        step.end()
        assert not hooks._pending
        step.close(failed=False)
    assert opt._recorded is None
    assert all(opt.state[p]["step"] == 0 for p in params)  # a recording runs none of its kernels
    if not fails:
        step.before_replay()  # each replay counts its steps once and loads their scalars
        assert all(opt.state[p]["step"] == 1 for p in params)
        assert step.scalars.values.view(-1, step.scalars.SLOT)[0, 0] == opt.param_groups[0]["lr"]
        assert hooks.finish() == 0


def test_tensors_that_pack_together_wait_together_inside_backward():
    """Gradients arrive in backward's order, shapes interleaved (each layer's bias, then its
    weight). The pending ones wait by the pack they would join and the largest steps when the
    limit is passed, so the six biases step as one pack and the weights in packs of two: four
    updates where stepping in arrival order makes six (a bias and a weight pack per flush)."""
    updates: list = []
    _train(Adafactor, torch.float32, 1, in_backward=True, steps=1, deep=True, min_pack=2 * 4096 + 128,
           updates=updates)
    assert sorted(updates, key=len) == [torch.Size([6, 64])] + [torch.Size([2, 64, 64])] * 3
