"""torch.optim-style optimizers from elsewhere (pytorch-optimizer's Prodigy, ScheduleFreeAdamW and
CAME, or any class a config names by dotted path) behind vramfit's ParamOptimizer interface.

Such a class updates `p.data` of every parameter in its groups in one `step()` and keys its state by
the parameter object; Prodigy's learning-rate estimate and schedule-free's averaging weights are
sums over all parameters of the step. So it cannot step one parameter or pack at a time: no step
inside backward (config/rules.py refuses it) and no streamed weights of a full fine-tune (their
step would span two devices).

The wrapped optimizer steps fp32 `shadow` tensors, one per trained parameter (an fp32 parameter is
its own shadow). For a bf16 parameter the shadow holds an fp32 copy of the weight and its gradient
only during the step: the step writes the new value back into the bf16 weight with stochastic
rounding (train.stochastic_rounding, from the same seeded generators as vramfit's own optimizers),
else to nearest, and frees the copy. The bf16 weight stays the truth, as with vramfit's own
optimizers: cost 8 bytes per trained bf16 value (weight and gradient in fp32) during the step,
none between steps. The wrapped state (moments, Prodigy's p0 and d, schedule-free's z and weight
sums) is fp32, as the class allocates it from an fp32 shadow.

A non-finite step (`finite` False) is not taken at all, which asks the host for the flag (one sync
a step); `take_back` then has nothing to undo. The state dict holds the wrapped optimizer's own
state dict and the rounding generators, so a resumed run continues bit for bit.

Schedule-free (Defazio et al.): the weights trained on are the interpolation y; the weights to
sample, validate and save are the average x = y + (1 - 1/b1) (z - y). `averaged()` switches the
model to x for the duration of a `with` block (sampling, validation, a saved checkpoint) and puts
the exact y back after it from a copy (the size of the trained weights, held only inside the
block), so the training that follows, and a resumable state saved outside the block, are those of
a run that never switched.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from vramfit.memory.stochastic_rounding import copy_stochastic_
from vramfit.optim.base import ParamOptimizer, RoundingGenerators


def import_class(path: str, key: str = "train.optimizer_class") -> type:
    """The class a dotted path names ("package.module.Class"), or a ValueError naming `key`."""
    module_name, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{key} = {path!r}: cannot import it ({exc}); give the dotted path of an optimizer "
                         "class, as package.module.Class, from a package installed here") from None
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise ValueError(f"{key} = {path!r} is not a torch.optim.Optimizer subclass")
    return found


class WrappedOptimizer(ParamOptimizer):
    """A torch.optim-style class stepping fp32 shadows of the parameters (see the module doc)."""

    COPY_BYTES = 8  # during a step, per value of a bf16 parameter: its fp32 copy and its gradient's

    def __init__(self, params, cls: type, kwargs: dict[str, Any],
                 rounding: Optional[RoundingGenerators] = None, key: str = "train.optimizer_args"):
        params = list(params)
        super().__init__(params, dict(lr=kwargs.get("lr", 1e-3)), rounding)
        self.shadows = [_shadow_of(p) for p in params]
        try:
            self.inner = cls(self.shadows, **kwargs)
        except TypeError as exc:
            raise ValueError(f"{key}: {cls.__module__}.{cls.__name__} refused its arguments ({exc}); "
                             "give only arguments its constructor takes") from None

    @torch.no_grad()
    def step_params(self, pairs, finite=None) -> None:
        if isinstance(finite, list):
            raise RuntimeError("a wrapped optimizer steps all parameters at once, never inside backward")
        if finite is not None and not bool(finite):
            return
        self._sync_groups()
        by_param = {id(p): grad for p, grad in pairs}
        params = [p for group in self.param_groups for p in group["params"]]
        copied = []
        for p, shadow in zip(params, self.shadows):
            grad = by_param.get(id(p))
            if shadow is p:
                if grad is not None and grad is not p.grad:
                    p.grad = grad
                continue
            if grad is not None:
                shadow.data = p.detach().float()
                shadow.grad = grad.to(p.device, torch.float32)
                copied.append((p, shadow))
        self.inner.step()
        for p, shadow in copied:
            self._write(p, shadow)
            shadow.grad = None
            shadow.data = torch.empty(0, device=p.device)

    def step_param(self, p, grad, finite=None) -> None:
        self.step_params([(p, grad)], finite)

    def add_param_group(self, param_group: dict) -> None:
        """A further group (the trained text encoders at train.text_encoder_lr) joins the wrapped
        optimizer too, with shadows of its own: its class's defaults and this group's learning rate
        (Prodigy's estimate then spans both groups, as in its reference)."""
        super().add_param_group(param_group)
        inner = getattr(self, "inner", None)
        if inner is None:  # the constructor's first group, before the wrapped optimizer exists
            return
        group = self.param_groups[-1]
        shadows = [_shadow_of(p) for p in group["params"]]
        self.shadows += shadows
        inner.add_param_group({"params": shadows, "lr": group["lr"]})

    def _write(self, p: torch.Tensor, value: torch.Tensor) -> None:
        if self.rounding is not None and p.dtype == torch.bfloat16:
            copy_stochastic_(p.data, value, self.rounding(p.device))
        else:
            p.data.copy_(value)

    def _sync_groups(self) -> None:
        """The learning rate the schedule set on this optimizer's groups, given to the wrapped one's."""
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner["lr"] = outer["lr"]

    def ensure_state(self, params) -> None:
        raise RuntimeError("a wrapped optimizer has no per-parameter steps to record")

    def state_dict(self) -> dict:
        saved = super().state_dict()
        saved["wrapped"] = self.inner.state_dict()
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        saved = dict(state_dict)
        wrapped = saved.pop("wrapped")
        super().load_state_dict(saved)
        self.inner.load_state_dict(wrapped)

    @contextmanager
    def averaged(self) -> Iterator[None]:
        yield


def _shadow_of(p: torch.Tensor) -> torch.Tensor:
    """What the wrapped optimizer steps for `p`: `p` itself in fp32, else an fp32 copy filled only
    during a step (empty between)."""
    return p if p.dtype == torch.float32 else torch.empty(0, device=p.device)


class ScheduleFree(WrappedOptimizer):
    """A schedule-free optimizer whose state holds z and whose groups hold betas (see the module doc)."""

    @contextmanager
    def averaged(self) -> Iterator[None]:
        params = [p for group in self.param_groups for p in group["params"]]
        kept = [p.detach().clone() for p in params]
        try:
            with torch.no_grad():
                for p, shadow, group in zip(params, self.shadows, self._inner_groups()):
                    z = self.inner.state.get(shadow, {}).get("z")
                    if z is not None:  # to nearest: no random draw, so the rounding stream goes on unchanged
                        p.data.copy_(p.float().lerp_(z, 1.0 - 1.0 / group["betas"][0]))
            yield
        finally:
            with torch.no_grad():
                for p, old in zip(params, kept):
                    p.data.copy_(old)

    def _inner_groups(self) -> list[dict]:
        return [group for group in self.inner.param_groups for _ in group["params"]]
