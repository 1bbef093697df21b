"""Image generation: tiny SDXL, SSD-1B and SD3 pipelines, seeds, LoRAs, compare grids, the CLI body."""
from __future__ import annotations

import argparse
import copy
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from conftest import train_args
from vramfit.cli import main
from vramfit.config.schema import ModelConfig
from vramfit.data.synth import make_synthetic_dataset
from vramfit.generate import (
    GenerateError, add_generate_parser, build_pipeline, compare_grid, generate, load_loras, parse_lora,
    read_lora, run_generate, sample_grid, unload_loras,
)
from vramfit.models.adapter import Source
from vramfit.models.registry import detect_family
from vramfit.models.sources import find_tokenizers, resolve_source, write_tokenizers

SIZE = 64
STEPS = 2
MODELS = ("tiny:sdxl", "tiny:ssd1b", "tiny:sd3")
FAST = dict(steps=STEPS, width=SIZE, height=SIZE, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny models gain nothing from a second thread, and on a busy two-core machine OpenMP's
    # spin-waits slow them many times over; restored for the tests after this file.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("generate-cache")


@pytest.fixture(scope="module")
def bundles(module_cache):
    loaded = {}

    def get(name: str):
        if name not in loaded:
            source = resolve_source(ModelConfig(path=name), module_cache)
            loaded[name] = detect_family(source).load(source)
        return loaded[name]
    return get


@pytest.fixture(scope="module")
def pipes(bundles):
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = build_pipeline(bundles(name))
            made[name].set_progress_bar_config(disable=True)
        return made[name]
    return get


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def same(a, b) -> bool:
    return np.array_equal(pixels(a), pixels(b))


def within_one_level(a, b) -> bool:
    return int(np.abs(pixels(a).astype(int) - pixels(b).astype(int)).max()) <= 1


def make_lora(bundle, path: Path, seed: int, *, rank: int = 4, kohya: bool = False,
              model_out: list | None = None) -> Path:
    """A LoRA on a copy of the denoiser with random non-zero lora_B, saved as diffusers reads it.

    With `model_out`, the adapted copy of the denoiser is appended to it (the in-process reference).
    """
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = copy.deepcopy(bundle.denoiser)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                 init_lora_weights=True))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # lora_A stays as peft initialised it; lora_B (zero at init) gets random values, large
        # enough that two steps on a tiny model visibly change the pixels.
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state)
    assert all(v.abs().sum() > 0 for v in state.values())
    if model_out is not None:
        model_out.append(model.eval())
    prefix = "transformer." if bundle.family == "sd3" else "unet."
    if kohya:
        assert bundle.family == "sdxl"
        out = {}
        for k, v in state.items():
            module, kind = k.rsplit(".lora_", 1)
            base = "lora_unet_" + module.replace(".", "_")
            out[f"{base}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = v
            out[f"{base}.alpha"] = torch.tensor(float(rank))
        state = out
    else:
        state = {prefix + k: v for k, v in state.items()}
    save_file(state, str(path))
    return path


def test_size_count_and_seeds(pipes):
    for name in MODELS:
        pipe = pipes(name)
        images = generate(pipe, ["a red circle", "a blue square"], seed=7, count=2, loras=[], **FAST)
        assert len(images) == 4, name
        assert all(im.size == (SIZE, SIZE) for im in images), name
        again = generate(pipe, ["a blue square"], seed=9, count=1, loras=[], **FAST)
        # image 3 of the first call is prompt 1 with seed 7 + 3 - 1 = 9: the same pixels exactly
        assert same(images[2], again[0]), name
        assert not same(images[2], images[3]), f"{name}: different seeds gave the same image"
        assert not same(images[0], images[1]), name


def test_seed_gives_the_same_start_in_every_dtype(bundles):
    # The starting noise is drawn in float32 and cast: bfloat16 renders the float32 image up to
    # rounding, not a different one (a separate copy, so the shared pipelines stay float32).
    pipe = build_pipeline(copy.deepcopy(bundles("tiny:sd3")))
    pipe.set_progress_bar_config(disable=True)
    (full,) = generate(pipe, ["a red circle"], seed=3, loras=[], **FAST)
    (half,) = generate(pipe, ["a red circle"], seed=3, loras=[], **{**FAST, "dtype": torch.bfloat16})
    (other,) = generate(pipe, ["a red circle"], seed=4, loras=[], **{**FAST, "dtype": torch.bfloat16})
    diff = lambda a, b: np.abs(pixels(a) - pixels(b)).mean()  # noqa: E731
    assert diff(full, half) < 5 < diff(full, other)


def test_non_square_and_bad_sizes(pipes):
    pipe = pipes("tiny:sd3")
    (image,) = generate(pipe, ["a cat"], seed=1, count=1, loras=[], **{**FAST, "width": 96})
    assert image.size == (96, SIZE)
    with pytest.raises(ValueError, match="multiples of 16"):
        generate(pipe, ["a cat"], loras=[], **{**FAST, "width": 72})
    with pytest.raises(ValueError, match="prompt"):
        generate(pipe, [], loras=[], **FAST)


@pytest.mark.parametrize("name", MODELS)
def test_lora_changes_image_and_scale_zero_is_base(name, pipes, bundles, tmp_path):
    pipe = pipes(name)
    lora = make_lora(bundles(name), tmp_path / "a.safetensors", seed=1)
    (base,) = generate(pipe, ["a green circle"], seed=3, loras=[], **FAST)
    (tuned,) = generate(pipe, ["a green circle"], seed=3, loras=[(lora, 1.0)], **FAST)
    (zero,) = generate(pipe, ["a green circle"], seed=3, loras=[(lora, 0.0)], **FAST)
    assert not same(base, tuned), "the LoRA did not change the image"
    # The denoiser's output at scale 0 is bitwise the base's (tests/test_lora_formats.py); over a
    # whole sampling loop on CPU a kernel may still round one last bit differently once the
    # adapter's tensors are allocated, so the image is held to one 8-bit level.
    assert within_one_level(base, zero), "a LoRA at scale 0 must give the base image"
    # generate removes its adapters again: the pipeline renders the base model afterwards
    assert not any(pipe.get_list_adapters().values())
    (after,) = generate(pipe, ["a green circle"], seed=3, loras=[], **FAST)
    assert within_one_level(base, after)


@pytest.mark.parametrize("name", MODELS)
def test_lora_file_renders_as_the_adapter_in_memory(name, pipes, bundles, tmp_path):
    # The file, read back by diffusers, gives exactly the image of the peft adapter it was saved
    # from (same keys, same alpha/rank scaling): what training holds is what generate shows.
    import dataclasses

    models: list = []
    lora = make_lora(bundles(name), tmp_path / "a.safetensors", seed=8, model_out=models)
    reference = build_pipeline(dataclasses.replace(bundles(name), denoiser=models[0]))
    reference.set_progress_bar_config(disable=True)
    (expected,) = generate(reference, ["a red square"], seed=1, loras=[], **FAST)
    (loaded,) = generate(pipes(name), ["a red square"], seed=1, loras=[(lora, 1.0)], **FAST)
    assert same(loaded, expected)


@pytest.mark.parametrize("name", ["tiny:ssd1b", "tiny:sd3"])
def test_two_loras_each_at_its_own_scale(name, pipes, bundles, tmp_path):
    pipe = pipes(name)
    a = make_lora(bundles(name), tmp_path / "a.safetensors", seed=1)
    b = make_lora(bundles(name), tmp_path / "b.safetensors", seed=2, rank=2)
    run = lambda loras: generate(pipe, ["a photo"], seed=5, loras=loras, **FAST)[0]  # noqa: E731
    only_a = run([(a, 1.0)])
    assert same(run([(a, 1.0), (b, 0.0)]), only_a), "b at scale 0 must leave a's image exactly"
    both = run([(a, 1.0), (b, 0.7)])
    assert not same(both, only_a), "the second LoRA had no effect"
    assert not same(both, run([(a, 1.0), (b, 0.3)])), "the second LoRA's scale had no effect"


def test_kohya_lora_loads(pipes, bundles, tmp_path):
    pipe = pipes("tiny:sdxl")
    lora = make_lora(bundles("tiny:sdxl"), tmp_path / "kohya.safetensors", seed=4, kohya=True)
    (base,) = generate(pipe, ["a cat"], seed=2, loras=[], **FAST)
    (tuned,) = generate(pipe, ["a cat"], seed=2, loras=[(lora, 1.0)], **FAST)
    assert not same(base, tuned)


def test_lora_of_another_family_is_refused(pipes, bundles, tmp_path):
    lora = make_lora(bundles("tiny:sd3"), tmp_path / "sd3.safetensors", seed=1)
    pipe = pipes("tiny:sdxl")
    with pytest.raises(ValueError, match="sd3.safetensors"):
        generate(pipe, ["a cat"], seed=2, loras=[(lora, 1.0)], **FAST)
    assert not any(pipe.get_list_adapters().values())
    with pytest.raises(FileNotFoundError):
        generate(pipe, ["a cat"], loras=[(tmp_path / "missing.safetensors", 1.0)], **FAST)


def test_lora_for_another_layout_of_the_family_warns(pipes, bundles, tmp_path, caplog):
    # tiny:sdxl's UNet has a mid-block attention (2 blocks x 2 attentions x q, k, v, out: 16
    # layers) that tiny:ssd1b's has not: diffusers leaves those out without a word
    pipe = pipes("tiny:ssd1b")
    own = make_lora(bundles("tiny:ssd1b"), tmp_path / "own.safetensors", seed=1)
    sdxl = make_lora(bundles("tiny:sdxl"), tmp_path / "sdxl.safetensors", seed=1)
    kohya = make_lora(bundles("tiny:sdxl"), tmp_path / "kohya.safetensors", seed=1, kohya=True)
    for lora, warned in ((own, False), (sdxl, True), (kohya, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vramfit.generate"):
            names = load_loras(pipe, [(lora, 1.0)])
        unload_loras(pipe, names)
        text = " ".join(r.getMessage() for r in caplog.records if r.name == "vramfit.generate")
        assert bool(text) == warned, (lora.name, text)
        if warned:
            assert f"--lora {lora}: 16 of its 136 layers are not in this sdxl model" in text
            assert ("mid_block.attentions.0.transformer_blocks.0.attn1.to_k" in text
                    or "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_k" in text), text
            assert "and 13 more" in text
    assert not any(pipe.get_list_adapters().values())


def test_broken_lora_files_are_refused_and_removed(pipes, bundles, tmp_path):
    pipe = pipes("tiny:sdxl")
    good = make_lora(bundles("tiny:sdxl"), tmp_path / "good.safetensors", seed=1)
    state = load_file(str(good))
    key = sorted(k for k in state if ".lora_A." in k)[-1]
    state[key] = torch.randn(state[key].shape[0], state[key].shape[1] + 3)  # wrong in_features
    save_file(state, str(tmp_path / "shapes.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    for name in ("shapes", "junk"):
        with pytest.raises(ValueError, match=f"{name}.safetensors"):
            generate(pipe, ["a cat"], loras=[(good, 1.0), (tmp_path / f"{name}.safetensors", 1.0)], **FAST)
        assert not any(pipe.get_list_adapters().values()), "a failed load leaves no adapter behind"


def test_compare_grid_layout():
    base = [Image.new("RGB", (32, 48), (255, 0, 0)) for _ in range(3)]
    tuned = [Image.new("RGB", (32, 48), (0, 0, 255)) for _ in range(3)]
    grid = compare_grid(base, tuned)
    assert grid.size == (3 * 32, 2 * 48)
    assert grid.getpixel((31 + 32, 47)) == (255, 0, 0) and grid.getpixel((31 + 64, 48 + 47)) == (0, 0, 255)
    assert grid.getpixel((1, 1)) != (255, 0, 0), "the row label is drawn in the corner"
    assert base[0].getpixel((1, 1)) == (255, 0, 0), "the input images are not drawn on"
    with pytest.raises(ValueError):
        compare_grid(base, tuned[:2])


def test_sample_grid_restores_training_model(pipes):
    pipe = pipes("tiny:ssd1b")
    pipe.unet.train()
    grid = sample_grid(pipe, ["a red circle", "a cat"], [11, 12, 13], steps=STEPS, width=SIZE, height=SIZE,
                       device="cpu")
    assert grid.size == (3 * SIZE, 2 * SIZE)
    assert pipe.unet.training, "the denoiser's train mode is restored"
    pipe.unet.eval()
    again = sample_grid(pipe, ["a red circle", "a cat"], [11, 12, 13], steps=STEPS, width=SIZE,
                        height=SIZE, labels=False)
    (image,) = generate(pipe, ["a cat"], seed=12, loras=[], **FAST)
    assert same(again.crop((SIZE, SIZE, 2 * SIZE, 2 * SIZE)), image), "grid cell = the same seed's image"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vramfit")
    add_generate_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["generate", *argv])


def test_parse_lora(tmp_path):
    assert parse_lora("x.safetensors") == (Path("x.safetensors"), 1.0)
    assert parse_lora("dir/x.safetensors:0.5") == (Path("dir/x.safetensors"), 0.5)
    odd = tmp_path / "a:b.safetensors"
    odd.write_bytes(b"")
    assert parse_lora(str(odd)) == (odd, 1.0)
    assert parse_lora(f"{odd}:2") == (odd, 2.0)


def test_cli_writes_pngs_and_compare_grid(bundles, module_cache, tmp_path, capsys):
    lora = make_lora(bundles("tiny:sd3"), tmp_path / "style.safetensors", seed=6)
    out = tmp_path / "out"
    args = parse(["--model", "tiny:sd3", "--prompt", "a cat called Lily, sat on a mat", "--prompt", "a dog",
                  "--count", "2", "--seed", "40", "--steps", str(STEPS), "--width", str(SIZE),
                  "--height", str(SIZE), "--lora", f"{lora}:0.8", "--compare", "--out", str(out),
                  "--cache-dir", str(module_cache), "--no-progress"])
    assert args.func is run_generate and args.lora == [(lora, 0.8)]
    assert run_generate(args) == 0
    printed = capsys.readouterr().out.split()
    expected = [out / f"{i}-{40 + i}.png" for i in range(4)] + [out / "compare.png"]
    assert printed == [str(p) for p in expected]
    for p in expected[:4]:
        with Image.open(p) as im:
            assert im.size == (SIZE, SIZE)
            assert im.text["seed"] == p.stem.split("-")[1]
    with Image.open(out / "compare.png") as grid:
        assert grid.size == (4 * SIZE, 2 * SIZE)  # count x prompts columns, base and fine-tuned rows
        grid = grid.convert("RGB")
        # the fine-tuned row holds the written images; the base row differs from them
        with Image.open(expected[1]) as second:
            assert same(grid.crop((SIZE, SIZE, 2 * SIZE, 2 * SIZE)), second)
            assert not same(grid.crop((SIZE, 0, 2 * SIZE, SIZE)), second)


def test_cli_plain_run_and_errors(module_cache, tmp_path, capsys):
    out = tmp_path / "plain"
    args = parse(["--model", "tiny:ssd1b", "--prompt", "a square", "--steps", str(STEPS),
                  "--width", str(SIZE), "--height", str(SIZE), "--seed", "3", "--out", str(out),
                  "--cache-dir", str(module_cache), "--no-progress"])
    assert run_generate(args) == 0
    assert capsys.readouterr().out.split() == [str(out / "0-3.png")]
    assert sorted(p.name for p in out.iterdir()) == ["0-3.png"]
    with pytest.raises(ValueError, match="--compare"):
        run_generate(parse(["--model", "tiny:ssd1b", "--prompt", "x", "--compare", "--cache-dir",
                            str(module_cache)]))
    with pytest.raises(SystemExit):
        parse(["--model", "tiny:ssd1b", "--prompt", "x", "--lora", str(tmp_path / "missing.safetensors")])


def test_cli_t5_precision(module_cache, tmp_path, capsys):
    """--t5 int8 stays close to the T5 as loaded; --t5 none (zero T5 tokens) renders differently."""
    def render(mode: str) -> np.ndarray:
        out = tmp_path / mode
        assert run_generate(parse(["--model", "tiny:sd3", "--prompt", "a cat called Lily",
                                   "--steps", str(STEPS), "--width", str(SIZE), "--height", str(SIZE),
                                   "--t5", mode, "--out", str(out),
                                   "--cache-dir", str(module_cache), "--no-progress"])) == 0
        with Image.open(out / "0-0.png") as im:
            return pixels(im)

    full, int8, none = render("bf16"), render("int8"), render("none")
    assert np.abs(full.astype(int) - int8.astype(int)).mean() < 2.0  # of 255 levels
    assert not np.array_equal(full, none)
    capsys.readouterr()


def test_casting_keeps_quantized_storage():
    """Casting a pipeline's models to bf16 keeps float8 buffers and torchao-quantized weights as
    they are (Module.to(dtype) would widen them back to full size)."""
    from vramfit.generate import cast_floating
    from vramfit.memory.accounting import tensor_bytes
    from vramfit.memory.quantize import quantize_encoder

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model.register_buffer("stored", torch.ones(8).to(torch.float8_e4m3fn))
    quantize_encoder(model, "int8")
    before = sum(tensor_bytes(p) for p in model.parameters())
    cast_floating(model, torch.bfloat16)
    assert model.stored.dtype == torch.float8_e4m3fn
    assert sum(tensor_bytes(p) for p in model.parameters()) <= before
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if n.endswith("bias"))


# ---- the command, in process (vramfit.cli.main) ------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_root):
    """Full fine-tunes of tiny:ssd1b and tiny:sd3 through `vramfit train`, two steps each with an
    intermediate save; SD3 trains with T5 left out (model.t5_precision=none), which its file keeps."""
    root = tmp_path_factory.mktemp("trained")
    make_synthetic_dataset(root / "images", n=4, size=SIZE, seed=1)
    runs = {"images": root / "images"}
    with pytest.MonkeyPatch.context() as mp:  # the per-test cache isolation does not reach here
        mp.setenv("XDG_CACHE_HOME", str(cache_root / "xdg"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_HOME", str(cache_root / "hf"))
        for name, extra in (("ssd1b", ()), ("sd3", ("model.t5_precision=none",))):
            args = train_args(root / "images", root / name, root / "cache", "save.every_steps=1",
                              "save.name=m", *extra, model=f"tiny:{name}")
            assert main(args) == 0
            runs[name] = root / name
    return runs


def cli(*argv: str) -> int:
    return main(["generate", "--no-progress", *argv])


def size_of(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        return im.size


@pytest.mark.parametrize("name, side", [("ssd1b", 128), ("sd3", 512)])
def test_a_trained_single_file_works_in_every_command_with_no_flags(name, side, trained, tmp_path, capsys):
    run = trained[name]
    # one copy of the tokenizers beside the checkpoints serves the intermediate and the final one;
    # SD3's T5 tokenizer is kept although training left T5 out (the file still holds T5)
    subs = ["tokenizer", "tokenizer_2", *(["tokenizer_3"] if name == "sd3" else [])]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("tokenizer")) == subs
    assert find_tokenizers(run / "m-step000001.safetensors") == run == find_tokenizers(run / "m.safetensors")
    capsys.readouterr()
    assert cli("--model", str(run / "m.safetensors"), "--prompt", "a cat", "--steps", "2",
               "--out", str(tmp_path)) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "0-0.png")]
    # no size flags: the size of the model it was trained from (recorded in the file), not 1024
    assert size_of(tmp_path / "0-0.png") == (side, side)
    assert main(["inspect", str(run / "m.safetensors"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"]["tokenizers"] == str(run)


def test_missing_tokenizers_name_each_commands_setting(trained, tmp_path, capsys):
    alone = tmp_path / "alone" / "m.safetensors"
    alone.parent.mkdir()
    shutil.copy(trained["ssd1b"] / "m.safetensors", alone)
    assert cli("--model", str(alone), "--prompt", "p", "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "--tokenizers" in err and "model.tokenizers" not in err
    assert main(train_args(trained["images"], tmp_path / "run", tmp_path / "cache", model=str(alone))) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "model.tokenizers" in err and "--tokenizers" not in err


def test_tokenizers_of_another_model_are_not_replaced(tmp_path):
    # A folder whose tokenizers differ (another model's checkpoint saved there before) keeps them:
    # the new file gets its own <stem>/ folder, which find_tokenizers reads first.
    def tokenizer_folder(root: Path, text: str) -> Path:
        for sub in ("tokenizer", "tokenizer_2"):
            (root / sub).mkdir(parents=True)
            (root / sub / "vocab.json").write_text(text)
        return root

    source = tokenizer_folder(tmp_path / "source", "new")
    out = tokenizer_folder(tmp_path / "out", "old")
    for name in ("a", "b"):
        ckpt = out / f"{name}.safetensors"
        where = write_tokenizers(Source("single_file", ckpt, source), [], ckpt)
        assert where == out / name == find_tokenizers(ckpt)
        assert (where / "tokenizer_2" / "vocab.json").read_text() == "new"
    assert (out / "tokenizer" / "vocab.json").read_text() == "old"
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no staging folder is left"
    # where the folder holds the same ones, they serve the new file too
    same_out = tokenizer_folder(tmp_path / "same", "new")
    assert write_tokenizers(Source("single_file", same_out / "c.safetensors", source), [],
                            same_out / "c.safetensors") == same_out


def test_size_and_steps_default_to_the_model():
    # the sizes themselves: tiny:ssd1b 128 (test_pickle_lora_...), a tiny:sd3 fine-tune 512
    # (test_a_trained_single_file_...: its transformer takes at most 32x32 patches of 2x2 latents)
    args = parse(["--model", "tiny:ssd1b", "--prompt", "p"])  # steps: the model's, once loaded
    assert (args.steps, args.width, args.height) == (None, None, None)


def test_compare_a_full_fine_tune_with_its_base(trained, pipes, tmp_path, capsys):
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["generate", "--model", str(trained["ssd1b"] / "m.safetensors"), "--base", "tiny:ssd1b",
                 "--compare", "--prompt", "a cat", "--prompt", "a dog", "--seed", "5", "--steps", "2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.split() == [str(out / p) for p in ("0-5.png", "1-6.png", "compare.png")]
    assert "images: 100%|" in printed.err and "4/4" in printed.err, "the bars say what they count"
    # the inner bar is cleared when its image is done, and may not have drawn its last state by then
    assert "denoising steps:" in printed.err and "/2 [" in printed.err and "step/s" in printed.err
    side = 128
    with Image.open(out / "compare.png") as grid:
        assert grid.size == (2 * side, 2 * side)
        assert "tiny:ssd1b" in grid.text["base"]
        grid = grid.convert("RGB")
    (base,) = generate(pipes("tiny:ssd1b"), ["a dog"], seed=6, loras=[],
                       **{**FAST, "width": side, "height": side})
    with Image.open(out / "1-6.png") as tuned:
        assert same(grid.crop((side, side, 2 * side, 2 * side)), tuned), "lower row: --model"
        assert same(grid.crop((side, 0, 2 * side, side)), base), "upper row: --base on the same seed"
        assert not same(base, tuned)


def test_pickle_lora_needs_allow_pickle_and_is_read_weights_only(pipes, bundles, tmp_path, capsys):
    lora = make_lora(bundles("tiny:ssd1b"), tmp_path / "a.safetensors", seed=3)
    torch.save(load_file(str(lora)), tmp_path / "a.bin")

    def run(out: str, *extra: str) -> int:
        return cli("--model", "tiny:ssd1b", "--prompt", "p", "--steps", str(STEPS),
                   "--lora", str(tmp_path / "a.bin"), "--out", str(tmp_path / out), *extra)

    assert run("refused") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --lora: ") and "pickle files can run code" in err
    assert "--allow-pickle" in err
    assert not (tmp_path / "refused").exists(), "refused before anything is loaded or written"
    assert run("allowed", "--allow-pickle") == 0
    # no size flags: tiny:ssd1b's own size (its UNet's sample size 16 x the VAE's factor 8)
    (expected,) = generate(pipes("tiny:ssd1b"), ["p"], seed=0, loras=[(lora, 1.0)],
                           **{**FAST, "width": 128, "height": 128})
    with Image.open(tmp_path / "allowed" / "0-0.png") as image:
        assert same(image, expected), "the pickle holds the same LoRA, rendered at 128x128"

    class RunsCode:
        def __reduce__(self):
            return open, (str(tmp_path / "ran"), "w")

    torch.save({"lora_unet_x.lora_up.weight": RunsCode()}, tmp_path / "evil.pt")
    with pytest.raises(GenerateError, match="evil.pt"):
        read_lora(tmp_path / "evil.pt", allow_pickle=True)
    assert not (tmp_path / "ran").exists(), "weights_only refused the code in the pickle"


def test_bad_flags_are_error_lines(bundles, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    torch.save({"a": torch.zeros(1)}, tmp_path / "weights.pt")
    sd3_lora = make_lora(bundles("tiny:sd3"), tmp_path / "sd3.safetensors", seed=1)
    cases = [
        (["--model", str(tmp_path / "missing.safetensors")], "--model: "),
        (["--model", "tiny:sdxxl"], "--model: tiny:sdxxl"),
        (["--model", str(tmp_path / "weights.pt")], "--allow-pickle"),
        (["--model", "tiny:ssd1b", "--steps", "0"], "--steps must be at least 1"),
        (["--model", "tiny:ssd1b", "--count", "0"], "--count"),
        (["--model", "tiny:ssd1b", "--width", "0"], "--width"),
        (["--model", "tiny:ssd1b", "--seed", "-1"], "--seed"),
        (["--model", "tiny:ssd1b", "--compare"], "--compare"),
        (["--model", "tiny:ssd1b", "--out", str(tmp_path / "file")], "--out"),
        (["--model", "tiny:ssd1b", "--t5", "int8"], "--t5 applies to SD3"),
        (["--model", "tiny:sd3", "--max-sequence-length", "0"], "--max-sequence-length"),
        (["--model", "tiny:sd3", "--width", "72"], "--width 72"),
        (["--model", "tiny:ssd1b", "--lora", str(sd3_lora)], "sd3.safetensors"),
    ]
    # refused before anything is resolved, loaded or written (the cache and --out stay unmade)
    devices = "auto, cpu, cuda or cuda:N"
    early = [
        (["--device", "tpu"], "--device 'tpu' is not a device vramfit renders on; use " + devices),
        (["--device", "cuda:99"], "--device cuda:99: "),
        (["--guidance", "nan"], "--guidance must be a finite number, 0 or more (got nan)"),
        (["--guidance", "-1"], "--guidance must be a finite number, 0 or more (got -1.0)"),
        (["--lora", f"{sd3_lora}:nan"], f"--lora {sd3_lora}:nan: a LoRA's scale must be a finite number"),
        (["--lora", f"{sd3_lora}:inf"], f"--lora {sd3_lora}:inf: "),
    ]
    if not torch.cuda.is_available():  # the GPU of a CPU-only machine (on one with GPUs: cuda:99)
        early.append((["--device", "cuda"], "--device cuda: no CUDA GPU is visible on this machine; "
                       f"use --device cpu or auto (--device takes {devices})"))
    for argv, expected in cases:
        assert cli("--prompt", "p", "--steps", "1", "--out", str(tmp_path / "out"), *argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after any import notice of a library
        assert err.startswith("error: ") and expected in err and "model." not in err, (argv, err)
    for argv, expected in early:
        assert cli("--model", "tiny:ssd1b", "--prompt", "p", "--out", str(tmp_path / "early"),
                   "--cache-dir", str(tmp_path / "cache"), *argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], (argv, err)
        assert not (tmp_path / "cache").exists() and not (tmp_path / "early").exists(), argv
    with pytest.raises(SystemExit) as exit_:
        cli("--model", "tiny:ssd1b", "--prompt", "p", "--lora", str(tmp_path / "missing.safetensors"))
    assert exit_.value.code == 2 and "missing.safetensors is not a file" in capsys.readouterr().err


def test_folders_that_cannot_be_written_are_named_before_loading(read_only_folder, tmp_path, capsys):
    ro = read_only_folder
    cache, out = tmp_path / "cache", tmp_path / "out"
    assert cli("--model", "tiny:ssd1b", "--prompt", "p", "--out", str(ro), "--cache-dir", str(cache)) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --out: cannot write in {ro}: Read-only file system; choose a folder you can write to"]
    assert not cache.exists(), "refused before the model was made"
    # the cache is written where a tiny model is made (or a pickle file converted) the first time
    assert cli("--model", "tiny:ssd1b", "--prompt", "p", "--out", str(out),
               "--cache-dir", str(ro / "cache")) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --cache-dir: cannot write in {ro} (where {ro / 'cache'} would be made): "
        "Read-only file system; choose a folder you can write to"]
    assert not out.exists()


def test_base_of_another_family_is_compared_with_a_warning(module_cache, tmp_path, capsys, caplog):
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="vramfit.generate"):
        assert cli("--model", "tiny:ssd1b", "--base", "tiny:sd3", "--prompt", "p", "--steps", "1",
                   "--width", str(SIZE), "--height", str(SIZE), "--out", str(out),
                   "--cache-dir", str(module_cache)) == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "vramfit.generate"]
    assert warned == ["--base tiny:sd3 is an SD3 model and --model tiny:ssd1b an SDXL-family model: "
                      "compare.png shows two model families side by side, not a model and its fine-tune"]
    assert size_of(out / "compare.png") == (SIZE, 2 * SIZE)
    capsys.readouterr()
