"""The fit probe (fit/probe.py) and the spill warning (fit/spill.py), on the CPU with the
measurements injected: the probe's steps really run on a stand-in and leave the real weights
as they were; a peak over the limit stops with a clear message; the spill watch warns once,
only near the limit and only when the slowdown persists."""
from __future__ import annotations

import pytest
import torch

from conftest import SIZE
from vramfit.config.schema import RunConfig
from vramfit.fit.planner import GIB
from vramfit.fit.probe import FitProbeError, fit_probe
from vramfit.fit.spill import SpillWatch
from vramfit.models.registry import detect_family
from vramfit.models.sources import resolve_source

CPU = torch.device("cpu")
BUCKETS = [(SIZE, SIZE), (SIZE // 2, SIZE * 2), (SIZE // 2, SIZE // 2)]


def _loaded(**sections):
    # graphs pinned off: left to their default they would be on where a GPU is (the probe then
    # measures reserved memory and its message adds a note)
    train = {"cuda_graphs": False, **sections.pop("train", {})}
    cfg = RunConfig.model_validate({"data": {"resolution": SIZE}, "train": train, **sections})
    source = resolve_source(cfg.model)
    family = detect_family(source)
    return cfg, family, family.load(source)


def _running(peak: int, results: list):
    def measure(run):
        results.append(run())
        return peak
    return measure


@pytest.mark.parametrize("sections", [
    {"model": {"path": "tiny:ssd1b"}, "train": {"grad_accum": 3, "optimizer_in_backward": True}},
    {"model": {"path": "tiny:sd3"}, "train": {"mode": "lora", "optimizer": "adamw8bit"},
     "lora": {"base_quantization": "int8"}},
])
def test_the_probe_trains_a_stand_in_and_leaves_the_real_weights_alone(sections):
    cfg, family, bundle = _loaded(**sections)
    before = {k: v.clone() for k, v in bundle.denoiser.state_dict().items()}
    results: list = []
    assert fit_probe(family, bundle, cfg, CPU, BUCKETS, limit=GIB, measure=_running(GIB // 2, results)) == GIB // 2
    assert len(results[0].losses) == 2  # two optimizer steps ran
    after = bundle.denoiser.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert all(p.grad is None for p in bundle.denoiser.parameters())
    assert not any("lora" in k for k in after)  # the placement happened to the stand-in only


def test_a_non_finite_probe_step_is_skipped_and_still_measured():
    """The zero-weight stand-in under an fp8 base gives NaN (a zero row's scale is 0): the probe
    skips that step as the run would and still reports the memory it used."""
    cfg, family, bundle = _loaded(model={"path": "tiny:ssd1b"}, train={"mode": "lora", "nonfinite": "stop"},
                                  lora={"base_quantization": "fp8"})
    results: list = []
    assert fit_probe(family, bundle, cfg, CPU, BUCKETS, limit=GIB, measure=_running(GIB // 4, results)) == GIB // 4
    assert len(results) == 1


def test_a_probe_that_fails_for_another_reason_lets_the_run_go_on(caplog):
    cfg, family, bundle = _loaded(model={"path": "tiny:ssd1b"})

    def broken(run):
        raise RuntimeError("a kernel the stand-in could not run")

    assert fit_probe(family, bundle, cfg, CPU, BUCKETS, limit=GIB, measure=broken) is None
    assert "fit probe could not run" in caplog.text


def test_a_peak_over_the_budget_stops_with_the_measurement_and_a_suggestion():
    cfg, family, bundle = _loaded(model={"path": "tiny:ssd1b"}, memory={"vram_budget": "1GiB"})
    with pytest.raises(FitProbeError) as err:
        fit_probe(family, bundle, cfg, CPU, BUCKETS, measure=_running(3 * GIB, []))
    message = str(err.value)
    assert "peaked at 3.00 GiB" in message and "1.00 GiB budget" in message
    assert f"{SIZE}x{SIZE}" in message and "nothing was cached" in message
    assert "planner" in message
    assert "cuda_graphs" not in message  # the note is for recorded steps only


def test_a_recorded_step_over_the_limit_names_the_step_without_graphs():
    cfg, family, bundle = _loaded(model={"path": "tiny:ssd1b"}, memory={"vram_budget": "1GiB"})
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"cuda_graphs": True})})
    with pytest.raises(FitProbeError) as err:
        fit_probe(family, bundle, cfg, CPU, BUCKETS, measure=lambda run: 3 * GIB)
    assert "memory pool" in str(err.value) and "--set train.cuda_graphs=false" in str(err.value)


def test_the_probe_is_skipped_on_the_cpu_and_when_turned_off():
    cfg, family, bundle = _loaded(model={"path": "tiny:ssd1b"})
    assert fit_probe(family, bundle, cfg, CPU, BUCKETS) is None  # no CUDA, nothing injected
    off = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"fit_probe": False})})
    calls: list = []
    assert fit_probe(family, bundle, off, CPU, BUCKETS, measure=_running(0, calls)) is None
    assert not calls


# ---- spill warning ----------------------------------------------------------------------------------

def _watch(reserved: float, messages: list, **kwargs) -> SpillWatch:
    return SpillWatch(10 * GIB, lambda: int(reserved * GIB), warn=messages.append, **kwargs)


def test_a_persistent_slowdown_near_the_limit_warns_once():
    messages: list = []
    watch = _watch(9.5, messages)
    times = [9.0, 1.0, 1.0] + [1.0] * 6 + [4.0, 4.0, 4.0] + [4.0] * 5
    fired = [i for i, t in enumerate(times) if watch.observe(t)]
    assert fired == [11]  # the third slow step in a row, never again
    assert len(messages) == 1 and "spilling" in messages[0] and "Sysmem Fallback" in messages[0]
    assert "memory.vram_budget" in messages[0]


def test_no_warning_far_from_the_limit_or_for_one_slow_step():
    far: list = []
    watch = _watch(5.0, far)
    assert not any(watch.observe(t) for t in [1.0] * 6 + [5.0] * 6)
    near: list = []
    watch = _watch(9.8, near)
    assert not any(watch.observe(t) for t in [1.0] * 6 + [8.0] + [1.0] * 4 + [8.0, 8.0] + [1.0] * 3)
    assert not far and not near


def test_slow_first_steps_are_not_counted_and_step_done_times_itself():
    messages: list = []
    clock = iter([0.0, 10.0, 20.0, 30.0, 31.0, 32.0, 33.0, 34.0, 38.0, 42.0, 46.0])
    watch = _watch(9.9, messages, clock=lambda: next(clock), warmup=3)
    fired = [watch.step_done() for _ in range(11)]
    assert fired.index(True) == 10 and fired.count(True) == 1
    assert SpillWatch.for_device(CPU) is None


@pytest.mark.gpu
def test_on_cuda_the_probe_measures_and_gives_its_memory_back():
    cuda = torch.device("cuda")
    cfg, family, bundle = _loaded(model={"path": "tiny:sd3"}, train={"mode": "lora"},
                                  lora={"base_quantization": "int8"})
    before = torch.cuda.memory_allocated(cuda)
    peak = fit_probe(family, bundle, cfg, cuda, BUCKETS)
    assert peak is not None and peak > before
    # the stand-in and its optimizer are gone (cuBLAS keeps its workspace, a few MiB)
    assert torch.cuda.memory_allocated(cuda) <= before + 64 * 2**20
    assert all(p.device.type == "cpu" for p in bundle.denoiser.parameters())
    tight = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"vram_budget": "1MiB"})})
    with pytest.raises(FitProbeError, match="1 x 64x64"):
        fit_probe(family, bundle, tight, cuda, BUCKETS)
    assert SpillWatch.for_device(cuda) is not None
