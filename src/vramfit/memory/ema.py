"""An exponential moving average (EMA) of the trained weights, kept beside the training.

After every `update_every`-th optimizer step each trained tensor's shadow s moves toward the
weight p: s <- s - (1 - d) * (s - p). With `warmup` the decay of the n-th update (n counted from
0) is min(decay, (1 + n) / (10 + n)) and 0 at n = 0 (the shadows start as the weights after the
first update), as diffusers' EMAModel computes it by default; without, it is `decay` from the
first update, the shadows starting at the weights the run starts from.

diffusers.training_utils.EMAModel holds the same average (tests/test_ema.py checks the fp32
shadows equal its own, value for value) but does not fit the two placements used here:
- bf16 shadows: its update rounds to nearest, and at decay 0.9999 a move of 1e-4 of the distance
  is far below half of bf16's 2**-8 spacing, so the shadows would never move. Here the update is
  made in fp32 and written back with the project's stochastic rounding
  (memory/stochastic_rounding.py), exact on average, from a generator of its own whose state is
  saved with the training state (a resume continues the same draws).
- shadows in CPU memory while the weights are on the GPU: its update subtracts across devices.
  Here the weights are copied into pinned staging buffers, queued on the compute stream without
  holding the host up (the copy must be done before the next step writes the weights, which it
  does inside backward hooks or recorded CUDA graphs, so the compute stream itself orders it), and
  the CPU's arithmetic runs on a worker thread while the GPU runs the next steps; anything that
  reads the shadows (a save, a swap, the training state) waits for it first. The staging buffers
  cost the trained weights' bytes of host memory again. Weights that live in CPU memory (a CPU
  run, streamed weights at home) are copied by the host at once, then updated the same way.

The update runs in the training loop after the optimizer step, outside any recorded step, and
reads the weights, never their gradients. `swapped()` puts the shadows into the weights in place
(the same tensors, so CUDA graph recordings keep their addresses) and the trained values back
after; the trained values wait in CPU memory meanwhile.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from vramfit.memory import pinned
from vramfit.memory.stochastic_rounding import copy_stochastic_

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_RNG, _UPDATES, _PREFIX = "rng", "updates", "shadow."


def ema_decay(decay: float, updates: int, warmup: bool) -> float:
    """The decay of the update made after `updates` earlier ones."""
    if not warmup:
        return decay
    return 0.0 if updates <= 0 else min(decay, (1 + updates) / (10 + updates))


class EMA:
    """Shadows of `params` (name -> trained parameter) in `dtype`, on `device` ("gpu": beside the
    weights, on whatever device each lives; "cpu": in CPU memory)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], *, decay: float, update_every: int = 1,
                 warmup: bool = True, device: str = "gpu", dtype: str = "fp32", seed: int = 0):
        self.params = params
        self.decay, self.update_every, self.warmup = decay, update_every, warmup
        self.on_cpu = device == "cpu"
        self.dtype = DTYPES[dtype]
        self.updates = 0
        first = next(iter(params.values()), None)
        home = torch.device("cpu") if self.on_cpu or first is None else first.device
        self.generator = torch.Generator(device=home).manual_seed(seed)
        with torch.no_grad():
            self.shadows = {n: p.detach().to("cpu" if self.on_cpu else p.device, self.dtype, copy=True)
                            for n, p in params.items()}
        self._staging: Optional[dict[str, torch.Tensor]] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None

    def bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shadows.values())

    def maybe_update(self, step: int) -> bool:
        """Update after optimizer step `step` (counted from 1) when it is an update_every-th one."""
        if step % self.update_every:
            return False
        self.update()
        return True

    @torch.no_grad()
    def update(self) -> None:
        d = ema_decay(self.decay, self.updates, self.warmup)
        self.updates += 1
        if not self.on_cpu:
            self._apply(d, {n: p.detach() for n, p in self.params.items()})
            return
        self.wait()
        staging = self._stage()
        ready = None
        for name, p in self.params.items():
            staging[name].copy_(p.detach(), non_blocking=p.device.type == "cuda")
            if p.device.type == "cuda" and ready is None:
                ready = p.device
        event = torch.cuda.current_stream(ready).record_event() if ready is not None else None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vramfit-ema")
        self._pending = self._pool.submit(self._apply_after, event, d, staging)

    def _stage(self) -> dict[str, torch.Tensor]:
        if self._staging is None:
            self._staging = {}
            for n, p in self.params.items():
                self._staging[n] = pinned.empty(p.numel(), p.dtype, pin=p.device.type == "cuda",
                                                 device=p.device).view(p.shape)
        return self._staging

    def _apply_after(self, event, d: float, values: dict[str, torch.Tensor]) -> None:
        if event is not None:
            event.synchronize()
        with torch.no_grad():
            self._apply(d, values)

    def _apply(self, d: float, values: dict[str, torch.Tensor]) -> None:
        """s <- s - (1 - d) (s - p), in fp32; bf16 shadows rounded stochastically."""
        for name, s in self.shadows.items():
            p = values[name]
            if s.dtype == torch.float32:
                s.sub_((1 - d) * (s - p.float()))
                continue
            wide = s.float()
            wide.sub_((1 - d) * (wide - p.float()))
            copy_stochastic_(s, wide, self.generator)

    def wait(self) -> None:
        """Until a pending CPU update is done (its error raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._staging = None

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The shadows in the weights inside the block, the trained values back after it."""
        self.wait()
        with torch.no_grad():
            kept = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}
            try:
                for n, p in self.params.items():
                    p.copy_(self.shadows[n])
                yield
            finally:
                for n, p in self.params.items():
                    p.copy_(kept[n])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU tensors for a safetensors file: the shadows, the rounding generator, the count."""
        self.wait()
        state = {_PREFIX + n: s.detach().to("cpu", copy=True) for n, s in self.shadows.items()}
        state[_RNG] = self.generator.get_state()
        state[_UPDATES] = torch.tensor([self.updates], dtype=torch.int64)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], where: str) -> None:
        """Restore what state_dict gave; `where` names the file in errors."""
        names = {k[len(_PREFIX):] for k in state if k.startswith(_PREFIX)}
        if names != set(self.shadows) or _RNG not in state or _UPDATES not in state:
            missing = sorted(set(self.shadows) - names)[:3]
            raise ValueError(f"{where}: its EMA weights do not match this model's trained weights (missing "
                             f"{missing}); resume without it by removing the file, or start a new run")
        self.wait()
        with torch.no_grad():
            for n, s in self.shadows.items():
                value = state[_PREFIX + n]
                if value.shape != s.shape:
                    raise ValueError(f"{where}: EMA weight {n} has shape {tuple(value.shape)}, the model's "
                                     f"{tuple(s.shape)}; start a new run")
                s.copy_(value)
        try:
            self.generator.set_state(state[_RNG])
        except (RuntimeError, ValueError):
            # saved with the EMA on another device (ema.device changed): that generator's state does not
            # fit this one, which keeps its seed; only the bf16 rounding draws differ from then on
            pass
        self.updates = int(state[_UPDATES][0])
