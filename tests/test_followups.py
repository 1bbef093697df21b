"""Follow-ups of the adapter types and the EMA: the fit probe holds a GPU EMA, LyCORIS files say
what kohya's trainer says of them, and an earlier run's EMA files are named before they are written
over."""
from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from conftest import SIZE, train_args
from vramfit.cli import main
from vramfit.config.schema import ModelConfig, RunConfig
from vramfit.fit import probe
from vramfit.fit.model_facts import read_facts
from vramfit.fit.planner import GIB, _factor_pair, adapter_temporaries, device_terms, with_values
from vramfit.formats import lora as L
from vramfit.formats.safetensors_io import read_header
from vramfit.models.registry import FAMILIES, detect_family
from vramfit.models.sources import resolve_source
from vramfit.train.lora import apply_lora
from vramfit.train.setup import save_lora_files

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sdxl(cache_root):
    source = resolve_source(ModelConfig(path="tiny:sdxl"), cache_root)
    return detect_family(source).load(source)


# ---- the fit probe builds a GPU EMA ---------------------------------------------------------------

@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_the_probe_keeps_an_ema_of_the_stand_ins_trained_weights(device, monkeypatch):
    """With [ema] on the GPU the probe's steps run with the EMA's shadows beside the stand-in's
    weights (updated after each step, as the run's loop does); an EMA in CPU memory is left out."""
    built: list = []

    class Spy(probe.EMA):
        def __init__(self, params, **kw):
            super().__init__(params, **kw)
            built.append(self)

    monkeypatch.setattr(probe, "EMA", Spy)
    cfg = RunConfig.model_validate({"model": {"path": "tiny:ssd1b"}, "data": {"resolution": SIZE},
                                    "train": {"mode": "lora", "cuda_graphs": False},
                                    "ema": {"enabled": True, "device": device, "dtype": "bf16"}})
    source = resolve_source(cfg.model)
    family = detect_family(source)
    bundle = family.load(source)
    seen: list = []

    def measure(run):
        seen.append(run())
        return GIB // 2

    assert probe.fit_probe(family, bundle, cfg, CPU, [(SIZE, SIZE)], limit=GIB, measure=measure) == GIB // 2
    assert len(seen[0].losses) == 2
    if device == "cpu":
        assert built == []
        return
    (ema,) = built
    assert ema.updates == 2 and not ema.on_cpu  # updated after both steps, beside the weights
    assert ema.shadows and all("lora" in n for n in ema.shadows)  # the stand-in's adapter, not the real model
    assert all(s.dtype == torch.bfloat16 for s in ema.shadows.values())
    assert not any("lora" in n for n, _ in bundle.denoiser.named_parameters())


# ---- LyCORIS metadata -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind, module, args", [
    ("lora", "networks.lora", {"conv_dim": "2", "conv_alpha": "3.0"}),
    ("dora", "lycoris.kohya", {"algo": "lora", "dora_wd": "True", "conv_dim": "2", "conv_alpha": "3.0"}),
    ("lokr", "lycoris.kohya", {"algo": "lokr", "factor": "4", "conv_dim": "2", "conv_alpha": "3.0"}),
    ("loha", "lycoris.kohya", {"algo": "loha", "conv_dim": "2", "conv_alpha": "3.0"}),
])
def test_kohya_files_name_the_network_module_and_args_kohya_writes(sdxl, tmp_path, kind, module, args):
    """What A1111's and kohya's tools read to tell LyCORIS files apart (ss_network_module,
    ss_network_args: json of strings, as kohya's trainer writes its network_args)."""
    cfg = RunConfig.model_validate({"model": {"path": "tiny:sdxl"}, "output": {"dir": str(tmp_path)},
                                    "train": {"mode": "lora"},
                                    "lora": {"type": kind, "rank": 4, "conv_rank": 2, "conv_alpha": 3.0,
                                             **({"lokr_factor": 4} if kind == "lokr" else {})}})
    bundle = copy.copy(sdxl)
    bundle.denoiser = copy.deepcopy(sdxl.denoiser).float()
    apply_lora(bundle.denoiser, cfg.lora)
    paths = save_lora_files(bundle, cfg, "m", cfg.save_formats, {})
    meta = {p.name: read_header(p)[1] for p in paths}
    kohya = meta["m.safetensors"]
    assert kohya["ss_network_module"] == module and json.loads(kohya["ss_network_args"]) == args
    assert kohya["ss_network_dim"] == "4"
    assert L.describe_lora(paths[0], FAMILIES.values()).get("adapter", "lora") == kind  # `vramfit inspect`
    for name, m in meta.items():  # the diffusers file (lora, dora) carries no kohya module
        assert name == "m.safetensors" or "ss_network_module" not in m


def test_a_plain_lora_without_convs_carries_no_network_args(sdxl, tmp_path):
    cfg = RunConfig.model_validate({"model": {"path": "tiny:sdxl"}, "output": {"dir": str(tmp_path)},
                                    "train": {"mode": "lora"}})
    bundle = copy.copy(sdxl)
    bundle.denoiser = copy.deepcopy(sdxl.denoiser).float()
    apply_lora(bundle.denoiser, cfg.lora)
    (path,) = save_lora_files(bundle, cfg, "m", ["lora_kohya"], {})
    meta = read_header(path)[1]
    assert meta["ss_network_module"] == "networks.lora" and "ss_network_args" not in meta


# ---- an earlier run's EMA files in the warning ----------------------------------------------------

def test_the_earlier_run_warning_names_its_ema_files(tmp_path, cache_root, caplog):
    """A new run into a folder with an earlier run's files (its EMA's among them) names them all
    before anything is written; here it then stops at its empty data folder."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("run.json", "m.safetensors", "m-ema.safetensors", "m-ema-kohya.safetensors",
                 "m-step000002.safetensors", "m-ema-step000001.safetensors", "m-ema-step000002.safetensors"):
        (out / name).write_bytes(b"earlier")
    (tmp_path / "images").mkdir()
    with caplog.at_level(logging.WARNING):
        assert main(train_args(tmp_path / "images", out, cache_root, "save.name=m")) != 0
    warned = [r.getMessage() for r in caplog.records if "earlier run" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert ("(run.json, m.safetensors, 1 intermediate checkpoint (m-step*), m-ema.safetensors, "
            "m-ema-kohya.safetensors, 2 intermediate checkpoints (m-ema-step*))") in warned[0]
    assert (out / "m-ema.safetensors").read_bytes() == b"earlier"


# ---- the planner's adapter bytes ------------------------------------------------------------------

def _adapter_config(kind: str, **lora) -> RunConfig:
    return RunConfig.model_validate({"model": {"path": "tiny:sdxl"}, "data": {"resolution": SIZE},
                                     "train": {"mode": "lora", "gradient_checkpointing": False},
                                     "lora": {"type": kind, **lora}})


@pytest.mark.parametrize("kind", ["lora", "dora", "lokr", "loha"])
@pytest.mark.parametrize("lora", [{"rank": 4, "conv_rank": 2, "conv_alpha": 3.0},
                                  {"rank": 16, "targets": ["all_linear"], "conv_rank": 1}])
def test_planned_adapter_bytes_are_the_ones_peft_builds(sdxl, kind, lora):
    """Every adapter type, on the linears and with lora.conv_rank on the UNet's convolutions: the
    planner's trained bytes (gradients, optimizer state) are those of the tensors apply_lora makes."""
    if kind == "lokr":
        lora = {**lora, "lokr_factor": 4} if lora["rank"] == 16 else lora
    cfg = _adapter_config(kind, **lora)
    facts = read_facts(cfg)
    terms = device_terms(facts, cfg)
    model = copy.deepcopy(sdxl.denoiser)
    apply_lora(model, cfg.lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert terms["gradients"] == sum(p.numel() * p.element_size() for p in trained)
    assert terms["trained numel"] == sum(p.numel() for p in trained)
    # AdamW: two fp32 values per trained value
    adamw = with_values(cfg, {"train.optimizer": "adamw"})
    assert device_terms(facts, adamw)["optimizer state"] == 2 * terms["gradients"]


def test_lokr_factors_split_dimensions_as_peft_does():
    from peft.tuners.lokr.layer import factorization

    for factor in (-1, 0, 1, 2, 3, 4, 8, 16, 100):
        for dim in (*range(1, 200), 320, 640, 1280, 2048, 5120, 10240):
            assert _factor_pair(dim, factor) == tuple(factorization(dim, factor)), (dim, factor)


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_the_planned_formed_weights_are_what_lokr_and_loha_keep_for_backward(sdxl, kind):
    """Without checkpointing LoKr and LoHa keep each module's formed update (a weight's size, fp32)
    for backward: the planner's adapter_temporaries is their sum + one more of the largest (being
    formed); DoRA's are two of the largest, LoRA makes none."""
    cfg = _adapter_config(kind, rank=4, conv_rank=2)
    model = copy.deepcopy(sdxl.denoiser)
    apply_lora(model, cfg.lora)
    model.train()
    formed: dict[str, torch.Tensor] = {}  # each adapted layer's update as it forms it
    for name, layer in model.named_modules():
        if hasattr(layer, "get_delta_weight"):
            def spy(*a, _form=layer.get_delta_weight, _name=name, **kw):
                formed[_name] = _form(*a, **kw)
                return formed[_name]
            layer.get_delta_weight = spy
    saved: set[int] = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    c = model.config
    # inputs that need gradients: every module's input then does, as the planner assumes (a module fed
    # by frozen inputs alone, the cross-attention's keys and values, keeps no update: an upper bound)
    x, ctx = torch.randn(1, c.in_channels, 8, 8, requires_grad=True), torch.randn(1, 6, c.cross_attention_dim,
                                                                                requires_grad=True)
    pooled = torch.randn(1, c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, torch.tensor([500]), ctx, added_cond_kwargs={
            "text_embeds": pooled, "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]])})
    assert out.sample.requires_grad
    layers = {n: m.get_base_layer().weight for n, m in model.named_modules()
              if hasattr(m, "get_delta_weight")}
    assert formed.keys() == layers.keys()
    for name, t in formed.items():  # weight-sized, fp32, kept for backward
        assert t.numel() == layers[name].numel() and t.dtype == torch.float32
        assert t.untyped_storage().data_ptr() in saved, name
    largest = max(4 * w.numel() for w in layers.values())
    facts = read_facts(cfg)
    assert adapter_temporaries(facts, cfg) == sum(4 * t.numel() for t in formed.values()) + largest
    for other, expect in (("dora", 2 * largest), ("lora", 0)):
        plain = _adapter_config(other, rank=4, conv_rank=2)
        assert adapter_temporaries(read_facts(plain), plain) == expect
