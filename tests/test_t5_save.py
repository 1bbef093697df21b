"""A diffusers folder saved by a run whose text encoders stay loaded (live text or latents) carries
the source's T5, whatever model.t5_precision stored it as for training (or left it out)."""
from __future__ import annotations

import pytest
import torch
from transformers import T5EncoderModel

from conftest import train_args
from vramfit.cli import main
from vramfit.config.schema import ModelConfig
from vramfit.models.registry import FAMILIES
from vramfit.models.sources import resolve_source


@pytest.mark.parametrize("model,family,sub,precision", [("tiny:sd3", "sd3", "text_encoder_3", "int8"),
                                                        ("tiny:flux", "flux", "text_encoder_2", "none")])
def test_a_diffusers_save_writes_the_sources_t5(images, tmp_path, cache_root, model, family, sub, precision):
    cache = cache_root / "t5-save"
    out = tmp_path / "out"
    assert main(train_args(images, out, cache, "save.name=m", "train.steps=1", "save.formats=['diffusers']",
                           "cache.text=false", f"model.t5_precision={precision}", model=model)) == 0
    saved = T5EncoderModel.from_pretrained(out / "m-diffusers" / sub).state_dict()
    source = resolve_source(ModelConfig(path=model), cache)
    t5 = FAMILIES[family].load_encoders(source)[1][-1].state_dict()  # as the source stores it
    assert saved.keys() == t5.keys()
    for key, value in t5.items():
        torch.testing.assert_close(saved[key].float(), value.float(), rtol=0, atol=0, msg=key)
