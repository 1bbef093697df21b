"""Single files written tensor by tensor (formats/safetensors_io.py `save_atomic_lazy`): the bytes
safetensors' own writer gives, the same checkpoints the families wrote from a whole dict, and only
about one tensor alive at a time while they are written."""
from __future__ import annotations

import json
import math
import struct
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vramfit.config.load import load_config
from vramfit.config.schema import ModelConfig
from vramfit.fit.host import written_at_once
from vramfit.fit.model_facts import read_facts
from vramfit.fit.planner import host_prediction
from vramfit.formats.safetensors_io import Lazy, eager, file_tensors, save_atomic, save_atomic_lazy, temp_path
from vramfit.models.registry import detect_family
from vramfit.models.sdxl.family import UNET
from vramfit.models.sdxl.sgm_unet import diffusers_to_sgm_unet
from vramfit.models.sources import resolve_source
from vramfit.train.setup import place_denoiser


def _split(path: Path) -> tuple[dict, bytes]:
    """(parsed header, the bytes after it) of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[:8] + raw[8 + n:]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"w.f32": torch.randn(3, 5, generator=g), "w.bf16": torch.randn(7, generator=g).bfloat16(),
           "w.f16": torch.randn(2, 2, generator=g).half(), "w.f64": torch.randn(3, generator=g).double(),
           "w.fp8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
           "w.fp8b": torch.randn(4, generator=g).to(torch.float8_e5m2),
           "i.64": torch.arange(5), "i.32": torch.arange(3, dtype=torch.int32),
           "i.16": torch.arange(3, dtype=torch.int16), "i.8": torch.arange(-2, 3, dtype=torch.int8),
           "u.8": torch.arange(6, dtype=torch.uint8), "b": torch.tensor([True, False, True]),
           "empty": torch.zeros(0, 4), "empty.int": torch.zeros(0, dtype=torch.int64),
           "scalar": torch.tensor(2.5), "a.first": torch.ones(1, 1, 1)}
    for name in ("uint16", "uint32", "uint64"):
        out[f"u.{name}"] = torch.arange(4).to(getattr(torch, name))
    return out


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}, {"z": "é\n\x01\"\\", "a": "1", "m": "x"}])
def test_lazy_writer_writes_what_save_file_writes(tmp_path, metadata):
    tensors = _tensors()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save_atomic_lazy({k: eager(v) for k, v in tensors.items()}, ours, metadata)
    save_file(tensors, str(theirs), metadata=metadata)
    if metadata is None or len(metadata) < 2:
        assert ours.read_bytes() == theirs.read_bytes()
    else:  # the library writes metadata in hash order (it differs run to run); ours sorts it
        assert _split(ours) == _split(theirs)
        assert ours.stat().st_size == theirs.stat().st_size
    with safe_open(str(ours), framework="pt") as fh:
        assert fh.metadata() == metadata and set(fh.keys()) == set(tensors)
        for key, t in tensors.items():
            got = fh.get_tensor(key)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), key
    assert not temp_path(ours).exists()


def test_lazy_writer_refuses_a_tensor_unlike_its_announcement_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "model.safetensors"
    save_atomic_lazy({"a": eager(torch.ones(2))}, target)
    before = target.read_bytes()
    wrong = Lazy(torch.float32, (3,), lambda: torch.ones(2))
    with pytest.raises(ValueError, match="'b' was announced as torch.float32 \\(3,\\)"):
        save_atomic_lazy({"a": eager(torch.zeros(2)), "b": wrong}, target)
    assert target.read_bytes() == before and not temp_path(target).exists()


def test_file_tensors_read_each_tensor_when_written(tmp_path):
    tensors = _tensors()
    source, copy = tmp_path / "source.safetensors", tmp_path / "copy.safetensors"
    save_file(tensors, str(source), metadata={"k": "v"})
    lazy = file_tensors(source, lambda k: not k.startswith("u."))
    assert set(lazy) == {k for k in tensors if not k.startswith("u.")}
    assert all(lazy[k].shape == tuple(tensors[k].shape) and lazy[k].dtype == tensors[k].dtype for k in lazy)
    save_atomic_lazy(lazy, copy, {"k": "v"})
    save_file({k: tensors[k] for k in lazy}, str(source), metadata={"k": "v"})  # the same, by the library
    assert copy.read_bytes() == source.read_bytes()


def _whole_dict_save(entries, path, metadata):
    """The save as it was: every tensor made first, then safetensors' own writer (`save_atomic`)."""
    save_atomic({k: e.produce() for k, e in entries.items()}, path, metadata)


def _tracked(real, seen: dict):
    """`save_atomic_lazy` with each produced tensor counted while it is alive (weakref finalizers):
    seen["peak"] is the most bytes of produced tensors alive at once."""
    def save(entries, path, metadata=None):
        alive = {"bytes": 0}

        def counted(key, entry):
            def produce():
                t = entry.produce()
                size = t.numel() * t.element_size()
                alive["bytes"] += size
                seen["peak"] = max(seen["peak"], alive["bytes"])
                weakref.finalize(t, lambda: alive.__setitem__("bytes", alive["bytes"] - size))
                return t
            return Lazy(entry.dtype, entry.shape, produce)

        seen["largest"] = max(math.prod(e.shape) * e.dtype.itemsize for e in entries.values())
        seen["total"] = sum(math.prod(e.shape) * e.dtype.itemsize for e in entries.values())
        real({k: counted(k, e) for k, e in entries.items()}, path, metadata)
    return save


@pytest.mark.parametrize("name", ["ssd1b", "sdxl", "sd3", "flux"])
def test_single_file_saves_are_the_whole_dict_saves_one_tensor_at_a_time(name, tmp_path, monkeypatch):
    """A trained denoiser saved to a single file: the bytes the whole-dict save wrote (the same
    tensors, header and data; metadata sorted), with at most one produced tensor alive at a time."""
    source = resolve_source(ModelConfig(path=f"tiny:{name}"))
    family = detect_family(source)
    bundle = family.load(source)
    torch.manual_seed(0)
    with torch.no_grad():  # trained: unlike the source's weights
        for p in bundle.denoiser.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    module = sys.modules[type(family).__module__]
    lazy, whole = tmp_path / "lazy.safetensors", tmp_path / "whole.safetensors"
    seen = {"peak": 0}
    monkeypatch.setattr(module, "save_atomic_lazy", _tracked(save_atomic_lazy, seen))
    family.save_single_file(bundle, lazy, torch.bfloat16, {"b": "2", "a": "1"})
    monkeypatch.setattr(module, "save_atomic_lazy", _whole_dict_save)
    family.save_single_file(bundle, whole, torch.bfloat16, {"b": "2", "a": "1"})
    assert _split(lazy) == _split(whole)
    assert 0 < seen["peak"] <= seen["largest"] < seen["total"] / 10
    # the parts not trained are the source's, byte for byte; the trained ones are the model's, cast
    saved, original = load_file(str(lazy)), load_file(str(source.path))
    carried = [k for k in saved if k in original and torch.equal(saved[k], original[k])]
    assert carried and len(carried) < len(saved)
    assert not any(saved[k].dtype == torch.float32 for k in set(saved) - set(carried) if saved[k].numel() > 1)


def test_the_predicted_save_holds_about_the_largest_tensor_not_the_checkpoint(cache_root, tmp_path,
                                                                              monkeypatch):
    """fit/host.py's save term for a streamed full fine-tune from a single file (its trained weights
    at home: no training state copy): at least what a real save of the file held at once (measured
    as above), and far below the whole checkpoint it was."""
    cfg = load_config(None, ["model.path=tiny:sdxl", f"cache.dir={cache_root}", "data.resolution=64",
                             "train.device=cpu", "train.mode=full", "save.dtype=bf16",
                             "memory.stream_weights=true", "train.precision=mixed_bf16"], need_data=False)
    facts = read_facts(cfg, cache_root)
    written = host_prediction(facts, cfg).phase("save").parts["written state"]
    source = resolve_source(cfg.model, cache_root)
    family = detect_family(source)
    bundle = family.load(source)
    assert place_denoiser(bundle, cfg, torch.device("cpu")).streamed_bytes() > 0  # saved from the homes
    seen = {"peak": 0}
    module = sys.modules[type(family).__module__]
    monkeypatch.setattr(module, "save_atomic_lazy", _tracked(save_atomic_lazy, seen))
    family.save_single_file(bundle, tmp_path / "m.safetensors", torch.bfloat16, {})
    assert seen["peak"] <= written == written_at_once(facts, cfg, 2)
    assert written < (tmp_path / "m.safetensors").stat().st_size / 10
    saved = load_file(str(tmp_path / "m.safetensors"))
    homes = {k: v.bfloat16() for k, v in bundle.denoiser.state_dict().items()}
    unet = diffusers_to_sgm_unet(homes, dict(bundle.denoiser.config))
    assert all(torch.equal(saved[UNET + k], v) for k, v in unet.items())


def test_diffusers_model_folders_are_the_whole_dict_files_written_one_tensor_at_a_time(tmp_path, monkeypatch):
    """A diffusers folder's denoiser weights (formats/safetensors_io.py `save_model_folder`): the
    bytes safetensors' writer gave for the whole cast state dict, with at most one tensor made at once."""
    from diffusers import SD3Transformer2DModel

    from vramfit.formats import safetensors_io

    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8)
    seen = {"peak": 0}
    monkeypatch.setattr(safetensors_io, "save_atomic_lazy", _tracked(save_atomic_lazy, seen))
    safetensors_io.save_model_folder(model, tmp_path / "lazy", torch.bfloat16)
    whole = tmp_path / "whole.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}, str(whole))
    assert (tmp_path / "lazy" / "diffusion_pytorch_model.safetensors").read_bytes() == whole.read_bytes()
    assert (tmp_path / "lazy" / "config.json").is_file()
    assert 0 < seen["peak"] <= seen["largest"] < seen["total"] / 5


def test_the_predicted_save_counts_a_diffusers_folders_reloaded_encoders(cache_root):
    """save.formats with "diffusers": the save phase holds the VAE and text encoders read again
    (families' save_diffusers), beside a tensor at a time of the denoiser."""
    sets = ["model.path=tiny:sd3", f"cache.dir={cache_root}", "data.resolution=64", "train.device=cpu"]
    single = load_config(None, sets, need_data=False)
    both = load_config(None, [*sets, "save.formats=['single_file', 'diffusers']"], need_data=False)
    facts = read_facts(single, cache_root)
    saved = {name: host_prediction(facts, cfg).phase("save").parts["written state"]
             for name, cfg in (("single", single), ("both", both))}
    encoders = sum(e.stored_bytes for e in facts.encoders if e.kind == "clip")
    assert saved["both"] >= saved["single"] and saved["both"] >= 4 * facts.vae_params + encoders


@pytest.mark.parametrize("name", ["sdxl", "sd3"])
def test_a_single_file_saved_from_a_diffusers_folder_is_predicted_by_its_largest_tensor(name, cache_root, tmp_path,
                                                                                      monkeypatch):
    """From a diffusers-folder source the denoiser is still written a tensor at a time; the VAE and
    encoders, read from the folder, are converted whole. The planned save term covers what the
    write held at once and counts the denoiser by its largest tensor, not whole."""
    tiny = resolve_source(ModelConfig(path=f"tiny:{name}"))
    family = detect_family(tiny)
    family.save_diffusers(family.load(tiny), tmp_path / "folder", torch.bfloat16)
    cfg = load_config(None, [f"model.path={tmp_path / 'folder'}", f"cache.dir={cache_root}", "data.resolution=64",
                             "train.device=cpu", "train.mode=full", "save.dtype=bf16"], need_data=False)
    facts = read_facts(cfg, cache_root)
    assert facts.largest_denoiser_values == 0  # no single-file facts: the folder's bound applies
    n = sum(p.numel() for p in facts.denoiser.parameters())
    written = written_at_once(facts, cfg, 2)
    bundle = family.load(resolve_source(cfg.model, cache_root))
    seen = {"peak": 0}
    module = sys.modules[type(family).__module__]
    monkeypatch.setattr(module, "save_atomic_lazy", _tracked(save_atomic_lazy, seen))
    family.save_single_file(bundle, tmp_path / "m.safetensors", torch.bfloat16, {})
    assert 0 < seen["peak"] <= written
    assert facts.vae_stored_bytes == 4 * facts.vae_params  # the folder's VAE in fp32, as loaded
    carried = facts.vae_stored_bytes + sum(e.stored_bytes for e in facts.encoders)
    assert written - carried < n  # the denoiser's share: under half its size in bf16
