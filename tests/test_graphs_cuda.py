"""train.cuda_graphs with real CUDA recordings (skipped without a GPU): graphed runs through the CLI
against the same runs without graphs, with several buckets, accumulation, sample grids between
steps (which move the weights and force new recordings) and a quantized LoRA base."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _train(images, out, cache, model, *extra):
    assert main(train_args(images, out, cache, "save.dtype=fp32", "save.name=m", "train.device=cuda",
                           "memory.fit_probe=false", "train.steps=4", "train.grad_accum=2", *extra,
                           model=model)) == 0
    return json.loads((out / "run.json").read_text())["losses"], load_file(str(out / "m.safetensors"))


CASES = {
    "ssd1b-full": ("tiny:ssd1b", ["train.precision=mixed_bf16", "train.optimizer=adamw", "train.lr=1e-4"]),
    "ssd1b-full-checkpointed-samples": ("tiny:ssd1b", [
        "train.precision=mixed_bf16", "train.optimizer=adamw", "train.lr=1e-4", "train.gradient_checkpointing=true",
        "sample.every_steps=2", "sample.prompts=['a red circle']", "sample.steps=2"]),
    "sd3-lora-nf4": ("tiny:sd3", ["train.mode=lora", "lora.base_quantization=nf4", "train.lr=1e-4"]),
    "sdxl-lora-int8": ("tiny:sdxl", ["train.mode=lora", "lora.base_quantization=int8", "train.lr=1e-4"]),
    # sample grids move the quantized base too: its inner tensors' new addresses force new recordings
    "sd3-lora-fp8-samples": ("tiny:sd3", ["train.mode=lora", "lora.base_quantization=fp8", "train.lr=1e-4",
                                          "sample.every_steps=2", "sample.prompts=['a red circle']",
                                          "sample.steps=2"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_graphed_runs_on_the_gpu_match_runs_without(images, tmp_path, cache_root, caplog, case):
    model, sets = CASES[case]
    cache = cache_root / "graphs-cuda"
    plain_losses, plain_weights = _train(images, tmp_path / "plain", cache, model, *sets)
    with caplog.at_level("INFO", logger="vramfit"):
        losses, weights = _train(images, tmp_path / "graphed", cache, model, *sets, "train.cuda_graphs=true")
    assert "recorded the denoiser's forward and backward" in caplog.text
    assert "run without CUDA graphs" not in caplog.text  # no signature fell back to eager
    if "sample.every_steps=2" in sets:
        assert "weights moved" in caplog.text
    # the same kernels in the same order: equal up to the few last bits that reductions may differ in
    assert losses == pytest.approx(plain_losses, rel=1e-3, abs=1e-5)
    for key in plain_weights:
        torch.testing.assert_close(weights[key], plain_weights[key], rtol=1e-3, atol=1e-5, msg=key)
