"""DreamBooth through the CLI: prior preservation (class images generated, cached, weighted) and
sample grids during training."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from conftest import SIZE, train_args
from vramfit.cli import main
from vramfit.train.prior import slot_buckets

DREAMBOOTH = ("train.mode=lora", "lora.rank=4", "train.lr=1e-2", "save.name=m",
              "data.instance_prompt=a photo of sks cat")
PRIOR = ("prior.class_prompt=a photo of a cat", "prior.num_images=3", "prior.steps=2")


def test_slot_buckets_follow_the_instance_buckets():
    buckets = [(64, 64)] * 3 + [(96, 32)]
    slots = slot_buckets(buckets, 8)
    assert len(slots) == 8 and slots.count((96, 32)) == 2 and slots.count((64, 64)) == 6
    assert slot_buckets(buckets, 8) == slots  # deterministic
    assert set(slot_buckets(buckets, 2)) == {(64, 64), (96, 32)}  # every bucket gets one
    with pytest.raises(ValueError, match="prior.num_images"):
        slot_buckets(buckets, 1)


@pytest.mark.parametrize("model", ["tiny:sd3", "tiny:ssd1b"])
def test_prior_preservation_generates_caches_and_trains_on_class_images(model, images, tmp_path, cache_root):
    out = tmp_path / "run"
    cache = cache_root / f"prior-{model[5:]}"
    assert main(train_args(images, out, cache, *DREAMBOOTH, *PRIOR, model=model)) == 0
    folder = out / "class_images"
    files = sorted(folder.glob("class-*.png"))
    assert [p.name for p in files] == ["class-00000.png", "class-00001.png", "class-00002.png"]
    with Image.open(files[1]) as im:
        assert im.size == (SIZE, SIZE) and im.info["prompt"] == "a photo of a cat" and im.info["seed"] == "1"
    run = json.loads((out / "run.json").read_text())
    assert run["cache"]["class_images_generated"] == 3
    assert run["cache"]["latents_cached"] == 4 + 3  # instance and class images, each cached once
    assert run["cache"]["text_cached"] == 2  # two prompts: the instance and the class prompt
    with_prior = run["losses"]

    # Again: nothing is generated, the cache is reused; without prior the loss differs.
    again = tmp_path / "again"
    args = train_args(images, again, cache, *DREAMBOOTH, *PRIOR, f"prior.class_dir={folder}", model=model)
    assert main(args) == 0
    run = json.loads((again / "run.json").read_text())
    assert run["cache"]["class_images_generated"] == 0 and run["cache"]["latents_reused"] == 7
    assert run["losses"] == with_prior
    assert not (again / "class_images").exists()
    plain = tmp_path / "plain"
    assert main(train_args(images, plain, cache, *DREAMBOOTH, model=model)) == 0
    assert json.loads((plain / "run.json").read_text())["losses"] != with_prior


def test_prior_loss_weight_zero_is_the_instance_loss(images, tmp_path, cache_root):
    """With weight 0 the class images ride along but add nothing: the loss is the instance term."""
    cache = cache_root / "prior-w0"
    args = (*DREAMBOOTH, *PRIOR, "train.steps=1", "train.batch_size=2")
    out = tmp_path / "w0"
    assert main(train_args(images, out, cache, *args, "prior.loss_weight=0", model="tiny:ssd1b")) == 0
    out2 = tmp_path / "w1"
    assert main(train_args(images, out2, cache, *args, "prior.loss_weight=1",
                           f"prior.class_dir={out / 'class_images'}", model="tiny:ssd1b")) == 0
    w0 = json.loads((out / "run.json").read_text())["losses"][0]
    w1 = json.loads((out2 / "run.json").read_text())["losses"][0]
    assert w1 > w0 > 0  # same draws; weight 1 adds the (positive) class term


def test_user_class_images_fill_slots_and_bad_ones_are_named(images, tmp_path, cache_root, caplog):
    folder = tmp_path / "classes"
    folder.mkdir()
    Image.new("RGB", (40, 120), (200, 10, 10)).save(folder / "mine.jpg")  # a tall one
    (folder / "broken.png").write_bytes(b"not a png")
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "prior-user", *DREAMBOOTH, *PRIOR,
                           f"prior.class_dir={folder}", "train.steps=1", model="tiny:ssd1b")) == 0
    run = json.loads((out / "run.json").read_text())
    # two files already there (one unreadable) take slots 0 and 1; only slot 2 is generated
    assert run["cache"]["class_images_generated"] == 1
    assert sorted(p.name for p in folder.glob("class-*.png")) == ["class-00002.png"]
    assert "broken.png" in caplog.text
    # the user's image keeps the bucket of its own aspect; the generated one has its slot's
    from vramfit.config.load import load_config
    from vramfit.train.prior import class_items

    cfg = load_config(out / "config.toml", need_data=False)
    buckets = {item.path.name: bucket for item, bucket in class_items(cfg, folder, [(SIZE, SIZE)] * 3)}
    assert buckets == {"mine.jpg": (32, 96), "class-00002.png": (SIZE, SIZE)}


def test_sample_grids_every_n_steps_and_at_the_end(images, tmp_path, cache_root):
    out = tmp_path / "run"
    sets = (*DREAMBOOTH, "train.steps=3", "sample.every_steps=2", "sample.prompts=['a photo of sks cat', 'a dog']",
            "sample.seeds=[1, 2]", "sample.steps=2")
    assert main(train_args(images, out, cache_root / "samples", *sets, model="tiny:sd3")) == 0
    grids = sorted((out / "samples").glob("*.png"))
    assert [p.name for p in grids] == ["step-000002.png", "step-000003.png"]
    with Image.open(grids[0]) as a, Image.open(grids[1]) as b:
        assert a.size == b.size == (2 * SIZE, 2 * SIZE)  # 2 prompts x 2 seeds
        assert a.info["seeds"] == "1, 2"
        # the LoRA trained in between, so the same prompts and seeds render differently
        assert not torch.equal(torch.tensor(list(a.getdata())), torch.tensor(list(b.getdata())))
    run = json.loads((out / "run.json").read_text())
    assert len(run["samples"]) == 2


def test_sample_config_errors_come_before_loading(images, tmp_path, cache_root, capsys):
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "samples", "sample.every_steps=1", model="tiny:sd3")) != 0
    assert "prompts" in capsys.readouterr().err
    assert main(train_args(images, out, cache_root / "samples", "sample.every_steps=1", "sample.prompts=['x']",
                           "sample.width=72", model="tiny:sd3")) != 0
    err = capsys.readouterr().err
    assert "sample.width" in err and "16" in err


def test_class_images_of_another_prompt_are_refused(images, tmp_path, cache_root, capsys):
    out = tmp_path / "run"
    cache = cache_root / "prior-other"
    assert main(train_args(images, out, cache, *DREAMBOOTH, *PRIOR, "train.steps=1", model="tiny:ssd1b")) == 0
    files = sorted((out / "class_images").iterdir())
    other = [a for a in (*DREAMBOOTH, *PRIOR) if not a.startswith("prior.class_prompt")]
    args = train_args(images, out, cache, *other, "prior.class_prompt=a photo of a dog", "train.steps=1",
                      model="tiny:ssd1b")
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "a photo of a cat" in err and "prior.class_dir" in err
    assert sorted((out / "class_images").iterdir()) == files  # nothing overwritten


def test_switched_off_or_impossible_prior_and_sample_settings_are_refused(images, tmp_path, cache_root, capsys):
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "x", "prior.num_images=3", model="tiny:ssd1b")) != 0
    assert "prior.num_images: given without prior.class_prompt" in capsys.readouterr().err
    # grids of a streamed denoiser take their prompts from the caption phase: live captions are refused
    assert main(train_args(images, out, cache_root / "x", "sample.every_steps=1", "sample.prompts=['x']",
                           "memory.stream_weights=true", "cache.text=false", model="tiny:ssd1b")) != 0
    err = capsys.readouterr().err
    assert "memory.stream_weights" in err and "cache.text" in err


def test_the_planner_counts_the_class_images_in_each_batch():
    from vramfit.config.schema import RunConfig
    from vramfit.fit.model_facts import read_facts
    from vramfit.fit.planner import predict

    # at 1024 the end of forward (saved activations), not the optimizer step, makes the tiny model's peak
    plain = RunConfig.model_validate({"model": {"path": "tiny:sd3"}, "train": {"batch_size": 2},
                                      "data": {"resolution": 1024}})
    prior = RunConfig.model_validate({**plain.model_dump(), "prior": {"class_prompt": "a cat"}})
    assert prior.step_batch == 4 and plain.step_batch == 2
    facts = read_facts(plain)
    a = next(p for p in predict(facts, plain).phases if p.name == "train").parts
    b = next(p for p in predict(facts, prior).phases if p.name == "train").parts
    assert b["saved"] == 2 * a["saved"] and b["weights"] == a["weights"]
