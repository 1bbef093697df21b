"""Gradient sums at home, added while backward runs: earlier micro-batches' gradients of streamed
weights copied to pinned CPU memory and added into their sums there by a worker thread.

With memory.streamed_grad_sums = "home" (grads.py) a gradient of an earlier micro-batch is copied
home on the copy-home stream and added into its weight's sum in CPU memory. Holding every copy
until backward ends and adding them then would keep a whole micro-batch's gradients staged (the
streamed weights' bytes again, pinned) and leave the CPU's additions (seconds over a billion
values) after the GPU's work instead of beside it. Here the copies go into a few kept *sheets*
(pinned buffers, one per dtype, each as large as the largest unit's values of that dtype), filled
in arrival order; a sheet that is full, or whose gradients belong to another unit than the next
one's, goes to a worker thread that waits for its copies (a CUDA event), adds them into the sums
(or copies the first micro-batch's in) and hands the sheet back. The main thread waits only when
all sheets are out, and at the end of backward for the last ones. torch's CPU additions release
the interpreter lock, so the worker adds while the main thread queues the backward's GPU work.

Costs `SHEETS` sheets of pinned memory (memory/pinned.py: exactly their size). No library does
this: torch offers pinned memory and streams, not a pipeline of host additions behind copies.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from vramfit.memory import pinned
from vramfit.memory.accounting import tensor_bytes

SHEETS = 3  # one being filled, one whose copies run, one being added: the copies and additions overlap


class _Sheet:
    """Pinned buffers (one per dtype) that gradients are copied into in arrival order, and what
    each one is added into."""

    def __init__(self, sizes: dict[torch.dtype, int], device: Optional[torch.device]):
        self.buffers = {dtype: pinned.empty(n, dtype, pin=device is not None, device=device)
                        for dtype, n in sizes.items()}
        self.used = dict.fromkeys(self.buffers, 0)
        self.owner: Optional[object] = None  # the unit whose gradients it holds
        self.entries: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (sum, staged copy, first)
        self.done: Optional[Future] = None

    def fits(self, grad: torch.Tensor, owner: object) -> bool:
        room = self.buffers.get(grad.dtype)
        return (self.owner is None or self.owner is owner) and room is not None \
            and self.used[grad.dtype] + grad.numel() <= room.numel()

    def take(self, grad: torch.Tensor, owner: object) -> torch.Tensor:
        """The next `grad.numel()` values of its dtype's buffer, shaped as `grad`."""
        start = self.used[grad.dtype]
        self.used[grad.dtype] = start + grad.numel()
        self.owner = owner
        return self.buffers[grad.dtype].narrow(0, start, grad.numel()).view(grad.shape)

    def reset(self) -> None:
        self.used = dict.fromkeys(self.buffers, 0)
        self.owner, self.entries, self.done = None, [], None


def copy_home(host: torch.Tensor, grad: torch.Tensor, back: Optional[torch.cuda.Stream]) -> None:
    """`grad` into `host`: on the stream `back` once the work queued so far on the current stream is
    done, `grad`'s memory reused only after the copy; with no stream (off CUDA) a plain copy."""
    if back is None:
        host.copy_(grad)
        return
    back.wait_stream(torch.cuda.current_stream(grad.device))
    with torch.cuda.stream(back):
        host.copy_(grad, non_blocking=True)
    grad.record_stream(back)


def _add(entries: list[tuple[torch.Tensor, torch.Tensor, bool]], copied) -> None:
    """The worker's part: once the copies are done, each staged gradient into its sum."""
    if copied is not None:
        copied.synchronize()
    for total, staged, first in entries:
        if first:
            total.copy_(staged)
        else:
            total.add_(staged)


class StagedSums:
    """Adds gradients on `device` into sums in CPU memory, through kept pinned sheets of `sizes`
    values per dtype (at least the largest gradient's), copied on the stream `back` (None for both:
    no copy stream, plain memory, the copy into the sheet a plain one; used off CUDA by the tests)."""

    def __init__(self, sizes: dict[torch.dtype, int], back: Optional[torch.cuda.Stream],
                 device: Optional[torch.device] = None, sheets: int = SHEETS):
        self.sizes, self.back, self.device, self.count = dict(sizes), back, device, max(2, sheets)
        self.sheets: list[_Sheet] = []
        self._filling: Optional[_Sheet] = None
        self._out: list[_Sheet] = []  # handed to the worker, oldest first
        self._worker: Optional[ThreadPoolExecutor] = None

    def add(self, total: torch.Tensor, grad: torch.Tensor, owner: object, first: bool) -> None:
        """Stage `grad` (a device tensor of one of the sheets' dtypes) to be added into `total`
        (copied in where `first`); `owner`: the unit it belongs to (a sheet holds one unit's)."""
        sheet = self._filling
        if sheet is None or not sheet.fits(grad, owner):
            self._hand_over()
            sheet = self._filling = self._free_sheet()
            if not sheet.fits(grad, owner):
                raise ValueError(f"a gradient of {grad.numel()} {grad.dtype} values does not fit a sheet "
                                 f"of {self.sizes}")
        staged = sheet.take(grad, owner)
        copy_home(staged, grad, self.back)
        sheet.entries.append((total, staged, first))

    def wait(self) -> None:
        """Every staged gradient added into its sum (at the end of a backward)."""
        self._hand_over()
        while self._out:
            self._reclaim()

    def drop(self) -> None:
        """After a backward that did not finish: whatever was staged is added or dropped, no
        addition still runs."""
        self._filling = None
        out, self._out = self._out, []
        for sheet in out:
            try:
                sheet.done.result()
            except Exception:  # its sums are dropped with the step (grads.py `drop`)
                pass
            sheet.reset()
        for sheet in self.sheets:
            sheet.reset()

    def nbytes(self) -> int:
        """Pinned bytes of the sheets made so far."""
        return sum(tensor_bytes(b) for s in self.sheets for b in s.buffers.values())

    def _hand_over(self) -> None:
        sheet, self._filling = self._filling, None
        if sheet is None:
            return
        if not sheet.entries:
            sheet.reset()
            return
        copied = None
        if self.back is not None:
            copied = torch.cuda.Event()
            copied.record(self.back)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vramfit-sums")
        sheet.done = self._worker.submit(_add, sheet.entries, copied)
        self._out.append(sheet)

    def _reclaim(self) -> _Sheet:
        """The oldest sheet handed over, once its additions are done (their error raised here)."""
        sheet = self._out.pop(0)
        try:
            sheet.done.result()
        finally:
            sheet.reset()
        return sheet

    def _free_sheet(self) -> _Sheet:
        busy = {id(s) for s in self._out}
        free = next((s for s in self.sheets if id(s) not in busy), None)
        if free is not None:
            return free
        if len(self.sheets) < self.count:
            self.sheets.append(_Sheet(self.sizes, self.device))
            return self.sheets[-1]
        return self._reclaim()
