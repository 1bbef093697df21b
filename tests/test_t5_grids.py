"""T5 and sample grids: the planner counts the T5 a grid reloads as the grid holds it (stored as
model.t5_precision asks while it loads, train/samples.py: its embedding and norms in bf16, not
widened to the grid's dtype); a Flux.1 run without T5 is refused grids before anything loads,
as are missing class images and `vramfit generate --t5 none`."""
from __future__ import annotations

from PIL import Image

from conftest import train_args
from vramfit.cli import main
from vramfit.config.schema import RunConfig
from vramfit.fit.model_facts import read_facts, sampled_encoder_bytes, weight_item_bytes
from vramfit.memory.quantize import storage_bytes
from vramfit.models.registry import FAMILIES
from vramfit.train import samples


def test_the_planned_grid_t5_is_the_reloaded_one(images, tmp_path, cache_root, monkeypatch):
    held = []  # the grid pipeline's T5 bytes, as built after the reload

    def build_pipeline(bundle):
        held.append(storage_bytes(bundle.text_encoders[-1]))
        return original(bundle)

    original = samples.build_pipeline
    monkeypatch.setattr(samples, "build_pipeline", build_pipeline)
    cache = cache_root / "t5-grid"
    sets = ("train.mode=lora", "train.precision=mixed_bf16", "model.t5_precision=int8", "cache.text=false", "train.steps=1",
            "sample.every_steps=1", "sample.steps=1", "sample.prompts=['a red circle']")
    args = train_args(images, tmp_path / "out", cache, *sets, model="tiny:sd3")
    assert main(args) == 0 and len(held) == 1
    cfg = RunConfig.model_validate({"model": {"path": "tiny:sd3", "t5_precision": "int8"},
                                    "train": {"mode": "lora", "precision": "mixed_bf16"}})
    t5 = next(e for e in read_facts(cfg, cache).encoders if e.kind == "t5")
    assert weight_item_bytes(cfg) == 4  # an fp32 grid: the CLIPs and the VAE are widened, T5 is not
    assert sampled_encoder_bytes(t5, "int8", weight_item_bytes(cfg)) == held[0]


def test_flux_grids_without_t5_are_refused_before_loading(images, tmp_path, cache_root, capsys):
    """FluxPipeline has no T5-less path: with model.t5_precision = "none" a grid could only fail
    once the model is loaded and the captions cached; the config is refused first, naming both keys."""
    cache = cache_root / "flux-no-t5"
    args = train_args(images, tmp_path / "out", cache, "train.mode=lora", "model.t5_precision=none",
                      "sample.every_steps=1", "sample.prompts=['a red circle']", model="tiny:flux")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "model.t5_precision" in err and "sample.every_steps" in err and "Traceback" not in err
    assert [p.name for p in cache.iterdir()] == ["tiny"] and not (tmp_path / "out" / "run.json").exists()


def test_generate_without_t5_is_refused_for_flux_before_loading(tmp_path, capsys, monkeypatch):
    """`vramfit generate --t5 none` on Flux.1 stops before any weight loads, naming the flag."""
    loads = []
    monkeypatch.setattr(FAMILIES["flux"], "load", lambda *a, **k: loads.append(1))
    out = tmp_path / "out"
    assert main(["generate", "--model", "tiny:flux", "--prompt", "a red circle", "--t5", "none",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--t5 none" in err and "--t5 int8" in err and "Traceback" not in err
    assert loads == [] and not any(out.glob("*.png"))


def test_flux_class_images_without_t5_are_refused_before_loading(images, tmp_path, cache_root, capsys,
                                                                 monkeypatch):
    """Class images are generated with the model: Flux.1 without T5 (model.t5_precision = "none") is
    refused before loading, naming the keys, while some are missing; with all of them there it loads."""
    loads = []

    def load(*args, **kwargs):
        loads.append(1)
        raise ValueError("the model loads")

    monkeypatch.setattr(FAMILIES["flux"], "load", load)
    folder = tmp_path / "class"
    args = train_args(images, tmp_path / "out", cache_root / "flux-no-t5-prior", "train.mode=lora",
                      "model.t5_precision=none", "prior.class_prompt='a shape'", "prior.num_images=2",
                      f"prior.class_dir={folder}", model="tiny:flux")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "model.t5_precision" in err and "prior.class_prompt" in err and "2 of" in err
    assert "Traceback" not in err and loads == []
    folder.mkdir()
    for name in ("a.png", "b.png"):  # the user's own class images: none to generate
        Image.new("RGB", (64, 64)).save(folder / name)
    assert main(args) == 2
    assert "the model loads" in capsys.readouterr().err and loads == [1]
