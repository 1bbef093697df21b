"""Count the torch operators one training step's backward and optimizer step dispatch (CPU, no GPU).

On a fast GPU a step inside backward is bound by the host: each operator is a kernel launch and
some Python around it. This counts them for SD3-Medium's real block widths with only `--layers`
joint blocks and a 16x16 latent (so it runs on a laptop CPU in seconds), bf16 weights and
vramfit's Adafactor with stochastic rounding, in three ways:
  normal   backward, then the optimizer's packed step
  whole    the step inside backward, every tensor stepped whole (chunking off)
  chunk    the step inside backward as vramfit runs it (tensors over 4 Mi values in row chunks)
Views and other operators that launch no kernel are not counted. Not run in CI.

usage: python bench/count_step_ops.py [--layers N]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
NO_KERNEL = {"aten::view", "aten::slice", "aten::_unsafe_view", "aten::unsqueeze", "aten::detach", "aten::alias",
             "aten::t", "aten::expand", "aten::as_strided", "aten::select", "aten::unbind", "aten::split",
             "aten::transpose", "aten::reshape", "aten::permute", "aten::squeeze"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name not in NO_KERNEL:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def count(mode: str, layers: int) -> tuple[int, int]:
    """(tensors trained, operators of one step's backward and optimizer step) after one warm-up step."""
    from diffusers import SD3Transformer2DModel

    from vramfit.optim.adafactor import Adafactor
    from vramfit.optim.base import RoundingGenerators
    from vramfit.optim.in_backward import BackwardSteps

    config = json.loads((ROOT / "src/vramfit/models/configs/sd3_medium_transformer.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config.update(num_layers=layers, sample_size=16, pos_embed_max_size=16)
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**config).bfloat16()
    params = list(model.parameters())
    opt = Adafactor(params, lr=1e-6, rounding=RoundingGenerators(0))
    if mode == "whole":
        opt.chunks = lambda p: False
    hooks = BackwardSteps(params, opt, in_backward=True, round_sums=True) if mode != "normal" else None
    inputs = (torch.randn(1, 16, 16, 16).bfloat16(), torch.randn(1, 8, 4096).bfloat16(),
              torch.randn(1, 2048).bfloat16(), torch.tensor([500.0]))
    ops = 0
    for measured in (False, True):
        if hooks is not None:
            hooks.begin(last=True)
        loss = model(*inputs).sample.float().pow(2).mean()
        counter = _Count()
        with counter if measured else _Nothing():
            loss.backward()
            if hooks is not None:
                hooks.finish()
            else:
                opt.step()
        opt.zero_grad(set_to_none=True)
        ops = counter.ops
    return len(params), ops


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    for mode in ("normal", "whole", "chunk"):
        tensors, ops = count(mode, args.layers)
        print(f"{mode:<8} {tensors} tensors, {ops} operators in backward and the optimizer step")


if __name__ == "__main__":
    main()
