"""Sample grids take their prompts from the caption phase when captions are cached: the grid needs
no text encoder (none is read again from disk) and renders the same images as a grid that encodes
its prompts itself."""
from __future__ import annotations

import pytest
from PIL import Image, ImageChops

from conftest import train_args
from vramfit.cli import main
from vramfit.memory.quantize import stored_precision
from vramfit.models.registry import FAMILIES
from vramfit.train import setup

GRIDS = ("sample.every_steps=2", "sample.steps=2", "sample.prompts=['a red circle', 'a blue square']",
         "sample.negative_prompt=blurry", "sample.guidance=4.0", "save.every_steps=0",
         "train.precision=mixed_bf16")  # fp32 encoders on both sides: the same numbers


@pytest.mark.parametrize("model,extra", [("tiny:sdxl", []), ("tiny:sd3", ["model.t5_precision=int8"])])
def test_grids_use_prompts_encoded_with_the_captions(images, tmp_path, cache_root, monkeypatch, caplog, model,
                                                     extra):
    family = FAMILIES["sdxl" if model == "tiny:sdxl" else "sd3"]
    loads = []  # (the keywords, the precision each encoder came stored in)

    def load_encoders(self, source, **kwargs):
        vae, encoders = original(self, source, **kwargs)
        loads.append((kwargs, [stored_precision(e) for e in encoders]))
        return vae, encoders

    original = type(family).load_encoders
    monkeypatch.setattr(type(family), "load_encoders", load_encoders)
    cache = cache_root / "sample-prompts"
    with caplog.at_level("INFO", logger="vramfit"):
        assert main(train_args(images, tmp_path / "cached", cache, *GRIDS, *extra, model=model)) == 0
    assert "prompt(s) encoded with the captions" in caplog.text and loads == []

    # as without: the grid encodes its prompts itself, reading the encoders again; T5 stored as it loads
    monkeypatch.setattr(setup, "encode_sample_prompts", lambda cfg, bundle, device: None)
    assert main(train_args(images, tmp_path / "loaded", cache, *GRIDS, *extra, model=model)) == 0
    assert loads == ([({}, [None, None])] if model == "tiny:sdxl" else
                     [({"t5_precision": "int8"}, [None, None, "int8"])])
    a = Image.open(tmp_path / "cached" / "samples" / "step-000002.png").convert("RGB")
    b = Image.open(tmp_path / "loaded" / "samples" / "step-000002.png").convert("RGB")
    assert ImageChops.difference(a, b).getbbox() is None
