"""train.compile: the denoiser's repeated blocks are compiled and train as the eager ones do."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import train_args
from vramfit.cli import main
from vramfit.config.load import load_config


@pytest.mark.parametrize("model,extra,rel", [
    ("tiny:sd3", ["train.precision=fp32"], 1e-5),
    # an nf4 base's widening cannot be traced: those linears run eagerly between compiled parts
    ("tiny:sd3", ["train.mode=lora", "lora.base_quantization=nf4", "train.lr=1e-4"], 1e-5),
    # the UNet's blocks; int8 weights are fixed-size guards: one compilation per resnet width, under
    # the raised limit. In fp32, as the eager run (in bf16 compiled graphs round differently)
    ("tiny:ssd1b",
     ["train.mode=lora", "lora.base_quantization=int8", "train.lr=1e-4", "train.precision=fp32"], 1e-5),
])
def test_compiled_blocks_train_like_eager_ones(images, tmp_path, cache_root, monkeypatch, model, extra, rel, capfd):
    # Dynamo captures each block and AOT autograd builds its backward, as on a GPU; the aot_eager
    # backend then runs those graphs without generating C++ (minutes on two CPU cores).
    compiled = []
    eager_compile = torch.nn.Module.compile

    def compile_for_test(module, *args, **kwargs):
        compiled.append(type(module).__name__)
        eager_compile(module, *args, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_for_test)
    losses = []
    for flag in ("false", "true"):
        out = tmp_path / flag
        assert main(train_args(images, out, cache_root / f"compile-{model}", f"train.compile={flag}",
                               "train.steps=3", "save.name=m", *extra, model=model)) == 0
        losses.append(json.loads((out / "run.json").read_text())["losses"])
    expected = {"BasicTransformerBlock", "ResnetBlock2D"} if model == "tiny:ssd1b" else {"JointTransformerBlock"}
    assert set(compiled) == expected and len(compiled) > len(expected)
    assert "recompile_limit" not in capfd.readouterr().err  # every block ran compiled
    assert losses[1] == pytest.approx(losses[0], rel=rel)
    assert len(set(losses[0])) == 3


def test_compile_refuses_hooks_that_move_weights(images):
    for key in ("memory.stream_weights", "memory.offload_activations"):
        with pytest.raises(Exception, match=f"train.compile: cannot be used with {key}"):
            load_config(None, [f"data.path={images}", "train.compile=true", f"{key}=true"])
