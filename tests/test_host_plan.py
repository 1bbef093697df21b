"""Host memory in the plan (fit/host.py, memory.host_budget): the predicted terms against what a
run really holds, the host budget in the planner's choice, its default, the plan's lines, and a
part of a model file loaded without a second copy in host memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from vramfit.cli import main
from vramfit.config.load import load_config
from vramfit.fit import host
from vramfit.fit.host import HostBudgetError, host_budget_of
from vramfit.memory.offload.staging import SHEETS
from vramfit.fit.model_facts import read_facts
from vramfit.fit.planner import PlanError, choose, host_prediction, predict, with_values
from vramfit.memory.accounting import tensor_bytes
from vramfit.models.registry import detect_family
from vramfit.models.sources import resolve_source
from vramfit.optim.build import build_optimizer
from vramfit.train.setup import place_denoiser

GIB = 2**30


def _cfg(cache_root, *sets: str):
    return load_config(None, ["model.path=tiny:sdxl", f"cache.dir={cache_root}", "data.resolution=64",
                              "data.bucket_step=32", "train.device=cpu", *sets], need_data=False)


def test_the_denoiser_terms_are_the_bytes_the_run_holds(cache_root, monkeypatch):
    """Loaded as the file stores it; streamed homes, their gradients and optimizer state (a streamed
    full fine-tune stepping in CPU memory) as place_denoiser and the optimizer allocate them."""
    cfg = _cfg(cache_root, "train.mode=full", "memory.stream_weights=true", "train.optimizer=adamw",
               "train.precision=mixed_bf16", "train.optimizer_in_backward=false")
    facts = read_facts(cfg, cache_root)
    source = resolve_source(cfg.model, cache_root)
    bundle = detect_family(source, "auto").load(source)
    assert facts.loaded_bytes == sum(tensor_bytes(t) for t in bundle.denoiser.state_dict().values())
    load = host_prediction(facts, cfg).phase("load").parts
    assert load["denoiser"] == facts.loaded_bytes

    streamer = place_denoiser(bundle, cfg, torch.device("cpu"))
    train = host_prediction(facts, cfg).phase("train").parts
    assert streamer.streamed_bytes() > 0
    assert train["streamed homes"] == streamer.streamed_bytes()
    streamed = [p for u in streamer.units for p in u.params]
    optimizer = build_optimizer([p for p in bundle.denoiser.parameters() if p.requires_grad], cfg.train)
    for p in bundle.denoiser.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    optimizer.step()
    assert train["streamed gradients"] == sum(tensor_bytes(p.grad) for p in streamed)
    state = sum(tensor_bytes(v) for p in streamed for v in optimizer.state[p].values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    assert train["streamed optimizer state"] == state
    # two processes on this machine (torchrun's LOCAL_WORLD_SIZE) hold twice as much
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert host_prediction(facts, cfg).phase("train").peak == 2 * sum(train.values())
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    # the EMA in CPU memory is the planner's own term
    ema = host_prediction(facts, with_values(cfg, {"ema.enabled": True, "ema.device": "cpu"}))
    assert ema.phase("train").parts["ema"] > 0


def test_a_quantized_base_is_held_as_loaded_not_cast_whole(cache_root):
    """A quantized LoRA base is placed a layer at a time (tests/test_quantized_placement.py): the
    train phase holds the denoiser as loaded with its unquantized parts widened, and on a CPU run
    one linear widened beside it; never the whole denoiser cast to fp32."""
    cfg = _cfg(cache_root, "train.mode=lora", "lora.base_quantization=int8", "train.precision=mixed_bf16")
    facts = read_facts(cfg, cache_root)
    linears = [sum(p.numel() for p in m.parameters()) for m in facts.denoiser.modules()
               if isinstance(m, torch.nn.Linear)]
    floats = sum(t.numel() for t in [*facts.denoiser.parameters(), *facts.denoiser.buffers()]
                 if t.is_floating_point())
    train = host_prediction(facts, cfg).phase("train").parts
    assert train["denoiser cast"] == 0
    assert train["denoiser placed by layer"] == facts.loaded_bytes + 4 * max(linears)  # a fp32 file
    bf16_file = replace(facts, loaded_bytes=2 * floats)
    on_gpu = host_prediction(bf16_file, with_values(cfg, {"train.device": "cuda"})).phase("train").parts
    assert on_gpu["denoiser placed by layer"] == 2 * floats + 2 * (floats - sum(linears))


def test_the_host_budget_refuses_a_combination_and_names_the_key(cache_root):
    """Planned for a GPU (the device's memory apart from the host's), with only memory.stream_weights
    left free: a GPU budget that only streamed weights fit takes them where the host budget holds
    their homes, gradients and optimizer state, and is refused naming memory.host_budget where not."""
    cfg = _cfg(cache_root, "train.mode=full", "train.optimizer=adamw", "train.gradient_checkpointing=true",
               "train.optimizer_in_backward=false", "memory.offload_activations=false",
               "train.cuda_graphs=false")
    cfg = with_values(cfg, {"train.device": "cuda"})
    facts = read_facts(cfg, cache_root)
    resident, streamed = (with_values(cfg, {"memory.stream_weights": s}) for s in (False, True))
    gpu = int(_gpu_peak(streamed, facts) / 0.9) + 1
    assert _gpu_peak(resident, facts) > gpu * 0.9  # only streaming fits the GPU
    host_need = host_prediction(facts, streamed).peak
    assert host_need > host_prediction(facts, resident).peak  # the homes and their state are host memory
    picked = choose(with_values(cfg, {"memory.host_budget": str(host_need)}), gpu, facts)
    assert picked.chosen["memory.stream_weights"] is True
    short = with_values(cfg, {"memory.host_budget": str(host_need - 1)})
    with pytest.raises(PlanError, match=r"nothing fits in host memory: memory\.host_budget .* the smallest "
                                        r"host prediction is .* memory.stream_weights = true"):
        choose(short, gpu, facts)
    # below what loading needs, nothing fits whatever the GPU budget: the error names the key
    with pytest.raises(PlanError, match=r"memory\.host_budget is 0\.29 GiB .*loading the models is "):
        choose(with_values(cfg, {"memory.host_budget": "300MiB"}), 64 * GIB, facts)


def test_the_fit_probe_phase_is_planned_and_named_where_it_is_what_does_not_fit(cache_root):
    """On a GPU the fit probe's phase holds the models as loaded and the stand-in's placed buffers
    (streamed homes and the sums at home) at once: a host budget between the train phase and it is
    refused naming memory.fit_probe, and fits with the probe off."""
    cfg = _cfg(cache_root, "train.mode=full", "train.optimizer=adafactor", "train.precision=full_bf16",
               "train.optimizer_in_backward=true", "train.grad_accum=2", "memory.stream_weights=true",
               "memory.streamed_grad_sums=home", "memory.offload_activations=false", "train.cuda_graphs=false",
               "train.gradient_checkpointing=true", "cache.vae_tiling=false", "memory.stream_encoders=false",
               "memory.resident_blocks=0")
    cfg = with_values(cfg, {"train.device": "cuda"})
    facts = read_facts(cfg, cache_root)
    phases = {p.name: p for p in host_prediction(facts, cfg, for_gpu=True).phases}
    probe, train = phases["fit probe"], phases["train"]
    assert probe.parts["stand-in's streamed homes"] == train.parts["streamed homes"] > 0
    # the stand-in's units share the largest unit's fp32 sums; the run keeps one per streamed value
    homes, sums = train.parts["streamed homes"], train.parts["streamed gradient sums"]
    largest = (sums - 2 * homes) // SHEETS
    assert 0 < largest < homes
    assert probe.parts["stand-in's streamed gradient sums"] == (2 + SHEETS) * largest < sums
    assert probe.peak > max(p.peak for name, p in phases.items() if name != "fit probe")
    budget = f"{(probe.peak + max(p.peak for n, p in phases.items() if n != 'fit probe')) // 2}"
    short = with_values(cfg, {"memory.host_budget": budget})
    with pytest.raises(PlanError, match=r"in the fit probe phase.*memory\.fit_probe = false leaves out"):
        choose(short, 64 * GIB, facts)
    off = choose(with_values(short, {"memory.fit_probe": False}), 64 * GIB, facts)
    assert off.chosen is not None


def _gpu_peak(cfg, facts) -> int:
    return predict(facts, cfg).peak


def test_the_default_host_budget_is_the_machines_memory_less_a_margin(cache_root, monkeypatch):
    cfg = _cfg(cache_root)
    monkeypatch.setattr(host.psutil, "virtual_memory", lambda: SimpleNamespace(total=32 * GIB))
    assert host_budget_of(cfg)[0] == 32 * GIB - int(3.2 * GIB)
    monkeypatch.setattr(host.psutil, "virtual_memory", lambda: SimpleNamespace(total=16 * GIB))
    assert host_budget_of(cfg)[0] == 14 * GIB  # the margin is at least 2 GiB
    given = with_values(cfg, {"memory.host_budget": "12GiB"})
    assert host_budget_of(given) == (12 * GIB, "memory.host_budget")
    with pytest.raises(HostBudgetError, match="memory.host_budget: 'lots' is not a size"):
        host_budget_of(with_values(cfg, {"memory.host_budget": "lots"}))
    # over the machine's own budget (not one the user set) the GPU's choice stands, with a warning
    monkeypatch.setattr(host.psutil, "virtual_memory", lambda: SimpleNamespace(total=2 * GIB))
    choice = choose(cfg, 64 * GIB, read_facts(cfg, cache_root))
    warned = [r for r in choice.reasons if r.startswith("host memory: over this machine's")]
    assert any("loading the models is predicted" in r for r in warned), choice.reasons


def test_the_plan_prints_host_memory_by_phase_and_a_bad_budget_names_the_key(cache_root, capsys):
    base = ["plan", "--set", "model.path=tiny:sdxl", "--set", f"cache.dir={cache_root}", "--set",
            "data.resolution=64", "--set", "data.bucket_step=32", "--set", "train.device=cpu"]
    assert main([*base, "--set", "memory.host_budget=3GiB", "--vram", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "with the choice below, the device's beside it; host budget 3.00 GiB (memory.host_budget)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and line.split()[0] in
            ("load", "cache_latents", "cache_text", "train", "save")]
    assert [r[0] for r in rows] == ["load", "cache_latents", "cache_text", "train", "save"]  # with the choice
    assert all(r[2].endswith(("G", "M")) for r in rows)
    assert main([*base, "--set", "memory.host_budget=lots"]) == 2
    assert "memory.host_budget" in capsys.readouterr().err


LOAD = """
import json, sys, torch
from pathlib import Path
from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer
from vramfit.config.load import load_config
from vramfit.fit.model_facts import read_facts
from vramfit.fit.planner import host_prediction
from vramfit.memory.accounting import MemoryTracker
from vramfit.models.registry import detect_family
from vramfit.models.sources import resolve_source
root = Path(sys.argv[1])
cfg = load_config(None, ["model.path=tiny:sdxl", f"cache.dir={root}", "train.device=cpu"], need_data=False)
source = resolve_source(cfg.model, root)
family = detect_family(source, "auto")
facts = read_facts(cfg, root)
tracker = MemoryTracker(torch.device("cpu"))
with tracker.phase("before"):
    pass
with tracker.phase("load"):
    bundle = family.load(source)
before, load = tracker.report.phases
pred = host_prediction(facts, cfg).phase("load")
print(json.dumps([load.rss_peak - before.rss_peak, pred.peak - pred.parts["baseline"]]))
"""


def test_the_load_phase_grows_the_resident_memory_by_the_predicted_models(cache_root):
    """A fresh process (the model file written before, the model classes imported): loading tiny:sdxl
    grows the peak RSS by the predicted models' bytes (a 32 MiB UNet, the VAE and the CLIPs), plus
    at most 16 MiB of Python objects and tokenizers; a second copy of the UNet would be 32 MiB more."""
    read_facts(_cfg(cache_root), cache_root)  # the tiny file exists before the measured process starts
    done = subprocess.run([sys.executable, "-c", LOAD, str(cache_root)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    growth, predicted = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.9 * predicted <= growth <= predicted + 16 * 2**20, (growth, predicted)


LOADER = """
import json, sys, torch
from vramfit.formats.safetensors_io import load_prefixed
from vramfit.memory.accounting import MemoryTracker
tracker = MemoryTracker(torch.device("cpu"))
with tracker.phase("before"):
    pass
with tracker.phase("load"):
    state = load_prefixed(sys.argv[1], "part.", torch.bfloat16)
assert all(t.dtype == torch.bfloat16 for t in state.values()) and len(state) == 24
before, load = tracker.report.phases
print(json.dumps([before.rss_peak, load.rss_peak]))
"""


def test_a_part_converted_while_it_loads_is_held_once(tmp_path):
    """300 MB of fp16 tensors read and converted to bf16: the peak grows by the converted part and
    a tensor, not by the file's pages beside it (a memory map) nor a whole dict converted after."""
    from safetensors.torch import save_file

    path = tmp_path / "part.safetensors"
    values = 300 * 10**6 // 2 // 24
    save_file({f"part.{i}": torch.full((values,), 0.5, dtype=torch.float16) for i in range(24)}, str(path))
    done = subprocess.run([sys.executable, "-c", LOADER, str(path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    before, peak = json.loads(done.stdout.strip().splitlines()[-1])
    size = path.stat().st_size
    assert peak - before < 1.5 * size, (peak - before) / size


def test_a_plan_for_a_gpu_budget_counts_no_device_memory_on_the_host(cache_root):
    """`vramfit plan --vram` on a machine without a GPU plans a GPU run: the device's memory is not
    added to the host's, as it is for a CPU run."""
    cfg = _cfg(cache_root, "train.device=auto")
    facts = read_facts(cfg, cache_root)
    planned = host_prediction(facts, cfg, for_gpu=True).phase("train").parts
    assert "device (CPU run)" not in planned
    on_cpu = host_prediction(facts, with_values(cfg, {"train.device": "cpu"}), for_gpu=True).phase("train")
    assert on_cpu.parts["device (CPU run)"] > 0


def test_a_host_budget_without_a_gpu_budget_is_checked_before_anything_loads(images, tmp_path, cache_root, capsys):
    """No plan chooses settings without memory.vram_budget: the settings as written are checked
    against memory.host_budget, and a run over it stops naming the key, with nothing written."""
    out = tmp_path / "run"
    code = main(["train", "--no-progress", "--set", "model.path=tiny:sdxl", "--set", f"data.path={images}",
                 "--set", "data.resolution=64", "--set", "data.min_size=64", "--set", f"cache.dir={cache_root}",
                 "--set", "train.device=cpu", "--set", "memory.host_budget=1MiB", "--set", f"output.dir={out}"])
    err = capsys.readouterr().err
    assert code != 0 and "memory.host_budget is 0.00 GiB" in err and "Traceback" not in err
    assert not (out / "run.json").exists()
