"""Optimizers: same updates where they should be, bf16 weights kept exact on average, the state
they keep and that it survives a save and load."""
from __future__ import annotations

import io
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.optimization import Adafactor as TransformersAdafactor

from vramfit.config.schema import TrainConfig
from vramfit.optim.adafactor import Adafactor
from vramfit.optim.adamw import AdamW, AdamW8bit
from vramfit.optim.base import ChunkedGrad, ParamOptimizer, RoundingGenerators, state_bytes
from vramfit.optim.build import build_optimizer, build_schedule
from vramfit.optim.lion import Lion

OPTIMIZERS = [Adafactor, AdamW, AdamW8bit, Lion]


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


def _hf_kw():
    return dict(lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False, weight_decay=0.01)


def test_adafactor_equals_transformers_on_non_conv_tensors():
    a, b = _model(), _model()
    # one step: afterwards the conv kernel differs, and so would every later gradient
    _train(a, Adafactor(a.parameters(), lr=1e-3, weight_decay=0.01), steps=1)
    _train(b, TransformersAdafactor(b.parameters(), **_hf_kw()), steps=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if pa.ndim <= 2:
            assert torch.equal(pa, pb), name
        else:  # the conv kernel moved, with its own factoring, and keeps its shape
            assert pa.shape == pb.shape and not torch.equal(pa, pb)
    # without conv kernels every step is transformers' to the bit
    a, b = _model()[1:], _model()[1:]
    x = torch.randn(4, 16, 6, 6, generator=torch.Generator().manual_seed(1))
    for model, opt in ((a, Adafactor(a.parameters(), lr=1e-3, weight_decay=0.01)),
                       (b, TransformersAdafactor(b.parameters(), **_hf_kw()))):
        for _ in range(4):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))


def test_adafactor_saves_conv_state_and_still_trains():
    a, b = _model(torch.bfloat16), _model(torch.bfloat16)
    opt_a = Adafactor(a.parameters(), lr=1e-3)
    opt_b = TransformersAdafactor(b.parameters(), **_hf_kw())
    first = _train(a, opt_a, steps=1)
    last = _train(a, opt_a, steps=20)
    _train(b, opt_b)
    conv = a[0].weight
    st = opt_a.state[conv]
    assert st["exp_avg_sq_row"].numel() == 16 and st["exp_avg_sq_col"].numel() == 8 * 9
    assert st["exp_avg_sq_row"].dtype == torch.float32  # fp32 factors for bf16 weights
    assert state_bytes(opt_a) < state_bytes(opt_b) - 4 * 16 * 8 * 3
    assert last < first
    assert a[0].weight.grad is None and a[0].weight.shape == (16, 8, 3, 3)


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_equals_torch_adamw(fused):
    """fp32: bitwise torch's fused AdamW (the kernel it runs), or its single-tensor AdamW (the
    foreach fallback runs the same operations)."""
    a, b = _model(), _model()
    ours = AdamW(a.parameters(), lr=1e-3, weight_decay=0.01)
    ours.fused = fused
    _train(a, ours, steps=4)
    _train(b, torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.01, foreach=False, fused=fused or None), steps=4)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))


def test_build_optimizer_and_schedules():
    model = _model()
    opt = build_optimizer(model.parameters(), TrainConfig(optimizer="adamw", lr=1e-3))
    assert type(opt) is AdamW and opt.rounding is not None
    sched = build_schedule(opt, TrainConfig(optimizer="adamw", lr=1e-3, lr_scheduler="cosine", steps=10,
                                            warmup_steps=2))
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == 0 and lrs[2] == 1e-3 and lrs[-1] < lrs[3]
    assert type(build_optimizer(model.parameters(), TrainConfig(optimizer="adafactor"))) is Adafactor
    opt = build_optimizer(model.parameters(), TrainConfig(optimizer="adamw8bit", stochastic_rounding=False))
    assert type(opt) is AdamW8bit and opt.rounding is None


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
    assert type(opt.state[model.weight]["exp_avg"]).__name__ == "OptimState8bit"
    # a quarter of AdamW's fp32 moments for the weight matrix, plus block scales and the small bias
    assert state_bytes(opt) < state_bytes(ref_opt) / 3


# ---- bf16 weights: stochastic rounding vs round-to-nearest ---------------------------------

def _mlp(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(dtype)


def _fit(cls, dtype, rounding, lr, steps=40):
    """Train toward a perturbed teacher; returns (weights as fp32, last loss)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 64, generator=g)
    teacher = _mlp(torch.float32)
    for p in teacher.parameters():
        p.data += 0.05 * torch.randn(p.shape, generator=g)
    y = teacher(x).detach()
    model = _mlp(dtype)
    opt = cls(model.parameters(), lr=lr, rounding=RoundingGenerators(0) if rounding else None)
    for _ in range(steps):
        loss = (model(x.to(dtype)).float() - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().float() for p in model.parameters()], loss.item()


def _distance(a, b):
    return sum((x - y).pow(2).sum() for x, y in zip(a, b)).sqrt().item()


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_bf16_with_stochastic_rounding_tracks_fp32_weights(cls):
    start = [p.detach().float() for p in _mlp(torch.float32).parameters()]
    # lr 1e-4: most updates are below half of bf16's spacing at these weights (|w| ~ 0.1)
    ref, ref_loss = _fit(cls, torch.float32, False, 1e-4)
    sr, sr_loss = _fit(cls, torch.bfloat16, True, 1e-4)
    rtn, rtn_loss = _fit(cls, torch.bfloat16, False, 1e-4)
    moved = _distance(ref, start)
    # Tolerances from runs of this setup: SR ends within 0.25 of the fp32 run's travel (its
    # noise, about 0.2) and within 1% of its loss; round-to-nearest loses most updates (0.75-0.85)
    assert _distance(sr, ref) < 0.35 * moved
    assert sr_loss == pytest.approx(ref_loss, rel=0.01)
    assert _distance(rtn, ref) > 0.6 * moved and rtn_loss > 1.1 * ref_loss


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_bf16_write_back_is_nearest_without_rounding_generators_and_a_neighbour_with(cls):
    """One step from the same bf16 weights and gradient: RTN gives the fp32 step rounded to
    nearest; SR gives one of its two bf16 neighbours, not always the nearest."""
    torch.manual_seed(0)
    w = torch.randn(64, 128).bfloat16()
    grad = torch.randn(64, 128).bfloat16()
    exact = torch.nn.Parameter(w.float())
    cls([exact], lr=1e-2).step_param(exact, grad)
    for rounding in (None, RoundingGenerators(0)):
        p = torch.nn.Parameter(w.clone())
        cls([p], lr=1e-2, rounding=rounding).step_param(p, grad)
        if rounding is None:
            assert torch.equal(p.data, exact.data.bfloat16())
        else:  # the bf16 values either side of the exact one: its bits truncated, and one above
            bits = exact.data.view(torch.int32)
            toward_zero = (bits & -65536).view(torch.float32)
            away = ((bits & -65536) + 65536).view(torch.float32)
            got = p.data.float()
            assert torch.all((got == toward_zero) | (got == away))
            assert not torch.equal(p.data, exact.data.bfloat16())


def _saved_and_loaded(opt: ParamOptimizer) -> dict:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_state_round_trips_exactly_with_its_dtypes_and_rounding_generators(cls):
    a = torch.nn.Linear(64, 128).bfloat16()
    b = torch.nn.Linear(64, 128).bfloat16()
    b.load_state_dict(a.state_dict())
    opt_a = cls(a.parameters(), lr=1e-3, rounding=RoundingGenerators(5))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).bfloat16()

    def steps(model, opt, n):
        for _ in range(n):
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    steps(a, opt_a, 2)
    b.load_state_dict(a.state_dict())
    opt_b = cls(b.parameters(), lr=1e-3, rounding=RoundingGenerators(99))  # other seed: restored by load
    opt_b.load_state_dict(_saved_and_loaded(opt_a))
    for key, value in opt_a.state[a.weight].items():
        loaded = opt_b.state[b.weight][key]
        assert type(loaded) is type(value) and getattr(loaded, "dtype", None) == getattr(value, "dtype", None)
    steps(a, opt_a, 3)
    steps(b, opt_b, 3)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_step_that_is_not_finite_changes_nothing(cls):
    p = torch.nn.Parameter(torch.randn(64, 128).bfloat16())
    opt = cls([p], lr=1e-2, rounding=RoundingGenerators(0))
    opt.step_param(p, torch.randn(64, 128))
    before = p.detach().clone()
    state = {k: (v.dequantize() if hasattr(v, "codes") else v.clone()) for k, v in opt.state[p].items()
             if torch.is_tensor(v)}
    opt.step_param(p, torch.randn(64, 128), finite=torch.tensor(False))
    assert torch.equal(p.data, before)
    for key, value in state.items():
        live = opt.state[p][key]
        assert torch.equal(live.dequantize() if hasattr(live, "codes") else live, value), key
    opt.step_param(p, torch.randn(64, 128), finite=torch.tensor(True))
    assert not torch.equal(p.data, before)


# ---- step(): parameters packed together -----------------------------------------------------

class _Blocks(torch.nn.Module):
    """Repeated shapes (packs by shape), a conv kernel, vectors, and 8-bit-sized matrices."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(128, 128) for _ in range(4))
        self.norm = torch.nn.LayerNorm(128)
        self.head = torch.nn.Linear(128, 8 * 4 * 4)
        self.to(dtype)

    def forward(self, x):
        h = self.conv(x).flatten(1)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(self.norm(h))


def _grads(model):
    x = torch.randn(4, 8, 4, 4, generator=torch.Generator().manual_seed(2)).to(next(model.parameters()).dtype)
    model(x).float().pow(2).mean().backward()
    return [(p, p.grad.clone()) for p in model.parameters()]


def _packed_and_alone(cls, dtype, rounding=None, steps=3):
    """The same model stepped by step() (packed) and by step_param one tensor at a time."""
    packed, alone = _Blocks(dtype), _Blocks(dtype)
    opt_p = cls(packed.parameters(), lr=1e-3, rounding=rounding and RoundingGenerators(0))
    opt_a = cls(alone.parameters(), lr=1e-3, rounding=rounding and RoundingGenerators(0))
    # packing is what is compared: AdamW's fp32 tensors step in place through the foreach ops, the
    # packs' own operations (torch's fused kernel is an ulp apart: its own test below)
    opt_p.fused = opt_a.fused = False
    calls = []
    update = opt_p._update
    opt_p._update = lambda *a, **k: calls.append(a[0].shape) or update(*a, **k)
    for _ in range(steps):
        _grads(packed)
        opt_p.step()
        opt_p.zero_grad()
        for p, grad in _grads(alone):
            opt_a.step_param(p, grad)
        opt_a.zero_grad()
    return packed, alone, opt_p, opt_a, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_packed_step_equals_one_parameter_at_a_time(cls, dtype):
    packed, alone, opt_p, opt_a, calls = _packed_and_alone(cls, dtype)
    count = len(list(packed.parameters()))
    if cls is AdamW and dtype == torch.float32:
        assert calls == []  # fp32 throughout: in place, no packs
    else:
        assert 0 < len(calls) < count / 2 * 3  # 3 steps, fewer than half an update per tensor
    for (name, pp), pa in zip(packed.named_parameters(), alone.parameters()):
        torch.testing.assert_close(pp, pa, rtol=1e-6, atol=0, msg=name)
        for key, value in opt_a.state[pa].items():
            if torch.is_tensor(value):
                got = opt_p.state[pp][key]
                assert type(got) is type(value)
                if hasattr(value, "codes"):
                    got, value = got.dequantize(), value.dequantize()
                torch.testing.assert_close(got, value, rtol=1e-6, atol=0, msg=f"{name} {key}")


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_packed_stochastic_rounding_lands_on_a_bf16_neighbour_of_the_exact_step(cls):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 128).bfloat16()) for _ in range(3)]
    grads = [torch.randn(64, 128).bfloat16() for _ in params]
    exact = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref = cls(exact, lr=1e-2)
    for p, g in zip(exact, grads):
        ref.step_param(p, g)
    opt = cls(params, lr=1e-2, rounding=RoundingGenerators(0))
    calls = []
    update = opt._update
    opt._update = lambda *a, **k: calls.append(1) or update(*a, **k)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    assert len(calls) == 1  # one pack for the three tensors
    for p, e in zip(params, exact):
        bits = e.data.view(torch.int32)
        toward_zero = (bits & -65536).view(torch.float32)
        away = ((bits & -65536) + 65536).view(torch.float32)
        got = p.data.float()
        assert torch.all((got == toward_zero) | (got == away))
        assert not torch.equal(p.data, e.data.bfloat16())  # not round-to-nearest everywhere


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_packs_hold_at_most_the_largest_tensor_and_a_step_that_is_not_finite_changes_nothing(cls):
    model = _Blocks(torch.float32)
    opt = cls(model.parameters(), lr=1e-3)
    opt.MIN_PACK_NUMEL = 1  # the bound is then the largest tensor: head.weight, 128 x 128
    opt.fused = False  # fp32 AdamW through torch's fused kernel makes no packs (tested below)
    sizes = []
    update = opt._update
    opt._update = lambda *a, **k: sizes.append(a[0].numel()) or update(*a, **k)
    pairs = _grads(model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step_params(pairs, finite=torch.tensor(False))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert max(sizes) == 128 * 128 and len(sizes) > 3
    opt.step_params(pairs, finite=torch.tensor(True))
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_packs_of_scalars_and_of_tensors_sharing_storage_step_as_each_alone(cls):
    """0-dim parameters stack into a [B] pack whose per-member statistics must stay per member;
    two parameters on one storage must not be packed together (a pack reads before it writes)."""
    def pairs():
        scalars = [torch.nn.Parameter(torch.tensor(v)) for v in (1.0, -2.0, 3.0)]
        grads = [torch.tensor(g) for g in (0.5, -4.0, 10.0)]
        base = torch.zeros(2, 64, dtype=torch.bfloat16)
        shared = [torch.nn.Parameter(base[0]), torch.nn.Parameter(base[1]), torch.nn.Parameter(base[0])]
        return list(zip(scalars + shared, grads + [torch.ones(64), -torch.ones(64), torch.ones(64)]))

    packed, alone = pairs(), pairs()
    opt_p = cls([p for p, _ in packed], lr=0.1)
    opt_p.step_params(packed)
    opt_a = cls([p for p, _ in alone], lr=0.1)
    for p, g in alone:
        opt_a.step_param(p, g)
    for (pp, _), (pa, _) in zip(packed, alone):
        torch.testing.assert_close(pp.data, pa.data, rtol=1e-6, atol=0)


class _NewStorages(TorchDispatchMode):
    """Peak bytes of the storages ops create while active and that are still referenced."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, tuple[int, list]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}  # a view of a Parameter makes no storage
        for t in tree_leaves(out):
            if type(t) is torch.Tensor and t.untyped_storage().data_ptr() not in inputs:
                entry = self.alive.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), []))
                entry[1].append(weakref.ref(t))
        self.alive = {k: v for k, v in self.alive.items() if any(r() is not None for r in v[1])}
        self.peak = max(self.peak, sum(n for n, _ in self.alive.values()))
        return out


def test_adafactor_temporaries_are_its_copy_its_gradient_and_one_buffer():
    """12 bytes per value (p32, grad32, one buffer for g^2 / the update / the new value) plus the
    rounding's 5 while a bf16 weight is written: 13 on a [256, 4096] bf16 weight (was 20)."""
    p = torch.nn.Parameter(torch.randn(256, 4096).bfloat16())
    grad = torch.randn(256, 4096).bfloat16()
    opt = Adafactor([p], lr=1e-3, rounding=RoundingGenerators(0))
    opt.step_param(p, grad)  # the state exists before measuring
    tracker = _NewStorages()
    with tracker:
        opt.step_param(p, grad)
    assert tracker.peak / p.numel() <= 13.5


@pytest.mark.parametrize("shape", [(96, 160), (24, 16, 3, 3)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("max_norm", [0.0, 20.0])
def test_adafactor_chunked_step_equals_the_whole_step(shape, weight_decay, max_norm):
    """Row chunks of a matrix and of a conv kernel's [out, in*kh*kw] view, a gradient given as a
    bf16 buffer plus a bf16 gradient, clipped or not: the same weights and factored moments as
    the whole step on that fp32 gradient clipped as clip_grad_norm_ would, over steps whose RMS
    clip is active."""
    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(*shape))
    chunked = torch.nn.Parameter(whole.detach().clone())
    opt_w = Adafactor([whole], lr=1e-2, weight_decay=weight_decay)
    opt_c = Adafactor([chunked], lr=1e-2, weight_decay=weight_decay)
    opt_c.MIN_PACK_NUMEL = 1000  # several chunks of whole rows (160 and 144 values a row)
    assert opt_c.chunks(chunked) and not opt_w.chunks(whole)
    # a chunk is whole rows: rows of more than the limit, vectors and non-contiguous tensors step whole
    assert not any(opt_c.chunks(t) for t in (torch.zeros(2, 3000), torch.zeros(1, 5000), torch.zeros(5000),
                                             torch.zeros(160, 96).t()))
    clipped = 0
    for _ in range(4):
        parts = [torch.randn(*shape).bfloat16() for _ in range(2)]
        clipped += bool((parts[0].float() + parts[1]).norm() > max_norm > 0)
        opt_w.step_param(whole, _clipped(parts, max_norm))
        chunks = ChunkedGrad(parts)
        assert len(chunks.spans(opt_c.MIN_PACK_NUMEL)) > 3
        assert opt_c.step_chunked(chunked, chunks, max_norm)
        torch.testing.assert_close(chunked, whole, rtol=2e-6, atol=1e-7)
    assert clipped == (4 if max_norm else 0)  # the norms are about 2 x sqrt(15360) or 2 x sqrt(3456)
    for key in ("exp_avg_sq_row", "exp_avg_sq_col"):
        torch.testing.assert_close(opt_c.state[chunked][key], opt_w.state[whole][key], rtol=2e-6, atol=0)
    assert opt_c.state[chunked]["step"] == 4
    before = {k: v.clone() for k, v in opt_c.state[chunked].items() if torch.is_tensor(v)}
    value = chunked.detach().clone()
    poisoned = torch.randn(*shape)
    poisoned.view(-1)[7] = float("nan")
    assert not opt_c.step_chunked(chunked, ChunkedGrad([poisoned]), max_norm)
    assert torch.equal(chunked, value)  # held back: the weight and its moments keep their values
    assert all(torch.equal(opt_c.state[chunked][k], v) for k, v in before.items())


def _clipped(parts: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The fp32 sum of `parts`, scaled as torch.nn.utils.clip_grad_norm_ scales a gradient."""
    holder = torch.nn.Parameter(torch.zeros_like(parts[0], dtype=torch.float32))
    holder.grad = parts[0].float() + parts[1]
    if max_norm:
        torch.nn.utils.clip_grad_norm_([holder], max_norm)
    return holder.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_decay,max_norm", [(0.0, 0.0), (0.1, 20.0)])
def test_adamw_chunked_step_equals_the_whole_step(dtype, weight_decay, max_norm):
    """AdamW's chunked step (the norm, then `_update` on each chunk's rows and moment slices):
    the same weights and moments as the whole step, with stochastic rounding under bf16 drawing
    other bits (so bf16 is held to a few roundings' spacing); 8-bit moments step whole."""
    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(96, 160).to(dtype))
    chunked = torch.nn.Parameter(whole.detach().clone())
    rounding = (lambda: RoundingGenerators(0)) if dtype == torch.bfloat16 else (lambda: None)
    opt_w = AdamW([whole], lr=1e-2, weight_decay=weight_decay, rounding=rounding())
    opt_c = AdamW([chunked], lr=1e-2, weight_decay=weight_decay, rounding=rounding())
    opt_c.MIN_PACK_NUMEL = 1000
    # an fp32 weight steps in place, fused, in backward: only lower-precision weights are chunked
    assert opt_c.chunks(chunked) == (dtype == torch.bfloat16) and not AdamW8bit([chunked]).chunks(chunked)
    for _ in range(4):
        parts = [torch.randn(96, 160).bfloat16() for _ in range(2)]
        opt_w.step_param(whole, _clipped(parts, max_norm))
        assert opt_c.step_chunked(chunked, ChunkedGrad(parts), max_norm)
    # bf16: each of four stochastic roundings may land an ulp (at most 2^-7 relative) either way
    tolerance = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=4 * 2 ** -7, atol=1e-3)
    torch.testing.assert_close(chunked.float(), whole.float(), **tolerance)
    for key in ("exp_avg", "exp_avg_sq"):
        ours, theirs = opt_c.state[chunked][key].float(), opt_w.state[whole][key].float()
        if dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        else:  # bf16 moments, stochastically rounded: within a few spacings, as a whole
            assert (ours - theirs).norm() < 2 ** -6 * theirs.norm(), key
    value = chunked.detach().clone()
    poisoned = torch.randn(96, 160)
    poisoned[50, 3] = float("inf")
    assert not opt_c.step_chunked(chunked, ChunkedGrad([poisoned]), max_norm)
    assert torch.equal(chunked, value)


def test_adafactor_chunked_step_keeps_its_temporaries_to_one_chunk():
    """It saves: a bf16 [1024, 1024] weight stepped in chunks of 64 Ki values makes temporaries of
    about 13 bytes per chunk value (its update, the finite-masked new value, the rounding's int32
    draw and NaN mask) plus the factors, where the whole step makes 13 bytes per weight value beside the
    4-byte fp32 gradient it needs."""
    p = torch.nn.Parameter(torch.randn(1024, 1024).bfloat16())
    grad = torch.randn(1024, 1024).bfloat16()
    opt = Adafactor([p], lr=1e-3, rounding=RoundingGenerators(0))
    opt.MIN_PACK_NUMEL = 1 << 16
    opt.step_chunked(p, ChunkedGrad([grad]))  # the state exists before measuring
    tracker = _NewStorages()
    with tracker:
        opt.step_chunked(p, ChunkedGrad([grad]))
    assert tracker.peak <= 14 * opt.MIN_PACK_NUMEL + 4 * 4 * 1024
    whole = _NewStorages()
    with whole:
        opt.step_param(p, grad)
    assert whole.peak >= 12 * p.numel() and tracker.peak < whole.peak / 10


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_in_place_adamw_matches_the_foreach_path_and_the_packed_math(weight_decay, monkeypatch):
    """fp32 AdamW steps in place through torch's fused kernel; the same values as the foreach
    fallback and as step_param's _update, one tensor at a time."""
    models = [_Blocks(torch.float32) for _ in range(3)]
    opts = [AdamW(m.parameters(), lr=1e-3, weight_decay=weight_decay) for m in models]
    opts[1].fused = False
    opts[0].MIN_PACK_NUMEL = 1  # a pack bound of the largest tensor, which the fused update ignores
    kernel, calls = torch._fused_adamw_, []
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(len(a[0])) or kernel(*a, **k))
    for _ in range(4):
        for m, opt in zip(models[:2], opts[:2]):
            _grads(m)
            opt.step()
            opt.zero_grad()
        for p, grad in _grads(models[2]):
            opts[2].step_param(p, grad)
        opts[2].zero_grad()
    # every tensor, every step, fused: one call a step, since an update in place needs no pack bound
    assert calls == [len(list(models[0].parameters()))] * 4
    for (name, fused), foreach, alone in zip(models[0].named_parameters(), models[1].parameters(),
                                            models[2].parameters()):
        assert not torch.equal(fused, _Blocks(torch.float32).state_dict()[name])  # it trained
        torch.testing.assert_close(fused, foreach, rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(fused, alone, rtol=1e-6, atol=1e-7, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opts[0].state[fused][key], opts[1].state[foreach][key], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_step_held_back_on_the_device_changes_nothing_and_takes_back_its_counts(cls, dtype, monkeypatch):
    """step(finite=flag): the training loop's step, launched before the host knows the flag. A
    False flag leaves every weight and state tensor as it was (fp32 AdamW: the fused kernel's
    found_inf), and take_back() returns the step counts, so the next step is the one a step never
    taken would have been followed by."""
    held, clean = _Blocks(dtype), _Blocks(dtype)
    opt_h = cls(held.parameters(), lr=1e-3, rounding=RoundingGenerators(0))
    opt_c = cls(clean.parameters(), lr=1e-3, rounding=RoundingGenerators(0))
    kernel, fused_calls = torch._fused_adamw_, []
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: fused_calls.append(k["found_inf"]) or kernel(*a, **k))
    for model, opt in ((held, opt_h), (clean, opt_c)):
        _grads(model)
        opt.step(finite=torch.tensor(True))
        opt.zero_grad()
    before = [p.detach().clone() for p in held.parameters()]
    states = [{k: (v.dequantize() if hasattr(v, "codes") else v.clone()) if torch.is_tensor(v) else v
               for k, v in opt_h.state[p].items()} for p in held.parameters()]
    _grads(held)
    opt_h.step(finite=torch.tensor(False))
    opt_h.zero_grad()
    assert all(torch.equal(p, b) for p, b in zip(held.parameters(), before))
    for p, state in zip(held.parameters(), states):
        for key, value in opt_h.state[p].items():
            if key == "step":
                assert value == state[key] + 1  # counted on the host until the flag is read
            else:
                live = value.dequantize() if hasattr(value, "codes") else value
                assert torch.equal(live, state[key]), key
    opt_h.take_back()
    assert all(opt_h.state[p]["step"] == 1 for p in held.parameters())
    if cls is AdamW and dtype == torch.float32:  # in place, through the fused kernel, flag and all
        assert fused_calls and all(f is not None for f in fused_calls)
    # a second step on the same gradients lands where the clean run's second step does (bf16: the
    # held-back step drew rounding noise, so the two land on bf16 neighbours of the same value)
    for model, opt in ((held, opt_h), (clean, opt_c)):
        _grads(model)
        opt.step(finite=torch.tensor(True))
    for (name, a), b in zip(held.named_parameters(), clean.parameters()):
        if dtype == torch.float32:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-6, msg=name)


class _ReadOnTheDevice:
    """Stands in for RecordedScalars on the CPU: every step reads its scalars from 0-dim tensors
    holding the values a replay would have loaded, so the tensor path of the update math runs."""

    def __init__(self, opt: ParamOptimizer):
        self.opt, self.steps = opt, 0

    def place(self, states, group):
        self.steps += 1
        return {k: torch.tensor(v) for k, v in self.opt.scalars(group, states[0]["step"]).items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_scalars_read_from_the_device_give_the_steps_of_scalars_given_as_numbers(cls, dtype):
    """What a recorded step computes (optim/base.py RecordedScalars): learning rate and step-count
    scalars as tensors, through packs with per-member flags, tensors alone and chunked tensors,
    with weight decay and a learning rate that changes every step."""
    models = [_Blocks(dtype), _Blocks(dtype)]
    opts = [cls(m.parameters(), lr=1e-3, weight_decay=0.1, rounding=RoundingGenerators(0)) for m in models]
    for opt in opts:
        opt.fused = False  # fp32 AdamW numbers would step in place; a recorded step always packs
        opt.MIN_PACK_NUMEL = 1000  # the 128 x 128 matrices and the head step in chunks where they can
    device_side = _ReadOnTheDevice(opts[1])
    opts[1]._recorded = device_side
    for step in range(3):
        for model, opt in zip(models, opts):
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (step + 1)
            pairs = _grads(model)
            big = [(p, g) for p, g in pairs if opt.chunks(p)]
            flags = [torch.tensor(True) for _ in pairs if not opt.chunks(_[0])]
            opt.step_params([(p, g) for p, g in pairs if not opt.chunks(p)], finite=flags)
            for p, g in big:
                opt.step_chunked(p, ChunkedGrad([g]))
            opt.step_param(*pairs[0])  # and one tensor alone
            opt.zero_grad()
    assert device_side.steps > 3 * 3
    chunked = any(opts[1].chunks(p) for p in models[1].parameters())
    assert chunked == (cls is Adafactor or (cls is AdamW and dtype == torch.bfloat16))
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        # float rounding apart (a product fused or not), where a wrong step's learning rate or bias
        # correction would move every weight by its whole update. That rounding may move a bf16
        # value's stochastic rounding, or an 8-bit moment's code, to a neighbour: a few values in
        # ten thousand
        close = torch.isclose(b.float(), a.float(), rtol=1e-5, atol=1e-7)
        assert close.float().mean() >= (1.0 if dtype == torch.float32 and cls is not AdamW8bit else 0.999), name
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-4, msg=name)


def test_recorded_scalars_count_steps_back_and_load_each_replay_s_numbers():
    model = _Blocks(torch.float32)
    opt = Adafactor(model.parameters(), lr=1e-3, weight_decay=0.1)
    opt.step_params(_grads(model))
    model.zero_grad()
    counted = {id(p): opt.state[p]["step"] for p in model.parameters()}
    assert set(counted.values()) == {1}
    recorded = opt.record_scalars(torch.device("cpu"), 64)
    opt.step_params(_grads(model))  # the recording (on a GPU its kernels would not run yet)
    places = len(recorded._steps)
    recorded.close()
    assert opt._recorded is None and {opt.state[p]["step"] for p in model.parameters()} == {1}
    for replay, lr in ((2, 1e-3), (3, 5e-4)):
        opt.param_groups[0]["lr"] = lr  # a schedule moved it
        recorded.load()
        assert {opt.state[p]["step"] for p in model.parameters()} == {replay}
        want = list(opt.scalars(opt.param_groups[0], replay).values()) * places
        loaded = recorded.values.view(-1, recorded.SLOT)[:len(want)]  # one value every 16 bytes
        torch.testing.assert_close(loaded[:, 0], torch.tensor(want, dtype=torch.float32))
        assert not loaded[:, 1:].any()
    too_few = opt.record_scalars(torch.device("cpu"), 3)  # too few places: the recording fails, clearly
    with pytest.raises(RuntimeError, match="more than 3 scalars"):
        opt.step_params(_grads(model))
    too_few.close()  # and every step it counted, the failing one too, is counted back
    assert {opt.state[p]["step"] for p in model.parameters()} == {3}


def test_recorded_scalars_sit_16_bytes_apart_as_fresh_tensors_do():
    """A Triton kernel handed a place compiles for its alignment; a place must look like the
    fresh tensor an eager step hands it."""
    model = _Blocks(torch.float32)
    opt = Adafactor(model.parameters(), lr=1e-3, weight_decay=0.1)
    opt.step_params(_grads(model))
    recorded = opt.record_scalars(torch.device("cpu"), 64)
    places = [recorded.place([opt.state[p]], opt.param_groups[0]) for p in list(model.parameters())[:3]]
    recorded.close()
    addresses = [t.data_ptr() for step in places for t in step.values()]
    assert len(set(addresses)) == 12 and all(a % 16 == 0 for a in addresses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_what_the_class_says_it_chunks_is_what_it_chunks(cls, dtype):
    """The planner reads `chunks_weights_of` before any weight exists; a large weight of that
    dtype is then chunked exactly when it says so."""
    big = torch.nn.Parameter(torch.zeros(64, 96, dtype=dtype))
    opt = cls([big], lr=1e-3)
    opt.MIN_PACK_NUMEL = 1000
    assert opt.chunks(big) == cls.chunks_weights_of(dtype)
    assert cls.chunks_weights_of(dtype) == (cls is Adafactor or (cls is AdamW and dtype == torch.bfloat16))


def test_adafactor_chunks_smaller_matrices_where_the_fused_kernels_run(monkeypatch):
    """Where the fused kernels take a bf16 weight written with stochastic rounding, matrices of
    more than FUSED_CHUNK_NUMEL values step in chunks instead of waiting for a pack; fp32
    weights, bf16 ones without the rounding, vectors and tensors the kernels cannot take keep
    the MIN_PACK_NUMEL limit. The step inside backward then leaves them out of its pack limit."""
    import vramfit.optim.adafactor as adafactor
    from vramfit.optim.in_backward import BackwardSteps

    monkeypatch.setattr(Adafactor, "MIN_PACK_NUMEL", 4000)
    monkeypatch.setattr(Adafactor, "FUSED_CHUNK_NUMEL", 1000)
    mid = torch.nn.Parameter(torch.zeros(40, 50, dtype=torch.bfloat16))  # 2000 values
    small = torch.nn.Parameter(torch.zeros(20, 40, dtype=torch.bfloat16))  # 800
    vector = torch.nn.Parameter(torch.zeros(3000, dtype=torch.bfloat16))
    long_rows = torch.nn.Parameter(torch.zeros(2, 5000, dtype=torch.bfloat16))  # a row over MIN_PACK_NUMEL
    params = [mid, small, vector, long_rows]
    taken: list[torch.Tensor] = []
    monkeypatch.setattr(adafactor, "fused_kernels", lambda *ts: taken.extend(ts) or True)
    rounded, plain = Adafactor(params, rounding=RoundingGenerators(0)), Adafactor(params)
    assert [rounded.chunks(p) for p in params] == [True, False, False, False]
    wide32 = torch.nn.Parameter(torch.zeros(40, 50))
    assert not plain.chunks(mid) and not Adafactor([wide32], rounding=RoundingGenerators(0)).chunks(wide32)
    assert any(t is mid for t in taken)
    steps = BackwardSteps(params, rounded, in_backward=True, round_sums=False)
    assert steps._chunked == {id(mid)} and steps._limit == 10000  # the largest waiting: the long rows
    monkeypatch.setattr(adafactor, "fused_kernels", lambda *ts: False)  # no Triton, or not on a GPU
    assert not rounded.chunks(mid)
