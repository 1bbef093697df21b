"""A quantized LoRA base placed layer by layer (train/setup.py place_denoiser): each frozen linear
reaches the device as loaded and is widened to the training precision and quantized there alone.

Same result as the old order (the whole denoiser cast first, then adapted, then quantized): the
quantized weights, the adapter, every other tensor, the loss and the LoRA gradients are equal bit
for bit. The peak: the widened bytes alive at once while placing, counted at every cast, stay
within two layers' worth beyond what the placed model keeps widened (its norms, embeddings and
biases), where the old order held every linear widened at once.
"""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from vramfit.config.load import load_config
from vramfit.memory.lora_compute import lora_in_base_dtype
from vramfit.memory.quantize import quantize_base
from vramfit.models.registry import detect_family
from vramfit.models.sources import resolve_source
from vramfit.train.lora import apply_lora
from vramfit.train.setup import place_denoiser

CPU = torch.device("cpu")
# (base_quantization, train.precision, lora.type, dtype the denoiser is stored in as loaded)
CASES = [("int8", "mixed_bf16", "lora", torch.bfloat16), ("nf4", "mixed_bf16", "lokr", torch.bfloat16),
         ("fp8", "full_bf16", "lora", torch.float32)]
# on CUDA the linears are widened on the device, where the old order widened them in CPU memory
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _cfg(cache_root, method: str, precision: str, kind: str = "lora"):
    return load_config(None, ["model.path=tiny:sd3", f"cache.dir={cache_root}", "train.device=cpu",
                              "train.mode=lora", f"lora.base_quantization={method}",
                              f"train.precision={precision}", f"lora.type={kind}", "lora.rank=4",
                              "train.gradient_checkpointing=false"], need_data=False)


def _bundle(cfg, cache_root, stored: torch.dtype):
    source = resolve_source(cfg.model, cache_root)
    bundle = detect_family(source, "auto").load(source)
    bundle.denoiser.to(stored)  # as a file of that dtype loads (the tiny files are fp32)
    return bundle


def _old_order(unet: torch.nn.Module, cfg, device: torch.device = CPU) -> None:
    """What place_denoiser did before: the whole denoiser cast in CPU memory, adapted, quantized."""
    unet.to(None, torch.bfloat16 if cfg.train.precision == "full_bf16" else torch.float32)
    unet.requires_grad_(True)
    apply_lora(unet, cfg.lora)
    if cfg.train.precision == "full_bf16":
        lora_in_base_dtype(unet)
    quantize_base(unet, cfg.lora.base_quantization, device)
    unet.to(device)


def _inner(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A tensor's own data: a quantized tensor's inner tensors (codes, scales), else itself."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return {"": t}
    names, _ = t.__tensor_flatten__()
    return {name: getattr(t, name) for name in names}


def _loss(unet: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    c = unet.config

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    timestep = torch.tensor([300.0, 700.0], device=device)
    pred = unet(hidden_states=randn(2, c.in_channels, 8, 8), timestep=timestep,
                encoder_hidden_states=randn(2, 7, c.joint_attention_dim),
                pooled_projections=randn(2, c.pooled_projection_dim), return_dict=False)[0]
    return torch.nn.functional.mse_loss(pred.float(), randn(*pred.shape).float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method,precision,kind,stored", CASES)
def test_layer_by_layer_placement_equals_the_whole_model_cast(cache_root, method, precision, kind, stored,
                                                              device):
    device = torch.device(device)
    cfg = _cfg(cache_root, method, precision, kind)
    bundle = _bundle(cfg, cache_root, stored)
    ref = copy.deepcopy(bundle.denoiser)
    with torch.random.fork_rng():  # peft draws the adapter's initial values from the global generator
        torch.manual_seed(0)
        _old_order(ref, cfg, device)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        assert place_denoiser(bundle, cfg, device) is None
    unet = bundle.denoiser

    assert [(n, type(m)) for n, m in unet.named_modules()] == [(n, type(m)) for n, m in ref.named_modules()]
    mine, theirs = dict(unet.named_parameters()), dict(ref.named_parameters())
    assert mine.keys() == theirs.keys()
    assert any(p.requires_grad for p in mine.values())
    for name, p in theirs.items():
        assert (mine[name].dtype, mine[name].requires_grad) == (p.dtype, p.requires_grad), name
        assert torch.equal(mine[name], p), name
    mine, theirs = dict(unet.named_buffers()), dict(ref.named_buffers())
    assert mine.keys() == theirs.keys()
    quantized = [n for n, b in theirs.items() if type(b) is not torch.Tensor]
    assert len(quantized) > 10
    for name, b in theirs.items():
        assert (type(mine[name]), mine[name].dtype) == (type(b), b.dtype), name
        inner, expected = _inner(mine[name]), _inner(b)
        assert inner.keys() == expected.keys(), name
        for part, t in expected.items():
            assert t.dtype == inner[part].dtype and torch.equal(inner[part], t), (name, part)

    # with the adapter's up matrices moved off zero, so that it acts: the same loss and gradients
    for model in (unet, ref):
        with torch.random.fork_rng():
            torch.manual_seed(5)
            for n, p in model.named_parameters():
                if p.requires_grad and ("lora_B" in n or "lokr_w1" in n):
                    p.data.normal_(0, 0.02)
    dtype = torch.bfloat16 if precision == "full_bf16" else torch.float32
    with sdpa_kernel(SDPBackend.MATH):  # a fused attention's backward may add in any order on CUDA
        loss, ref_loss = _loss(unet, dtype, device), _loss(ref, dtype, device)
        loss.backward()
        ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    grads = {n: p.grad for n, p in unet.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert torch.equal(grads[n], p.grad), n


class WidenedBytes:
    """Counts the bytes of tensors made wider than their source by `Tensor.to` (every cast the
    placement does) that are alive at once: each storage is counted until it is freed."""

    def __init__(self):
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def wrap(self, to):
        def counted(tensor, *args, **kwargs):
            out = to(tensor, *args, **kwargs)
            if (out is not tensor and out.is_floating_point() and tensor.is_floating_point()
                    and out.element_size() > tensor.element_size()):
                storage = out.untyped_storage()
                if id(storage) not in self.seen:
                    self.seen.add(id(storage))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
            return out
        return counted

    def _freed(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def test_placing_a_quantized_base_widens_one_layer_at_a_time(cache_root, monkeypatch):
    cfg = _cfg(cache_root, "int8", "mixed_bf16")
    bundle = _bundle(cfg, cache_root, torch.bfloat16)
    ref = copy.deepcopy(bundle.denoiser)
    linears = [m for m in ref.modules() if isinstance(m, torch.nn.Linear)]
    widened = [4 * (m.weight.numel() + (0 if m.bias is None else m.bias.numel())) for m in linears]

    counts = {}
    for name, place in (("layer by layer", lambda: place_denoiser(bundle, cfg, CPU)),
                        ("old order", lambda: _old_order(ref, cfg))):
        counter = WidenedBytes()
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "to", counter.wrap(torch.Tensor.to))
            place()
        counts[name] = counter
    # beyond what stays widened (norms, embeddings, the quantized layers' biases): one linear at a
    # time, where the old order had every linear widened at once before quantizing them
    ours, old = counts["layer by layer"], counts["old order"]
    assert ours.live == old.live > 0
    assert ours.peak - ours.live <= 2 * max(widened)
    biases = 4 * sum(m.bias.numel() for m in linears if m.bias is not None)  # kept widened either way
    assert old.peak - old.live >= sum(widened) - biases
    assert sum(widened) > 10 * max(widened)
