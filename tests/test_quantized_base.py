"""Quantized frozen base under a LoRA (memory/quantize.py quantize_base), both families.

Same result: the loss of the adapted tiny:ssd1b / tiny:sd3 denoiser over an int8/fp8/nf4 base
is within LOSS_TOL of the bf16 base's, and the LoRA gradients point the same way (COSINE).
It saves: bytes counted from the denoiser's parameter and buffer storages.
"""
from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from safetensors import safe_open

from conftest import train_args
from vramfit.cli import main
from vramfit.config.schema import LoraSettings, ModelConfig
from vramfit.memory.accounting import tensor_bytes
from vramfit.memory.quantize import (
    QuantizedLinear, frozen_linears, linear_weight_share, quantize_base, storage_bytes,
)
from vramfit.models.registry import detect_family
from vramfit.models.sources import resolve_source
from vramfit.train.lora import apply_lora

METHODS = ("int8", "fp8", "nf4")
FAMILIES = ("tiny:ssd1b", "tiny:sd3")
# Relative change of the loss against the bf16 base; measured (ssd1b / sd3): int8 0.01% / 0.03%,
# fp8 0.05% / 0.04%, nf4 0.1% / 0.4%, and at most 0.6% for the CLI runs' first-step losses.
LOSS_TOL = {"int8": 0.005, "fp8": 0.02, "nf4": 0.05}
# Cosine of the LoRA gradients with the bf16 base's; measured: int8 0.998 / 0.9999, fp8 0.986 /
# 0.999, nf4 0.86 / 0.98 (4-bit rounding compounds through the random tiny UNet's layers).
COSINE = {"int8": 0.995, "fp8": 0.975, "nf4": 0.8}
# Stored bytes of the quantized linears over their bf16 bytes: int8/fp8 keep one byte per weight
# plus a per-row scale (large beside the tiny models' 32-wide rows), nf4 half a byte plus its
# absmax per block of 64.
RATIO = {"int8": (0.5, 0.6), "fp8": (0.5, 0.6), "nf4": (0.25, 0.3)}
LORA = LoraSettings(rank=4, targets=["to_q", "to_k", "to_v", "to_out.0"])


def _adapted(path: str, seed: int = 0) -> torch.nn.Module:
    source = resolve_source(ModelConfig(path=path))
    model = detect_family(source).load(source).denoiser.to(torch.bfloat16)
    with torch.random.fork_rng():  # peft draws lora_A from the global generator
        torch.manual_seed(seed)
        apply_lora(model, LORA)
    return model


def _inputs(model: torch.nn.Module, seed: int = 1) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = model.config

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    timestep = torch.tensor([300.0, 700.0])
    if "joint_attention_dim" in c:  # the SD3 transformer
        kwargs = dict(hidden_states=randn(2, c.in_channels, 8, 8), timestep=timestep,
                      encoder_hidden_states=randn(2, 7, c.joint_attention_dim),
                      pooled_projections=randn(2, c.pooled_projection_dim))
    else:
        text = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
        time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * 2).to(torch.bfloat16)
        kwargs = dict(sample=randn(2, c.in_channels, 8, 8), timestep=timestep,
                      encoder_hidden_states=randn(2, 7, c.cross_attention_dim),
                      added_cond_kwargs={"text_embeds": randn(2, text), "time_ids": time_ids})
    return kwargs, torch.randn(2, c.out_channels, 8, 8, generator=g)


def _loss(model: torch.nn.Module, kwargs: dict, target: torch.Tensor) -> torch.Tensor:
    pred = model(**kwargs, return_dict=False)[0]
    return torch.nn.functional.mse_loss(pred.float(), target)


def _lora_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten().float() for n, p in model.named_parameters() if p.requires_grad])


@pytest.mark.parametrize("path", FAMILIES)
def test_same_loss_and_lora_gradients_over_a_quantized_base(path):
    ref = _adapted(path)
    kwargs, target = _inputs(ref)
    with torch.random.fork_rng():
        torch.manual_seed(5)  # lora_B starts at zero: give it values so the adapter acts in forward
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.02)
    ref_loss = _loss(ref, kwargs, target)
    ref_loss.backward()
    ref_grads = _lora_grads(ref)
    for method in METHODS:
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        summary = quantize_base(model, method)
        assert summary.layers == len(frozen_linears(ref)) and not summary.kept
        assert not frozen_linears(model)  # every frozen linear of the base is stored quantized
        loss = _loss(model, kwargs, target)
        loss.backward()
        assert abs(loss.item() / ref_loss.item() - 1) < LOSS_TOL[method], (method, loss.item(), ref_loss.item())
        grads = _lora_grads(model)
        cosine = float(torch.nn.functional.cosine_similarity(grads, ref_grads, dim=0))
        assert cosine > COSINE[method], (method, cosine)
        assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


@pytest.mark.parametrize("path", FAMILIES)
def test_quantized_base_saves_storage_bytes(path):
    model = _adapted(path)
    bf16_total = storage_bytes(model)
    frozen = sum(tensor_bytes(model.get_submodule(n).weight) for n in frozen_linears(model))
    linear, _ = linear_weight_share(model)
    assert 0 < frozen < linear  # LoRA's own (trainable) linears are not part of the base
    for method in METHODS:
        quantized = copy.deepcopy(model)
        summary = quantize_base(quantized, method)
        assert summary.bytes_before == frozen
        low, high = RATIO[method]
        assert low < summary.bytes_after / summary.bytes_before < high, method
        # the counts come from the tensors the model now holds
        assert storage_bytes(quantized) == bf16_total - summary.bytes_before + summary.bytes_after
        lora = [n for n, p in quantized.named_parameters() if p.requires_grad]
        assert lora and all("lora_" in n for n in lora)


def test_backward_keeps_no_widened_weight():
    """Through F.linear autograd would keep each layer's widened weight until backward."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    linear = torch.nn.Linear(128, 256).to(torch.bfloat16).requires_grad_(False)
    plain = copy.deepcopy(linear)
    quantize_(plain, Int8WeightOnlyConfig(set_inductor_config=False))
    ours = copy.deepcopy(linear)
    container = torch.nn.Sequential(ours)
    quantize_base(container, "int8")
    assert isinstance(container[0], QuantizedLinear)
    saved, grads = {}, {}
    for name, layer in (("torchao", plain), ("ours", container)):
        x = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).requires_grad_()
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            y = layer(x)
        saved[name] = sum(sizes)
        y.float().square().sum().backward()
        grads[name] = x.grad.float()
    assert saved["torchao"] >= 128 * 256 * 2 and saved["ours"] == 0
    scale = float(grads["torchao"].abs().max())  # both are bf16 products: compare at bf16's precision
    torch.testing.assert_close(grads["ours"], grads["torchao"], rtol=0.02, atol=0.01 * scale)


def test_lora_learns_over_an_nf4_base_with_checkpointing():
    model = _adapted("tiny:sd3")
    quantize_base(model, "nf4")
    model.train()
    kwargs, target = _inputs(model)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for checkpointing in (False, True):  # recomputing the quantized forward gives the same gradients
        model.enable_gradient_checkpointing() if checkpointing else model.disable_gradient_checkpointing()
        _loss(model, kwargs, target).backward()
        grads.append(torch.cat([p.grad.flatten() for p in params]))
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[1], grads[0])
    base = {n: b.quantized_data.clone() for n, b in model.named_buffers() if n.endswith(".weight")}
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(6):
        loss = _loss(model, kwargs, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.97 * losses[0], losses
    after = dict(model.named_buffers())
    assert base and all(torch.equal(after[n].quantized_data, b) for n, b in base.items())


def test_byte_split_of_the_full_size_denoisers():
    """How much of each shipped full-size denoiser is Linear weight (what quantize_base reaches)."""
    from accelerate import init_empty_weights
    from diffusers import SD3Transformer2DModel, UNet2DConditionModel

    from vramfit.models.parts import shipped_config

    shares = {}
    for name, cls in (("sdxl_unet", UNet2DConditionModel), ("ssd1b_unet", UNet2DConditionModel),
                      ("sd3_medium_transformer", SD3Transformer2DModel)):
        with init_empty_weights():
            model = cls(**{k: v for k, v in shipped_config(name).items() if not k.startswith("_")})
        linear, total = linear_weight_share(model.to(torch.bfloat16))
        shares[name] = linear / total
    # the figures the module docstring of memory/quantize.py states
    assert shares["sdxl_unet"] == pytest.approx(0.870, abs=0.001)
    assert shares["ssd1b_unet"] == pytest.approx(0.771, abs=0.001)
    assert shares["sd3_medium_transformer"] == pytest.approx(0.972, abs=0.001)


def _keys_and_shapes(path) -> dict:
    with safe_open(str(path), "pt") as fh:
        return {k: (tuple(fh.get_slice(k).get_shape()), fh.get_slice(k).get_dtype()) for k in fh.keys()}


@pytest.mark.parametrize("model,method,formats", [
    ("tiny:ssd1b", "int8", ("m.safetensors", "m-diffusers.safetensors")),
    ("tiny:sd3", "nf4", ("m.safetensors",)),
])
def test_cli_run_over_a_quantized_base(images, tmp_path, cache_root, caplog, model, method, formats):
    caplog.set_level(logging.INFO, logger="vramfit")
    lora = ("train.mode=lora", "train.lr=1e-2", "save.name=m",
            "save.formats=['lora','lora_kohya']" if len(formats) == 2 else "save.formats=['lora']")
    runs = {}
    for name in ("none", method):
        out = tmp_path / name
        assert main(train_args(images, out, cache_root / "qb", *lora, f"lora.base_quantization={name}",
                               model=model)) == 0
        runs[name] = out
    first = [json.loads((runs[n] / "run.json").read_text())["losses"][0] for n in ("none", method)]
    assert first[1] != first[0] and abs(first[1] / first[0] - 1) < LOSS_TOL[method], first
    assert f"linear layers stored {method}" in caplog.text
    for name in formats:  # the exported LoRA does not depend on how the base was stored
        assert _keys_and_shapes(runs["none"] / name) == _keys_and_shapes(runs[method] / name)
    with safe_open(str(runs[method] / "m.safetensors"), "pt") as fh:
        ups = [fh.get_tensor(k) for k in fh.keys() if "lora_B" in k or "lora_up" in k]
    assert ups and any(bool(u.abs().sum() > 0) for u in ups)  # lora_B starts at zero: it trained
    assert 'base_quantization = "' + method + '"' in (runs[method] / "config.toml").read_text()


def test_base_quantization_needs_lora_mode(images, tmp_path, cache_root, capsys):
    args = train_args(images, tmp_path / "run", cache_root / "qb", "train.mode=full", "lora.base_quantization=int8")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "lora.base_quantization" in err and "train.mode" in err


def test_fp8_keeps_a_layer_with_a_zero_row_unquantized():
    """torchao's fp8 gives a row of zeros the scale 0, which dequantizes to NaN: such a layer stays
    in the training precision and is listed, and the output stays finite."""
    from vramfit.memory.quantize import quantize_base

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    with torch.no_grad():
        model[1].weight[3].zero_()
    model.requires_grad_(False)
    summary = quantize_base(model, "fp8")
    assert summary.kept == ["1"] and summary.layers == 1
    out = model(torch.randn(2, 64, dtype=torch.bfloat16))
    assert bool(torch.isfinite(out).all())


class _LargestTemporary(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of the largest tensor any op makes, the op's `out=` targets aside."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "out" not in (kwargs or {}) and not func._schema.is_mutable:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if torch.is_tensor(t) and t._base is None:
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_widening_equals_torchaos_and_keeps_its_temporaries_small(monkeypatch, dtype):
    import math

    from torchao.quantization import to_nf4

    from vramfit.memory import quantize

    torch.manual_seed(0)
    weight = torch.randn(96, 640, dtype=dtype)
    nf4 = to_nf4(weight, 64, math.gcd(weight.numel() // 64, 256))
    monkeypatch.setattr(quantize, "NF4_CHUNK", 1024)  # several passes over the 30,720 packed bytes
    reference = nf4.get_original_weight()
    with _LargestTemporary() as ours:
        widened = quantize.dequantize(nf4)
    assert widened.dtype == dtype and torch.equal(widened, reference)
    assert ours.largest == tensor_bytes(widened)  # the result itself; every temporary is smaller
    with _LargestTemporary() as theirs:
        nf4.get_original_weight()
    # torchao's int64 codes: half the weights, 8 bytes each (4x the bf16 result, 2x the fp32 one)
    assert theirs.largest >= 4 * weight.numel()


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rowwise_widening_equals_torchaos_and_makes_only_the_result(method, dtype):
    from vramfit.memory.quantize import dequantize

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 96)).to(dtype).requires_grad_(False)
    quantize_base(model, method)
    weight = model[0].weight
    assert model[0].zero_free  # symmetric int8: its zero point is all zeros
    for zero_free in (False, True):  # the in-place path, and the one-kernel path of int8
        with _LargestTemporary() as ours:
            widened = dequantize(weight, zero_free)
        assert widened.dtype == dtype and torch.equal(widened, weight.dequantize())
        assert ours.largest == tensor_bytes(widened)
    with _LargestTemporary() as theirs:
        weight.dequantize()
    assert theirs.largest >= 4 * weight.numel()  # torchao's product of the codes and scales is fp32


def test_widening_applies_a_zero_point_and_leaves_other_layouts_to_torchao():
    """An asymmetric int8 weight (nonzero zero points) and layouts without one scale per row
    (per tensor, per row along the other dimension, blocks) are widened as torchao widens them."""
    from torchao.quantization.granularity import PerBlock, PerRow, PerTensor
    from torchao.quantization.quant_primitives import MappingType
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    from vramfit.memory.quantize import dequantize, widen_rowwise

    torch.manual_seed(0)
    w = (torch.randn(64, 64) * 3 + 1).to(torch.bfloat16)
    asymmetric = Int8Tensor.from_hp(w, PerRow(), mapping_type=MappingType.ASYMMETRIC)
    assert bool(asymmetric.zero_point.any())
    assert torch.equal(dequantize(asymmetric), asymmetric.dequantize())
    others = [Int8Tensor.from_hp(w, PerTensor()), Float8Tensor.from_hp(w, granularity=PerTensor()),
              Float8Tensor.from_hp(w, granularity=PerRow(dim=0)), Float8Tensor.from_hp(w, granularity=PerBlock([8, 8]))]
    for weight in others:
        assert widen_rowwise(weight) is None
        assert torch.equal(dequantize(weight), weight.dequantize())
