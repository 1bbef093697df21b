"""Several datasets in one run: repeats, caption variants and dropout, flips, masks, epochs and the
validation loss, through the CLI on the tiny models (and the sampling itself without a model)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import SIZE
from vramfit.cli import main
from vramfit.config.schema import CacheConfig, ModelConfig, RunConfig
from vramfit.data.datasets import dataset_configs, scan_datasets
from vramfit.data.synth import make_synthetic_dataset
from vramfit.models.registry import detect_family
from vramfit.models.sources import resolve_source
from vramfit.train.data import TrainingData, encode_item_image, make_records

TAGS = ["sks", "red", "round", "shiny", "small", "flat"]


def _images(root: Path, n: int, seed: int, captions: bool = True) -> Path:
    make_synthetic_dataset(root, n=n, size=SIZE, seed=seed)
    if not captions:
        for txt in root.glob("*.txt"):
            txt.unlink()
    return root


def _square(root: Path, n: int, seed: int, caption: str = ", ".join(TAGS)) -> Path:
    """n square images (one bucket) of random pixels, each with `caption`."""
    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        pixels = torch.randint(0, 256, (SIZE, SIZE, 3), generator=gen, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(caption)
    return root


def _config(tmp_path: Path, body: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def _args(config: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    sets = ["model.path=tiny:ssd1b", f"data.resolution={SIZE}", f"data.min_size={SIZE}", "data.bucket_step=32",
            f"cache.dir={cache}", "train.lr=1e-3", f"output.dir={out}", "logging.tensorboard=false", *extra]
    args = ["train", str(config), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    return args


def _run(config: Path, out: Path, cache: Path, *extra: str) -> dict:
    assert main(_args(config, out, cache, *extra)) == 0
    return json.loads((out / "run.json").read_text())


def _datasets(*tables: str) -> str:
    return "".join(f"[[data.datasets]]\n{t}\n" for t in tables)


# ---- sampling (no model) ---------------------------------------------------------------------

def _data(tmp_path: Path, body: str, seed: int = 0) -> TrainingData:
    import tomllib

    cfg = RunConfig.model_validate({**tomllib.loads(body), "train": {"seed": seed}})
    records = make_records(scan_datasets(cfg), seed)
    return TrainingData(None, None, records, CacheConfig(), None, torch.device("cpu"), seed=seed)


def test_an_epoch_follows_the_repeats_and_weights_exactly(tmp_path):
    a, b, c = (_images(tmp_path / n, k, i) for i, (n, k) in enumerate((("a", 3), ("b", 2), ("c", 4))))
    data = _data(tmp_path, f'[data]\nmin_size = {SIZE}\nresolution = {SIZE}\nbucket_step = 32\n' + _datasets(
        f'path = "{a}"\nrepeats = 3', f'path = "{b}"', f'path = "{c}"\nweight = 0.5'))
    seen: dict[int, dict[str, int]] = {}
    for epoch in range(4):
        draws = [d for batch in data.batches(1, torch.Generator().manual_seed(epoch), True, epoch) for d in batch]
        assert len(draws) == data.epoch_length(epoch, 1) == 9 + 2 + 2
        counts = {i: sum(d.record.dataset == i for d in draws) for i in range(3)}
        assert counts == {0: 9, 1: 2, 2: 2}  # repeats 3, 1, and half of four images
        for d in draws:
            seen.setdefault(d.record.dataset, {}).setdefault(d.item.key, 0)
            seen[d.record.dataset][d.item.key] += 1
    assert set(seen[0].values()) == {12} and set(seen[1].values()) == {4}
    assert set(seen[2].values()) == {2}  # weight 0.5: every image of c every other epoch, in turn


def test_dropout_rate_shuffles_and_flips_over_many_draws(tmp_path):
    root = _square(tmp_path / "a", 4, 0)
    data = _data(tmp_path, f'[data]\nmin_size = {SIZE}\nresolution = {SIZE}\n' + _datasets(
        f'path = "{root}"\ncaption_dropout = 0.3\nshuffle_tags = true\nkeep_tokens = 2\ncaption_variants = 5\n'
        'flip = true'))
    draws = [d for e in range(300) for b in data.batches(2, torch.Generator().manual_seed(e), True, e) for d in b]
    dropped = sum(d.variant < 0 for d in draws) / len(draws)
    assert abs(dropped - 0.3) < 0.05, dropped  # 1200 draws: the standard error is 0.013
    assert abs(sum(d.flipped for d in draws) / len(draws) - 0.5) < 0.05
    for r in data.records:
        assert len(r.captions) == 5 and r.captions[0] == ", ".join(TAGS)  # the caption as written first
        for caption in r.captions:
            tags = caption.split(", ")
            assert tags[:2] == TAGS[:2] and sorted(tags) == sorted(TAGS)  # the kept tokens stay in front
    used = {d.caption for d in draws}
    assert "" in used and len(used) == 1 + len({c for r in data.records for c in r.captions})


def test_draws_are_the_same_for_the_same_epoch_and_seed(tmp_path):
    root = _square(tmp_path / "a", 4, 0)
    body = f'[data]\nmin_size = {SIZE}\nresolution = {SIZE}\ncaption_dropout = 0.5\nflip = true\npath = "{root}"\n'

    def epoch(data, e):
        return [(d.item.key, d.variant, d.flipped) for b in data.batches(1, torch.Generator().manual_seed(e), True, e)
                for d in b]

    one, two = _data(tmp_path, body), _data(tmp_path, body)
    assert epoch(one, 3) == epoch(two, 3) and epoch(one, 3) != epoch(one, 4)
    assert epoch(one, 3) != epoch(_data(tmp_path, body, seed=1), 3)


# ---- through the CLI ---------------------------------------------------------------------------

def test_two_datasets_train_their_repeats_in_an_epoch_and_epochs_derive_the_steps(tmp_path, cache_root):
    a, b = _images(tmp_path / "a", 3, 0), _images(tmp_path / "b", 2, 1)
    config = _config(tmp_path, _datasets(f'path = "{a}"\nrepeats = 3', f'name = "bee"\npath = "{b}"'))
    out = tmp_path / "run"
    run = _run(config, out, cache_root / "two", "train.epochs=2", "train.grad_accum=2", "save.every_epochs=1")
    assert run["end_step"] == 11  # 2 epochs of 9 + 2 micro-batches, 2 a step
    names = [d["name"] for d in run["datasets"]]
    assert names == ["a", "bee"] and [d["images"] for d in run["datasets"]] == [3, 2]
    # 22 micro-batches of one image: each dataset's images times its repeats, twice
    assert [d["images_trained"] for d in run["datasets"]] == [18, 4]
    # epoch 1 ends at micro-batch 11, inside step 6: the checkpoint of every epoch is written there
    assert (out / "model-step000006.safetensors").is_file()
    assert "steps" not in (out / "config.toml").read_text().split("[train]")[1].split("[")[0]


def test_caption_variants_and_dropout_are_cached_once_and_reused(tmp_path, cache_root, monkeypatch):
    root = _square(tmp_path / "a", 3, 0)
    config = _config(tmp_path, _datasets(f'path = "{root}"\nshuffle_tags = true\ncaption_variants = 3\n'
                                         'caption_dropout = 0.5'))
    first = _run(config, tmp_path / "one", cache_root / "variants", "train.steps=3")["cache"]
    # each image: its caption as written (one entry for all three: the same text) and two shuffles;
    # and the empty caption
    assert first["text_cached"] == 1 + 3 * 2 + 1
    assert first["text_entries"] == 8 and first["text_bytes"] > 0
    family = detect_family(resolve_source(ModelConfig(path="tiny:ssd1b")), "auto")
    calls = []
    monkeypatch.setattr(type(family), "encode_text", lambda *a, **k: calls.append(a) or pytest.fail("encoded"))
    second = _run(config, tmp_path / "two", cache_root / "variants", "train.steps=3")["cache"]
    assert second["text_cached"] == 0 and second["text_reused"] == 8 and not calls


def _masked(tmp_path: Path, half: bool) -> Path:
    folder = tmp_path / ("half" if half else "white")
    folder.mkdir()
    for i in range(2):
        mask = Image.new("L", (SIZE, SIZE), 255)
        if half:
            mask.paste(0, (0, 0, SIZE // 2, SIZE))
        mask.save(folder / f"{i}.png")
    return folder


def test_masks_weight_the_loss(tmp_path, cache_root):
    root = _square(tmp_path / "a", 2, 0)
    cache = cache_root / "masks"

    def loss(*extra: str) -> float:
        body = _datasets(f'path = "{root}"' + "".join(f"\n{e}" for e in extra))
        return _run(_config(tmp_path, body), tmp_path / f"run{len(list(tmp_path.iterdir()))}", cache,
                    "train.steps=1")["losses"][0]

    plain = loss()
    white, half = _masked(tmp_path, False), _masked(tmp_path, True)
    assert loss(f'masks = "{white}"') == plain  # weight one everywhere: the same loss
    assert loss(f'masks = "{half}"', "mask_min_weight = 1.0") == plain
    masked = loss(f'masks = "{half}"')
    assert 0.3 * plain < masked < 0.7 * plain  # half the elements weigh nothing
    assert masked < loss(f'masks = "{half}"', "mask_min_weight = 0.5") < plain


def test_a_mask_that_does_not_match_its_image_skips_it_by_name(tmp_path, cache_root):
    root = _square(tmp_path / "a", 2, 0)
    folder = _masked(tmp_path, False)
    Image.new("L", (SIZE // 2, SIZE), 255).save(folder / "1.png")
    config = _config(tmp_path, _datasets(f'path = "{root}"\nmasks = "{folder}"'))
    run = _run(config, tmp_path / "run", cache_root / "masks", "train.steps=1")
    assert run["items"] == 1
    assert run["skipped"] == [{"path": "1.png", "reason": f"mask {folder / '1.png'} is 32x64, its image 64x64: "
                                                          "make them the same size"}]


def test_flip_caches_the_mirrored_latent_with_mirrored_crop_conditioning(tmp_path, cache_root):
    root = tmp_path / "a"
    root.mkdir()
    gen = torch.Generator().manual_seed(0)
    Image.fromarray(torch.randint(0, 256, (SIZE, SIZE * 3 // 2 + 8, 3), generator=gen,
                                  dtype=torch.uint8).numpy()).save(root / "wide.png")
    (root / "wide.txt").write_text("a wide image")
    cfg = RunConfig.model_validate({"data": {"datasets": [{"path": str(root), "flip": True}], "resolution": SIZE,
                                             "min_size": SIZE, "bucket_step": 32}})
    (record,) = make_records(scan_datasets(cfg), 0)
    source = resolve_source(ModelConfig(path="tiny:ssd1b"))
    family = detect_family(source, "auto")
    bundle = family.load(source)
    plain = encode_item_image(family, bundle, record, CacheConfig(), torch.device("cpu"))
    mirrored = encode_item_image(family, bundle, record, CacheConfig(), torch.device("cpu"), flipped=True)
    top, left = plain["time_ids"][2:4].tolist()
    assert left > 0  # the image is wider than its bucket: a centred crop cuts both sides
    spare = round(record.item.width * record.bucket[1] / record.item.height) - record.bucket[0]
    assert mirrored["time_ids"].tolist() == [*plain["time_ids"][:2].tolist(), top, spare - left,
                                             *plain["time_ids"][4:].tolist()]
    # the mirrored entry is the encoding of the mirrored crop (not the plain latent mirrored)
    from vramfit.data.buckets import fit_to_bucket, image_to_tensor
    from vramfit.data.scan import load_image

    crop = fit_to_bucket(load_image(record.item.path), record.bucket)[0].transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    direct = family.encode_images(bundle, image_to_tensor(crop).unsqueeze(0), torch.device("cpu"), torch.float32,
                                  False)
    assert torch.equal(mirrored["mean"], direct["mean"][0]) and not torch.equal(mirrored["mean"], plain["mean"])
    run = _run(_config(tmp_path, _datasets(f'path = "{root}"\nflip = true')), tmp_path / "run", cache_root / "flip",
               "train.steps=4")
    assert run["cache"]["latents_cached"] + run["cache"]["latents_reused"] == 2  # the image, and mirrored


def test_validation_loss_is_the_same_across_a_resume_and_leaves_training_alone(tmp_path, cache_root):
    a, held = _images(tmp_path / "a", 3, 0), _images(tmp_path / "held", 2, 5)
    train_only = _config(tmp_path, _datasets(f'path = "{a}"'), "plain.toml")
    config = _config(tmp_path, _datasets(f'path = "{a}"', f'path = "{held}"\nvalidation = true'))
    cache = cache_root / "validation"
    whole = _run(config, tmp_path / "whole", cache, "train.steps=4", "validation.every_steps=2")
    assert [v[0] for v in whole["validation"]] == [2, 4]
    assert whole["validation"][0][1] != whole["validation"][1][1]
    assert [d["images_trained"] for d in whole["datasets"]] == [4, 0]  # held-out images never train
    assert _run(train_only, tmp_path / "plain", cache, "train.steps=4")["losses"] == whole["losses"]
    out = tmp_path / "parts"
    _run(config, out, cache, "train.steps=2", "validation.every_steps=2")
    assert main(_args(config, out, cache, "train.steps=4", "validation.every_steps=2") + ["--resume", "latest"]) == 0
    resumed = json.loads((out / "run.json").read_text())
    assert resumed["validation"] == whole["validation"] and resumed["losses"] == whole["losses"]


def test_validation_share_holds_out_the_same_images_every_run(tmp_path):
    root = _images(tmp_path / "a", 16, 0)
    body = f'[data]\nmin_size = {SIZE}\nresolution = {SIZE}\nvalidation_share = 0.25\npath = "{root}"\n'
    held = [r.item.key for r in _data(tmp_path, body).held_out]
    assert held == [r.item.key for r in _data(tmp_path, body, seed=7).held_out]
    assert 1 <= len(held) <= 9  # a quarter of 16, by a hash of each name


@pytest.mark.parametrize("tables, line", [
    (['path = "A"\nrepeats = 0'], "data.datasets[0] ('A').repeats: Input should be greater than or equal to 1"),
    (['path = "A"\nrepeats = -2'], "data.datasets[0] ('A').repeats: Input should be greater than or equal to 1"),
    (['path = "A"\nrepeats = 2\nweight = 0.5'], "data.datasets[0] ('A').weight: given beside repeats"),
    (['path = "A"', 'name = "c"\npath = "A/../A"'], "data.datasets[1] ('c').path: A/../A is the folder of "
                                                   "data.datasets[0]"),
    (['path = "A"', 'path = "x/A"'], "data.datasets: two datasets are named 'A'; give each a distinct name"),
    (['path = "A"', 'name = "b"\npath = "A"'], "data.datasets[1] ('b').path: A is the folder of data.datasets[0]"),
    (['path = "A"\nflip = 1.5'], "data.datasets[0] ('A').flip: Input should be a valid boolean"),
    (['path = "A"\ncaption_dropout = 1'], "data.datasets[0] ('A').caption_dropout: Input should be less than 1"),
    (['path = "A"\nrepats = 2'], "data.datasets[0] ('A').repats: unknown key; did you mean data.datasets[0].repeats?"),
    (['path = "A"\nclass_prompt = "a dog"'], "data.datasets[0] ('A').class_prompt: only for a regularization"),
    (['path = "missing"'], "data.datasets[0] ('missing').path: missing is not there"),
    (['path = "A"\nvalidation = true'], "data.datasets: every dataset is a validation dataset"),
])
def test_bad_datasets_are_refused_naming_the_dataset_and_key(tmp_path, capsys, monkeypatch, tables, line):
    _images(tmp_path / "A", 1, 0)
    monkeypatch.chdir(tmp_path)
    assert main(_args(_config(tmp_path, _datasets(*tables)), tmp_path / "out", tmp_path / "cache")) == 2
    err = capsys.readouterr().err
    assert line in err, err


def test_an_empty_dataset_is_named(tmp_path, cache_root, capsys):
    a = _images(tmp_path / "a", 2, 0)
    (tmp_path / "empty").mkdir()
    config = _config(tmp_path, _datasets(f'path = "{a}"', f'name = "nothing"\npath = "{tmp_path / "empty"}"'))
    assert main(_args(config, tmp_path / "out", cache_root / "empty")) == 2
    assert f"data.datasets[1] ('nothing'): no images found in {tmp_path / 'empty'}" in capsys.readouterr().err


def test_the_short_form_is_one_dataset(tmp_path):
    root = _images(tmp_path / "a", 2, 0)
    cfg = RunConfig.model_validate({"data": {"path": str(root), "flip": True}})
    (only,) = dataset_configs(cfg.data)
    assert only.path == str(root) and only.flip and only.times == 1.0


def test_kohya_toml_and_kohya_folders_give_the_datasets_of_the_same_vramfit_config(tmp_path, cache_root):
    train, reg = tmp_path / "train", tmp_path / "reg"
    _images(train / "3_sks dog", 2, 0)
    (train / "3_sks dog" / "0000.txt").unlink()  # takes the class tokens "sks dog"
    _images(reg / "1_dog", 2, 4, captions=False)
    (tmp_path / "kohya.toml").write_text(
        "[general]\nshuffle_caption = true\nkeep_tokens = 1\nflip_aug = true\n\n[[datasets]]\n"
        "[[datasets.subsets]]\nimage_dir = 'train/3_sks dog'\nclass_tokens = 'sks dog'\nnum_repeats = 3\n\n"
        "[[datasets.subsets]]\nimage_dir = 'reg/1_dog'\nclass_tokens = 'dog'\nis_reg = true\nnum_repeats = 1\n")
    vramfit = _config(tmp_path, "[data]\nshuffle_tags = true\nkeep_tokens = 1\nflip = true\n" + _datasets(
        f'path = "{train / "3_sks dog"}"\nrepeats = 3\ndefault_caption = "sks dog"',
        f'path = "{reg / "1_dog"}"\nrepeats = 1\ndefault_caption = "dog"\nregularization = true'))
    folders = _config(tmp_path, f'[data]\nkohya = "{train}"\nkohya_reg = "{reg}"\nshuffle_tags = true\n'
                                'keep_tokens = 1\nflip = true\n', "folders.toml")
    toml = _config(tmp_path, f'[data]\nkohya = "{tmp_path / "kohya.toml"}"\n', "from-toml.toml")
    import tomllib

    def resolved(path: Path) -> list[dict]:
        cfg = RunConfig.model_validate(tomllib.loads(path.read_text()))
        return [d.model_dump(exclude={"name"}) for d in dataset_configs(cfg.data)]

    assert resolved(folders) == resolved(vramfit) == resolved(toml)
    runs = [_run(c, tmp_path / c.stem, cache_root / "kohya", "train.steps=3") for c in (vramfit, folders, toml)]
    assert runs[0]["losses"] == runs[1]["losses"] == runs[2]["losses"]
    assert [d["regularization"] for d in runs[0]["datasets"]] == [False, True]


def test_a_kohya_config_vramfit_cannot_follow_is_one_error(tmp_path, capsys):
    _images(tmp_path / "img", 1, 0)
    (tmp_path / "kohya.toml").write_text("[general]\ncolor_aug = true\n[[datasets]]\n[[datasets.subsets]]\n"
                                         f"image_dir = '{tmp_path / 'img'}'\nnum_repeat = 2\n")
    config = _config(tmp_path, f'[data]\nkohya = "{tmp_path / "kohya.toml"}"\n')
    assert main(_args(config, tmp_path / "out", tmp_path / "cache")) == 2
    err = capsys.readouterr().err
    assert "color_aug" in err and "num_repeat" in err and "did you mean" in err and "Traceback" not in err


def test_a_regularization_dataset_pairs_each_batch_with_class_images(tmp_path, cache_root):
    a, reg = _images(tmp_path / "a", 2, 0), _images(tmp_path / "reg", 3, 2, captions=False)
    config = _config(tmp_path, _datasets(f'path = "{a}"', f'path = "{reg}"\nregularization = true\n'
                                                          'class_prompt = "a picture"'))
    run = _run(config, tmp_path / "run", cache_root / "reg", "train.steps=4")
    trained = {d["name"]: d["images_trained"] for d in run["datasets"]}
    assert trained["a"] == 4 and 0 < trained["reg"] <= 4  # a class image of the same bucket, where there is one


def test_sd3_trains_two_datasets_with_flips_masks_dropout_validation_and_epoch_samples(tmp_path, cache_root):
    """Every part of the data pipeline on the other family (a flow-matching MMDiT, 16-channel latents)."""
    a, b, held = _square(tmp_path / "a", 2, 0), _images(tmp_path / "b", 2, 1), _images(tmp_path / "held", 1, 3)
    config = _config(tmp_path, "[sample]\nprompts = [\"a red circle\"]\nevery_epochs = 1\nsteps = 2\n" + _datasets(
        f'path = "{a}"\nrepeats = 2\nmasks = "{_masked(tmp_path, True)}"\nmask_min_weight = 0.2',
        f'path = "{b}"\nflip = true\ncaption_dropout = 0.5\nshuffle_tags = true',
        f'path = "{held}"\nvalidation = true'))
    out = tmp_path / "run"
    run = _run(config, out, cache_root / "sd3", "model.path=tiny:sd3", "train.epochs=1", "train.batch_size=2")
    assert [d["images_trained"] for d in run["datasets"]] == [4, 2, 0]
    assert run["end_step"] == len(run["losses"]) >= 3 and [v[0] for v in run["validation"]] == [run["end_step"]]
    assert run["cache"]["latents_cached"] == 2 + 2 * 2 + 1  # b's mirrored latents too
    assert all(torch.isfinite(torch.tensor(run["losses"])))
    assert len(run["samples"]) == 1  # the end of the run (its one epoch ends there)


@pytest.mark.gpu
@pytest.mark.parametrize("memory", [["memory.stream_weights=true", "train.optimizer_in_backward=true"],
                                    ["memory.offload_activations=true"], ["train.cuda_graphs=true"]])
def test_the_validation_loss_on_a_gpu_is_the_same_beside_each_memory_setting(tmp_path, cache_root, memory):
    """The validation forward runs eagerly between steps, beside streamed weights, offloaded
    activations or CUDA graph recordings; its values match a run without them."""
    a, held = _images(tmp_path / "a", 3, 0), _images(tmp_path / "held", 2, 5)
    config = _config(tmp_path, _datasets(f'path = "{a}"', f'path = "{held}"\nvalidation = true'))
    sets = ["train.device=cuda", "train.steps=4", "validation.every_steps=2", "train.precision=fp32",
            "train.max_grad_norm=0"]  # the step in backward clips per tensor: no clipping, the same steps
    plain = _run(config, tmp_path / "plain", cache_root / "gpu-validation", *sets, "train.cuda_graphs=false")
    other = _run(config, tmp_path / "other", cache_root / "gpu-validation", *sets, *memory)
    assert [v[0] for v in other["validation"]] == [2, 4]
    for (_, x), (_, y) in zip(plain["validation"], other["validation"]):
        assert abs(x - y) <= 1e-3 * abs(x), (plain["validation"], other["validation"])


def test_captions_over_an_encoders_limit_are_named_with_the_limit(tmp_path, cache_root, caplog):
    root = _square(tmp_path / "a", 2, 0)
    (root / "1.txt").write_text(", ".join(f"tag{i}" for i in range(60)))  # about 180 CLIP tokens
    with caplog.at_level("WARNING", logger="vramfit"):
        run = _run(_config(tmp_path, _datasets(f'path = "{root}"')), tmp_path / "run", cache_root / "long",
                   "train.steps=1")
    assert run["cache"]["captions_truncated"] == 1
    assert "caption of 1.png is" in caplog.text and "the text encoder keeps the first 77" in caplog.text


def test_the_short_forms_missing_folder_and_metadata_are_named_once(tmp_path, capsys):
    (tmp_path / "imgs").mkdir()
    for path, expected in (("nowhere", ["data.path: ", "data.metadata: "]), ("imgs", ["data.metadata: "])):
        assert main(["train", "--set", f"data.path={tmp_path / path}", "--set", "data.metadata=meta.jsonl",
                     "--set", f"cache.dir={tmp_path / 'cache'}", "--set", f"output.dir={tmp_path / 'out'}"]) == 2
        lines = [line.strip() for line in capsys.readouterr().err.splitlines() if line.strip().startswith("- ")]
        assert [line[2:].split(" ")[0] + " " for line in lines] == expected, lines


def test_the_same_image_in_two_datasets_is_one_latent_entry(tmp_path, cache_root):
    a = _square(tmp_path / "a", 2, 0)
    b = _square(tmp_path / "b", 2, 0, caption="another caption")  # the same pixels, captioned otherwise
    run = _run(_config(tmp_path, _datasets(f'path = "{a}"', f'path = "{b}"')), tmp_path / "run",
               cache_root / "shared-images", "train.steps=1")
    assert run["cache"]["latents_cached"] == 2 and run["cache"]["latents_entries"] == 2
    assert run["cache"]["text_cached"] == 2  # two captions
