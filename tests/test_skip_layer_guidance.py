"""Skip-layer guidance as the user asks for it: off, the model's default or their own blocks and scale
(`vramfit generate --slg/--slg-scale`, sample.skip_layer_guidance*), through the CLI on the tiny
SD3.5 Medium; refused, naming the flag or key, for blocks the model lacks and for families whose
sampler has none."""
from __future__ import annotations

import pytest
from PIL import Image
from diffusers import StableDiffusion3Pipeline

from conftest import train_args
from vramfit.cli import main
from vramfit.models.registry import FAMILIES

TINY = "tiny:sd3.5-medium"  # 10 transformer blocks; its default skips 7, 8, 9 at scale 2.5


def _generate(tmp_path, cache_root, name: str, *flags: str, model: str = TINY) -> list[str]:
    return ["generate", "--model", model, "--prompt", "a red circle", "--steps", "6", "--guidance", "4",
            "--width", "64", "--height", "64", "--no-progress", "--out", str(tmp_path / name),
            "--cache-dir", str(cache_root / "slg"), *flags]


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """The skip-layer arguments each StableDiffusion3Pipeline call gets (after the family's pipeline
    filled in its own), the call returning its starting latents instead of denoising."""
    seen: list[dict] = []

    def spy(self, *args, **kwargs):
        seen.append({k: v for k, v in kwargs.items() if k.startswith("skip_")})
        return (kwargs["latents"],)

    monkeypatch.setattr(StableDiffusion3Pipeline, "__call__", spy)
    return seen


def test_off_default_and_own_blocks_reach_the_pipeline(calls, tmp_path, cache_root, capsys):
    default = {"skip_guidance_layers": [7, 8, 9], "skip_layer_guidance_scale": 2.5,
               "skip_layer_guidance_start": 0.01, "skip_layer_guidance_stop": 0.2}
    for name, flags, want in (
            ("default", (), default),
            ("off", ("--slg", "off"), {}),
            ("scale", ("--slg-scale", "1.5"), {**default, "skip_layer_guidance_scale": 1.5}),
            ("own", ("--slg", "2,5", "--slg-scale", "3"),
             {**default, "skip_guidance_layers": [2, 5], "skip_layer_guidance_scale": 3.0})):
        calls.clear()
        assert main(_generate(tmp_path, cache_root, name, *flags)) == 0, name
        assert calls == [want], name
    # the PNG says what was asked (the model's default: nothing)
    written = {name: Image.open(tmp_path / name / "0-0.png").info.get("skip-layer guidance")
               for name in ("default", "off", "own")}
    assert written == {"default": None, "off": "off", "own": "blocks 2,5, scale 3"}
    capsys.readouterr()


def test_own_blocks_are_the_ones_the_transformer_leaves_out(tmp_path, cache_root, transformer_skip_layers,
                                                            capsys):
    """Not only the arguments: the transformer runs a third prediction without blocks 2 and 5 on
    step 1 (steps between 1% and 20% of 6), and none with --slg off."""
    seen = transformer_skip_layers
    assert main(_generate(tmp_path, cache_root, "own", "--slg", "2,5")) == 0
    assert seen == [None, None, [2, 5]] + [None] * 4  # step 1's guided call, then its third
    seen.clear()
    assert main(_generate(tmp_path, cache_root, "off", "--slg", "off")) == 0
    assert seen == [None] * 6
    capsys.readouterr()


@pytest.mark.parametrize("flags, named", [
    (("--slg", "3,10"), "--slg: block 10 is beyond this model's 10 transformer blocks; give blocks 0 to 9"),
    (("--slg", "off", "--slg-scale", "2"), "--slg-scale: given while --slg is off"),
    (("--slg", "3", "--guidance", "1"), "which --guidance 1 turns off"),
    (("--slg-scale", "-1"), "--slg-scale must be a finite number above 0"),
])
def test_generate_refuses_what_the_model_cannot_take(flags, named, tmp_path, cache_root, capsys):
    assert main(_generate(tmp_path, cache_root, "bad", *flags)) != 0
    assert named in capsys.readouterr().err
    assert not list((tmp_path / "bad").glob("*.png"))


@pytest.mark.parametrize("flags, named", [
    (("--slg-scale", "2"), "--slg-scale: this sd3-custom model samples without skip-layer guidance by default"),
    (("--slg", "1,5"), "--slg: block 5 is beyond this model's 2 transformer blocks"),
])
def test_generate_refuses_what_the_base_cannot_take_before_loading(flags, named, tmp_path, cache_root, capsys,
                                                                    monkeypatch):
    """--base a model that cannot take the asked skip-layer guidance: refused, naming it, before either
    model loads (not once --model has rendered and the base loads)."""
    loads = []
    monkeypatch.setattr(FAMILIES["sd3"], "load", lambda *a, **k: loads.append(1))
    assert main(_generate(tmp_path, cache_root, "base", "--base", "tiny:sd3", "--compare", *flags)) == 2
    err = capsys.readouterr().err
    assert named in err and "--base tiny:sd3" in err and "Traceback" not in err
    assert loads == [] and not list((tmp_path / "base").glob("*.png"))


@pytest.mark.parametrize("model, shown", [("tiny:ssd1b", "SDXL-family"), ("tiny:flux", "Flux.1")])
def test_generate_refuses_slg_for_families_without_it(model, shown, tmp_path, cache_root, capsys):
    assert main(_generate(tmp_path, cache_root, "x", "--slg", "1", model=model)) != 0
    err = capsys.readouterr().err
    assert "--slg applies to the skip-layer guidance of SD3 models" in err and f"({shown}) samples" in err
    # off is how it samples anyway: taken
    assert main(_generate(tmp_path, cache_root, "x", "--slg", "off", "--steps", "1", model=model)) == 0


@pytest.mark.parametrize("model, sets, named", [
    (TINY, ("sample.skip_layer_guidance_layers=[9, 12]",),
     "sample.skip_layer_guidance_layers: block 12 is beyond this model's 10 transformer blocks"),
    ("tiny:sd3", ("sample.skip_layer_guidance=true",),
     "sample.skip_layer_guidance: this sd3-custom model samples without skip-layer guidance by default; "
     "give the transformer blocks to leave out with sample.skip_layer_guidance_layers"),
    ("tiny:ssd1b", ("sample.skip_layer_guidance_scale=2.0",),
     "sample.skip_layer_guidance_scale: SDXL-family models sample without skip-layer guidance; leave it out"),
    (TINY, ("sample.skip_layer_guidance=false", "sample.skip_layer_guidance_layers=[1]"),
     "sample.skip_layer_guidance_layers: given while sample.skip_layer_guidance is off"),
])
def test_training_refuses_sample_settings_before_it_starts(model, sets, named, images, tmp_path, cache_root,
                                                           capsys):
    args = train_args(images, tmp_path / "out", cache_root / "slg", "sample.prompts=['a cat']",
                      "sample.every_steps=1", *sets, model=model)
    assert main(args) != 0
    err = capsys.readouterr().err
    assert named in err and err.startswith("error: config"), err  # the checks before loading


def test_sample_grids_take_the_configs_blocks_and_scale(calls, images, tmp_path, cache_root, capsys):
    args = train_args(images, tmp_path / "out", cache_root / "slg", "train.steps=1", "sample.every_steps=1",
                      "sample.prompts=['a cat']", "sample.steps=2",
                      "sample.skip_layer_guidance_layers=[1, 4]", "sample.skip_layer_guidance_scale=2.0",
                      model=TINY)
    assert main(args) == 0
    assert calls == [{"skip_guidance_layers": [1, 4], "skip_layer_guidance_scale": 2.0,
                      "skip_layer_guidance_start": 0.01, "skip_layer_guidance_stop": 0.2}]
    grids = list((tmp_path / "out").rglob("samples/step-*.png"))
    assert len(grids) == 1
    assert Image.open(grids[0]).info.get("skip-layer guidance") == "blocks 1,4, scale 2"  # as generate writes it
    capsys.readouterr()


def test_a_single_files_blocks_are_read_from_its_header(images, tmp_path, cache_root, capsys):
    """model.path a file: its block count comes from its keys, and a block beyond it is refused
    before any weight loads."""
    path = FAMILIES["sd3"].materialize_tiny("sd3.5-medium", cache_root / "slg" / "tiny")
    args = train_args(images, tmp_path / "out", cache_root / "slg", "sample.prompts=['a cat']",
                      "sample.every_steps=1", "sample.skip_layer_guidance_layers=[10]", model=str(path))
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "config for this sd3 model" in err  # the check before loading, not the pipeline's after
    assert "sample.skip_layer_guidance_layers: block 10 is beyond this model's 10 transformer blocks" in err
