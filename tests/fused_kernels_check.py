"""Checks of the Triton kernels (memory/stochastic_rounding.py, optim/adafactor.py), run by
tests/test_fused_kernels.py in a process of its own: on the CPU under Triton's interpreter
(TRITON_INTERPRET=1 must be set before Triton is imported) or on a GPU. Prints one JSON line of
what it measured; the test asserts on it."""
from __future__ import annotations

import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vramfit.memory import stochastic_rounding as sr
from vramfit.optim import adafactor
from vramfit.optim.adafactor import Adafactor
from vramfit.optim.base import ChunkedGrad, RoundingGenerators


def rounding(device: str) -> dict:
    value = 1.0 + 3 * 2**-10
    x = torch.full((20000,), value, device=device)
    x[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, 3.4e38])
    calls = []
    torch_ops = sr._rounded_bits
    sr._rounded_bits = lambda *a: calls.append(1) or torch_ops(*a)
    out = sr.copy_stochastic_(torch.zeros(x.shape, dtype=torch.bfloat16, device=device), x,
                              torch.Generator(device).manual_seed(0))
    again = sr.copy_stochastic_(torch.zeros_like(out), x, torch.Generator(device).manual_seed(0))
    held = torch.zeros_like(out)
    sr.copy_stochastic_(held, x, torch.Generator(device).manual_seed(0), torch.tensor(False, device=device))
    sr._rounded_bits = torch_ops
    rest = out[5:].float()
    return {"torch_ops_calls": len(calls), "nan": torch.isnan(out[0]).item(), "specials": out[1:5].float().tolist(),
            "values": sorted(rest.unique().tolist()), "up": (rest > value).double().mean().item(),
            "same": torch.equal(out[1:], again[1:]), "held_untouched": bool((held == 0).all())}


def chunked_step(device: str, weight_decay: float, max_norm: float, parts: int, shape=(96, 160), limit=1000,
                 transposed=False) -> dict:
    """One chunked Adafactor step of a bf16 weight (its three passes fused) against the exact step of
    its fp32 copy (no rounding): every value one of the two bf16 neighbours of the exact one, the
    rounding unbiased, the factored moments equal."""
    torch.manual_seed(0)
    weight = torch.randn(*shape, device=device).bfloat16()
    start = weight.clone()
    exact = weight.float().clone()
    grads = [torch.randn(*shape, device=device).bfloat16() for _ in range(parts)]
    if transposed:  # views that are not contiguous: the kernels must not take them
        grads = [torch.randn(*shape[::-1], device=device).bfloat16().t() for _ in range(parts)]
    opts = [Adafactor([w], lr=1e-2, weight_decay=weight_decay, rounding=r)
            for w, r in ((weight, RoundingGenerators(0)), (exact, None))]
    launched = []
    apply = adafactor._apply_kernel
    for opt in opts:
        opt.MIN_PACK_NUMEL = limit
    adafactor._apply_kernel = type("Counted", (), {"__getitem__": lambda self, grid: (
        lambda *a, **k: launched.append(1) or apply[grid](*a, **k))})()
    finite = [opt.step_chunked(w, ChunkedGrad(grads), max_norm) for opt, w in zip(opts, (weight, exact))]
    adafactor._apply_kernel = apply
    got, want = weight.float(), exact
    ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 8)  # bf16's spacing at each value
    states = {k: ((opts[0].state[weight][k] - opts[1].state[exact][k]).abs() / opts[1].state[exact][k]).max().item()
              for k in ("exp_avg_sq_row", "exp_avg_sq_col")}  # relative: pass 1 sums in another order
    before = weight.clone()
    poisoned = [g.clone() for g in grads]
    poisoned[0][0, 7] = float("nan")
    held = opts[0].step_chunked(weight, ChunkedGrad(poisoned), max_norm)
    untouched = torch.equal(weight, before)
    # one more step, its torch ops counted: besides the kernels only allocations, views and the seeds
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    again = [g.clone() for g in grads]
    with Ops():
        opts[0].step_chunked(weight, ChunkedGrad(again), max_norm)
    return {"finite": [bool(f) for f in finite], "launches": len(launched), "torch_ops": sorted(set(ops)),
            "chunks": len(ChunkedGrad(grads).spans(limit)),
            "within_a_spacing": bool(((got - want).abs() <= ulp * 1.001).all()),
            "bias_in_spacings": ((got - want) / ulp).mean().item(),
            # along each value's step: a step too long or too short (an update off by a factor) shows here
            "bias_along_step": ((got - want) / ulp * torch.sign(want - start.float())).mean().item(), "moved": (got != start.float()).double().mean().item(),
            "state_error": max(states.values()), "held_back": not bool(held), "untouched": untouched}


if __name__ == "__main__":
    device = sys.argv[1]
    assert sr.fused_kernels(torch.zeros(1, device=device)), "the fused kernels are not taken here"
    report = {"rounding": rounding(device),
              "steps": [chunked_step(device, wd, norm, parts) for wd, norm, parts in
                        ((0.0, 0.0, 1), (0.1, 5.0, 2), (0.1, 0.0, 2))]
                       # rows that are not a multiple of a pass-1 program's, columns over several of its reads
                       + [chunked_step(device, 0.0, 0.0, 2, shape=(100, 600), limit=6000),
                          chunked_step(device, 0.1, 0.0, 1, shape=(64, 64), transposed=True)]}
    print(json.dumps(report))
