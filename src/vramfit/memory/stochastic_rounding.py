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

On a GPU with Triton (torch's CUDA builds ship it) a contiguous float32 source written into a
contiguous bf16 destination of its shape takes one fused kernel instead of about seven: a seed is
drawn on the device from the generator passed in (no host sync), and each element's 16 noise bits
come from Philox at its own index, added, masked and stored in the same pass, with no noise
tensor or NaN mask (no temporaries: 6 bytes of traffic a value instead of about 50). The same
arithmetic on the same bit patterns; only where the random bits come from differs, so the bits
again depend only on the generator's state. A 0-dim `finite` flag is read by the kernel too:
when it is False nothing is written. Anything else (CPU tensors, strided views, other dtypes)
takes the torch ops above. The kernel pays where the GPU's time is what a step costs (a step
recorded as a CUDA graph, train/graphs.py); launched eagerly, a step is bound by the host and
measured the same either way (docs/benchmarks.md).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import lru_cache
from typing import Optional

import torch

try:  # torch's CUDA wheels bring Triton; CPU-only installs have none and use the torch ops below
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

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


if triton is not None:
    @triton.jit
    def round_bf16(x, seed, offsets):
        """float32 `x` rounded stochastically to bf16 with Philox noise at `offsets` (the bit
        arithmetic of `_rounded_bits`)."""
        noise = (tl.randint(seed, offsets.to(tl.uint32)) & 0xFFFF).to(tl.int32)
        nan = x != x  # no noise for NaN (it could carry into the sign bit); written back as NaN
        bits = (x.to(tl.int32, bitcast=True) + tl.where(nan, 0, noise)) & -65536
        return tl.where(nan, x, bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)  # exact: low bits zero

    @triton.jit
    def _round_kernel(src_ptr, dst_ptr, seed_ptr, keep_ptr, n, KEEP: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if KEEP:  # a 0-dim finite flag: when False no value is inside, so none is written
            n = n * tl.load(keep_ptr).to(tl.int64)
        inside = offsets < n
        x = tl.load(src_ptr + offsets, mask=inside, other=0.0)
        tl.store(dst_ptr + offsets, round_bf16(x, tl.load(seed_ptr), offsets), mask=inside)


FUSED_BLOCK = 1024


# Triton's interpreter (TRITON_INTERPRET=1, read when Triton is imported) runs the kernels on the
# CPU, value for value: the tests run them there where Triton is installed
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def fused_kernels(*tensors: torch.Tensor) -> bool:
    """Whether Triton's kernels can take these tensors: Triton present, all contiguous on one GPU
    (or the CPU under Triton's interpreter), fewer than 2**32 values each."""
    device = tensors[0].device
    return (triton is not None and (device.type == "cuda" or INTERPRETED)
            and all(t.device == device and t.is_contiguous() and t.numel() < 2**32 for t in tensors))


def on(device: torch.device):
    """The context a kernel launch on `device` runs in (its GPU current)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def device_seed(generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A Philox seed for a fused kernel, drawn on the device from `generator` (no host sync; a
    recorded CUDA graph draws it anew at each replay). 62 bits (Philox takes 64): two of the
    millions of draws of a long run meeting on one seed, and so on the same noise, is unlikely."""
    return torch.randint(0, 2**62, (1,), generator=generator, device=device, dtype=torch.int64)


def _round_fused(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator,
                 finite: Optional[torch.Tensor]) -> torch.Tensor:
    seed = device_seed(generator, dst.device)
    with on(dst.device):
        _round_kernel[(triton.cdiv(src.numel(), FUSED_BLOCK),)](
            src.detach(), dst, seed, finite.view(torch.uint8) if finite is not None else seed, src.numel(),
            KEEP=finite is not None, BLOCK=FUSED_BLOCK)
    return dst


def stochastic_round(src: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A new bf16 tensor: `src` (float32) rounded stochastically, exact on average."""
    if src.dtype == torch.float32 and fused_kernels(src) and src.numel():
        return _round_fused(torch.empty(src.shape, dtype=torch.bfloat16, device=src.device), src, generator, None)
    return _rounded_bits(src, generator).to(torch.bfloat16)  # exact: the low bits are zero


def copy_stochastic_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator,
                     finite: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write `src` (float32) into the bf16 tensor `dst` with stochastic rounding; returns dst.
    With `finite` (a 0-dim bool tensor on dst's device) nothing is written when it is False.

    A dst of any other dtype gets a plain copy (float32 needs no rounding; no other dtype is
    rounded stochastically here)."""
    if (dst.dtype == torch.bfloat16 and src.dtype == torch.float32 and src.shape == dst.shape and src.numel()
            and (finite is None or (finite.dim() == 0 and finite.device == dst.device)) and fused_kernels(dst, src)):
        return _round_fused(dst, src, generator, finite)
    if finite is not None:
        src = torch.where(finite, src, dst)
    if dst.dtype != torch.bfloat16:
        return dst.copy_(src)
    return dst.copy_(_rounded_bits(src, generator))
