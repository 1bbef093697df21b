"""Adafactor with a fixed learning rate, conv kernels factored as whole matrices.

The semantics are those of transformers' Adafactor with relative_step, scale_parameter and
warmup_init off, as the 8 GB SSD-1B recipe uses it: no first moment (beta1 None), the second
moment of a matrix kept as a row and a column mean (Shazeer & Stern), beta2 at step t
1 - t^-0.8, eps1 = 1e-30 added to g^2, the update divided by max(1, RMS(update) / 1.0), and
decoupled weight decay p <- p - wd * lr * p. Vectors keep a full second moment.

transformers factors a tensor's second moment over its last two dimensions. For a conv kernel
[out, in, kh, kw] those are the 3x3 kernel dims, so it keeps two fp32 tensors of out*in*kh
values: for SSD-1B's UNet that is 0.83 GiB of optimizer state, 2/3 of a bf16 copy of every conv
weight. Here each kernel is viewed as the [out, in*kh*kw] matrix it acts as (Adafactor's paper
factors weight matrices), which shrinks that to out + in*kh*kw values per kernel, about
0.02 GiB for SSD-1B. State is fp32 whatever the weight's dtype, as in transformers.

Cost: the reshapes are views; fp32 temporaries of one parameter, or one pack of parameters of
the same shape (optim/base.py), at a time: its fp32 copy, its fp32 gradient and one buffer that
holds g^2, then the update, then the new value (12 bytes per value; 16 with weight decay), and
while a bf16 result is written back the rounding's 5 bytes per value.

Chunked (`step_chunked`, used by the step inside backward for a tensor of more than
MIN_PACK_NUMEL values, or FUSED_CHUNK_NUMEL where the fused kernels below run it, whose rows each
fit in MIN_PACK_NUMEL): the same update read from the gradient
in chunks of whole rows of the matrix view, in three passes: g^2's row and column sums (whose
total is the gradient's norm, for the finite check and the clipping; the factors follow), the
update's RMS, then the update itself, each chunk written back (with stochastic rounding) as it
is done. The gradient is read three times, and the temporaries are those of one chunk (its
update, the new value, the rounding's draw and NaN mask: about 13 bytes per value of at most
MIN_PACK_NUMEL values, measured on CPU) instead of 12 to 13 bytes per value of the whole tensor
beside an fp32 copy of its gradient. Equal to the whole update within float rounding (sums of
chunk sums and chunk dot products; a clipped gradient's squares are the squares times the
scale's square).

On a GPU with Triton, for a bf16 weight written with stochastic rounding, each pass runs as one
kernel a chunk (`_sums_kernel`, `_squares_kernel`, `_apply_kernel`; the first two leave one
partial sum a program, which torch adds up: the same order at every run): g^2 and the update
r[row] c[col] g are formed in registers, never as fp32 tensors, and pass 3 adds the weight decay,
rounds the new value (memory/stochastic_rounding.py's Philox rounding) and holds it back on a
False finite flag in the same pass. Per value that is 2 bytes read in each of passes 1 and 2 and
6 moved in pass 3, against about 26, 22 and 40 for the torch ops; a chunk takes three Triton
kernels and five small torch ops (the two partial sums' totals, their adds, the seed's draw)
instead of about twenty full-size ones. It pays where the
GPU's time is the step's (a step inside backward recorded as a CUDA graph, train/graphs.py);
tests/test_fused_kernels.py holds it to the exact fp32 step (each value one of its two bf16
neighbours, unbiased).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from vramfit.memory.stochastic_rounding import FUSED_BLOCK, device_seed, fused_kernels, on, triton
from vramfit.optim.base import ChunkedGrad, ParamOptimizer, RoundingGenerators, norm_checks, scaled, scaled_

if triton is not None:
    import triton.language as tl

    from vramfit.memory.stochastic_rounding import round_bf16

    @triton.jit
    def _update_at(g_ptr, g2_ptr, r_ptr, c_ptr, offsets, inside, cols, TWO: tl.constexpr):
        """The update (r[row] c[col]) g at `offsets` of a chunk (g: one part, or the sum of two in
        fp32), as passes 2 and 3 both form it; the torch ops compute the same products in the same
        order (r c, then times g)."""
        g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        if TWO:
            g = g + tl.load(g2_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + offsets // cols, mask=inside, other=0.0)
        c = tl.load(c_ptr + offsets % cols, mask=inside, other=0.0)
        return (r * c) * g

    @triton.jit
    def _apply_kernel(p_ptr, g_ptr, g2_ptr, r_ptr, c_ptr, decay_ptr, keep_ptr, seed_ptr, n, cols,
                      TWO: tl.constexpr, DECAY: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 3 of a chunked step of a bf16 weight, fused: for each value of the chunk,
        new = old (+ decay * old) - the update, rounded stochastically into the weight; nothing is
        written when the finite flag is False."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n * tl.load(keep_ptr).to(tl.int64)  # a False finite flag: no value is inside
        update = _update_at(g_ptr, g2_ptr, r_ptr, c_ptr, offsets, inside, cols, TWO)
        old = tl.load(p_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        if DECAY:
            old = old + old * tl.load(decay_ptr)
        new = old - update
        tl.store(p_ptr + offsets, round_bf16(new, tl.load(seed_ptr), offsets), mask=inside)

    @triton.jit
    def _squares_kernel(g_ptr, g2_ptr, r_ptr, c_ptr, out_ptr, n, cols, TWO: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 2 of a chunked step, fused: each program's sum of the update's squares over its
        block, one partial sum a program (summed by torch: the same order at every run)."""
        program = tl.program_id(0)
        offsets = program.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        update = _update_at(g_ptr, g2_ptr, r_ptr, c_ptr, offsets, inside, cols, TWO)
        tl.store(out_ptr + program, tl.sum(update * update, axis=0))

    @triton.jit
    def _sums_kernel(g_ptr, g2_ptr, row_ptr, part_ptr, rows, cols, TWO: tl.constexpr, ROWS: tl.constexpr,
                     COLS: tl.constexpr):
        """Pass 1 of a chunked step, fused: g^2's sum over each of a program's ROWS rows (into
        row_ptr) and over each column of them (one row of partial sums a program, summed by
        torch: the same order at every run)."""
        program = tl.program_id(0)
        row = program * ROWS + tl.arange(0, ROWS)
        in_rows = row < rows
        total = tl.zeros((ROWS,), dtype=tl.float32)
        for start in range(0, cols, COLS):
            col = start + tl.arange(0, COLS)
            in_cols = col < cols
            inside = in_rows[:, None] & in_cols[None, :]
            offsets = row[:, None].to(tl.int64) * cols + col[None, :]
            g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            if TWO:
                g = g + tl.load(g2_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            squares = g * g
            total += tl.sum(squares, axis=1)
            tl.store(part_ptr + program.to(tl.int64) * cols + col, tl.sum(squares, axis=0), mask=in_cols)
        tl.store(row_ptr + row, total, mask=in_rows)


SUM_ROWS, SUM_COLS = 16, 256  # a pass-1 program's rows, and the columns it reads at a time


def _sums_fused(parts: list[torch.Tensor], row_sum: torch.Tensor) -> torch.Tensor:
    """Pass 1 on one chunk: its rows' sums of g^2 written into `row_sum`; returns its column sums."""
    rows, cols = parts[0].shape
    programs = triton.cdiv(rows, SUM_ROWS)
    partial = torch.empty(programs, cols, dtype=torch.float32, device=row_sum.device)
    with on(row_sum.device):
        _sums_kernel[(programs,)](parts[0], parts[-1], row_sum, partial, rows, cols, TWO=len(parts) == 2,
                                  ROWS=SUM_ROWS, COLS=SUM_COLS)
    return partial.sum(dim=0)


def _squares_fused(parts: list[torch.Tensor], r_factor: torch.Tensor, c_factor: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of one chunk's update (pass 2) from `_squares_kernel`."""
    n, cols = parts[0].numel(), parts[0].shape[-1]
    programs = triton.cdiv(n, FUSED_BLOCK)
    partial = torch.empty(programs, dtype=torch.float32, device=parts[0].device)
    with on(partial.device):
        _squares_kernel[(programs,)](parts[0], parts[-1], r_factor, c_factor, partial, n, cols,
                                     TWO=len(parts) == 2, BLOCK=FUSED_BLOCK)
    return partial.sum()

EPS1 = 1e-30
CLIP_THRESHOLD = 1.0
DECAY_RATE = -0.8


def _matrix_shape(shape: torch.Size) -> tuple[int, ...]:
    return (shape[0], math.prod(shape[1:])) if len(shape) > 2 else tuple(shape)


def _rms(t: torch.Tensor, batch_dims: int, over: float = 1.0) -> torch.Tensor:
    """Root mean square over the dimensions after the first `batch_dims`, kept for broadcasting,
    divided by `over` in the same kernel (a new tensor)."""
    dims = tuple(range(batch_dims, t.dim()))
    if not batch_dims:
        return t.norm(2) / (t.numel() ** 0.5 * over)
    if not dims:  # a stack of 0-dim parameters: each one's RMS is its magnitude (dim=() would mean all)
        return t.abs() / over
    per_item = t[(0,) * batch_dims].numel()
    return torch.linalg.vector_norm(t, 2, dim=dims, keepdim=True) / (per_item ** 0.5 * over)


class Adafactor(ParamOptimizer):
    compact_state = True  # out + in values per matrix (vectors: their own size)

    def __init__(self, params, lr: float = 1e-5, weight_decay: float = 0.0,
                 rounding: Optional[RoundingGenerators] = None):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay), rounding)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        shape = _matrix_shape(p.shape)
        state = {"step": 0}
        if len(shape) >= 2:
            state["exp_avg_sq_row"] = torch.zeros(shape[:-1], device=p.device)
            state["exp_avg_sq_col"] = torch.zeros(shape[:-2] + shape[-1:], device=p.device)
        else:
            state["exp_avg_sq"] = torch.zeros(shape, device=p.device)
        return state

    def scalars(self, group: dict, step: int) -> dict[str, float]:
        beta2t = 1.0 - math.pow(step, DECAY_RATE)
        return {"lr": group["lr"], "beta2t": beta2t, "rest": 1.0 - beta2t, "decay": -group["weight_decay"] * group["lr"]}

    @classmethod
    def chunks_weights_of(cls, dtype: torch.dtype) -> bool:
        return True

    # With the fused kernels a chunked step forms nothing of the matrix's size in fp32 and moves
    # about a tenth of the bytes of the torch ops, so matrices down to this size step in chunks too
    # instead of waiting for a pack (an fp32 copy of the gradient, then about 15 bytes a value of
    # the pack's temporaries). Smaller ones still pack with others of their shape: fewer kernels.
    FUSED_CHUNK_NUMEL = 1 << 20

    def chunks(self, p: torch.Tensor) -> bool:
        # a chunk is whole rows of the matrix view: a row of more than the limit could not be bounded
        above = min(self.FUSED_CHUNK_NUMEL, self.MIN_PACK_NUMEL) if self._fuses(p) else self.MIN_PACK_NUMEL
        return p.dim() >= 2 and self._chunkable(p, above)

    def _fuses(self, p: torch.Tensor) -> bool:
        """Whether a chunked step of `p` runs the fused kernels: a bf16 weight written with
        stochastic rounding, where Triton can take it (memory/stochastic_rounding.py)."""
        return p.dtype == torch.bfloat16 and self.rounding is not None and fused_kernels(p)

    @torch.no_grad()
    def step_chunked(self, p: torch.Tensor, grad: ChunkedGrad, max_norm: float = 0.0) -> torch.Tensor:
        group, state, hyper, spans = self._begin_chunked(p, grad)
        rows, cols = grad.shape
        # pass 1: g^2's row and column sums, unscaled; the norm is their total
        row_sum = torch.empty(rows, dtype=torch.float32, device=p.device)
        col_sum = torch.zeros(cols, dtype=torch.float32, device=p.device)
        fused = self._fused_passes(p, grad)
        for start, stop in spans:
            if fused:
                col_sum.add_(_sums_fused([t[start:stop] for t in grad.parts], row_sum[start:stop]))
                continue
            sq = grad.rows(start, stop).square_()
            torch.sum(sq, dim=-1, out=row_sum[start:stop])
            col_sum.add_(sq.sum(dim=0))
            del sq
        norm = row_sum.sum().sqrt_()
        # clipped, the gradient is s g: its squares s^2 g^2, its update's RMS s times that of g
        finite, scale = norm_checks(norm, max_norm)
        if scale is not None:
            squared = scale.square()
            row_sum.mul_(squared)
            col_sum.mul_(squared)
        row_mean, col_mean = row_sum.div_(cols).add_(EPS1), col_sum.div_(rows).add_(EPS1)
        row = scaled_(state["exp_avg_sq_row"].mul(hyper["beta2t"]), row_mean, hyper["rest"])
        col = scaled_(state["exp_avg_sq_col"].mul(hyper["beta2t"]), col_mean, hyper["rest"])
        self._store(state["exp_avg_sq_row"], row, finite)
        self._store(state["exp_avg_sq_col"], col, finite)
        r_factor = (row / row.mean()).rsqrt_().unsqueeze(-1)
        c_factor = col.rsqrt_()

        square_sum = torch.zeros((), dtype=torch.float32, device=p.device)
        for start, stop in spans:  # pass 2: the update's RMS
            if fused:
                square_sum.add_(_squares_fused([t[start:stop] for t in grad.parts], r_factor[start:stop], c_factor))
                continue
            flat = grad.times(torch.mul(r_factor[start:stop], c_factor), start, stop).view(-1)
            square_sum.add_(torch.dot(flat, flat))
            del flat
        rms = square_sum.div_(rows * cols).sqrt_()
        if scale is not None:
            rms.mul_(scale)
        # the step is update * factor: the clipping scale, the RMS clip and the learning rate at once
        factor = (rms / CLIP_THRESHOLD).clamp_(min=1.0).reciprocal_().mul_(hyper["lr"])
        if scale is not None:
            factor.mul_(scale)
        r_factor.mul_(factor)
        matrix = p.view(rows, cols)
        decay = hyper["decay"] if group["weight_decay"] else None
        if fused and decay is not None and not torch.is_tensor(decay):  # the kernel reads it from the device
            decay = torch.full((), decay, dtype=torch.float32, device=p.device)
        for start, stop in spans:  # pass 3: the update, written back chunk by chunk
            old = matrix[start:stop]
            if fused:
                self._apply_fused(old, [t[start:stop] for t in grad.parts], r_factor[start:stop], c_factor, decay,
                                  finite)
                continue
            step = grad.times(torch.mul(r_factor[start:stop], c_factor), start, stop)
            if group["weight_decay"]:
                old32 = old.float()
                new = scaled(old32, old32, hyper["decay"]).sub_(step)
            else:
                new = torch.sub(old, step, out=step)
            self._store(old, new, finite)
            del step, new
        return finite

    def _fused_passes(self, p: torch.Tensor, grad: ChunkedGrad) -> bool:
        """Whether the passes of this chunked step run as Triton kernels (`_sums_kernel`,
        `_squares_kernel`, `_apply_kernel`): a bf16 weight written with stochastic rounding, a
        gradient of one or two contiguous parts, on a GPU with Triton."""
        return self._fuses(p) and len(grad.parts) <= 2 and fused_kernels(p, *grad.parts)

    def _apply_fused(self, old: torch.Tensor, parts: list[torch.Tensor], r_factor: torch.Tensor,
                     c_factor: torch.Tensor, decay, finite: torch.Tensor) -> None:
        """Pass 3 of a chunked step on one chunk in one kernel (`_apply_kernel`)."""
        device = old.device
        seed = device_seed(self.rounding(device), device)
        rows, cols = old.shape
        with on(device):
            _apply_kernel[(triton.cdiv(old.numel(), FUSED_BLOCK),)](
                old, parts[0], parts[-1], r_factor, c_factor, decay if decay is not None else seed,
                finite.view(torch.uint8), seed,
                old.numel(), cols, TWO=len(parts) == 2, DECAY=decay is not None, BLOCK=FUSED_BLOCK)

    def _update(self, p32, grad, state, group, hyper, finite, batch_dims):
        shape = p32.shape
        grad = grad.reshape(shape[:batch_dims] + _matrix_shape(shape[batch_dims:]))
        beta2t, rest = hyper["beta2t"], hyper["rest"]
        sq = grad.square().add_(EPS1)
        # `sq` is read once more (the moments) and then holds the update, and with no weight decay
        # the new value too: the temporaries are p32, grad and sq, 12 bytes per value.
        if "exp_avg_sq_row" in state:
            row = scaled_(state["exp_avg_sq_row"].mul(beta2t), sq.mean(dim=-1), rest)
            col = scaled_(state["exp_avg_sq_col"].mul(beta2t), sq.mean(dim=-2), rest)
            self._store(state["exp_avg_sq_row"], row, finite)
            self._store(state["exp_avg_sq_col"], col, finite)
            r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            update = torch.mul(r_factor, col.unsqueeze(-2).rsqrt(), out=sq).mul_(grad)
        else:
            avg = scaled_(state["exp_avg_sq"].mul(beta2t), sq, rest)
            self._store(state["exp_avg_sq"], avg, finite)
            update = torch.rsqrt(avg, out=sq).mul_(grad)
            del avg
        update.div_(_rms(update, batch_dims, CLIP_THRESHOLD).clamp_(min=1.0)).mul_(hyper["lr"])
        update = update.view(shape)
        if group["weight_decay"]:  # p + (-wd lr) p, as transformers computes it, then the step
            return scaled(p32, p32, hyper["decay"]).sub_(update)
        return torch.sub(p32, update, out=update)
