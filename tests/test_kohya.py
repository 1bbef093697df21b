"""Tests for vramfit.data.kohya: kohya dataset config TOMLs and kohya-named folders as vramfit datasets."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from vramfit.config.schema import DatasetConfig
from vramfit.data.kohya import KohyaImportError, kohya_datasets


def _folders(root: Path, *names: str) -> None:
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)


def _problems(source: Path, reg: Path | None = None) -> list[str]:
    with pytest.raises(KohyaImportError) as info:
        kohya_datasets(source, reg)
    for p in info.value.problems:  # the message lists every problem, each naming its file
        assert p in str(info.value)
    return info.value.problems


REALISTIC = """
[general]
shuffle_caption = true
caption_extension = '.txt'
keep_tokens = 1
batch_size = 4
color_aug = false            # kohya's defaults: accepted
token_warmup_min = 1
min_bucket_reso = 256
resize_interpolation = "lanczos"
enable_bucket = true

# a DreamBooth dataset
[[datasets]]
resolution = 1024
keep_tokens = 2
validation_split = 0.1

  [[datasets.subsets]]
  image_dir = 'hoge'
  class_tokens = 'hoge girl'
  num_repeats = 10

  [[datasets.subsets]]
  image_dir = 'fuga'
  class_tokens = 'fuga boy'
  keep_tokens = 3
  flip_aug = true
  caption_dropout_rate = 0.05

  [[datasets.subsets]]
  is_reg = true
  image_dir = 'reg'
  class_tokens = 'human'

# a fine-tuning dataset (metadata) and a masked-loss subset
[[datasets]]
resolution = [768, 768]
bucket_reso_steps = 32
caption_separator = ";"

  [[datasets.subsets]]
  image_dir = 'piyo'
  metadata_file = 'piyo/meta.json'
  alpha_mask = true

[[datasets]]
  [[datasets.subsets]]
  image_dir = 'masked'
  conditioning_data_dir = 'masked_masks'
  random_crop = true
"""


def test_toml_flattens_general_dataset_subset_inheritance(tmp_path):
    _folders(tmp_path, "hoge", "fuga", "reg", "piyo", "masked", "masked_masks")
    (tmp_path / "piyo" / "meta.json").write_text("{}")
    (tmp_path / "dataset.toml").write_text(REALISTIC)
    got = kohya_datasets(tmp_path / "dataset.toml")
    t = str(tmp_path)
    common = {"shuffle_tags": True, "caption_extension": ".txt"}
    assert got.datasets == [
        {**common, "path": f"{t}/hoge", "default_caption": "hoge girl", "repeats": 10, "keep_tokens": 2,
         "resolution": 1024, "validation_share": 0.1},
        {**common, "path": f"{t}/fuga", "default_caption": "fuga boy", "keep_tokens": 3, "flip": True,
         "caption_dropout": 0.05, "resolution": 1024, "validation_share": 0.1},
        # kohya reads a regularization image's caption file too; class_tokens is the fallback. And it
        # holds no regularization image out for validation.
        {**common, "path": f"{t}/reg", "default_caption": "human", "regularization": True, "keep_tokens": 2,
         "resolution": 1024, "validation_share": 0.0},
        # a fine-tuning subset reads no caption_extension (its captions are in the metadata)
        {"path": f"{t}/piyo", "metadata": f"{t}/piyo/meta.json", "alpha_mask": True, "shuffle_tags": True,
         "keep_tokens": 1, "resolution": 768, "bucket_step": 32, "tag_separator": ";"},
        {**common, "path": f"{t}/masked", "masks": f"{t}/masked_masks", "random_crop": True,
         "keep_tokens": 1},
    ]
    for d in got.datasets:
        DatasetConfig(**d)
    assert got.train == {"batch_size": 4}
    assert got.notes == []


def test_toml_lists_every_unknown_and_unsupported_key_in_one_error(tmp_path):
    _folders(tmp_path, "a", "b")
    (tmp_path / "d.toml").write_text("""
[general]
color_aug = true
num_repeat = 3
image_dir = "a"
enable_bucket = false
max_bucket_reso = 2048
resolution = 1024
prior_loss_weight = 1.0

[[datasets]]
resolution = [1024, 768]
  [[datasets.subsets]]
  image_dir = 'a'
  face_crop_aug_range = [2.0, 4.0]
  caption_prefix = "masterpiece, "
  shufle_caption = true
  num_repeats = "10"
  caption_dropout_rate = 1.5
  [[datasets.subsets]]
  image_dir = 'b'
  conditioning_data_dir = 'a'
  class_tokens = "x"
  [[datasets.subsets]]
  image_dir = 'a'
  name = "mine"
""")
    f = tmp_path / "d.toml"
    problems = _problems(f)
    expected = {
        "general.color_aug": "vramfit has no colour augmentation",
        "general.num_repeat": "unknown key (did you mean 'num_repeats'?)",
        "general.image_dir": "kohya reads it only in [[datasets.subsets]]; move it there",
        "general.enable_bucket": "vramfit always buckets",
        "general.max_bucket_reso": "at resolution 1024 these limits allow up to 4:1, so set "
                                   "data.max_aspect = 4",
        "general.prior_loss_weight": "set prior.loss_weight in the vramfit config",
        "datasets[0].resolution": "use resolution = 896",
        "datasets[0].subsets[0].face_crop_aug_range": "vramfit has no face-centred crop augmentation",
        "datasets[0].subsets[0].caption_prefix": "vramfit adds no prefix to captions",
        "datasets[0].subsets[0].shufle_caption": "did you mean 'shuffle_caption'?",
        "datasets[0].subsets[0].num_repeats": "'10' is not an integer",
        "datasets[0].subsets[0].caption_dropout_rate": "1.5: input should be less than 1",
        "datasets[0].subsets[1].class_tokens": "mask subsets (with conditioning_data_dir) take no "
                                               "class_tokens",
        "datasets[0].subsets[2].name": "unknown key",
    }
    for place, text in expected.items():
        assert any(p.startswith(f"{f}: {place}: ") and text in p for p in problems), (place, problems)
    assert len(problems) == len(expected), problems


def test_toml_relative_paths_beside_the_config_then_the_current_directory(tmp_path, monkeypatch):
    conf, cwd = tmp_path / "conf", tmp_path / "work"
    _folders(conf, "both")
    _folders(cwd, "both", "only_cwd", "meta")
    (cwd / "meta" / "m.json").write_text("{}")
    (conf / "d.toml").write_text("""
[[datasets]]
  [[datasets.subsets]]
  image_dir = 'both'
  [[datasets.subsets]]
  image_dir = 'only_cwd'
  [[datasets.subsets]]
  image_dir = 'only_cwd'
  metadata_file = 'meta/m.json'
""")
    monkeypatch.chdir(cwd)
    got = kohya_datasets(Path("../conf/d.toml"))
    assert [d["path"] for d in got.datasets] == [str(conf / "both"), str(cwd / "only_cwd")]
    assert got.notes == ["../conf/d.toml: datasets[0].subsets[2]: skipped, its image_dir is the folder of "
                         "datasets[0].subsets[1] (kohya uses only the first)"]
    (conf / "d.toml").write_text("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'nowhere'\n")
    (problem,) = _problems(conf / "d.toml")
    assert "datasets[0].subsets[0].image_dir: 'nowhere' is not there" in problem
    assert str(conf) in problem and str(cwd) in problem


def test_toml_batch_sizes_must_agree(tmp_path):
    _folders(tmp_path, "a", "b")
    body = "[general]\nbatch_size = 4\n" + "".join(
        f"[[datasets]]\n{size}[[datasets.subsets]]\nimage_dir = '{d}'\n"
        for d, size in (("a", ""), ("b", "batch_size = 2\n")))
    (tmp_path / "d.toml").write_text(body)
    (problem,) = _problems(tmp_path / "d.toml")
    assert "general.batch_size = 4, datasets[1].batch_size = 2" in problem and "train.batch_size" in problem
    # [general]'s value that every dataset overrides is no disagreement
    (tmp_path / "d.toml").write_text(body.replace("[[datasets]]\n[[", "[[datasets]]\nbatch_size = 2\n[[", 1))
    assert kohya_datasets(tmp_path / "d.toml").train == {"batch_size": 2}


def test_folder_naming_train_and_reg(tmp_path):
    train, reg = tmp_path / "train", tmp_path / "reg"
    _folders(train, "10_sks dog", "2_a_b", "3", "misc", ".thumbs")
    _folders(reg, "1_dog", "1_a_b")  # 1_a_b: the name of a train folder too
    (train / "stray.png").write_bytes(b"x")
    (train / "10_sks dog" / "x.caption").write_text("a caption")
    got = kohya_datasets(train, reg)
    assert got.datasets == [
        {"path": str(train / "10_sks dog"), "repeats": 10, "default_caption": "sks dog"},
        {"path": str(train / "2_a_b"), "repeats": 2, "default_caption": "a_b"},
        {"path": str(train / "3"), "repeats": 3},  # kohya: no class tokens
        {"path": str(reg / "1_a_b"), "repeats": 1, "default_caption": "a_b", "regularization": True},
        {"path": str(reg / "1_dog"), "repeats": 1, "default_caption": "dog", "regularization": True},
    ]
    for d in got.datasets:
        DatasetConfig(**d)
    assert got.train == {}
    notes = "\n".join(got.notes)
    assert f"{train / 'misc'}: skipped, not named <repeats>_<class tokens>" in notes
    assert f"{train}: 1 file(s) directly in the train_data_dir are not read" in notes
    assert f"{train / '10_sks dog'}: holds .caption files" in notes
    assert ".thumbs" not in notes and len(got.notes) == 3


def test_folders_sharing_a_name_get_distinct_names(tmp_path):
    _folders(tmp_path, "train/1_dog", "reg/1_dog", "x/img", "y/img", "z/b")
    got = kohya_datasets(tmp_path / "train", tmp_path / "reg")
    assert [d.get("name") for d in got.datasets] == ["train/1_dog", "reg/1_dog"]
    (tmp_path / "d.toml").write_text("[[datasets]]\n" + "".join(
        f"[[datasets.subsets]]\nimage_dir = '{d}'\n" for d in ("x/img", "y/img", "z/b")))
    assert [d.get("name") for d in kohya_datasets(tmp_path / "d.toml").datasets] == ["x/img", "y/img", None]


def test_folder_errors(tmp_path):
    train = tmp_path / "train"
    _folders(train, "0_x", "5_ok", "junk")
    (problem,) = _problems(train)
    assert problem.startswith(f"{train / '0_x'}: 0 repeats train none of its images")
    _folders(tmp_path, "plain", "10_sks dog")
    (tmp_path / "plain" / "a.png").write_bytes(b"x")
    (problem,) = _problems(tmp_path / "plain")
    assert "no subfolder named <repeats>_<class tokens>" in problem and "use data.path" in problem
    (problem,) = _problems(tmp_path / "10_sks dog")
    assert "give the folder that holds it" in problem
    odd = tmp_path / "odd"
    os.makedirs(os.fsencode(odd / "10_caf") + b"\xe9")  # a Latin-1 name: not UTF-8
    (problem,) = _problems(odd)
    assert problem.startswith(f"{odd}{os.sep}10_caf\\xe9: its name is not UTF-8 text")
    problem.encode("utf-8")  # printable: no escaped bytes of the file name left in it
    problems = _problems(tmp_path / "missing", tmp_path / "plain" / "a.png")
    assert problems == [
        f"{tmp_path / 'missing'}: not there (a kohya dataset config .toml or a train_data_dir folder)",
        f"{tmp_path / 'plain' / 'a.png'}: not a folder (a kohya reg_data_dir of <repeats>_<class tokens> "
        "subfolders)"]


@pytest.mark.parametrize("name, content, expected", [
    ("d.json", b"{}", "neither a kohya dataset config (.toml) nor a folder"),
    ("d.toml", b"[general\n", "not valid TOML: Expected ']'"),
    ("d.toml", b"[general]\nclass_tokens = 'caf\xe9'\n", "not UTF-8 text"),
    ("d.toml", b"[datasets]\nresolution = 512\n", "datasets: must be tables: write [[datasets]]"),
    ("d.toml", b"[[datasets]]\n[datasets.subsets]\nimage_dir = 'a'\n",
     "must be tables: write [[datasets.subsets]]"),
    ("d.toml", b"[general]\n", "no [[datasets]] table"),
])
def test_bad_files_name_the_file(tmp_path, name, content, expected):
    (tmp_path / name).write_bytes(content)
    (problem,) = _problems(tmp_path / name)
    assert problem.startswith(f"{tmp_path / name}: ") and expected in problem


def test_toml_with_a_byte_order_mark_reads(tmp_path):
    _folders(tmp_path, "a")
    (tmp_path / "d.toml").write_bytes(b"\xef\xbb\xbf[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'a'\n")
    assert kohya_datasets(tmp_path / "d.toml").datasets == [{"path": str(tmp_path / "a")}]


def test_zero_repeats_in_toml_is_an_error(tmp_path):
    _folders(tmp_path, "a")
    (tmp_path / "d.toml").write_text("[[datasets]]\nnum_repeats = 0\n[[datasets.subsets]]\nimage_dir = 'a'\n")
    (problem,) = _problems(tmp_path / "d.toml")
    assert "datasets[0].num_repeats: 0 repeats train none of the images" in problem
