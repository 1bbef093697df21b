"""train.cuda_graphs on CPU: the recording is stood in for by a recorder that keeps torch's
contract (the replayed backward hands each gradient over in a buffer the graph owns and
overwrites at the next replay), so the loop's handling of those buffers is what is tested."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main
from vramfit.config.load import load_config
from vramfit.train import graphs


def graph_like_recorder(calls: list):
    """Record as torch.cuda.make_graphed_callables does, as far as gradients go: one buffer per
    weight, written by every backward, handed to autograd as that weight's gradient."""
    def record(module, sample_args):
        calls.append(tuple(tuple(t.shape) for t in sample_args))
        params = tuple(module.parameters())
        buffers: dict[int, torch.Tensor] = {}
        original = module.forward

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, count, *inputs_and_params):
                with torch.enable_grad():
                    ctx.outs = original(*inputs_and_params[:count])
                ctx.count = count
                return tuple(o.detach() for o in ctx.outs)

            @staticmethod
            def backward(ctx, *grad_outs):
                wanted = [p for p in params if p.requires_grad]
                found = iter(torch.autograd.grad(ctx.outs, wanted, grad_outs, allow_unused=True))
                handed = []
                for p in params:
                    grad = next(found) if p.requires_grad else None
                    if grad is not None:
                        buffer = buffers.setdefault(id(p), torch.empty_like(grad))
                        buffer.copy_(grad)
                        grad = buffer.detach()
                    handed.append(grad)
                return (None,) * (1 + ctx.count) + tuple(handed)

        module.forward = lambda *tensors: Replay.apply(len(tensors), *tensors, *params)
        return module
    return record


@pytest.fixture
def recorded(monkeypatch):
    calls: list = []
    monkeypatch.setattr(graphs, "make_graphed", graph_like_recorder(calls))
    monkeypatch.setattr(graphs, "check_device", lambda device: None)
    return calls


def _train(images, out, cache, *extra):
    assert main(train_args(images, out, cache, "save.dtype=fp32", "save.name=m", "train.precision=mixed_bf16",
                           "train.optimizer=adamw", "train.lr=1e-4", *extra)) == 0
    return json.loads((out / "run.json").read_text())["losses"], load_file(str(out / "m.safetensors"))


def _assert_same(a, b):
    losses_a, weights_a = a
    losses_b, weights_b = b
    assert losses_a == pytest.approx(losses_b, rel=1e-5)
    for key in weights_a:
        torch.testing.assert_close(weights_a[key], weights_b[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_graphed_training_with_accumulation_equals_training_without(images, tmp_path, cache_root, recorded,
                                                                    checkpointing):
    cache = cache_root / "graphs"
    sets = ["train.grad_accum=2", "train.steps=3", f"train.gradient_checkpointing={str(checkpointing).lower()}"]
    plain = _train(images, tmp_path / "plain", cache, *sets)
    assert recorded == []
    graphed = _train(images, tmp_path / "graphed", cache, *sets, "train.cuda_graphs=true")
    # one recording per input signature (bucket shape), none again when a shape comes back
    assert recorded and len(recorded) == len(set(recorded))
    _assert_same(graphed, plain)


def test_without_the_gradient_copies_accumulation_would_be_wrong(images, tmp_path, cache_root, recorded,
                                                                  monkeypatch):
    """The recorder above is strict enough to catch a sum left in a graph's buffer."""
    cache = cache_root / "graphs"
    sets = ["train.grad_accum=2", "train.steps=2", "train.gradient_checkpointing=false"]
    plain = _train(images, tmp_path / "plain", cache, *sets)
    monkeypatch.setattr(graphs, "own_gradients", lambda params: [])
    broken = _train(images, tmp_path / "broken", cache, *sets, "train.cuda_graphs=true")
    with pytest.raises(AssertionError):
        _assert_same(broken, plain)


def test_a_failed_recording_warns_and_runs_those_inputs_without_graphs(images, tmp_path, cache_root, monkeypatch,
                                                                       caplog):
    def refuse(module, sample_args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "make_graphed", refuse)
    monkeypatch.setattr(graphs, "check_device", lambda device: None)
    cache = cache_root / "graphs"
    plain = _train(images, tmp_path / "plain", cache, "train.gradient_checkpointing=false")
    with caplog.at_level("WARNING", logger="vramfit"):
        fallback = _train(images, tmp_path / "fallback", cache, "train.gradient_checkpointing=false",
                          "train.cuda_graphs=true")
    assert "run without CUDA graphs" in caplog.text and "not permitted" in caplog.text
    _assert_same(fallback, plain)


def test_on_the_cpu_the_run_stops_before_any_weight_loads(images, tmp_path, cache_root, capsys):
    code = main(train_args(images, tmp_path / "cpu", cache_root / "graphs", "train.device=cpu",
                           "train.cuda_graphs=true"))
    assert code == 2
    err = capsys.readouterr().err
    assert "train.cuda_graphs" in err and "CUDA device" in err
    assert not (tmp_path / "cpu" / "run.json").exists()


@pytest.mark.parametrize("setting", ["memory.stream_weights=true", "memory.offload_activations=true",
                                     "train.optimizer_in_backward=true", "train.compile=true"])
def test_settings_a_replay_cannot_hold_are_refused(setting):
    with pytest.raises(ValueError, match=f"train.cuda_graphs with {setting.split('=')[0]}"):
        load_config(None, ["train.cuda_graphs=true", setting], need_data=False)


@pytest.mark.parametrize("setting", ["lora.base_quantization=int8", "lora.dropout=0.1"])
def test_lora_settings_a_replay_cannot_hold_are_refused(setting):
    with pytest.raises(ValueError, match=f"train.cuda_graphs with {setting.split('=')[0]}"):
        load_config(None, ["train.cuda_graphs=true", "train.mode=lora", setting], need_data=False)
    load_config(None, ["train.cuda_graphs=true", "train.mode=lora"], need_data=False)  # a plain base is fine


def test_the_planner_leaves_out_what_cuda_graphs_refuses():
    from vramfit.memory.model_facts import facts_for_layout
    from vramfit.memory.planner import free_knobs

    facts = facts_for_layout("ssd1b")
    cfg = load_config(None, ["model.path=tiny:ssd1b"], need_data=False)
    graphed = load_config(None, ["model.path=tiny:ssd1b", "train.cuda_graphs=true"], need_data=False)
    keys = {k.key for k in free_knobs(cfg, facts)}
    kept = {k.key for k in free_knobs(graphed, facts)}
    assert {"train.optimizer_in_backward", "memory.stream_weights", "memory.offload_activations"} <= keys
    assert keys - kept == {"train.optimizer_in_backward", "memory.stream_weights", "memory.offload_activations"}
    assert "train.gradient_checkpointing" in kept


def test_graph_safe_checkpoint_gives_the_gradients_of_no_checkpointing():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    direct = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    checked = torch.autograd.grad(graphs.graph_safe_checkpoint(block, x).square().sum(), [x, *block.parameters()])
    for a, b in zip(direct, checked):
        torch.testing.assert_close(a, b)
