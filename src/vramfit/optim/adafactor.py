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

On a GPU with Triton, for a bf16 weight written with stochastic rounding, the whole step runs as
Triton kernels (`_fused_step`): each pass one kernel a chunk (`_sums_kernel`, `_squares_kernel`,
`_apply_kernel`), and the arithmetic between them in two more (`_factors_kernel`: the norm, its
finite flag and clipping scale, both moments and the update's factors; `_rms_kernel`: the
update's RMS clip, the learning rate and the scale in one factor). Passes 1 and 2 leave one partial
sum a program, which the next kernel adds up in program order: the same order at every run. g^2
and the update r[row] c[col] g are formed in registers, never as fp32 tensors, and pass 3 adds the
weight decay, rounds the new value (memory/stochastic_rounding.py's Philox rounding) and holds it
back on a False finite flag in the same pass. Per value that is 2 bytes read in each of passes 1
and 2 and 6 moved in pass 3, against about 26, 22 and 40 for the torch ops. The learning rate,
beta2 and the decay are read from the device (ParamOptimizer.device_scalars), so a step recorded
as a CUDA graph (train/graphs.py) runs the kernels an eager step compiled. Besides the kernels a
step makes two allocations, the chunks' views and a seed a chunk, where the torch ops take about
fifty small launches a tensor: on the host (a step inside backward, eagerly) and on the GPU (a
recorded one, where every tiny kernel still costs its few microseconds) alike.
tests/test_fused_kernels.py holds it to the exact fp32 step (each value one of its two bf16
neighbours, unbiased).
"""
from __future__ import annotations

import itertools
import math
from typing import Optional

import torch

from vramfit.memory.stochastic_rounding import FUSED_BLOCK, device_seed, fused_kernels, on, triton
from vramfit.optim.base import ChunkedGrad, ParamOptimizer, RoundingGenerators, norm_checks, scaled, scaled_

if triton is not None:
    import triton.language as tl

    from vramfit.memory.stochastic_rounding import round_bf16

    @triton.jit
    def _update_at(g_ptr, g2_ptr, r_ptr, c_ptr, offsets, inside, cols, factor, TWO: tl.constexpr):
        """The update (r[row] factor c[col]) g at `offsets` of a chunk (g: one part, or the sum of
        two in fp32), as passes 2 (factor 1) and 3 both form it; the torch ops compute the same
        products in the same order (r times the factor, times c, then times g)."""
        g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        if TWO:
            g = g + tl.load(g2_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + offsets // cols, mask=inside, other=0.0) * factor
        c = tl.load(c_ptr + offsets % cols, mask=inside, other=0.0)
        return (r * c) * g

    @triton.jit
    def _apply_kernel(p_ptr, g_ptr, g2_ptr, r_ptr, c_ptr, factor_ptr, decay_ptr, keep_ptr, seed_ptr, n, cols,
                      TWO: tl.constexpr, DECAY: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 3 of a chunked step of a bf16 weight, fused: for each value of the chunk,
        new = old (+ decay * old) - the update times the step's factor (`_rms_kernel`), rounded
        stochastically into the weight; nothing is written when the finite flag is False."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n * tl.load(keep_ptr).to(tl.int64)  # a False finite flag: no value is inside
        update = _update_at(g_ptr, g2_ptr, r_ptr, c_ptr, offsets, inside, cols, tl.load(factor_ptr), TWO)
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
        update = _update_at(g_ptr, g2_ptr, r_ptr, c_ptr, offsets, inside, cols, 1.0, TWO)
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

    @triton.jit
    def _factors_kernel(row_sum_ptr, part_ptr, row_state_ptr, col_state_ptr, r_ptr, c_ptr, scale_ptr, keep_ptr,
                        beta_ptr, rest_ptr, max_norm, rows, cols, parts, CLIP: tl.constexpr, EPS: tl.constexpr,
                        ROWS: tl.constexpr, COLS: tl.constexpr):
        """Between passes 1 and 2, fused: from g^2's row sums and pass 1's partial column sums, the
        norm's finite flag and clipping scale, both second-moment factors updated (held back on a
        False flag) and the update's row and column factors. Every program sums the row sums, in
        the same order, for the norm; program 0 then does the rows (their mean needs all of them),
        each other program COLS columns, adding up their partial sums in program order."""
        program = tl.program_id(0)
        total = tl.zeros((ROWS,), dtype=tl.float32)
        for start in range(0, rows, ROWS):
            i = start + tl.arange(0, ROWS)
            total += tl.load(row_sum_ptr + i, mask=i < rows, other=0.0)
        norm = tl.sqrt(tl.sum(total, axis=0))
        finite = norm < float("inf")  # a norm is >= 0 or NaN
        held = finite.to(tl.int32)  # indices below rows * held (cols * held) are written: none on a False flag
        if CLIP:  # clip_grad_norm_'s factor; the clipped gradient's squares are the squares times its square
            scale = tl.minimum(max_norm / (norm + 1e-6), 1.0)
        else:
            scale = norm * 0.0 + 1.0
        squared = scale * scale
        beta, rest = tl.load(beta_ptr), tl.load(rest_ptr)
        if program == 0:
            kept = tl.zeros((ROWS,), dtype=tl.float32)
            for start in range(0, rows, ROWS):
                i = start + tl.arange(0, ROWS)
                inside = i < rows
                mean = tl.load(row_sum_ptr + i, mask=inside, other=0.0) * squared / cols + EPS
                new = tl.load(row_state_ptr + i, mask=inside, other=0.0) * beta + rest * mean
                tl.store(r_ptr + i, new, mask=inside)
                kept += tl.where(inside, new, 0.0)
            row_mean = tl.sum(kept, axis=0) / rows
            tl.debug_barrier()
            for start in range(0, rows, ROWS):
                i = start + tl.arange(0, ROWS)
                inside = i < rows
                new = tl.load(r_ptr + i, mask=inside, other=1.0)
                tl.store(row_state_ptr + i, new, mask=i < rows * held)
                tl.store(r_ptr + i, tl.math.rsqrt(new / row_mean), mask=inside)
            tl.store(scale_ptr, scale)
            tl.store(keep_ptr, held.to(tl.uint8))
        else:
            j = (program - 1) * COLS + tl.arange(0, COLS)
            inside = j < cols
            col = tl.zeros((COLS,), dtype=tl.float32)
            for part in range(0, parts):
                col += tl.load(part_ptr + part * cols + j, mask=inside, other=0.0)
            mean = col * squared / rows + EPS
            new = tl.load(col_state_ptr + j, mask=inside, other=0.0) * beta + rest * mean
            tl.store(col_state_ptr + j, new, mask=j < cols * held)
            tl.store(c_ptr + j, tl.math.rsqrt(new), mask=inside)

    @triton.jit
    def _rms_kernel(part_ptr, scale_ptr, factor_ptr, lr_ptr, parts, count, CLIP: tl.constexpr,
                    LIMIT: tl.constexpr, BLOCK: tl.constexpr):
        """After pass 2, one program: the update's RMS from pass 2's partial sums (in program order)
        and the factor pass 3 multiplies the update by: the RMS clip, the learning rate and the
        clipping scale at once."""
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, parts, BLOCK):
            i = start + tl.arange(0, BLOCK)
            total += tl.load(part_ptr + i, mask=i < parts, other=0.0)
        rms = tl.sqrt(tl.sum(total, axis=0) / count)
        if CLIP:
            rms = rms * tl.load(scale_ptr)
        factor = (1.0 / tl.maximum(rms / LIMIT, 1.0)) * tl.load(lr_ptr)
        if CLIP:
            factor = factor * tl.load(scale_ptr)
        tl.store(factor_ptr, factor)


SUM_ROWS, SUM_COLS = 16, 256  # a pass-1 program's rows, and the columns it reads at a time
FACTOR_ROWS, FACTOR_COLS = 1024, 256  # `_factors_kernel`: rows read at a time; columns of a program
ALIGN = 16  # fp32 values: each piece of a fused step's buffer starts 64 bytes in, as a fresh tensor


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
        factors = (state["exp_avg_sq_row"], state["exp_avg_sq_col"])
        if self._fused_passes(p, grad) and all(t.dtype == torch.float32 and t.is_contiguous() for t in factors):
            return self._fused_step(p, grad, group, state, hyper, spans, max_norm)
        rows, cols = grad.shape
        # pass 1: g^2's row and column sums, unscaled; the norm is their total
        row_sum = torch.empty(rows, dtype=torch.float32, device=p.device)
        col_sum = torch.zeros(cols, dtype=torch.float32, device=p.device)
        for start, stop in spans:
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
        for start, stop in spans:  # pass 3: the update, written back chunk by chunk
            old = matrix[start:stop]
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
        """Whether this chunked step runs as Triton kernels (`_fused_step`): a bf16 weight written
        with stochastic rounding, a gradient of one or two contiguous parts, on a GPU with Triton."""
        return self._fuses(p) and len(grad.parts) <= 2 and fused_kernels(p, *grad.parts)

    def _fused_step(self, p: torch.Tensor, grad: ChunkedGrad, group: dict, state: dict, hyper: dict,
                    spans: list[tuple[int, int]], max_norm: float) -> torch.Tensor:
        """`step_chunked`'s arithmetic as five Triton kernels and a seed's draw per chunk, with one
        buffer for everything they pass on: pass 1 a chunk (`_sums_kernel`), the factors
        (`_factors_kernel`), pass 2 a chunk (`_squares_kernel`), the step's factor
        (`_rms_kernel`), pass 3 a chunk (`_apply_kernel`). The numbers they read (the learning
        rate, beta2 and the decay) are read from the device, eagerly as when a step is recorded
        (`device_scalars`), so a recording meets the kernels an eager step compiled."""
        rows, cols = grad.shape
        device = p.device
        two = len(grad.parts) == 2
        pieces = [[t[start:stop] for t in grad.parts] for start, stop in spans]
        sums = [triton.cdiv(stop - start, SUM_ROWS) for start, stop in spans]  # pass 1's programs a chunk
        squares = [triton.cdiv((stop - start) * cols, FUSED_BLOCK) for start, stop in spans]  # pass 2's
        sizes = (rows, rows, cols, sum(sums) * cols, sum(squares), 1, 1)
        padded = [-(-n // ALIGN) * ALIGN for n in sizes]
        starts = [0, *itertools.accumulate(padded)]
        buffer = torch.empty(starts[-1], dtype=torch.float32, device=device)
        row_sum, r_factor, c_factor, part1, part2, scale, factor = (
            buffer[start:start + n] for start, n in zip(starts, sizes))
        finite = torch.empty((), dtype=torch.bool, device=device)
        keep = finite.view(torch.uint8)
        numbers = self.device_scalars(hyper, device)
        clip = max_norm > 0
        with on(device):
            first = 0
            for (start, stop), parts, programs in zip(spans, pieces, sums):
                _sums_kernel[(programs,)](parts[0], parts[-1], row_sum[start:stop], part1[first * cols:], stop - start,
                                          cols, TWO=two, ROWS=SUM_ROWS, COLS=SUM_COLS)
                first += programs
            _factors_kernel[(1 + triton.cdiv(cols, FACTOR_COLS),)](
                row_sum, part1, state["exp_avg_sq_row"], state["exp_avg_sq_col"], r_factor, c_factor, scale, keep,
                numbers["beta2t"], numbers["rest"], float(max_norm), rows, cols, first, CLIP=clip, EPS=EPS1,
                ROWS=FACTOR_ROWS, COLS=FACTOR_COLS)
            first = 0
            for (start, stop), parts, programs in zip(spans, pieces, squares):
                _squares_kernel[(programs,)](parts[0], parts[-1], r_factor[start:stop], c_factor, part2[first:],
                                             (stop - start) * cols, cols, TWO=two, BLOCK=FUSED_BLOCK)
                first += programs
            _rms_kernel[(1,)](part2, scale, factor, numbers["lr"], first, float(rows * cols), CLIP=clip,
                              LIMIT=CLIP_THRESHOLD, BLOCK=FUSED_BLOCK)
            decay = numbers["decay"] if group["weight_decay"] else None
            matrix = p.view(rows, cols)
            for (start, stop), parts in zip(spans, pieces):
                seed = device_seed(self.rounding(device), device)
                old = matrix[start:stop]
                _apply_kernel[(triton.cdiv(old.numel(), FUSED_BLOCK),)](
                    old, parts[0], parts[-1], r_factor[start:stop], c_factor, factor,
                    decay if decay is not None else seed, keep, seed, old.numel(), cols, TWO=two,
                    DECAY=decay is not None, BLOCK=FUSED_BLOCK)
        return finite

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
