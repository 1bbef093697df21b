"""Stochastic rounding of float32 values into bfloat16.

Round-to-nearest into bf16 (8 significant bits) drops any update smaller than half a unit in
the last place: a weight of 1.0 moved by lr * update = 1e-4 stays 1.0 forever, so full-bf16
training silently stops learning at small learning rates. Stochastic rounding rounds up with
probability equal to the distance from the lower neighbour, so the rounded value is exact on
average (E[round(x)] = x) and small updates accumulate over steps.

The rounding is exact bit arithmetic: a bf16 value is the upper 16 bits of a float32. Adding a
uniform random integer in [0, 2**16) to the float32 bit pattern carries into the upper half
with probability (low 16 bits) / 2**16, and truncating the low half then gives the stochastic
result. Values already representable in bf16 have zero low bits and are returned unchanged;
inf stays inf (its low bits are zero); NaN stays NaN (it gets no noise, so no carry can reach
the sign bit, and is written back as a quiet NaN). Finite values above bf16's largest finite
value round to inf with the probability of their distance, as they would to nearest.

Cost: one int32 random draw per element from the generator passed in (never the global RNG),
an add and a mask: a few passes over the tensor, and temporaries of 5 bytes per element of the
source (the int32 draw and a NaN mask) while it runs. Used one tensor at a time, that temporary is
bounded by the largest parameter.

On the CPU, torch draws random numbers on one thread (a Mersenne twister), which made the draws
most of a streamed full fine-tune's CPU optimizer step. A CPU tensor of more than two chunks
(CPU_CHUNK values) is therefore filled chunk by chunk on a pool of threads (torch releases the
GIL while it fills): one seed per chunk is drawn from the generator passed in, each chunk from
its own generator seeded with it. The chunks are fixed by size, not by the thread count, so the
bits depend only on the generator's state, on any machine; they differ from a single draw's.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch

_UPPER_HALF = -65536  # 0xFFFF0000 as a signed int32
CPU_CHUNK = 1 << 22  # values per chunk of a CPU draw spread over threads


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="vramfit-rounding")


def _noise(shape: torch.Size, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Uniform int32 values in [0, 2**16) of `shape` (see the module doc for the CPU chunks)."""
    numel = shape.numel()
    if device.type != "cpu" or numel <= 2 * CPU_CHUNK:
        return torch.randint(0, 1 << 16, shape, generator=generator, device=device, dtype=torch.int32)
    noise = torch.empty(shape, dtype=torch.int32)
    chunks = noise.view(-1).split(CPU_CHUNK)
    seeds = torch.randint(0, 2**62, (len(chunks),), generator=generator).tolist()

    def fill(chunk: torch.Tensor, seed: int) -> None:
        chunk.random_(0, 1 << 16, generator=torch.Generator().manual_seed(seed))

    for done in [_pool().submit(fill, c, s) for c, s in zip(chunks, seeds)]:
        done.result()
    return noise


def _rounded_bits(src: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """float32 values whose low 16 bits are zero: the stochastic bf16 rounding of `src`."""
    src = src.detach()
    if src.dtype != torch.float32:
        src = src.float()
    nan = torch.isnan(src)
    noise = _noise(src.shape, generator, src.device)
    # NaN patterns near 0x7FFFFFFF would carry into the sign bit: they get no noise, and are
    # written back as NaN after the truncation (which could have made one of them inf).
    noise.masked_fill_(nan, 0).add_(src.contiguous().view(torch.int32)).bitwise_and_(_UPPER_HALF)
    return noise.view(torch.float32).masked_fill_(nan, float("nan"))


def stochastic_round(src: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A new bf16 tensor: `src` (float32) rounded stochastically, exact on average."""
    return _rounded_bits(src, generator).to(torch.bfloat16)  # exact: the low bits are zero


def copy_stochastic_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Write `src` (float32) into the bf16 tensor `dst` with stochastic rounding; returns dst.

    A dst of any other dtype gets a plain copy (float32 needs no rounding; no other dtype is
    rounded stochastically here)."""
    if dst.dtype != torch.bfloat16:
        return dst.copy_(src)
    return dst.copy_(_rounded_bits(src, generator))
