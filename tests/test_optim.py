"""Optimizers: same updates where they should be, and the state they save."""
from __future__ import annotations

import pytest
import torch
from transformers.optimization import Adafactor

from vramfit.config.schema import TrainConfig
from vramfit.optim.adafactor import MatrixAdafactor, state_bytes
from vramfit.optim.build import build_optimizer, build_schedule


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.GroupNorm(4, 16),
                               torch.nn.Flatten(), torch.nn.Linear(16 * 6 * 6, 5)).to(dtype)


def _train(model, opt, steps=3):
    x = torch.randn(4, 8, 6, 6, generator=torch.Generator().manual_seed(1))
    x = x.to(next(model.parameters()).dtype)
    for _ in range(steps):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


def _kw():
    return dict(lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False)


def test_matrix_adafactor_equals_transformers_on_non_conv_tensors():
    a, b = _model(), _model()
    # one step: afterwards the conv kernel differs, and so would every later gradient
    _train(a, MatrixAdafactor(a.parameters(), **_kw()), steps=1)
    _train(b, Adafactor(b.parameters(), **_kw()), steps=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if pa.ndim <= 2:
            assert torch.equal(pa, pb), name
        else:  # the conv kernel moved, with its own factoring, and keeps its shape
            assert pa.shape == pb.shape and not torch.equal(pa, pb)


def test_matrix_adafactor_saves_conv_state_and_still_trains():
    a, b = _model(torch.bfloat16), _model(torch.bfloat16)
    opt_a, opt_b = MatrixAdafactor(a.parameters(), **_kw()), Adafactor(b.parameters(), **_kw())
    first = _train(a, opt_a, steps=1)
    last = _train(a, opt_a, steps=20)
    _train(b, opt_b)
    conv = a[0].weight
    st = opt_a.state[conv]
    assert st["exp_avg_sq_row"].numel() == 16 and st["exp_avg_sq_col"].numel() == 8 * 9
    assert state_bytes(opt_a) < state_bytes(opt_b) - 4 * 16 * 8 * 3
    assert last < first
    assert a[0].weight.grad is None and a[0].weight.shape == (16, 8, 3, 3)


def test_build_optimizer_and_schedules():
    model = _model()
    opt = build_optimizer(model.parameters(), TrainConfig(optimizer="adamw", lr=1e-3))
    assert isinstance(opt, torch.optim.AdamW)
    sched = build_schedule(opt, TrainConfig(optimizer="adamw", lr=1e-3, lr_scheduler="cosine", steps=10,
                                            warmup_steps=2))
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == 0 and lrs[2] == 1e-3 and lrs[-1] < lrs[3]
    opt = build_optimizer(model.parameters(), TrainConfig(optimizer="adafactor"))
    assert isinstance(opt, MatrixAdafactor)


def test_adamw8bit_keeps_8bit_state_and_trains_like_adamw():
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128)
    opt = build_optimizer(model.parameters(), TrainConfig(optimizer="adamw8bit", lr=1e-3))
    ref = torch.nn.Linear(256, 128)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    losses, ref_losses = [], []
    for _ in range(5):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        losses.append(model(x).pow(2).mean().item())
        ref_losses.append(ref(x).pow(2).mean().item())
    assert losses[-1] < losses[0] / 3
    assert losses == pytest.approx(ref_losses, rel=1e-2)  # 8-bit moments follow fp32 AdamW closely
    # a quarter of AdamW's fp32 moments for the weight matrix, plus block scales and the small bias
    assert state_bytes(opt) < state_bytes(ref_opt) / 3
