"""Lower-precision storage for frozen text encoders (SD3's T5-XXL: 9.1 GiB in bf16).

Modes, each applied to every nn.Linear of the module (embeddings and norms stay as they are):
- "int8": torchao int8 weight-only quantization (per-channel scales); about half of bf16.
- "fp8": weights stored as float8_e4m3fn with a per-output-channel scale, widened to the input's
  dtype inside each forward; about half of bf16, no extra dependency, any device.
- "nf4": torchao 4-bit NormalFloat (`QuantizedLinear` below, as `quantize_base`; CPU and CUDA, no
  bitsandbytes); about a quarter of bf16. A linear whose weight is not whole blocks of 64 stays.
Cost: a small rounding error in the encoder's output (the tests state the tolerance), and for
fp8 and nf4 one widening of each weight per forward.

`quantize_base` does the same for the frozen base of a LoRA run (both families): every frozen
nn.Linear of the denoiser (SDXL/SSD-1B: attention, feed-forward, proj_in/out, time and add
embeddings; SD3: every linear of the transformer) is replaced by a `QuantizedLinear` holding
- "int8": torchao Int8Tensor, per-output-channel symmetric, weight-only: ~0.52x of bf16;
- "fp8": torchao Float8Tensor, e4m3 with a per-row fp32 scale: ~0.52x of bf16; a weight read from
  an fp8 file (`mark_fp8_source`) keeps the file's codes and scales, so the base is the file's values;
- "nf4": torchao NF4Tensor, blocks of 64 with double-quantized (int8) absmax: ~0.26x of bf16.
Convolutions, norms and embeddings stay in the training precision. Share of the bf16 denoiser
that is Linear weight (meta-device count from the shipped configs): SDXL 87.0% (4.16 of 4.78
GiB), SSD-1B 77.1% (1.91 of 2.48 GiB), SD3-M 97.2% (3.78 of 3.88 GiB).
Cost: rounding error in every base output (relative error per layer about 0.5% int8, 2.5% fp8,
9% nf4); each weight is widened to the training precision once in forward and once more in
backward (the widened copy is never kept for backward, so activations hold no weight copies).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from vramfit.memory.accounting import tensor_bytes

MODES = ("bf16", "int8", "fp8", "nf4")


class Fp8Linear(torch.nn.Module):
    """A frozen Linear whose weight is stored in float8_e4m3fn with per-row scales."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        self.register_buffer("weight_fp8", (w / scale).to(torch.float8_e4m3fn))
        self.register_buffer("scale", scale.to(torch.float32))
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype

    @property
    def weight(self) -> torch.Tensor:
        # Models such as T5 read `layer.weight.dtype` to choose their activations' dtype; answer
        # with the precision the weight had before it was stored in fp8.
        return torch.empty(0, dtype=self.compute_dtype, device=self.scale.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = (self.weight_fp8.to(torch.float32) * self.scale).to(x.dtype)
        return torch.nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def _swap_linears(module: torch.nn.Module, make) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, make(child))
        else:
            _swap_linears(child, make)


def quantize_encoder(module: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Store `module`'s linear weights in `mode`; returns the (same) module, frozen. A module already
    stored in `mode` (`stored_precision`: a T5 stored part by part as it loaded) is left as it is."""
    done = stored_precision(module)
    if done is not None and done != mode:
        raise ValueError(f"the encoder is stored as {done} already; it cannot be stored as {mode} too")
    module.requires_grad_(False)
    if mode == "bf16":
        module.to(torch.bfloat16)
    elif done == mode:
        return module
    elif mode == "fp8":
        _swap_linears(module, Fp8Linear)
    elif mode == "int8":
        # heavy: torchao (~0.2 s, prints kernel-load warnings); `vramfit plan` imports this module
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(module, Int8WeightOnlyConfig(set_inductor_config=False))
    elif mode == "nf4":
        quantize_base(module, "nf4")  # every linear is frozen now
    else:
        raise ValueError(f"unknown precision {mode!r}; choose one of {MODES}")
    mark_stored(module, mode)
    return module


STORED = "vramfit_stored_precision"  # the attribute `mark_stored` sets on a module


def mark_stored(module: torch.nn.Module, mode: str) -> None:
    """Record that `module` is stored in `mode` (quantize_encoder then leaves it as it is)."""
    setattr(module, STORED, mode)


def stored_precision(module: torch.nn.Module) -> Optional[str]:
    """The mode `module` was stored in by quantize_encoder or a loader (`mark_stored`); None if neither."""
    return getattr(module, STORED, None)


def plain_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state dict with each quantized tensor (torchao's, which take no strided view) given
    as the plain tensors it is made of (`<name>.<part>`), for digests of a stored encoder."""
    out = {}
    for name, t in module.state_dict().items():
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            parts, _ = t.__tensor_flatten__()
            out.update({f"{name}.{type(t).__name__}.{part}": getattr(t, part) for part in parts})
        else:
            out[name] = t
    return out


def storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameter and buffer storage, counting quantized tensors by their real storage."""
    return sum(tensor_bytes(t) for t in [*module.parameters(), *module.buffers()])


BASE_METHODS = ("int8", "fp8", "nf4")
NF4_BLOCK = 64  # weights per absmax; torchao's NF4 default, as QLoRA
FP8_SOURCE = "vramfit_fp8_source_scale"  # the attribute `mark_fp8_source` sets on a linear


def mark_fp8_source(linear: torch.nn.Module, scale: torch.Tensor) -> None:
    """Record that `linear`'s weight was read from float8_e4m3fn codes times `scale` (one value per
    output row; 1 for a plain fp8 file), so that an fp8 base keeps those codes (`adopt_fp8`)
    instead of rounding the widened values to fp8 a second time with scales of its own."""
    setattr(linear, FP8_SOURCE, scale.detach().to(torch.float32).reshape(-1, 1))


def fp8_source_scale(linear: torch.nn.Module) -> Optional[torch.Tensor]:
    """The per-row scale `mark_fp8_source` recorded (shape (rows, 1), fp32); None if none."""
    return getattr(linear, FP8_SOURCE, None)


def adopt_fp8(linear: torch.nn.Linear) -> Optional[torch.Tensor]:
    """The weight of a linear read from float8_e4m3fn (`mark_fp8_source`) as a Float8Tensor of its
    file's own codes and scales, in quantize_base's fp8 layout (codes, one fp32 scale per row):
    its dequantized values are the file's values times their scale, rounded once to the weight's
    dtype. None where the weight is not (or no longer) those values widened to bfloat16 as the
    loader widens them, or a scale is not a positive finite number: it is then quantized afresh.

    The widened value round_bf16(code * scale) is within 2^-9 (relative) of code * scale, far
    inside half of e4m3's spacing (2^-4), so dividing by the scale and rounding to e4m3 gives the
    code back; the check below confirms it for every weight."""
    scale = fp8_source_scale(linear)
    weight = linear.weight.detach()
    if scale is None or weight.dim() != 2 or scale.shape[0] != weight.shape[0]:
        return None
    scale = scale.to(weight.device)
    if not bool(((scale > 0) & scale.isfinite()).all()):
        return None
    work = weight.to(torch.float32, copy=True)  # one fp32 copy, reused: temporaries as torchao's own
    codes = work.div_(scale).to(torch.float8_e4m3fn)
    if not torch.equal(work.copy_(codes).mul_(scale).to(torch.bfloat16), weight.to(torch.bfloat16)):
        return None
    # heavy: torchao (~0.2 s, prints kernel-load warnings); `vramfit plan` imports this module
    from torchao.quantization import Float8Tensor

    return Float8Tensor(codes, scale, block_size=[1, weight.shape[1]], dtype=weight.dtype)


def _quantize_weight(linear: torch.nn.Linear, method: str) -> Optional[torch.Tensor]:
    """The linear's weight as a torchao quantized tensor, or None when its shape cannot be. An fp8
    base over a weight read from fp8 keeps the file's codes and scales (`adopt_fp8`)."""
    if method == "fp8" and (adopted := adopt_fp8(linear)) is not None:
        return adopted
    if method == "nf4":
        # heavy: torchao (~0.2 s, prints kernel-load warnings); `vramfit plan` imports this module
        from torchao.quantization import to_nf4

        weight = linear.weight.detach().contiguous()
        if weight.numel() % NF4_BLOCK:
            return None
        # The absmax values are themselves int8-quantized in groups; the group must divide them.
        return to_nf4(weight, NF4_BLOCK, math.gcd(weight.numel() // NF4_BLOCK, 256))
    # heavy: torchao (~0.2 s, prints kernel-load warnings); `vramfit plan` imports this module
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    if method == "fp8" and bool((linear.weight.detach().abs().amax(dim=1) == 0).any()):
        return None  # a row of zeros gets scale 0 in torchao's fp8 and dequantizes to NaN: keep it
    # set_inductor_config=False: quantize_ would otherwise change torch.compile's global settings
    config = (Int8WeightOnlyConfig(set_inductor_config=False) if method == "int8"
              else Float8WeightOnlyConfig(set_inductor_config=False))
    quantize_(linear, config)
    return linear.weight.detach()


def dequantize(weight: torch.Tensor, zero_free: bool = False) -> torch.Tensor:
    """A plain tensor in the precision the weight had before it was quantized (`zero_free`: its
    zero point, if it has one, is known to be all zeros)."""
    if hasattr(weight, "quantized_scalers"):  # torchao's NF4Tensor
        return widen_nf4(weight)
    widened = widen_rowwise(weight, zero_free)
    return widened if widened is not None else weight.dequantize()


def widen_rowwise(weight: torch.Tensor, zero_free: bool = False) -> Optional[torch.Tensor]:
    """An int8 or fp8 weight with one scale per row (what quantize_base makes) in its original
    dtype, equal bit for bit to torchao's `dequantize`; None for any other layout.

    torchao widens the codes to the output dtype or to fp32, subtracts the zero point into a new
    tensor and multiplies by the fp32 scales into a third, fp32 one (up to 10 bytes of
    temporaries per weight for a bf16 result, and three passes over memory). Here, without a zero
    point (or with `zero_free`: the caller knows it is all zeros, as quantize_base's symmetric
    int8 makes it), one kernel reads the codes and scales and writes the result; otherwise the
    codes are widened once into the result and the zero point and scales applied in place. The
    product is computed in fp32 and rounded once either way, so the values are the same."""
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if qdata is None or scale is None or qdata.dim() != 2:
        return None
    rows = qdata.shape[0]
    if tuple(scale.shape) not in ((rows, 1), (rows,)):  # one scale per row, not a block or column layout
        return None
    block = getattr(weight, "block_size", None)
    if block is not None and list(block) != [1, qdata.shape[1]]:
        return None
    if qdata.dtype not in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):
        return None
    zero_point = getattr(weight, "zero_point", None)
    if qdata.dtype == torch.int8 and (zero_point is None or zero_free):
        # one kernel: codes times scales in fp32, rounded once (torch does not promote fp8 so)
        return torch.mul(qdata, scale.reshape(-1, 1), out=torch.empty(qdata.shape, dtype=weight.dtype,
                                                                        device=qdata.device))
    out = qdata.to(weight.dtype)  # exact: int8 and fp8 values are all bf16 (and fp32) values
    if zero_point is not None:
        out.sub_(zero_point.reshape(-1, 1).to(weight.dtype))
    return out.mul_(scale.reshape(-1, 1))


NF4_CHUNK = 1 << 23  # packed bytes (two weights each) widened per pass: 32 MiB of int32 codes


def widen_nf4(weight: torch.Tensor) -> torch.Tensor:
    """An NF4Tensor in its original dtype, equal bit for bit to torchao's `get_original_weight`.

    torchao widens both 4-bit codes of every byte to int64 before looking them up: about 12 bytes
    of temporaries per weight (0.5 GiB for T5-XXL's largest linear, the peak of encoding with it).
    Here a 256-entry table gives both values of a byte at once, looked up with int32 indices, a
    bounded number of bytes per pass, and the block scales are applied in place: the widened
    weight plus at most 32 MiB."""
    packed = weight.quantized_data.view(-1)
    pair = torch.stack((weight.nf4.repeat_interleave(16), weight.nf4.repeat(16)), dim=1)  # byte -> (high, low)
    out = torch.empty((packed.numel(), 2), dtype=pair.dtype, device=packed.device)
    for start in range(0, packed.numel(), NF4_CHUNK):
        codes = packed[start:start + NF4_CHUNK].to(torch.int32)
        torch.index_select(pair, 0, codes, out=out[start:start + NF4_CHUNK])
        del codes
    scales = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor,
                                       weight.scaler_block_size)
    out.view(-1, weight.block_size).mul_(scales.unsqueeze(-1))
    return out.view(weight.shape)


class _FrozenQuantizedLinear(torch.autograd.Function):
    """y = x W^T + b for a frozen quantized W, widening W again in backward.

    Through F.linear, autograd would keep each layer's widened weight alive until backward: a
    full-precision copy of the base in the activations. Here only the quantized tensor is kept.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                zero_free: bool = False) -> torch.Tensor:
        ctx.weight = weight  # a module buffer, alive anyway; not saved through autograd's hooks
        ctx.zero_free = zero_free
        return torch.nn.functional.linear(x, dequantize(weight, zero_free), bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # autograd casts the result to the input's dtype (it can differ under autocast)
        return grad_out @ dequantize(ctx.weight, ctx.zero_free).to(grad_out.dtype), None, None, None


@torch.compiler.disable
def _eager_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return _FrozenQuantizedLinear.apply(x, weight, bias)


class QuantizedLinear(torch.nn.Module):
    """A frozen Linear whose weight is a quantized buffer (so optimizers and checks skip it)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], method: str):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.method = method
        self.register_buffer("weight", weight)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        # symmetric int8: all zeros, known once here (a weight's values never change: moving the
        # module between devices copies them, and nothing assigns this buffer another weight)
        zero_point = getattr(weight, "zero_point", None)
        self.zero_free = zero_point is None or not bool(zero_point.any())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == "nf4":  # torch.compile cannot trace NF4Tensor's widening: run it eagerly
            return _eager_linear(x, self.weight, self.bias)
        return _FrozenQuantizedLinear.apply(x, self.weight, self.bias, self.zero_free)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method}"


@dataclass
class BaseQuantization:
    method: str
    layers: int  # linears now stored quantized
    kept: list[str]  # frozen linears left in the training precision (shape not quantizable, or an fp8 zero row)
    bytes_before: int  # of the quantized layers' weights
    bytes_after: int


def frozen_linears(model: torch.nn.Module) -> list[str]:
    """Names of the nn.Linear modules whose weight is frozen (LoRA's own matrices train)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]


def cast_all_but_linears(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast `model`'s floating-point parameters and buffers to `dtype` as Module.to does, but for
    those of its nn.Linear modules: quantize_base casts each linear on its own (`dtype`), so the
    whole model is never widened at once in CPU memory."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_floating_point() and b.dtype != dtype:
                setattr(module, name, b.to(dtype))


def quantize_base(denoiser: torch.nn.Module, method: str, device: Optional[torch.device] = None,
                  targets: Optional[Iterable[str]] = None, dtype: Optional[torch.dtype] = None
                  ) -> BaseQuantization:
    """Store the denoiser's frozen linear weights as `method` (see the module docstring).

    Call it after the LoRA adapter is added (peft's layers then wrap a QuantizedLinear). `targets`
    (default: every frozen linear) names the modules. Each is moved to `device` as it lies, then
    cast there to the training `dtype` (default: it is in it already) and quantized, so neither
    the device nor the CPU memory ever holds more than one widened linear at a time; the caller
    moves the rest of the model.
    """
    if method not in BASE_METHODS:
        raise ValueError(f"unknown base quantization {method!r}; choose one of {BASE_METHODS}")
    names = frozen_linears(denoiser) if targets is None else list(targets)
    result = BaseQuantization(method, 0, [], 0, 0)
    for name in names:
        linear = denoiser.get_submodule(name)
        if not isinstance(linear, torch.nn.Linear) or linear.weight.requires_grad:
            raise ValueError(f"{name} is not a frozen nn.Linear; only frozen linears can be quantized")
        if device is not None:
            linear.to(device)
        if dtype is not None:
            linear.to(dtype=dtype)
        before = tensor_bytes(linear.weight)
        weight = _quantize_weight(linear, method)
        if weight is None:
            result.kept.append(name)
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = denoiser.get_submodule(parent_name) if parent_name else denoiser
        setattr(parent, attr, QuantizedLinear(weight, linear.bias, method))
        result.layers += 1
        result.bytes_before += before
        result.bytes_after += tensor_bytes(weight)
    return result


def linear_weight_share(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of nn.Linear weights, bytes of all parameters and buffers); works on meta tensors."""
    linear = sum(tensor_bytes(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear))
    return linear, storage_bytes(model)
