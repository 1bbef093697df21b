"""train.cuda_graphs with real CUDA recordings (skipped without a GPU): graphed runs through the CLI
against the same runs without graphs, with several buckets, accumulation (bf16 sums with
stochastic rounding too), sample grids between steps (which move the weights and force new
recordings), a quantized LoRA base, the optimizer step inside backward recorded with the
backward, compiled blocks, streamed weights and offloaded activations."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main

pytestmark = pytest.mark.gpu


def _train(images, out, cache, model, *extra):
    # without graphs unless `extra` asks for them: on a GPU they are on by default.
    # Each run compiles afresh: torch.compile remembers across runs of one process which sizes
    # changed, and a later run would compile other kernels (dynamic sizes), rounding otherwise
    torch._dynamo.reset()
    assert main(train_args(images, out, cache, "save.dtype=fp32", "save.name=m", "train.device=cuda",
                           "memory.fit_probe=false", "train.steps=4", "train.grad_accum=2",
                           "train.cuda_graphs=false", *extra, model=model)) == 0
    return json.loads((out / "run.json").read_text())["losses"], load_file(str(out / "m.safetensors"))


# a full fine-tune, fp32 weights under bf16 autocast; a sample grid after every second step
FULL_ADAMW = ["train.precision=mixed_bf16", "train.optimizer=adamw", "train.lr=1e-4"]
SAMPLES = ["sample.every_steps=2", "sample.prompts=['a red circle']", "sample.steps=2"]
STREAMED_INBWD = ["train.precision=full_bf16", "train.optimizer=adafactor", "train.lr=1e-3", "train.grad_accum=1",
                  "train.optimizer_in_backward=true", "memory.stream_weights=true"]

CASES = {
    "ssd1b-full": ("tiny:ssd1b", FULL_ADAMW),
    "ssd1b-full-checkpointed-samples": ("tiny:ssd1b", [*FULL_ADAMW, "train.gradient_checkpointing=true", *SAMPLES]),
    # half of the blocks checkpointed (memory/checkpointing.py), the graph-safe checkpoint inside
    "ssd1b-full-half-checkpointed": ("tiny:ssd1b", [*FULL_ADAMW, "train.gradient_checkpointing=0.5"]),
    # bf16 weights, two micro-batches a step summed with stochastic rounding in the recorded backward
    "ssd1b-full-bf16-sums": ("tiny:ssd1b", [
        "train.precision=full_bf16", "train.optimizer=adafactor", "train.lr=1e-3", "train.gradient_checkpointing=true"]),
    "sd3-lora-nf4": ("tiny:sd3", ["train.mode=lora", "lora.base_quantization=nf4", "train.lr=1e-4"]),
    "sdxl-lora-int8": ("tiny:sdxl", ["train.mode=lora", "lora.base_quantization=int8", "train.lr=1e-4"]),
    # sample grids between steps drop the recordings (over a quantized base too); the next step records again
    "sd3-lora-fp8-samples": ("tiny:sd3", ["train.mode=lora", "lora.base_quantization=fp8", "train.lr=1e-4", *SAMPLES]),
    # the step inside backward, recorded with the backward: one micro-batch a step, a learning rate
    # that moves every step (the recorded step reads it from the device), clipping per tensor
    "ssd1b-full-inbwd-fp32": ("tiny:ssd1b", [
        "train.precision=mixed_bf16", "train.optimizer=adafactor", "train.lr=1e-3", "train.grad_accum=1",
        "train.optimizer_in_backward=true", "train.gradient_checkpointing=true", "train.lr_scheduler=cosine",
        "train.warmup_steps=2", "train.max_grad_norm=0.5"]),
    "ssd1b-full-inbwd-bf16": ("tiny:ssd1b", [
        "train.precision=full_bf16", "train.optimizer=adafactor", "train.lr=1e-3", "train.grad_accum=1",
        "train.optimizer_in_backward=true", "train.lr_scheduler=cosine"]),
    # weight decay (read from a recorded place by a Triton kernel) and tensors stepped in chunks
    # (CHUNKED lowers the limit so that the tiny model has some): the fused Adafactor kernels recorded
    "ssd1b-full-inbwd-bf16-decay-chunked": ("tiny:ssd1b", [
        "train.precision=full_bf16", "train.optimizer=adafactor", "train.lr=1e-3", "train.grad_accum=1",
        "train.optimizer_in_backward=true", "train.weight_decay=0.01", "train.lr_scheduler=cosine"]),
    "sd3-lora-inbwd-adamw": ("tiny:sd3", [
        "train.mode=lora", "train.optimizer=adamw", "train.lr=1e-3", "train.grad_accum=1",
        "train.optimizer_in_backward=true", "train.lr_scheduler=cosine", "train.weight_decay=0.01"]),
    # compiled blocks recorded (both sides compiled): each bucket shape compiles in an eager step first
    "sd3-full-compiled": ("tiny:sd3", [*FULL_ADAMW, "train.compile=true"]),
    # ... and again after each sample grid, whose calls compile the blocks for inference
    "sd3-full-compiled-samples": ("tiny:sd3", [*FULL_ADAMW, "train.compile=true", *SAMPLES]),
    "ssd1b-full-inbwd-compiled-checkpointed": ("tiny:ssd1b", [
        "train.precision=full_bf16", "train.optimizer=adafactor", "train.lr=1e-3", "train.grad_accum=1",
        "train.optimizer_in_backward=true", "train.gradient_checkpointing=true", "train.compile=true"]),
    # streamed weights recorded with their copies into the streamer's slots, their step on those
    # copies inside backward and the copies of the new values home (memory/offload/grads.py)
    "sd3-full-streamed-inbwd": ("tiny:sd3", [*STREAMED_INBWD, "train.gradient_checkpointing=true"]),
    # half of the blocks keep their saved weights as references, fetched again in backward; blocks
    # split into several units; the fit probe records its stand-in's streamed step too
    "ssd1b-full-streamed-inbwd-half-checkpointed-probed": ("tiny:ssd1b", [
        *STREAMED_INBWD, "train.gradient_checkpointing=0.5", "memory.stream_unit_mib=0.5", "memory.fit_probe=true"]),
    # a streamed frozen base under LoRA, two micro-batches a step
    "sd3-lora-streamed": ("tiny:sd3", ["train.mode=lora", "train.lr=1e-4", "memory.stream_weights=true"]),
    # offloaded activations recorded with their copies to the streamer's kept pinned buffers and back
    # (each bucket shape runs once eagerly first, which makes them): every activation of the blocks
    # that do not recompute, under accumulation; with the step in backward; beside a streamed base
    "ssd1b-full-offloaded-half-checkpointed": ("tiny:ssd1b", [
        *FULL_ADAMW, "train.gradient_checkpointing=0.5", "memory.offload_activations=true"]),
    "sd3-full-offloaded-inbwd": ("tiny:sd3", [
        *STREAMED_INBWD[:-1], "train.gradient_checkpointing=true", "memory.offload_activations=true"]),
    "sd3-lora-streamed-offloaded": ("tiny:sd3", [
        "train.mode=lora", "train.lr=1e-4", "memory.stream_weights=true", "memory.offload_activations=true"]),
    # Flux.1: the recorded transformer is a wrapper without diffusers' config (the family reads what it
    # needs from the bundle), over a streamed or nf4 base, and a streamed full fine-tune stepped in backward
    "flux-lora-streamed": ("tiny:flux", ["train.mode=lora", "train.lr=1e-4", "memory.stream_weights=true"]),
    # ... under checkpointing with blocks above memory.stream_unit_mib: the frozen base's units are the
    # recomputed blocks whole (a unit a part of one left its Parameters at home for the block's backward)
    "flux-lora-streamed-checkpointed-cut": ("tiny:flux", [
        "train.mode=lora", "train.lr=1e-4", "memory.stream_weights=true", "train.gradient_checkpointing=true",
        "memory.stream_unit_mib=0.01"]),
    "flux-lora-nf4-samples": ("tiny:flux", ["train.mode=lora", "lora.base_quantization=nf4", "train.lr=1e-4",
                                            *SAMPLES]),
    # sample grids of a streamed base: the denoiser renders streamed, only the VAE placed on the GPU
    "flux-lora-streamed-samples": ("tiny:flux", ["train.mode=lora", "train.lr=1e-4", "memory.stream_weights=true",
                                                 *SAMPLES]),
    "flux-full-streamed-inbwd": ("tiny:flux", [*STREAMED_INBWD, "train.gradient_checkpointing=true"]),
    # adapters that form their weight each call (peft's DoRA and LoKr), recorded
    "sdxl-dora": ("tiny:sdxl", ["train.mode=lora", "lora.type=dora", "train.lr=1e-4", "save.formats=['lora_kohya']"]),
    "sdxl-lokr-conv": ("tiny:sdxl", ["train.mode=lora", "lora.type=lokr", "lora.conv_rank=2", "train.lr=1e-4"]),
}


CHUNKED = {"ssd1b-full-inbwd-bf16-decay-chunked": 4096}  # Adafactor's MIN_PACK_NUMEL for the case


@pytest.mark.parametrize("case", list(CASES))
def test_graphed_runs_on_the_gpu_match_runs_without(images, tmp_path, cache_root, caplog, monkeypatch, case):
    model, sets = CASES[case]
    if case in CHUNKED:
        from vramfit.optim.adafactor import Adafactor

        monkeypatch.setattr(Adafactor, "MIN_PACK_NUMEL", CHUNKED[case])
    if "train.compile=true" in sets:
        # every bucket shape compiled for its own sizes in both runs. With torch's automatic dynamic
        # sizes a second shape compiles kernels for any size, which the run without graphs then
        # uses for the first shape too, while the recording keeps the kernels it was recorded with:
        # both right, rounding apart
        monkeypatch.setattr("torch._dynamo.config.automatic_dynamic_shapes", False)
    cache = cache_root / "graphs-cuda"
    with caplog.at_level("INFO", logger="vramfit"):
        plain_losses, plain_weights = _train(images, tmp_path / "plain", cache, model, *sets)
    assert "recorded the denoiser's forward and backward" not in caplog.text  # the eager side is eager
    caplog.clear()
    with caplog.at_level("INFO", logger="vramfit"):
        losses, weights = _train(images, tmp_path / "graphed", cache, model, *sets, "train.cuda_graphs=true")
    assert "recorded the denoiser's forward and backward" in caplog.text
    assert "run without CUDA graphs" not in caplog.text  # no signature fell back to eager
    if "sample.every_steps=2" in sets:  # the grid's memory: recordings dropped before it, made again after
        assert "recordings dropped for the sample grid" in caplog.text
    # the same kernels in the same order: equal up to the few last bits that reductions may differ in
    assert losses == pytest.approx(plain_losses, rel=1e-3, abs=1e-5)
    for key in plain_weights:
        if plain_weights[key].dtype == torch.float8_e4m3fn:  # SD3's T5 in its single file: not trained
            assert torch.equal(weights[key].view(torch.uint8), plain_weights[key].view(torch.uint8)), key
        elif "train.precision=full_bf16" in sets:
            # the same draws, but a last bit of the fp32 update may move a stochastic rounding to the
            # other bf16 neighbour (0.4 to 0.8% apart): a few values in a thousand at most
            close = torch.isclose(weights[key], plain_weights[key], rtol=1e-3, atol=1e-5)
            assert close.float().mean() > 0.99, key
            torch.testing.assert_close(weights[key], plain_weights[key], rtol=2e-2, atol=1e-4, msg=key)
        else:
            torch.testing.assert_close(weights[key], plain_weights[key], rtol=1e-3, atol=1e-5, msg=key)


def test_recording_frees_the_eager_cublas_workspaces():
    """The eager warm-up leaves cuBLAS workspaces on the default stream (forward and autograd's
    backward thread); the recordings make their own on their stream. The first recording frees
    the eager ones, so recording adds little beyond its activations instead of a second pair of
    workspaces (8 to 32 MiB each, by GPU)."""
    from vramfit.train.graphs import GraphedDenoiser

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).cuda()
    graphed = GraphedDenoiser(model)
    x = torch.randn(8, 64, device="cuda")
    graphed(x).square().mean().backward()  # the eager warm-up: workspaces for both threads
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(2):  # records, then replays
        model.zero_grad(set_to_none=True)
        graphed(x).square().mean().backward()
    torch.cuda.synchronize()
    assert graphed.captures == 1
    assert torch.cuda.memory_allocated() - before < 4 * 2**20


def test_the_fit_probe_frees_its_recordings_workspaces_and_the_run_its_eager_ones(images, tmp_path, cache_root,
                                                                                  monkeypatch):
    """With the fit probe on, the workspaces are freed three times: at the probe's first
    recording, after the probe (whose denoiser, garbage by then, must not hold them), and at the
    run's first recording; none is held back by a denoiser that no longer records."""
    from vramfit.train import graphs

    calls: list[tuple[bool, bool]] = []  # (called by a denoiser, freed)
    release = graphs.release_cublas_workspaces
    monkeypatch.setattr(graphs, "release_cublas_workspaces",
                        lambda owner=None: calls.append((owner is not None, release(owner))) or calls[-1][1])
    out = tmp_path / "probed"
    assert main(train_args(images, out, cache_root / "graphs-cuda", "train.device=cuda", "memory.fit_probe=true",
                           "train.cuda_graphs=true", "train.steps=3", "train.precision=mixed_bf16",
                           "train.optimizer=adamw", model="tiny:ssd1b")) == 0
    assert calls == [(True, True), (False, True), (True, True)]


def test_graphs_on_by_default_fall_back_when_only_the_step_without_them_fits(images, tmp_path, cache_root,
                                                                             caplog, monkeypatch):
    """train.cuda_graphs left to its default: where the fit probe finds the recorded step over
    the GPU's memory and the step without graphs under it, the run trains without graphs and
    config.toml says so. The GPU's size is made to fall between the two measured peaks."""
    from vramfit.fit import probe

    peaks: list[int] = []
    measure = probe.fit_probe
    monkeypatch.setattr(probe, "fit_probe", lambda *a, **k: peaks.append(measure(*a, **k)) or peaks[-1])
    sets = ("train.device=cuda", "memory.fit_probe=true", "train.steps=2", "train.precision=mixed_bf16",
            "train.optimizer=adamw", "save.every_steps=0")
    cache = cache_root / "graphs-cuda"
    for side, graphs in (("graphed", "true"), ("eager", "false")):
        assert main(train_args(images, tmp_path / side, cache, *sets, f"train.cuda_graphs={graphs}",
                               model="tiny:ssd1b")) == 0
    graphed, eager = peaks
    assert graphed > eager, (graphed, eager)  # the recordings' pool keeps its room reserved

    real = torch.cuda.get_device_properties

    class Smaller:  # the GPU as the run sees it: its memory between the two peaks
        def __init__(self, props):
            self._props = props
            self.total_memory = (graphed + eager) // 2

        def __getattr__(self, name):
            return getattr(self._props, name)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: Smaller(real(*a, **k)))
    peaks.clear()
    out = tmp_path / "default"
    with caplog.at_level("INFO", logger="vramfit"):
        assert main(train_args(images, out, cache, *sets, model="tiny:ssd1b")) == 0
    assert "the recorded step does not fit" in caplog.text
    assert "off, the step fits without graphs" in caplog.text
    assert "recorded the denoiser's forward and backward" not in caplog.text.split("fits without graphs")[1]
    assert len(peaks) == 1 and "cuda_graphs = false" in (out / "config.toml").read_text()
