"""Regional compilation of the denoiser: torch.compile on each repeated block, not the whole model.

A denoiser at batch 1 spends much of a step launching small kernels (norms, activations, adds,
reshapes) one at a time from Python; compiling a block fuses its elementwise work and launches
fewer, larger kernels. Compiling the blocks rather than the whole model (diffusers calls this
`compile_repeated_blocks`) compiles one block of each kind and shape once and reuses it for
every block like it, so start-up stays short, the code around the blocks (embeddings, the
conditioning, gradient checkpointing's wrappers) stays eager, and a block recomputed by
gradient checkpointing runs the compiled code again.

A bucket of another shape compiles again (torch marks the changing sizes dynamic after the
second shape), so a dataset with a few buckets pays a few compilations. A quantized LoRA base
(int8, fp8) holds its weights as tensor subclasses whose sizes stay fixed guards, so each width
of an SDXL-family resnet block compiles once (about ten); torch's default limit of 8 compilations
per code object would leave the rest eager, so `compile_blocks` raises it to RECOMPILE_LIMIT.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch._dynamo

RECOMPILE_LIMIT = 64


def compile_blocks(denoiser: torch.nn.Module, names: Sequence[str]) -> int:
    """Compile each repeated block of `denoiser` (the modules of the classes `names`, as its family
    names them) in place; returns how many were compiled."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    count = 0
    for module in denoiser.modules():
        if type(module).__name__ in names:
            module.compile()
            count += 1
    return count
