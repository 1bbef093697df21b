"""Stochastic rounding into bf16: unbiased, reproducible, exact where it can be, and it keeps
updates that round-to-nearest loses."""
from __future__ import annotations

import math

import pytest
import torch

from vramfit.memory.stochastic_rounding import copy_stochastic_, stochastic_round

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _gen(device, seed=0):
    return torch.Generator(device=device).manual_seed(seed)


def _neighbours(x: float) -> tuple[float, float]:
    """The bf16 values either side of the float32 x (toward zero, away from zero)."""
    bits = torch.tensor([x], dtype=torch.float32).view(torch.int32)
    low = (bits & -65536).view(torch.float32).item()
    high = ((bits & -65536) + 65536).view(torch.float32).item()
    return low, high


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [1.0 + 2**-9, 1.0 + 3 * 2**-10, -3.14159, 1e-3 + 1e-7, 123456.7, 2.5e-39])
def test_rounding_is_unbiased(device, value):
    n = 200_000
    x = torch.full((n,), value, dtype=torch.float32, device=device)
    out = stochastic_round(x, _gen(device)).float()
    low, high = _neighbours(value)
    assert set(out.unique().tolist()) <= {low, high}
    spacing = abs(high - low)
    # One rounding has standard deviation <= spacing / 2, the mean of n of them spacing / (2 sqrt n):
    # 5 of those is the tolerance (a false alarm once in 3.5 million runs).
    assert abs(out.double().mean().item() - value) < 5 * spacing / (2 * math.sqrt(n))
    # and the split between the neighbours is the distance: P(away from zero) = |x - low| / spacing
    p_away = (out == high).double().mean().item()
    assert p_away == pytest.approx(abs(value - low) / spacing, abs=5 * 0.5 / math.sqrt(n))


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_rounding_and_representable_values_are_exact(device):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)).to(device)
    a, b = stochastic_round(x, _gen(device, 7)), stochastic_round(x, _gen(device, 7))
    assert torch.equal(a, b) and not torch.equal(a, stochastic_round(x, _gen(device, 8)))
    exact = x.bfloat16().float()  # every value representable in bf16
    assert torch.equal(stochastic_round(exact, _gen(device)), exact.bfloat16())
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0], device=device)
    nan_bits = torch.tensor([0x7FFFFFFF, -1, 0x7F800001], dtype=torch.int32, device=device).view(torch.float32)
    out = stochastic_round(torch.cat([special, nan_bits]), _gen(device))
    assert out[0] == float("inf") and out[1] == -float("inf")
    assert torch.isnan(out[2]) and torch.isnan(out[5:]).all()  # no NaN pattern turns into inf or 0
    assert out[3] == 0 and torch.signbit(out[4])


@pytest.mark.parametrize("device", DEVICES)
def test_copy_stochastic_writes_in_place_and_copies_other_dtypes(device):
    src = torch.full((1000,), 1.0 + 2**-9, device=device)
    dst = torch.zeros(1000, dtype=torch.bfloat16, device=device)
    assert copy_stochastic_(dst, src, _gen(device)) is dst
    assert torch.equal(dst, stochastic_round(src, _gen(device)))
    wide = torch.zeros(1000, device=device)
    copy_stochastic_(wide, src, _gen(device))
    assert torch.equal(wide, src)


def test_small_updates_are_lost_to_nearest_and_kept_on_average():
    """1.0 + 1000 increments of 1e-4: the spacing of bf16 at 1.0 is 2**-7 = 0.0078, so every
    increment rounds away to nearest; with stochastic rounding the sum arrives at 1.1."""
    gen = _gen("cpu")
    rtn = torch.ones(4096, dtype=torch.bfloat16)
    sr = torch.ones(4096, dtype=torch.bfloat16)
    for _ in range(1000):
        rtn.copy_(rtn.float() + 1e-4)
        copy_stochastic_(sr, sr.float() + 1e-4, gen)
    assert torch.equal(rtn, torch.ones_like(rtn))
    # Each weight's own walk has a standard deviation below 0.03 (binomial steps of 2**-7 or
    # 2**-6 above 1.0); the mean of 4096 of them below 0.0005; tolerance 0.005.
    assert sr.float().mean().item() == pytest.approx(1.1, abs=0.005)


def test_rounding_generators_are_keyed_by_device_type_and_restore_anywhere():
    """A state saved on cuda:0 (or by rank 0) restores the generator of whatever device of that
    type asks; a type this machine lacks waits, and is saved again unchanged."""
    from vramfit.optim.base import RoundingGenerators

    gens = RoundingGenerators(7)
    first = torch.randint(0, 100, (5,), generator=gens(torch.device("cpu")))
    saved = gens.state_dict()
    assert list(saved) == ["cpu"]
    again = RoundingGenerators(7)
    fake_cuda = torch.Generator().manual_seed(3).get_state()
    again.load_state_dict({"cpu": saved["cpu"], "cuda:1": fake_cuda})  # an older state's device key
    assert torch.equal(torch.randint(0, 100, (5,), generator=again(torch.device("cpu"))),
                       torch.randint(0, 100, (5,), generator=gens(torch.device("cpu"))))
    assert not torch.equal(first, torch.randint(0, 100, (5,), generator=again(torch.device("cpu"))))
    assert torch.equal(again.state_dict()["cuda"], fake_cuda)  # kept for a machine with a GPU


def test_large_cpu_draws_are_chunked_over_threads_and_depend_only_on_the_generator(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from vramfit.memory import stochastic_rounding as sr

    monkeypatch.setattr(sr, "CPU_CHUNK", 1000)  # 10 chunks for 10,000 values
    value = 1.0 + 3 * 2**-10
    x = torch.full((10_000,), value)
    runs = []
    for threads in (1, 4):
        pool = ThreadPoolExecutor(threads)
        monkeypatch.setattr(sr, "_pool", lambda: pool)
        g = torch.Generator().manual_seed(7)
        runs.append((stochastic_round(x, g).float(), g.get_state()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    out = runs[0][0]
    low, high = _neighbours(value)
    assert set(out.unique().tolist()) == {low, high}
    spacing = high - low
    assert abs(out.double().mean().item() - value) < 5 * spacing / (2 * math.sqrt(out.numel()))
    chunks = out.view(10, 1000)
    assert not any(torch.equal(chunks[0], chunks[i]) for i in range(1, 10))  # each chunk its own stream
    g = torch.Generator().manual_seed(7)
    assert not torch.equal(stochastic_round(x[:2000], g).float(), out[:2000])  # 2 chunks: one plain draw
