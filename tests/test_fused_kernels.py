"""The Triton kernels of stochastic rounding and of Adafactor's chunked step, run by
tests/fused_kernels_check.py: on the CPU under Triton's interpreter where Triton is installed,
and on a GPU where there is one. Without Triton the torch ops run instead (every other test)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import triton
except ImportError:  # still collected, so that `pytest -m gpu --co` lists the GPU case; skipped below
    triton = None

pytestmark = pytest.mark.skipif(triton is None, reason="could not import 'triton'")

CHECK = Path(__file__).with_name("fused_kernels_check.py")
# Triton's interpreter runs a loop bounded by a kernel argument (pass 1's columns) from 3.9 on;
# 3.6's stops with "only 0-dimensional arrays can be converted to Python scalars"
OLD_INTERPRETER = triton is not None and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9)
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(OLD_INTERPRETER, reason="Triton's interpreter "
                                                        "before 3.9 cannot run pass 1's loop"))]
DEVICES += [pytest.param("cuda", marks=pytest.mark.gpu)]


ARITHMETIC = {"add", "add_", "addcmul", "addcmul_", "mul", "mul_", "div", "div_", "sum", "mean", "sqrt_", "rsqrt_",
              "where", "lt", "clamp_", "reciprocal_", "dot", "pow_", "stack", "logical_not", "full", "fill_"}


def _neighbours(value: float) -> tuple[float, float]:
    low = torch.tensor(value).bfloat16().float().item()
    if low > value:
        low -= 2 ** (math.frexp(value)[1] - 8)
    return low, low + 2 ** (math.frexp(low)[1] - 8)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_rounding_and_chunked_adafactor_steps(device):
    env = {**os.environ, "TRITON_INTERPRET": "1" if device == "cpu" else "0"}
    done = subprocess.run([sys.executable, str(CHECK), device], env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    rounding = report["rounding"]
    assert rounding["torch_ops_calls"] == 0  # one fused kernel, no noise tensor
    low, high = _neighbours(1.0 + 3 * 2**-10)
    big = torch.tensor(3.4e38).bfloat16().float().item()  # rounds to its bf16 value or to inf
    assert rounding["nan"] and rounding["specials"][:3] == [math.inf, -math.inf, 1.0]
    assert rounding["specials"][3] in (big, math.inf)
    assert rounding["values"] == [low, high] and rounding["up"] == pytest.approx(0.375, abs=0.02)
    assert rounding["same"] and rounding["held_untouched"]  # same generator state, same bits; a False flag writes nothing

    assert len(report["steps"]) == 5
    for index, step in enumerate(report["steps"]):
        if index == 4:  # a gradient that is not contiguous: the torch ops, not the kernels
            assert step["launches"] == 0 and step["chunks"] >= 4
        else:
            assert step["launches"] == step["chunks"] >= 10  # a kernel a chunk
            # the arithmetic between the passes runs in the kernels too: no torch op computes anything
            assert not set(step["torch_ops"]) & ARITHMETIC, step["torch_ops"]
        assert step["finite"] == [True, True]
        assert step["within_a_spacing"] and abs(step["bias_in_spacings"]) < 0.02  # a neighbour, unbiased
        assert abs(step["bias_along_step"]) < 0.02  # and the step itself as long as the exact one
        assert step["moved"] > 0.5 and step["state_error"] < 1e-6
        assert step["held_back"] and step["untouched"]  # a NaN gradient: the weight keeps its values
