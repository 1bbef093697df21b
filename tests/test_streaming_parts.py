"""The parts of the weight streamer (memory/offload/), each alone on the CPU: the slot pool, the
activation offload and the gradients' way home (or their step on the compute copy).
tests/test_offload.py covers them composed."""
from __future__ import annotations

import torch
from torch import nn

from vramfit.memory.accounting import tensor_bytes
from vramfit.memory.offload.activations import ActivationOffload, Offloaded
from vramfit.memory.offload.grads import GradsHome
from vramfit.memory.offload.slots import SlotPool
from vramfit.memory.offload.units import StreamStats, Unit

CPU = torch.device("cpu")
F32 = torch.float32


def test_slot_pool_takes_the_smallest_free_slot_that_fits_else_makes_one():
    pool = SlotPool(CPU, capacity=2)
    small = pool.take({F32: 10}, held=[])
    assert small.buffers[F32].numel() == 10 and pool.slots == [small]
    large = pool.take({F32: 100}, held=[small])  # the only slot is held: a new one of the size asked
    assert large is not small and large.buffers[F32].numel() == 100
    pool.release(small)
    pool.release(large)
    assert pool.take({F32: 10}, held=[]) is small  # both fit: the smallest
    assert pool.take({F32: 8}, held=[small]) is large  # the smallest is held: the next that fits
    assert pool.take({F32: 50}, held=[]) is large  # the small one does not fit
    read = large.buffers[F32][:5]  # something else (autograd's saved copy) still reads the large one
    middle = pool.take({F32: 50}, held=[])
    assert middle not in (small, large) and middle.buffers[F32].numel() == 50
    del read
    assert pool.take({F32: 50}, held=[]) is middle  # free again; of the two that fit, the smaller
    both = pool.take({F32: 4, torch.bfloat16: 4}, held=[])  # no slot has bf16 buffers: a new one
    assert set(both.buffers) == {F32, torch.bfloat16} and len(pool.slots) == 4
    assert pool.nbytes() == (10 + 100 + 50 + 4) * 4 + 4 * 2
    pool.clear()
    assert pool.nbytes() == 0 and pool.take({F32: 10}, held=[]) not in (small, large, middle, both)


def _offloaded_step(offload: ActivationOffload, x: torch.Tensor, w: torch.Tensor):
    """One forward and backward whose saved tensors go through `offload`; the buffers busy
    between them, and the gradients."""
    with torch.autograd.graph.saved_tensors_hooks(lambda t: offload.pack(t, t.untyped_storage().data_ptr()),
                                                  offload.unpack):
        h = (x @ w).tanh()
        loss = (h * h).sum()  # h saved twice (as both factors): copied once
    offload.forward_done()
    busy = [b.busy for b in offload.buffers]
    grads = torch.autograd.grad(loss, [x, w])
    del loss, h
    return busy, grads


def test_activation_offload_round_trips_saved_tensors_through_kept_host_buffers():
    x, w = torch.randn(6, 5, requires_grad=True), torch.randn(5, 7, requires_grad=True)
    expected = torch.autograd.grad(((x @ w).tanh() ** 2).sum(), [x, w])
    stats = StreamStats()
    offload = ActivationOffload(CPU, enabled=True, stats=stats)
    busy, grads = _offloaded_step(offload, x, w)
    assert all(busy) and len(busy) == 3  # x and w (for the matmul), h (tanh's output, and twice for mul)
    assert stats.offloaded_bytes == tensor_bytes(x) + tensor_bytes(w) + 6 * 7 * 4 and stats.kept_bytes == 0
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))  # values came back exactly
    assert not any(b.busy for b in offload.buffers)  # backward done: every buffer free again
    first = [b.data.data_ptr() for b in offload.buffers]
    busy, grads = _offloaded_step(offload, x, w)
    assert [b.data.data_ptr() for b in offload.buffers] == first  # the second pass made none
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))
    assert offload.host_bytes() == sum(tensor_bytes(b.data) for b in offload.buffers) > 0
    # a smaller save takes the smallest free buffer it fits; while recording, one that none fits is refused
    smallest = min(offload.buffers, key=lambda b: b.data.numel())
    assert offload.host_buffer(F32, 3) is smallest
    offload.recording = True
    try:
        offload.host_buffer(F32, 10**4)
    except RuntimeError as e:
        assert "saved only while recording has no pinned buffer" in str(e)
    else:
        raise AssertionError("a pinned buffer was made while recording")
    offload.recording = False
    offload.clear()
    assert offload.host_bytes() == 0


def test_activation_offload_keeps_what_it_is_not_asked_to_move():
    stats = StreamStats()
    offload = ActivationOffload(CPU, enabled=False, stats=stats)
    t = torch.randn(4)
    assert offload.pack(t, t.untyped_storage().data_ptr()) is t and offload.unpack(t) is t
    assert stats.kept_bytes == tensor_bytes(t) and not offload.buffers
    on = ActivationOffload(CPU, enabled=True, stats=stats)
    packed = on.pack(t, t.untyped_storage().data_ptr())
    assert isinstance(packed, Offloaded) and on.pack(t, t.untyped_storage().data_ptr()) is packed  # once
    assert torch.equal(on.unpack(packed), t)


class _Boundaries:
    """What the streamer does around a backward, for GradsHome alone: the CPU gradients step
    aside when it begins, and at its end the gathered unit steps and the gradients go home."""

    def __init__(self):
        self.grads = None
        self.running = False

    def expect_end(self) -> None:
        if not self.running:
            self.running = True
            torch.autograd.Variable._execution_engine.queue_callback(self.ends)

    def begins(self, grad) -> None:
        if not self.running:
            self.expect_end()
            self.grads.set_aside()

    def ends(self) -> None:
        self.running = False
        self.grads.step_gathered()
        self.grads.backward_done()


def _grads_home(w: nn.Parameter, steps=None):
    home = w.data.clone()
    w.data = home
    unit = Unit(0, "w", [w], [home], tensor_bytes(home))
    stats, bounds = StreamStats(), _Boundaries()
    grads = GradsHome([unit], CPU, side=None, back=None, stats=stats, slots=SlotPool(CPU, 2),
                      expect_end_of_backward=bounds.expect_end, in_backward=lambda: bounds.running)
    grads.steps = steps
    bounds.grads = grads
    w.register_post_accumulate_grad_hook(grads.grad_ready)
    return unit, stats, bounds


def _loss(w, x, bounds):
    loss = (x @ w).sin().sum()
    loss.register_hook(bounds.begins)
    return loss


def test_gradients_go_home_summed_as_autograd_sums_micro_batches():
    w = nn.Parameter(torch.randn(5, 3))
    reference = nn.Parameter(w.detach().clone())
    xs = [torch.randn(4, 5) for _ in range(2)]
    unit, stats, bounds = _grads_home(w)
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(None if p.grad is None else p.grad.clone()))
    _loss(w, xs[0], bounds).backward()
    assert w.grad.device == CPU and w.data_ptr() == unit.homes[0].data_ptr()
    torch.testing.assert_close(w.grad, torch.autograd.grad((xs[0] @ reference).sin().sum(), reference)[0])
    _loss(w, xs[1], bounds).backward()  # a second micro-batch: added to the first on the home parameter
    expected = sum(torch.autograd.grad((x @ reference).sin().sum(), reference)[0] for x in xs)
    torch.testing.assert_close(w.grad, expected)
    assert stats.grads_moved == 2
    # a later hook saw the moved gradient through autograd's accumulation, the sum at the last one
    assert seen[-1] is not None and torch.equal(seen[-1], w.grad)


class _SGD:
    """A stand-in for optim/in_backward.py BackwardSteps in its stepping backward: plain SGD on
    wherever each parameter's values lie when it is handed over."""

    stepping = True
    discarded = 0  # steps skipped so far (none here)

    def __init__(self, lr: float):
        self.lr, self.stepped_on = lr, []

    def step_now(self, pairs) -> None:
        for p, grad in pairs:
            self.stepped_on.append(p.data.data_ptr())
            p.data.add_(grad, alpha=-self.lr)


def test_a_weight_steps_on_its_compute_copy_and_the_new_value_is_copied_home():
    w = nn.Parameter(torch.randn(5, 3))
    start = w.detach().clone()
    x = torch.randn(4, 5)
    steps = _SGD(0.1)
    unit, stats, bounds = _grads_home(w, steps)
    copy = unit.homes[0].clone()  # the compute copy, as the streamer's fetch leaves it (bound)
    unit.buffers, unit.views, unit.own_refs = {F32: copy.view(-1)}, [copy], {F32: 1}
    w.data = copy
    _loss(w, x, bounds).backward()
    expected = start - 0.1 * torch.autograd.grad((x @ start.requires_grad_()).sin().sum(), start)[0]
    assert steps.stepped_on == [copy.data_ptr()] and stats.stepped_on_device == 1 and stats.grads_moved == 0
    torch.testing.assert_close(unit.homes[0], expected)  # the new value reached the home
    assert w.grad is None and not unit.to_step
