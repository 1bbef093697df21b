"""train.cuda_graphs on CPU: the CUDA recording is stood in for by one that keeps its contract
where gradients go (the replayed backward adds into the buffers that were `p.grad` when it was
recorded, whatever `p.grad` is at replay time), so the loop's handling of those buffers, the
first eager call and the per-signature recordings are what is tested. Weights whose bf16
gradients the hooks sum with stochastic rounding (accumulation) are stood in for likewise: the
replayed backward adds into the accumulation buffers kept when it was recorded."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main
from vramfit.config.load import load_config
from vramfit.memory.checkpointing import graph_safe_checkpoint
from vramfit.optim.in_backward import RecordedSums
from vramfit.train import graphs


class BakedRecording:
    def __init__(self, flat, tensors, prepare):
        self.flat = flat
        self.static_in = [t.detach().clone() for t in tensors]
        with torch.enable_grad():
            outs = flat(*self.static_in)
        step = prepare(outs)
        sums = step if isinstance(step, RecordedSums) else None
        summed = {id(p) for p in sums.params} if sums else set()
        self.params = [p for p in graphs.used_parameters(outs) if id(p) not in summed]
        for p in self.params:  # as a recorded backward does where no buffer is in place: makes its own
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.targets = [p.grad for p in self.params]  # the addresses a recorded backward writes to
        # the recorded hooks add each summed weight's fresh gradient into the buffer kept now
        self.summed = sums.params if sums else []
        self.kept = [(sums.steps, id(p), sums.steps._buffers[id(p)]) for p in self.summed]

    def forward(self, tensors):
        with torch.enable_grad():
            self.outs = self.flat(*tensors)
        return list(self.outs)

    def backward(self, grads):
        found = (torch.autograd.grad(self.outs, self.params, grads, allow_unused=True, retain_graph=True)
                 if self.params else [])
        with torch.no_grad():
            for target, grad in zip(self.targets, found):
                if grad is not None:
                    target.add_(grad)
        if self.summed:  # the hooks run (in autograd's order, as recorded); where they add is checked
            torch.autograd.backward(self.outs, grads, inputs=self.summed)
            moved = [key for steps, key, buffer in self.kept if steps._buffers.get(key) is not buffer]
            assert not moved, "a replay adds into the accumulation buffers kept when it was recorded"
        self.outs = None


@pytest.fixture
def recorded(monkeypatch):
    calls: list = []

    def init(self, denoiser, recorder=None, **kwargs):
        original_init(self, denoiser, recorder=lambda flat, tensors, prepare: (
            calls.append(tuple(tuple(t.shape) for t in tensors)) or BakedRecording(flat, tensors, prepare)),
            **kwargs)

    original_init = graphs.GraphedDenoiser.__init__
    monkeypatch.setattr(graphs.GraphedDenoiser, "__init__", init)
    monkeypatch.setattr(graphs, "check_device", lambda device: None)
    return calls


def _train(images, out, cache, *extra, model="tiny:ssd1b"):
    # without graphs unless `extra` asks for them (on a machine with a GPU they are on by default)
    assert main(train_args(images, out, cache, "save.dtype=fp32", "save.name=m", "train.precision=mixed_bf16",
                           "train.optimizer=adamw", "train.lr=1e-4", "train.cuda_graphs=false", *extra,
                           model=model)) == 0
    return json.loads((out / "run.json").read_text())["losses"], load_file(str(out / "m.safetensors"))


def _assert_same(a, b):
    losses_a, weights_a = a
    losses_b, weights_b = b
    assert losses_a == pytest.approx(losses_b, rel=1e-5)
    for key in weights_a:
        # (in fp32: SD3's single file holds an fp8 T5, which assert_close compares only bit for bit)
        torch.testing.assert_close(weights_a[key].float(), weights_b[key].float(), rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_graphed_training_with_accumulation_equals_training_without(images, tmp_path, cache_root, recorded,
                                                                    checkpointing):
    cache = cache_root / "graphs"
    sets = ["train.grad_accum=2", "train.steps=3", f"train.gradient_checkpointing={str(checkpointing).lower()}"]
    plain = _train(images, tmp_path / "plain", cache, *sets)
    assert recorded == []
    graphed = _train(images, tmp_path / "graphed", cache, *sets, "train.cuda_graphs=true")
    # each input signature (bucket shape) recorded once, after the first (eager) call of the run
    assert recorded and len(recorded) == len(set(recorded))
    _assert_same(graphed, plain)


# tiny SD3 (SSD-1B with checkpointing runs on the GPU, tests/test_graphs_cuda.py: here its compilation takes 30 s)
def test_compiled_blocks_record_and_train_as_without_graphs(images, tmp_path, cache_root, recorded, monkeypatch):
    """train.compile beside train.cuda_graphs through the CLI: each bucket shape compiles in an eager
    step and then records, again after each sample grid (which drops the recordings), and the run
    trains as the compiled run without graphs does."""
    compiled = []
    eager_compile = torch.nn.Module.compile

    def compile_for_test(module, *args, **kwargs):  # AOT autograd's graphs, run without generating C++
        compiled.append(type(module).__name__)
        eager_compile(module, *args, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_for_test)
    # the stand-in recording runs one autograd graph's backward at every replay (retain_graph), which
    # AOT autograd's donated buffers forbid; a CUDA recording runs it once
    monkeypatch.setattr("torch._functorch.config.donated_buffer", False)
    model, cache = "tiny:sd3", cache_root / "graphs-sd3"
    sets = ["train.grad_accum=2", "train.steps=3", "train.precision=fp32", "train.compile=true",
            "train.gradient_checkpointing=false", "sample.every_steps=1",
            "sample.prompts=['a red circle']", "sample.steps=1", "sample.seeds=[1]"]
    alone = _train(images, tmp_path / "alone", cache, *sets, model=model)
    assert recorded == [] and compiled
    calls = []  # (signatures that ran eagerly, recordings held) before each training call
    forward = graphs.GraphedDenoiser.forward

    def counting(self, *args, **kwargs):
        if self.denoiser.training and torch.is_grad_enabled():
            calls.append((len(self._eager_keys), self.captures))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(graphs.GraphedDenoiser, "forward", counting)
    both = _train(images, tmp_path / "both", cache, *sets, "train.cuda_graphs=true", model=model)
    # two micro-batches a step, a grid after steps 1 and 2. Step 1: eager, then the same shape
    # records. The grid drops it; step 2 has two shapes, each eager (none recorded, yet the grid
    # after it still makes them run eagerly again); step 3 eager, then recorded
    assert calls == [(0, 0), (1, 0), (0, 0), (1, 0), (0, 0), (1, 0)]
    assert len(recorded) == 2
    _assert_same(both, alone)


def test_the_stand_in_recording_catches_gradients_that_miss_the_recorded_buffers(images, tmp_path, cache_root,
                                                                                 recorded, monkeypatch):
    """Without the owned buffers put back after each optimizer step, a replay's gradients land
    where the loop no longer looks: the stand-in is strict enough to show it."""
    cache = cache_root / "graphs"
    sets = ["train.grad_accum=2", "train.steps=3", "train.gradient_checkpointing=false"]
    plain = _train(images, tmp_path / "plain", cache, *sets)
    adopt = graphs.GraphedDenoiser._adopt

    def never_put_back(self, params):  # buffers made, but not zeroed and put back after a step
        adopt(self, [p for p in params if id(p) not in self._owned])

    monkeypatch.setattr(graphs.GraphedDenoiser, "_adopt", never_put_back)
    broken = _train(images, tmp_path / "broken", cache, *sets, "train.cuda_graphs=true")
    assert recorded
    with pytest.raises(AssertionError):
        _assert_same(broken, plain)


def test_a_failed_recording_warns_and_runs_those_inputs_without_graphs(images, tmp_path, cache_root, monkeypatch,
                                                                       caplog):
    def refuse(self, denoiser, recorder=None, **kwargs):
        def fail(flat, tensors, prepare):
            raise RuntimeError("operation not permitted when stream is capturing")
        original_init(self, denoiser, recorder=fail, **kwargs)

    original_init = graphs.GraphedDenoiser.__init__
    monkeypatch.setattr(graphs.GraphedDenoiser, "__init__", refuse)
    monkeypatch.setattr(graphs, "check_device", lambda device: None)
    cache = cache_root / "graphs"
    sets = ["train.gradient_checkpointing=false", "train.steps=4", "train.grad_accum=2"]
    plain = _train(images, tmp_path / "plain", cache, *sets)
    with caplog.at_level("WARNING", logger="vramfit"):
        fallback = _train(images, tmp_path / "fallback", cache, *sets, "train.cuda_graphs=true")
    assert "run without CUDA graphs" in caplog.text and "not permitted" in caplog.text
    _assert_same(fallback, plain)


def test_used_parameters_finds_the_weights_an_output_depends_on():
    used, unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    x = torch.randn(2, 4)
    found = graphs.used_parameters((used(frozen(x)).sum(dim=1),))
    assert {id(p) for p in found} == {id(used.weight), id(used.bias)}
    assert not any(p is unused.weight for p in found)


def test_on_the_cpu_the_run_stops_before_any_weight_loads(images, tmp_path, cache_root, capsys):
    code = main(train_args(images, tmp_path / "cpu", cache_root / "graphs", "train.device=cpu",
                           "train.cuda_graphs=true"))
    assert code == 2
    err = capsys.readouterr().err
    assert "train.cuda_graphs" in err and "CUDA device" in err
    assert not (tmp_path / "cpu" / "run.json").exists()


def test_settings_a_replay_cannot_hold_are_refused():
    # streamed weights of a full fine-tune stepping in CPU memory (the step after backward)
    with pytest.raises(ValueError, match="train.cuda_graphs: cannot be used with memory.stream_weights"):
        load_config(None, ["train.cuda_graphs=true", "memory.stream_weights=true"], need_data=False)
    # offloaded activations record: their copies go to pinned buffers kept from step to step
    offloaded = load_config(None, ["train.cuda_graphs=true", "memory.offload_activations=true"], need_data=False)
    assert offloaded.train.cuda_graphs is True


@pytest.mark.parametrize("sets,ok", [
    (["train.mode=lora"], True),  # a frozen base streamed: no gradient of it
    (["train.optimizer=adafactor", "train.optimizer_in_backward=true", "train.grad_accum=1"], True),
    # AdamW's state is not compact: streamed weights step in CPU memory
    (["train.optimizer=adamw", "train.optimizer_in_backward=true", "train.grad_accum=1"], False),
    (["train.optimizer=adafactor", "train.grad_accum=1"], False),
], ids=["lora", "full-adafactor-inbwd", "full-adamw-inbwd", "full-step-after-backward"])
def test_streamed_weights_record_where_they_step_on_the_gpu_or_not_at_all(sets, ok):
    args = ["train.cuda_graphs=true", "memory.stream_weights=true", *sets]
    if ok:
        assert load_config(None, args, need_data=False).train.cuda_graphs is True
    else:
        with pytest.raises(ValueError, match="memory.stream_weights in a full fine-tune that steps streamed "
                                             "weights in CPU memory"):
            load_config(None, args, need_data=False)


def test_graphed_streamed_lora_equals_training_without(images, tmp_path, cache_root, recorded):
    """The graphed denoiser over a streamed base (stand-in recording: the streamer's hooks run at
    every call here; on a GPU, tests/test_graphs_cuda.py, once, while recording) trains as the
    streamed run without graphs; the recording's device is the streamer's, not the first weight's."""
    cache = cache_root / "graphs-sd3"
    sets = ["train.mode=lora", "train.lr=1e-2", "train.grad_accum=2", "train.steps=3", "memory.stream_weights=true",
            "train.precision=fp32"]
    plain = _train(images, tmp_path / "plain", cache, *sets, model="tiny:sd3")
    graphed = _train(images, tmp_path / "graphed", cache, *sets, "train.cuda_graphs=true", model="tiny:sd3")
    assert recorded
    _assert_same(graphed, plain)


def test_graphed_flux_lora_equals_training_without(images, tmp_path, cache_root, recorded):
    """Flux.1 behind the graph wrapper (which has no diffusers config: the family reads the guidance
    embedding's presence from the bundle) trains as without graphs."""
    cache = cache_root / "graphs-flux"
    sets = ["train.mode=lora", "train.lr=1e-2", "train.grad_accum=2", "train.steps=3", "train.precision=fp32"]
    plain = _train(images, tmp_path / "plain", cache, *sets, model="tiny:flux")
    graphed = _train(images, tmp_path / "graphed", cache, *sets, "train.cuda_graphs=true", model="tiny:flux")
    assert recorded
    _assert_same(graphed, plain)


@pytest.mark.parametrize("adapter", ["dora"])  # LoKr too on the GPU (test_graphs_cuda.py)
def test_graphed_adapters_equal_training_without(images, tmp_path, cache_root, recorded, adapter):
    """DoRA forms its adapted weight each call (peft), as LoKr does: recorded, it trains as without graphs."""
    cache = cache_root / "graphs-adapters"
    sets = ["train.mode=lora", f"lora.type={adapter}", "train.lr=1e-2", "train.steps=3", "train.precision=fp32",
            "save.formats=['lora_kohya']"]
    plain = _train(images, tmp_path / "plain", cache, *sets, model="tiny:sdxl")
    graphed = _train(images, tmp_path / "graphed", cache, *sets, "train.cuda_graphs=true", model="tiny:sdxl")
    assert recorded
    _assert_same(graphed, plain)


def test_the_step_inside_backward_records_with_one_micro_batch_only():
    graphed = ["train.cuda_graphs=true", "train.optimizer_in_backward=true"]
    load_config(None, [*graphed, "train.grad_accum=1"], need_data=False)
    with pytest.raises(ValueError, match="train.optimizer_in_backward with train.grad_accum > 1"):
        load_config(None, [*graphed, "train.grad_accum=2"], need_data=False)


BF16_SUMS = ["train.precision=full_bf16", "train.optimizer=adafactor", "train.lr=1e-3", "train.grad_accum=3",
             "train.steps=3", "train.gradient_checkpointing=false"]


@pytest.fixture
def sums_as_on_a_gpu(monkeypatch):
    """The CPU's first micro-batch adds into zeros as a GPU's does (optim/in_backward.py UNIFORM_ON)."""
    from vramfit.optim.in_backward import BackwardSteps

    monkeypatch.setattr(BackwardSteps, "UNIFORM_ON", ("cuda", "cpu"))


def test_graphed_rounded_bf16_sums_equal_training_without(images, tmp_path, cache_root, recorded,
                                                          sums_as_on_a_gpu):
    """bf16 weights, three micro-batches a step summed with stochastic rounding: the recorded
    backward adds into the kept buffers with the eager run's draws, step after step."""
    load_config(None, ["train.cuda_graphs=true", *BF16_SUMS], need_data=False)  # no longer refused
    cache = cache_root / "graphs"
    plain = _train(images, tmp_path / "plain", cache, *BF16_SUMS)
    graphed = _train(images, tmp_path / "graphed", cache, *BF16_SUMS, "train.cuda_graphs=true")
    assert recorded
    _assert_same(graphed, plain)


@pytest.mark.parametrize("sums", [False, True])
def test_sample_grids_drop_the_recordings_and_their_buffers_and_training_goes_on_the_same(
        images, tmp_path, cache_root, recorded, caplog, sums, sums_as_on_a_gpu):
    """A grid between steps gets the memory of the recordings and of the gradient buffers kept
    for them (owned ones; with bf16 sums, the hooks' kept sums); the next step records again."""
    cache = cache_root / "graphs"
    sets = [*(BF16_SUMS if sums else ["train.grad_accum=2"]), "train.steps=2", "sample.every_steps=1",
            "sample.prompts=['a red circle']", "sample.steps=1", "sample.seeds=[1]"]
    plain = _train(images, tmp_path / "plain", cache, *sets)
    with caplog.at_level("INFO", logger="vramfit"):
        graphed = _train(images, tmp_path / "graphed", cache, *sets, "train.cuda_graphs=true")
    assert caplog.text.count("recordings dropped for the sample grid") == 1  # after step 1 (2 is the last)
    assert len(recorded) > len(set(recorded))  # the same inputs recorded again after each grid
    _assert_same(graphed, plain)


def test_the_stand_in_catches_sums_whose_buffers_are_made_again(images, tmp_path, cache_root, recorded,
                                                                monkeypatch, sums_as_on_a_gpu):
    """Without keep_sums the buffers are handed to the step and made again at the next one,
    where a replay's sums would not land: the stand-in stops there."""
    from vramfit.optim.in_backward import BackwardSteps

    cache = cache_root / "graphs"
    keep = BackwardSteps.keep_sums

    def made_again(self, params):
        summed = keep(self, params)
        self._kept = False
        return summed

    monkeypatch.setattr(BackwardSteps, "keep_sums", made_again)
    with pytest.raises(AssertionError, match="accumulation buffers kept"):
        _train(images, tmp_path / "broken", cache, *BF16_SUMS, "train.cuda_graphs=true")
    assert recorded


def test_by_default_graphs_record_on_a_gpu_where_nothing_refuses_them(monkeypatch):
    """train.cuda_graphs = "auto": the schema keeps it as written; the resolution step decides it for
    the environment (fit/resolve.py), left out of the keys set for the planner."""
    from vramfit.fit.resolve import Environment, with_automatic_values

    def loaded(*sets, gpu=True):
        cfg = load_config(None, list(sets), need_data=False)
        assert cfg.train.cuda_graphs in ("auto", True, False)
        device = torch.device("cuda" if gpu and cfg.train.device != "cpu" else "cpu")
        return with_automatic_values(cfg, Environment(device, int(os.environ.get("WORLD_SIZE", "1")))).train

    on = loaded()
    assert on.cuda_graphs is True and "cuda_graphs" not in on.model_fields_set
    written = loaded("train.cuda_graphs=auto")  # written out, it is still the default's to decide
    assert written.cuda_graphs is True and "cuda_graphs" not in written.model_fields_set
    assert loaded(gpu=False).cuda_graphs is False
    assert loaded().cuda_graphs is True  # a section left out is not the class's shared default, changed
    assert loaded("train.device=cpu").cuda_graphs is False
    assert loaded("memory.stream_weights=true").cuda_graphs is False  # off beside it, where `true` is an error
    assert loaded("memory.offload_activations=true").cuda_graphs is True
    assert loaded("train.compile=true").cuda_graphs is True  # compiled blocks record
    assert loaded("train.mode=lora", "lora.dropout=0.1").cuda_graphs is False
    monkeypatch.setenv("WORLD_SIZE", "2")  # a process of a multi-GPU run (DDP)
    assert loaded().cuda_graphs is False


def test_a_default_that_resolved_on_does_not_stop_a_multi_gpu_launch(monkeypatch):
    """`vramfit train --gpus N` checks the config in the launching process, where the default
    resolves as for one process; its N processes resolve it off."""
    from vramfit.train.distributed import composition_problems

    from vramfit.fit.resolve import Environment, with_automatic_values

    for sets in ([], ["train.cuda_graphs=auto"]):
        default = with_automatic_values(load_config(None, sets, need_data=False), Environment(torch.device("cuda")))
        assert default.train.cuda_graphs is True and composition_problems(default, 2) == []
    written = load_config(None, ["train.cuda_graphs=true"], need_data=False)
    assert [p.split(":")[0] for p in composition_problems(written, 2)] == ["train.cuda_graphs"]


@pytest.fixture
def graphs_by_default_on_the_cpu(monkeypatch):
    """The default resolves on and the fit probe measures the recorded step over the GPU (stand-ins:
    the run trains on the CPU, graphed through the stand-in recording); returns the probes' settings."""
    from vramfit.config.rules import graph_clashes
    from vramfit.fit import probe, resolve

    probed: list = []

    def fake_probe(family, bundle, cfg, device, buckets, **kwargs):
        probed.append(cfg.train.cuda_graphs)
        if cfg.train.cuda_graphs:
            raise probe.FitProbeError("fit probe: two training steps at the largest bucket peaked at 9.00 GiB, "
                                      "more than the 8.00 GiB of the GPU; nothing was cached. ...")

    monkeypatch.setattr(resolve, "graphs_by_default", lambda cfg, env: not graph_clashes(cfg))
    monkeypatch.setattr(probe, "fit_probe", fake_probe)
    monkeypatch.setattr(graphs, "check_device", lambda device: None)
    return probed


def test_graphs_on_by_default_that_do_not_fit_are_turned_off(images, tmp_path, cache_root, caplog,
                                                             graphs_by_default_on_the_cpu):
    with caplog.at_level("WARNING", logger="vramfit"):
        assert main(train_args(images, tmp_path / "run", cache_root / "graphs", "train.precision=mixed_bf16",
                               "train.optimizer=adamw")) == 0
    assert graphs_by_default_on_the_cpu == [True, False]  # the recorded step, then the one without
    assert "does not fit" in caplog.text and "without graphs" in caplog.text
    report = json.loads(next((tmp_path / "run").glob("*.memory.json")).read_text())
    assert [p["name"] for p in report["phases"]].count("load") == 1  # probed again, not loaded again
    saved = load_config(tmp_path / "run" / "config.toml", [], need_data=False)
    assert saved.train.cuda_graphs is False  # what the run did


def test_graphs_the_user_asked_for_that_do_not_fit_stop_the_run(images, tmp_path, cache_root, capsys,
                                                                graphs_by_default_on_the_cpu):
    code = main(train_args(images, tmp_path / "run", cache_root / "graphs", "train.precision=mixed_bf16",
                           "train.optimizer=adamw", "train.cuda_graphs=true"))
    assert code != 0 and "fit probe" in capsys.readouterr().err
    assert graphs_by_default_on_the_cpu == [True]
    assert not (tmp_path / "run" / "run.json").exists()


def test_lora_dropout_is_refused_and_a_plain_or_quantized_base_passes():
    with pytest.raises(ValueError, match="train.cuda_graphs: cannot be used with lora.dropout"):
        load_config(None, ["train.cuda_graphs=true", "train.mode=lora", "lora.dropout=0.1"], need_data=False)
    for base in ("none", "int8", "nf4"):
        load_config(None, ["train.cuda_graphs=true", "train.mode=lora", f"lora.base_quantization={base}"],
                    need_data=False)


@pytest.mark.parametrize("base", ["int8", "nf4"])
def test_graphed_lora_over_a_quantized_base_equals_training_without(images, tmp_path, cache_root, recorded, base):
    cache = cache_root / "graphs"
    sets = ["train.mode=lora", f"lora.base_quantization={base}", "train.grad_accum=2", "train.steps=3"]
    plain = _train(images, tmp_path / "plain", cache, *sets)
    graphed = _train(images, tmp_path / "graphed", cache, *sets, "train.cuda_graphs=true")
    assert recorded
    _assert_same(graphed, plain)


def test_moving_a_quantized_weight_counts_as_the_weights_moving():
    """torchao's quantized tensors report data_ptr 0; their inner tensors say where they live."""
    from vramfit.memory.quantize import quantize_base

    model = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16).requires_grad_(False)
    quantize_base(model, "int8")
    before = graphs.weight_addresses(model.modules())
    assert len(before) > 2 and 0 not in before  # data, scale (and zero point) of the weight, the bias
    model[0].weight = model[0].weight.clone()  # what offloading to another device and back does
    after = graphs.weight_addresses(model.modules())
    assert after != before and after[0] == before[0]  # the bias (a parameter, listed first) stayed


def test_the_planner_leaves_out_what_cuda_graphs_refuses():
    from vramfit.fit.model_facts import facts_for_layout
    from vramfit.fit.planner import free_knobs

    facts = facts_for_layout("ssd1b")
    cfg = load_config(None, ["model.path=tiny:ssd1b"], need_data=False)
    graphed = load_config(None, ["model.path=tiny:ssd1b", "train.cuda_graphs=true"], need_data=False)
    keys = {k.key for k in free_knobs(cfg, facts)}
    kept = {k.key for k in free_knobs(graphed, facts)}
    assert {"train.optimizer_in_backward", "memory.stream_weights", "memory.offload_activations"} <= keys
    # offloaded activations record; so do a full fine-tune's streamed weights, beside the step in
    # backward (free here) with Adafactor, but not with an optimizer whose state steps on the CPU
    assert keys == kept
    adamw = load_config(None, ["model.path=tiny:ssd1b", "train.cuda_graphs=true", "train.optimizer=adamw"],
                        need_data=False)
    assert keys - {k.key for k in free_knobs(adamw, facts)} == {"memory.stream_weights"}
    assert load_config(None, ["model.path=tiny:ssd1b"], need_data=False).train.optimizer == "adafactor"
    # the step inside backward records with graphs, but only at one micro-batch a step
    accumulating = load_config(None, ["model.path=tiny:ssd1b", "train.cuda_graphs=true", "train.grad_accum=2",
                                      "train.precision=mixed_bf16"],
                               need_data=False)
    assert "train.optimizer_in_backward" not in {k.key for k in free_knobs(accumulating, facts)}
    assert "train.gradient_checkpointing" in kept


def test_graph_safe_checkpoint_gives_the_gradients_of_no_checkpointing():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    direct = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    checked = torch.autograd.grad(graph_safe_checkpoint(block, x).square().sum(), [x, *block.parameters()])
    for a, b in zip(direct, checked):
        torch.testing.assert_close(a, b)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x, scale=1.0):
        return self.b(torch.tanh(self.a(x))) * scale


def _eager_grads(xs):
    """The gradients of each input through a fresh _Tiny without graphs."""
    eager = _Tiny()
    expected = []
    for x in xs:
        eager(x).square().mean().backward()
        expected.append([p.grad.clone() for p in eager.parameters()])
        eager.zero_grad(set_to_none=True)
    return expected


def _steps(model, calls, xs):
    """Forward and backward of each input through a GraphedDenoiser (stand-in recorder); the
    gradients after each, the loop's zero_grad(set_to_none=True) between them."""
    graphed = graphs.GraphedDenoiser(model, recorder=lambda flat, tensors, prepare: (
        calls.append(tuple(tuple(t.shape) for t in tensors)) or BakedRecording(flat, tensors, prepare)))
    grads = []
    for x in xs:
        graphed(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return graphed, grads


def test_moved_weights_are_recorded_again_and_give_eager_gradients():
    xs = [torch.randn(2, 4), torch.randn(2, 4), torch.randn(3, 4), torch.randn(2, 4)]
    expected = _eager_grads(xs)
    calls = []
    model = _Tiny()
    graphed, grads = _steps(model, calls, xs[:2])
    assert calls == [((2, 4),)] and graphed.captures == 1  # the first call warmed up, the second recorded
    with torch.no_grad():  # what CPU offload and back does to each weight: new memory, same values
        for p in model.parameters():
            p.data = p.data.clone()
    for x in xs[2:]:
        graphed(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    assert calls == [((2, 4),), ((3, 4),), ((2, 4),)]  # everything recorded again after the move
    for got, want in zip(grads, expected):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_with_compiled_blocks_each_signature_runs_eagerly_once_before_it_records():
    """A compiled block compiles (and loads kernels) at the first call of each shape, which a
    recording must not do: with warm_each every signature's first call runs eagerly, its second
    records, and the gradients are the eager ones throughout."""
    xs = [torch.randn(2, 4), torch.randn(2, 4), torch.randn(3, 4), torch.randn(3, 4), torch.randn(2, 4)]
    expected = _eager_grads(xs)
    model = _Tiny()
    shapes = []
    graphed = graphs.GraphedDenoiser(model, warm_each=True, recorder=lambda flat, tensors, prepare: (
        shapes.append(tuple(tensors[0].shape)) or BakedRecording(flat, tensors, prepare)))
    for n, x in enumerate(xs):
        graphed(x).square().mean().backward()
        for g, w in zip([p.grad for p in model.parameters()], expected[n]):
            torch.testing.assert_close(g, w)
        model.zero_grad(set_to_none=True)
        assert shapes == [(2, 4), (3, 4)][:{0: 0, 1: 1, 2: 1, 3: 2, 4: 2}[n]]
    assert graphed.captures == 2
    graphed.release()  # a sample grid's turn: its calls may have compiled for other sizes
    for expect in ([(2, 4), (3, 4)], [(2, 4), (3, 4), (2, 4)]):  # eager again first, then recorded
        graphed(xs[0]).square().mean().backward()
        model.zero_grad(set_to_none=True)
        assert shapes == expect
    with torch.no_grad():  # weights moved (offload and back): recordings dropped, eager first again
        for p in model.parameters():
            p.data = p.data.clone()
    for expect in ([(2, 4), (3, 4), (2, 4)], [(2, 4), (3, 4), (2, 4), (2, 4)]):
        graphed(xs[0]).square().mean().backward()
        model.zero_grad(set_to_none=True)
        assert shapes == expect


def test_inputs_that_want_gradients_run_eagerly():
    calls = []
    model = _Tiny()
    x = torch.randn(2, 4, requires_grad=True)
    graphed, _ = _steps(model, calls, [torch.randn(2, 4), x, x])
    assert calls == [] and x.grad is not None


def test_reentrant_checkpointing_is_not_recorded():
    block = torch.nn.Linear(4, 4)
    out = torch.utils.checkpoint.checkpoint(block, torch.randn(2, 4, requires_grad=True), use_reentrant=True)
    with pytest.raises(RuntimeError, match="reentrant"):
        graphs.used_parameters((out,))


def test_with_the_step_in_backward_recording_waits_for_a_finished_step():
    """The first recording must come after a step whose optimizer kernels ran eagerly (CUDA cannot
    load a kernel while it records): a first call whose loss was not finite leaves none run."""
    from vramfit.optim.adafactor import Adafactor
    from vramfit.optim.in_backward import BackwardSteps

    model = _Tiny()
    params = list(model.parameters())
    hooks = BackwardSteps(params, Adafactor(params, lr=1e-3), in_backward=True, round_sums=False)
    calls = []

    def refuse(flat, tensors, prepare):  # counts recordings; each then runs eagerly
        calls.append(1)
        raise RuntimeError("stand-in recording")

    graphed = graphs.GraphedDenoiser(model, recorder=refuse, steps=hooks)
    x = torch.randn(2, 4)
    graphed(x)  # the first call, eager; its loss "was not finite": no backward, no step
    graphed(x)
    assert calls == []  # still eager: no step has run
    hooks.begin(last=True)
    graphed(x).square().mean().backward()
    hooks.finish()
    graphed(x)
    assert calls == [1]  # after a finished step the next call records


def test_cublas_workspaces_are_kept_while_another_denoiser_holds_recordings(monkeypatch):
    """The workspaces are the process's: a new pool's first recording frees them only when no
    other denoiser still holds recordings that replay with them; one that is only garbage (the
    fit probe's) is collected first and does not hold them back."""
    cleared: list[int] = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(1), raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    older, newer = graphs.GraphedDenoiser(torch.nn.Linear(2, 2)), graphs.GraphedDenoiser(torch.nn.Linear(2, 2))
    assert graphs.release_cublas_workspaces(newer) and cleared == [1]  # the older one has recorded nothing
    older._recordings["signature"] = object()  # now it has
    assert not graphs.release_cublas_workspaces(newer) and cleared == [1]
    older._recordings.clear()  # dropped (its weights moved): nothing replays with the workspaces
    assert graphs.release_cublas_workspaces(newer) and cleared == [1, 1]
    older._recordings["signature"] = object()
    cycle = [older]
    cycle.append(cycle)  # garbage only a collection frees, as the probe's denoiser is
    del older, cycle
    assert graphs.release_cublas_workspaces(newer) and cleared == [1, 1, 1]


def test_graphs_the_planner_chose_that_do_not_fit_are_turned_off(images, tmp_path, cache_root, caplog,
                                                                 graphs_by_default_on_the_cpu, monkeypatch):
    """Under memory.vram_budget the planner sets train.cuda_graphs; the user did not ask for them,
    so a recorded step the probe finds too large falls back as the default's does. (The planner
    offers graphs where a GPU is there: it is made to see one; the run still trains on the CPU.)"""
    from vramfit.fit import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(resolve, "pick_device", lambda name: torch.device("cpu"))
    with caplog.at_level("INFO", logger="vramfit"):
        assert main(train_args(images, tmp_path / "run", cache_root / "graphs", "train.precision=mixed_bf16",
                               "train.optimizer=adamw", "memory.vram_budget=64GiB")) == 0
    assert "train.cuda_graphs = true" in caplog.text  # the planner's choice
    assert graphs_by_default_on_the_cpu == [True, False]
    assert "train.cuda_graphs (memory.vram_budget): off, the step fits without graphs" in caplog.text
    saved = load_config(tmp_path / "run" / "config.toml", [], need_data=False)
    assert saved.train.cuda_graphs is False


def test_config_toml_keeps_the_default_undecided_and_says_what_it_resolved_to(tmp_path, monkeypatch):
    """A run's config.toml, given again on another machine or with --gpus N, must decide the
    default afresh: it says "auto", with this run's resolution beside it as a comment."""
    from vramfit.config.load import dump_config
    from vramfit.fit.resolve import Environment, with_automatic_values
    from vramfit.train.distributed import composition_problems

    gpu, cpu = Environment(torch.device("cuda")), Environment(torch.device("cpu"))
    ran = with_automatic_values(load_config(None, [], need_data=False), gpu)
    assert ran.train.cuda_graphs is True
    text = dump_config(ran)
    assert 'cuda_graphs = "auto"  # resolved for this run: on' in text
    (tmp_path / "config.toml").write_text(text)
    again = load_config(tmp_path / "config.toml", [], need_data=False)
    assert again.train.cuda_graphs == "auto" and composition_problems(again, 2) == []
    again = with_automatic_values(again, gpu)
    assert "cuda_graphs" not in again.train.model_fields_set and composition_problems(again, 2) == []
    # a machine without a GPU
    assert with_automatic_values(load_config(tmp_path / "config.toml", [], need_data=False), cpu).train.cuda_graphs is False
    chosen = load_config(None, ["train.cuda_graphs=false"], need_data=False)
    assert "cuda_graphs = false\n" in dump_config(chosen)  # a value the user (or a fallback) set stays


def test_when_neither_step_fits_the_error_gives_both_measurements(images, tmp_path, cache_root, capsys,
                                                                  graphs_by_default_on_the_cpu, monkeypatch):
    from vramfit.fit import probe

    def fake_probe(family, bundle, cfg, device, buckets, **kwargs):
        graphs_by_default_on_the_cpu.append(cfg.train.cuda_graphs)
        peak = "9.00" if cfg.train.cuda_graphs else "8.50"
        raise probe.FitProbeError(f"fit probe: two training steps at the largest bucket peaked at {peak} GiB, "
                                  "more than the 8.00 GiB of the GPU; nothing was cached. ...")

    monkeypatch.setattr(probe, "fit_probe", fake_probe)
    code = main(train_args(images, tmp_path / "run", cache_root / "graphs", "train.precision=mixed_bf16",
                           "train.optimizer=adamw"))
    err = capsys.readouterr().err
    assert code != 0 and graphs_by_default_on_the_cpu == [True, False]
    assert "with CUDA graphs (auto)" in err and "9.00 GiB" in err and "Without them" in err and "8.50 GiB" in err
