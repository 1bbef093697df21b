"""`vramfit lora merge | extract | resize` through the CLI on tiny models: merged weights equal peft's
own merge (LoRA, DoRA, LoHa, LoKr, text-encoder LoRA), extraction recovers a merged LoRA (linears,
convolutions, text encoders; layers no file carries named with their energy), resizing gives the
best lower-rank product."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from conftest import SIZE, train_args
from vramfit.cli import main
from vramfit.config.schema import LoraSettings
from vramfit.data.synth import make_synthetic_dataset
from vramfit.formats.lora import (
    TEXT_ENCODERS, load_lora, lora_config_kwargs, save_lora, text_encoder_lora,
)
from vramfit.formats.safetensors_io import read_header
from vramfit.lora_tools import load_model
from vramfit.models.registry import FAMILIES
from vramfit.train.lora import TEXT_ENCODER_TARGETS, apply_lora, lora_state

LORA = ("train.mode=lora", "lora.rank=4", "train.lr=1e-2", "save.name=m", "save.formats=['lora_kohya', 'lora']")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_root):
    """A tiny:sdxl LoRA of rank 4 after two steps, in kohya (m.safetensors) and diffusers keys: one
    run for the tests that only read it."""
    root = tmp_path_factory.mktemp("trained")
    make_synthetic_dataset(root / "images", n=4, size=SIZE, seed=1)
    with pytest.MonkeyPatch.context() as env:  # conftest's per-test isolation, for this module's run
        env.setenv("XDG_CACHE_HOME", str(cache_root / "xdg"))
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_HOME", str(cache_root / "hf"))
        args = train_args(root / "images", root / "run", cache_root / "lt", *LORA, model="tiny:sdxl")
        assert main(args) == 0
    return root / "run"


def _peft_merged(model: torch.nn.Module, state: dict, config, scales: list[float]) -> dict[str, torch.Tensor]:
    """`model`'s weights after peft injects the adapter `state` (peft keys) once per scale, scales
    each and merges them in turn (a DoRA's magnitudes as the file has them)."""
    names = [f"a{i}" for i in range(len(scales))]
    for name in names:
        inject_adapter_in_model(config, model, adapter_name=name)
        assert not set_peft_model_state_dict(model, state, adapter_name=name).unexpected_keys
    for module in model.modules():
        if hasattr(module, "set_scale") and hasattr(module, "merge"):
            module.set_adapter(names)
            for name, scale in zip(names, scales):
                module.set_scale(name, scale)
            module.merge(adapter_names=names)
    return {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}


def _same_weights(got: dict, want: dict, original: dict) -> None:
    assert set(got) == set(want)
    assert any(not torch.equal(want[k], original[k]) for k in want)  # the adapter changed something
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def _products(path, config) -> dict[str, torch.Tensor]:
    """{module: alpha/r * B @ A} of a LoRA file, read the way vramfit reads LoRAs."""
    lora = load_lora(path, FAMILIES.values(), unet_config=config)
    names = {k.rsplit(".lora_", 1)[0] for k in lora.state}
    out = {}
    for n in names:
        a, b = lora.state[f"{n}.lora_A.weight"].float(), lora.state[f"{n}.lora_B.weight"].float()
        out[n] = (b.flatten(1) @ a.flatten(1)) * lora.alphas.get(n, a.shape[0]) / a.shape[0]
    return out


def test_merge_equals_peft_merge_and_extract_recovers_the_lora(trained, tmp_path, capsys):
    merged = tmp_path / "merged.safetensors"
    assert main(["lora", "merge", "tiny:sdxl", f"{trained / 'm.safetensors'}:0.5", "--out", str(merged),
                 "--dtype", "fp32"]) == 0
    assert "layers merged" in capsys.readouterr().out

    # the reference: peft injects the same LoRA into the base UNet and merges it at scale 0.5
    _, base = load_model("tiny:sdxl")
    lora = load_lora(trained / "m.safetensors", FAMILIES.values(), unet_config=dict(base.denoiser.config))
    unet = base.denoiser
    inject_adapter_in_model(LoraConfig(**lora_config_kwargs(lora.state, lora.alphas)), unet)
    set_peft_model_state_dict(unet, lora.state)
    for module in unet.modules():
        if hasattr(module, "scale_layer") and hasattr(module, "merge"):
            module.scale_layer(0.5)
            module.merge()
    want = {k.replace(".base_layer", ""): v for k, v in unet.state_dict().items() if "lora_" not in k}
    _, got = load_model(str(merged))
    got_state = got.denoiser.state_dict()
    assert set(want) == set(got_state)
    original = load_model("tiny:sdxl")[1].denoiser.state_dict()
    changed = [k for k in want if not torch.equal(want[k], original[k])]
    assert changed and all(torch.allclose(got_state[k], want[k], atol=1e-6) for k in want)

    # extract (rank 4) from base and merged: the same products at 0.5, to 1e-4 relative
    extracted = tmp_path / "x.safetensors"
    assert main(["lora", "extract", "tiny:sdxl", str(merged), "--rank", "4", "--out", str(extracted),
                 "--dtype", "fp32", "--format", "lora_kohya", "--format", "lora"]) == 0
    assert "100.0% of the difference's energy" in capsys.readouterr().out
    config = dict(base.denoiser.config)
    source, back = _products(trained / "m.safetensors", config), _products(extracted, config)
    assert set(back) == set(source)
    for name, p in source.items():
        assert (back[name] - 0.5 * p).norm() <= 1e-4 * (0.5 * p).norm() + 1e-7, name
    assert (tmp_path / "x-diffusers.safetensors").is_file()
    from vramfit.formats.safetensors_io import read_header

    meta = read_header(extracted)[1]
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0" and meta["ss_network_dim"] == "4"


def _layers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: fp32 weight} of a model's linears and 2-D convolutions."""
    return {n: m.weight.detach().float() for n, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}


@pytest.fixture(scope="module")
def conv_merged(tmp_path_factory, cache_root):
    """tiny:sdxl with a rank-2 LoRA of its linears and convolutions (lora.conv_rank=2, two steps)
    merged in fp32: the merged checkpoint, for the extract tests of convolutions."""
    root = tmp_path_factory.mktemp("conv")
    make_synthetic_dataset(root / "images", n=4, size=SIZE, seed=1)
    with pytest.MonkeyPatch.context() as env:  # conftest's per-test isolation, for this module's run
        env.setenv("XDG_CACHE_HOME", str(cache_root / "xdg"))
        env.setenv("HF_HOME", str(cache_root / "hf"))
        env.setenv("HF_HUB_OFFLINE", "1")
        assert main(train_args(root / "images", root / "run", cache_root / "lt", "train.mode=lora", "lora.rank=2",
                               "lora.conv_rank=2", "train.lr=1e-2", "save.name=m", model="tiny:sdxl")) == 0
        merged = root / "merged.safetensors"
        assert main(["lora", "merge", "tiny:sdxl", str(root / "run" / "m.safetensors"), "--out", str(merged),
                     "--dtype", "fp32"]) == 0
    return merged


def test_extract_recovers_every_convolution_and_linear_of_a_merged_conv_lora(conv_merged, tmp_path, capsys):
    """Rank 4 >= the trained 2: base + each extracted product is the merged weight (to 1e-4 of the
    change) for every linear and convolution that changed, in both formats; all energy is kept."""
    out = tmp_path / "x.safetensors"
    assert main(["lora", "extract", "tiny:sdxl", str(conv_merged), "--rank", "4", "--out", str(out), "--dtype",
                 "fp32", "--format", "lora_kohya", "--format", "lora"]) == 0
    printed = capsys.readouterr().out
    base, merged = _layers(load_model("tiny:sdxl")[1].denoiser), _layers(load_model(str(conv_merged))[1].denoiser)
    changed = {n for n in base if not torch.equal(base[n], merged[n])}
    convs = {n for n in changed if base[n].dim() == 4}
    assert len(convs) > 40 and len(changed) > len(convs)  # the resnets' and samplers' convolutions, the linears
    assert f"rank 4 on {len(changed)} layers" in printed and "100.0% of the difference's energy" in printed
    assert float(read_header(out)[1]["vramfit.extract_kept_energy"]) > 0.9999
    config = dict(load_model("tiny:sdxl")[1].denoiser.config)
    for path in (out, tmp_path / "x-diffusers.safetensors"):
        products = _products(path, config)
        assert set(products) == changed, path
        for name in changed:
            delta = (merged[name] - base[name]).flatten(1)
            assert (products[name] - delta).norm() <= 1e-4 * delta.norm() + 1e-7, (path, name)
    raw = load_file(str(out))
    conv = next(n for n in convs if n.endswith("conv1"))
    down = next(k for k in raw if k.endswith(".lora_down.weight") and raw[k].shape[1:] == base[conv].shape[1:])
    assert raw[down].shape[0] == 4 and raw[down.replace("lora_down", "lora_up")].shape[2:] == (1, 1)
    assert json.loads(read_header(out)[1]["ss_network_args"]) == {"conv_dim": "4", "conv_alpha": "4"}


def test_an_extracted_kohya_conv_lora_merges_back_into_the_tuned_weights(conv_merged, tmp_path):
    """extract (kohya, convolutions too) then merge into the base: the merged checkpoint again."""
    out = tmp_path / "x.safetensors"
    assert main(["lora", "extract", "tiny:sdxl", str(conv_merged), "--rank", "2", "--out", str(out),
                 "--dtype", "fp32"]) == 0
    assert all(k.startswith("lora_unet_") for k in load_file(str(out)))
    again = tmp_path / "again.safetensors"
    assert main(["lora", "merge", "tiny:sdxl", str(out), "--out", str(again), "--dtype", "fp32"]) == 0
    want, got = _layers(load_model(str(conv_merged))[1].denoiser), _layers(load_model(str(again))[1].denoiser)
    base = _layers(load_model("tiny:sdxl")[1].denoiser)
    assert any(w.dim() == 4 and not torch.equal(w, base[n]) for n, w in want.items())
    for name, w in want.items():
        assert (got[name] - w).norm() <= 1e-4 * (w - base[name]).norm() + 1e-6, name


def test_extract_leaves_out_convolutions_a_format_cannot_carry_and_says_so(conv_merged, tmp_path, capsys,
                                                                          caplog, monkeypatch):
    """A family whose diffusers writer refuses convolutions: the linears are extracted, the
    convolutions left out and named, and the kept share is of the whole difference."""
    family = FAMILIES["sdxl"]
    write = family.lora_tensors

    def linears_only(fmt, state, config, alpha):
        if any(t.dim() == 4 for t in state.values()):
            raise ValueError("no convolutions here")
        return write(fmt, state, config, alpha)

    monkeypatch.setattr(family, "lora_tensors", linears_only)
    out = tmp_path / "x.safetensors"
    with caplog.at_level("WARNING"):
        assert main(["lora", "extract", "tiny:sdxl", str(conv_merged), "--rank", "4", "--out", str(out),
                     "--dtype", "fp32", "--format", "lora"]) == 0
    printed = capsys.readouterr().out
    left = json.loads(read_header(out)[1]["vramfit.extract_left_out"])
    assert len(left) > 40 and all(n.endswith(("conv1", "conv2", "conv", "conv_shortcut")) for n in left)
    share = sum(left.values())
    kept = float(read_header(out)[1]["vramfit.extract_kept_energy"])
    assert 0 < share < 1 and kept == pytest.approx(1 - share, abs=1e-4)
    assert f"keeping {100 * kept:.1f}%" in printed and f"{100 * kept:.1f}" != "100.0"
    assert f"{len(left)} layer(s) that differ are left out" in caplog.text
    assert f"{len(left)} layer(s) that differ left out ({100 * share:.1f}% of it" in printed
    assert not any(t.dim() == 4 for t in load_file(str(out)).values())


def test_extract_takes_text_encoder_lora_and_names_the_layers_it_leaves_out(tmp_path, capsys, caplog):
    """A text-encoder LoRA (both CLIPs' attention and MLP linears, and CLIP-G's text_projection, which
    text-encoder LoRA files do not name) merged, then extracted at its rank: lora_te1_ / lora_te2_
    and text_encoder(_2). keys that, merged again, give the tuned encoders; text_projection is left
    out with its share of the energy."""
    _, base = load_model("tiny:sdxl")
    gen = torch.Generator().manual_seed(0)
    states = []
    for i, encoder in enumerate(base.text_encoders):
        state = {}
        for name, m in encoder.named_modules():
            if isinstance(m, torch.nn.Linear) and (name.rsplit(".", 1)[-1] in TEXT_ENCODER_TARGETS
                                                   or (i == 1 and name == "text_projection")):
                state[f"{name}.lora_A.weight"] = torch.randn(2, m.in_features, generator=gen) * 0.1
                state[f"{name}.lora_B.weight"] = torch.randn(m.out_features, 2, generator=gen) * 0.1
        states.append(state)
    lora = tmp_path / "te.safetensors"
    save_lora(lora, text_encoder_lora(states, 2.0, kohya=False))
    tuned_path = tmp_path / "tuned.safetensors"
    assert main(["lora", "merge", "tiny:sdxl", str(lora), "--out", str(tuned_path), "--dtype", "fp32"]) == 0
    out = tmp_path / "x.safetensors"
    capsys.readouterr()
    with caplog.at_level("WARNING"):
        assert main(["lora", "extract", "tiny:sdxl", str(tuned_path), "--rank", "2", "--out", str(out), "--dtype",
                     "fp32", "--format", "lora_kohya", "--format", "lora"]) == 0
    printed = capsys.readouterr().out
    kohya, diffusers = load_file(str(out)), load_file(str(tmp_path / "x-diffusers.safetensors"))
    assert {k.split("_text_model", 1)[0] for k in kohya} == {"lora_te1", "lora_te2"}
    assert {k.split(".", 1)[0] for k in diffusers} == {"text_encoder", "text_encoder_2"}
    assert f"rank 2 on {sum(len(s) for s in states) // 2 - 1} layers" in printed
    assert "1 layer(s) that differ are left out" in caplog.text and "text_projection" in caplog.text

    tuned = load_model(str(tuned_path))[1].text_encoders
    want = [_layers(e) for e in tuned]
    orig = [_layers(e) for e in base.text_encoders]
    energy = {(i, n): float((w - orig[i][n]).square().sum()) for i in range(2) for n, w in want[i].items()}
    share = energy[1, "text_projection"] / sum(energy.values())
    left = json.loads(read_header(out)[1]["vramfit.extract_left_out"])
    assert list(left) == ["text_encoder_2.text_projection"] and left[list(left)[0]] == pytest.approx(share, rel=1e-4)
    assert f"keeping {100 * (1 - share):.1f}%" in printed and share > 1e-3
    for path in (out, tmp_path / "x-diffusers.safetensors"):
        again = tmp_path / f"again-{path.name}"
        assert main(["lora", "merge", "tiny:sdxl", str(path), "--out", str(again), "--dtype", "fp32"]) == 0
        got = [_layers(e) for e in load_model(str(again))[1].text_encoders]
        for i in range(2):
            for name, w in want[i].items():
                if name == "text_projection":  # left out: the base's
                    assert torch.equal(got[i][name], orig[i][name])
                    continue
                assert (got[i][name] - w).norm() <= 1e-4 * (w - orig[i][name]).norm() + 1e-6, (path, i, name)


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")  # two adapters, on purpose
def test_merge_takes_dora_and_text_encoder_lora_as_peft_merges_them(images, tmp_path, cache_root):
    """A DoRA with a text-encoder LoRA: the merged UNet and CLIP encoders equal peft's merge of the
    diffusers file's tensors, for the kohya file (dora_scale) at 1 and for it at 1 followed by the
    diffusers file at 0.5 (each DoRA's norm is of the unmerged weight, as peft merges two).
    Trained in fp32: a kohya dora_scale holds the base's row norms in the training precision."""
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "lt", *LORA, "lora.type=dora",
                           "lora.text_encoder_rank=2", "train.precision=fp32", model="tiny:sdxl")) == 0
    raw = load_file(str(out / "m-diffusers.safetensors"))  # alpha / rank folded into lora_B: scale 1
    kohya = load_file(str(out / "m.safetensors"))
    assert any(k.endswith(".dora_scale") for k in kohya) and any(k.startswith("lora_te2_") for k in kohya)
    unet = {k[len("unet."):]: v for k, v in raw.items() if k.startswith("unet.")}
    assert any(k.endswith(".lora_magnitude_vector") for k in unet)
    dora = LoraConfig(r=4, lora_alpha=4, use_dora=True, target_modules=sorted(
        {k.rsplit(".lora_", 1)[0] for k in unet}))
    original = load_model("tiny:sdxl")[1]
    for files, scales in (([out / "m.safetensors"], [1.0]),
                          ([out / "m.safetensors", out / "m-diffusers.safetensors"], [1.0, 0.5])):
        merged = tmp_path / f"merged-{len(files)}.safetensors"
        assert main(["lora", "merge", "tiny:sdxl", *[f"{f}:{s}" for f, s in zip(files, scales)], "--out",
                     str(merged), "--dtype", "fp32"]) == 0
        _, got = load_model(str(merged))  # as `vramfit generate` and `train` load it
        base = copy.deepcopy(original)
        _same_weights(got.denoiser.state_dict(), _peft_merged(base.denoiser, unet, dora, scales),
                      original.denoiser.state_dict())
        for i, encoder in enumerate(base.text_encoders):
            state = _encoder_lora(raw, TEXT_ENCODERS[i], encoder)
            config = LoraConfig(r=2, lora_alpha=2,
                                target_modules=sorted({k.rsplit(".lora_", 1)[0] for k in state}))
            _same_weights(got.text_encoders[i].state_dict(), _peft_merged(encoder, state, config, scales),
                          original.text_encoders[i].state_dict())


def _encoder_lora(raw: dict, component: str, encoder: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A diffusers file's LoRA of one text encoder under the encoder's own module names (the file's
    `text_model.<...>`, which CLIPTextModel may not have)."""
    names = {n for n, _ in encoder.named_modules()}
    state = {}
    for key, t in raw.items():
        if key.startswith(component + "."):
            key = key.split(".", 1)[1]
            state[key if key.rsplit(".lora_", 1)[0] in names else key[len("text_model."):]] = t
    return state


def test_merge_writes_a_flux_clip_text_encoder_lora_into_the_checkpoint(images, tmp_path, cache_root):
    """Flux.1's kohya file (lora_te1_) merged at 0.5: its CLIP-L equals peft's merge of the diffusers
    file's text_encoder LoRA, T5 is the source's."""
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "lt", *LORA[:-1], "lora.text_encoder_rank=2",
                           "train.precision=fp32", model="tiny:flux")) == 0
    merged = tmp_path / "merged.safetensors"
    assert main(["lora", "merge", "tiny:flux", f"{out / 'm-kohya.safetensors'}:0.5", "--out", str(merged),
                 "--dtype", "fp32"]) == 0
    got, original = load_model(str(merged))[1], load_model("tiny:flux")[1]
    clip = copy.deepcopy(original.text_encoders[0])
    state = _encoder_lora(load_file(str(out / "m.safetensors")), "text_encoder", clip)
    config = LoraConfig(r=2, lora_alpha=2, target_modules=sorted({k.rsplit(".lora_", 1)[0] for k in state}))
    _same_weights(got.text_encoders[0].state_dict(), _peft_merged(clip, state, config, [0.5]),
                  original.text_encoders[0].state_dict())
    t5, source = got.text_encoders[1].state_dict(), original.text_encoders[1].state_dict()
    assert all(torch.equal(t5[k], source[k]) for k in source)


@pytest.mark.parametrize("kind, scale", [("lokr", 1.0), ("loha", 0.5)])
def test_merge_takes_lokr_and_loha_files_as_peft_merges_them(tmp_path, kind, scale):
    """A LoKr / LoHa (linears and convolutions, alpha != rank) exported as a run saves it (kohya /
    LyCORIS keys): the merged UNet equals peft's own merge of the adapter at that scale."""
    family, base = load_model("tiny:sdxl")
    model, original = base.denoiser, {k: v.clone() for k, v in base.denoiser.state_dict().items()}
    apply_lora(model, LoraSettings(type=kind, rank=4, alpha=6.0, conv_rank=2, conv_alpha=3.0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every factor off its initial value (LoKr's w1 starts at zero)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    path = tmp_path / f"{kind}.safetensors"
    save_lora(path, family.lora_tensors("lora_kohya", lora_state(model), dict(model.config), 6.0))
    merged = tmp_path / "merged.safetensors"
    assert main(["lora", "merge", "tiny:sdxl", f"{path}:{scale}", "--out", str(merged),
                 "--dtype", "fp32"]) == 0
    for module in model.modules():
        if hasattr(module, "scale_layer") and hasattr(module, "merge"):
            module.scale_layer(scale)
            module.merge()
    want = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items()}
    got = load_model(str(merged))[1].denoiser.state_dict()
    _same_weights(got, {k: want[k] for k in got}, original)


def test_resize_gives_the_best_lower_rank_product_in_the_same_format(trained, tmp_path, capsys):
    for name in ("m.safetensors", "m-diffusers.safetensors"):
        out = tmp_path / f"r2-{name}"
        assert main(["lora", "resize", str(trained / name), "--rank", "2", "--out", str(out)]) == 0
        assert "resized to rank 2" in capsys.readouterr().out
        raw, small = load_file(str(trained / name)), load_file(str(out))
        assert set(raw) == set(small)  # the same keys: the same format
        _, base = load_model("tiny:sdxl")
        config = dict(base.denoiser.config)
        before, after = _products(trained / name, config), _products(out, config)
        for module, p in before.items():
            s = torch.linalg.svdvals(p)
            best = s[2:].square().sum().sqrt()  # Eckart-Young: the least error of any rank-2 product
            assert (after[module] - p).norm() <= best * (1 + 1e-4) + 1e-6, module
            assert torch.linalg.matrix_rank(after[module], rtol=1e-5) <= 2


def test_lora_tools_refuse_bad_input_with_the_file_named(trained, tmp_path, capsys):
    # a LoRA of another family
    assert main(["lora", "merge", "tiny:sd3", str(trained / "m.safetensors"), "--out", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "m.safetensors" in err and "tiny:sd3" in err
    # a text-encoder LoRA for an encoder the checkpoint lacks (SDXL has two)
    third = dict(load_file(str(trained / "m-diffusers.safetensors")))
    third["text_encoder_3.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight"] = torch.zeros(2, 8)
    third["text_encoder_3.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight"] = torch.zeros(8, 2)
    save_file(third, str(tmp_path / "third.safetensors"))
    assert main(["lora", "merge", "tiny:sdxl", str(tmp_path / "third.safetensors"), "--out",
                 str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "third.safetensors" in err and "text_encoder_3" in err and "CLIP text encoders only" in err
    assert not (tmp_path / "o.safetensors").exists()
    # a DoRA scale on the input axis (LyCORIS can write one; ComfyUI applies it per input column)
    wd_in = dict(load_file(str(trained / "m.safetensors")))
    down = next(k for k in wd_in if k.endswith("lora_down.weight") and wd_in[k].dim() == 2)
    wd_in[down.replace("lora_down.weight", "dora_scale")] = torch.ones(1, wd_in[down].shape[1])
    save_file(wd_in, str(tmp_path / "wd_in.safetensors"))
    assert main(["lora", "merge", "tiny:sdxl", str(tmp_path / "wd_in.safetensors"), "--out",
                 str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "wd_in.safetensors" in err and "not one value per output row" in err
    assert not (tmp_path / "o.safetensors").exists()
    # not a plain LoRA (a DoRA magnitude vector)
    dora = dict(load_file(str(trained / "m-diffusers.safetensors")))
    first = next(k for k in dora if k.endswith("lora_A.weight"))
    dora[first.replace("lora_A.weight", "lora_magnitude_vector")] = torch.ones(3)
    save_file(dora, str(tmp_path / "dora.safetensors"))
    assert main(["lora", "resize", str(tmp_path / "dora.safetensors"), "--rank", "2", "--out",
                 str(tmp_path / "d2.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "dora.safetensors" in err and "not a plain LoRA" in err and not (tmp_path / "d2.safetensors").exists()
    # two identical checkpoints hold nothing to extract; a missing file is named
    assert main(["lora", "extract", "tiny:sdxl", "tiny:sdxl", "--rank", "2", "--out", str(tmp_path / "e.safetensors")]) == 2
    assert "nothing to extract" in capsys.readouterr().err
    assert main(["lora", "resize", str(tmp_path / "missing.safetensors"), "--rank", "2", "--out",
                 str(tmp_path / "x.safetensors")]) == 2
    assert "missing.safetensors does not exist" in capsys.readouterr().err
    assert main(["lora", "resize", str(trained / "m.safetensors"), "--rank", "0", "--out",
                 str(tmp_path / "x.safetensors")]) == 2
    assert "--rank 0" in capsys.readouterr().err
    assert main(["lora", "resize", str(trained / "m.safetensors"), "--rank", "2", "--device", "tpu", "--out",
                 str(tmp_path / "x.safetensors")]) == 2
    assert "--device 'tpu'" in capsys.readouterr().err and not (tmp_path / "x.safetensors").exists()


def test_trained_lora_files_carry_the_metadata_a1111_reads(images, tmp_path, cache_root):
    """ss_base_model_version, ss_network_dim/alpha and ss_tag_frequency (per dataset, from the captions)."""
    import json

    from vramfit.formats.safetensors_io import read_header

    for path in images.glob("*.txt"):  # tags, as booru-style captions are
        path.write_text("sks, " + path.read_text().strip() + ", photo\n")
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "lt", *LORA, "lora.alpha=2", model="tiny:sdxl")) == 0
    kohya = read_header(out / "m.safetensors")[1]
    assert kohya["ss_base_model_version"] == "sdxl_base_v1-0"
    assert kohya["ss_network_dim"] == "4" and float(kohya["ss_network_alpha"]) == 2.0
    tags = json.loads(kohya["ss_tag_frequency"])
    assert tags[images.name]["sks"] == 4 and tags[images.name]["photo"] == 4
    assert sum(tags[images.name].values()) == 4 * 3
    assert read_header(out / "m-diffusers.safetensors")[1]["ss_tag_frequency"] == kohya["ss_tag_frequency"]


def test_resize_rewrites_the_rank_metadata_of_linears_and_convolutions(images, tmp_path, cache_root):
    """A LoRA with convolutions (kohya's conv_dim) resized below both ranks says the new rank everywhere."""
    import json

    from vramfit.formats.safetensors_io import read_header

    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root / "lt", "train.mode=lora", "lora.rank=4", "lora.conv_rank=4",
                           "save.name=m", model="tiny:sdxl")) == 0
    small = tmp_path / "r2.safetensors"
    assert main(["lora", "resize", str(out / "m.safetensors"), "--rank", "2", "--out", str(small)]) == 0
    before, meta = read_header(out / "m.safetensors")[1], read_header(small)[1]
    assert json.loads(before["ss_network_args"])["conv_dim"] == "4"
    assert json.loads(meta["ss_network_args"])["conv_dim"] == "2" and meta["ss_network_dim"] == "2"
    assert meta["vramfit.lora_rank"] == "2"
    assert all(t.shape[0] == 2 for k, t in load_file(str(small)).items() if k.endswith("lora_down.weight"))


def test_merge_refuses_a_t5_lora_naming_the_encoder_the_model_has(tmp_path, capsys):
    """merge reads no T5 (the save carries the source's): a LoRA of SD3's T5 (text_encoder_3) is refused
    as not a CLIP encoder's, not as one of an encoder the model lacks."""
    family, bundle = load_model("tiny:sd3")
    name, linear = next((n, m) for n, m in bundle.text_encoders[2].named_modules()
                        if isinstance(m, torch.nn.Linear))
    path = tmp_path / "t5.safetensors"
    save_file({f"text_encoder_3.{name}.lora_A.weight": torch.zeros(2, linear.in_features),
               f"text_encoder_3.{name}.lora_B.weight": torch.zeros(linear.out_features, 2)}, str(path))
    assert main(["lora", "merge", "tiny:sd3", str(path), "--out", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "text_encoder_3" in err and "has no CLIP encoder there" in err and "no such encoder" not in err
    assert not (tmp_path / "m.safetensors").exists()
