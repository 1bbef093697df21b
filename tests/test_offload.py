"""Streamed weights and activation offload (memory/offload.py): same result, it saves, resume.

On CPU the compute device is the home device, so the checks look at storages: a streamed
weight must be computed with from a compute copy (never its home tensor), between uses no
compute copy may exist, and at most two units may be on the "device" at once.
"""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import train_args
from vramfit.cli import main
from vramfit.config.load import load_config
from vramfit.memory.accounting import MemoryTracker, tensor_bytes
from vramfit.memory.offload import WeightStreamer, block_modules
from vramfit.optim.adafactor import Adafactor
from vramfit.optim.build import build_optimizer
from vramfit.optim.in_backward import optional_steps
from vramfit.train.engine import micro_step_loss
from vramfit.train.setup import place_denoiser, prepare

STREAM = ("memory.stream_weights=true",)
OFFLOAD = ("memory.offload_activations=true",)
CASES = {  # name: (model, settings of both runs, settings of the run compared with the plain one)
    "ssd1b-full-ckpt-accum": ("tiny:ssd1b", ("train.grad_accum=2", "train.stochastic_rounding=false"),
                              (*STREAM, *OFFLOAD, "memory.stream_unit_mib=0.05")),
    "ssd1b-lora-nockpt": ("tiny:ssd1b", ("train.mode=lora", "train.lr=1e-2", "train.gradient_checkpointing=false"),
                          STREAM),
    "sd3-full-mixed-nockpt": ("tiny:sd3", ("train.precision=mixed_bf16", "train.gradient_checkpointing=false"),
                              (*STREAM, *OFFLOAD)),
    "sd3-lora-ckpt-offload-only": ("tiny:sd3", ("train.mode=lora", "train.lr=1e-2"), OFFLOAD),
    # the gradients reach the CPU homes through autograd, so the optimizer step in backward sees them
    "sd3-full-ckpt-in-backward": ("tiny:sd3", ("train.optimizer_in_backward=true", "train.stochastic_rounding=false"),
                                  STREAM),
}


# On CPU streaming must not change a single bit. On CUDA (the lead runs this file on the GPU
# machine) some backward kernels sum in a varying order, so a bf16 weight may differ by an ulp.
CUDA = torch.cuda.is_available()
TOL = {"rtol": 1e-2, "atol": 1e-2} if CUDA else {"rtol": 1e-6, "atol": 1e-6}


def _run(images, out, cache, model: str, *sets: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    assert main(train_args(images, out, cache, "save.name=m", *sets, model=model)) == 0
    return json.loads((out / "run.json").read_text())["losses"], load_file(str(out / "m.safetensors"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_result_streamed_or_not(images, tmp_path, cache_root, case):
    """CLI runs: losses and saved weights equal (to 1e-6 on CPU: streaming copies exactly)."""
    model, sets, on = CASES[case]
    ref_losses, ref = _run(images, tmp_path / "off", cache_root / "off", model, *sets)
    losses, got = _run(images, tmp_path / "on", cache_root / "off", model, *sets, *on)
    assert losses == pytest.approx(ref_losses, rel=TOL["rtol"])
    assert ref.keys() == got.keys()
    for key in ref:
        torch.testing.assert_close(got[key].float(), ref[key].float(), **TOL, msg=key)
    written = (tmp_path / "on" / "config.toml").read_text()
    assert all("{} = {}".format(*item.split(".", 1)[1].split("=")) in written for item in on)


@pytest.mark.parametrize("inside", [False, True], ids=["step-after-backward", "step-in-backward"])
def test_resume_while_streamed(images, tmp_path, cache_root, inside):
    """Inside backward the streamed weights' Adafactor state lives beside their compute copies;
    it is saved, and loaded next to the homes, and follows them again."""
    sets = ("train.steps=4", "save.state_every_steps=2", "save.name=m", *STREAM,
            f"train.optimizer_in_backward={str(inside).lower()}")
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(train_args(images, full, cache_root / "off", *sets, model="tiny:sd3")) == 0
    state = load_file(str(full / "state" / "step-000002" / "weights.safetensors"))
    assert any(k.startswith("transformer_blocks.") for k in state)  # the streamed weights were saved
    args = train_args(images, part, cache_root / "off", *sets, model="tiny:sd3")
    assert main(args + ["--resume", str(full / "state" / "step-000002")]) == 0
    ref = json.loads((full / "run.json").read_text())["losses"]
    assert json.loads((part / "run.json").read_text())["losses"] == ref
    a, b = load_file(str(full / "m.safetensors")), load_file(str(part / "m.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("model,steps,sets", [
    # accumulation: the earlier micro-batch's sums come from the homes' buffers (sums on the device:
    # test_stream_accum.py); clipping; chunks. One step: the tiny UNet's time-embedding weights get
    # gradients of float noise, which Adafactor scales to full-size updates, so packs that round
    # differently drift apart from the second step on
    ("tiny:ssd1b", 1, ("train.grad_accum=2", "train.max_grad_norm=0.05", "memory.stream_unit_mib=0.05",
                       "memory.streamed_grad_sums=home")),
    ("tiny:sd3", 2, ("train.precision=fp32",)),
    # autocast saves bf16 casts, not the weights: most gradients find their copy gone and fetch it
    # again alone, the backward's last one too
    ("tiny:sd3", 2, ("train.precision=mixed_bf16", "memory.stream_unit_mib=0.05")),
])
def test_streamed_weights_step_in_backward_on_their_compute_copies(images, tmp_path, cache_root, monkeypatch,
                                                                   model, steps, sets):
    """With Adafactor in backward every streamed weight steps on its compute copy during the last
    backward (weights autograd kept no copy of are fetched again) and its new value is copied
    home: no gradient of the last micro-batch goes home, and losses and weights are the resident
    run's."""
    made = []
    init = WeightStreamer.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(WeightStreamer, "__init__", spy)
    monkeypatch.setattr(Adafactor, "MIN_PACK_NUMEL", 2048)  # some of the tiny models' kernels step in chunks
    accum = 2 if "train.grad_accum=2" in sets else 1
    both = ("train.optimizer_in_backward=true", "train.stochastic_rounding=false", f"train.steps={steps}", *sets)
    ref_losses, ref = _run(images, tmp_path / "off", cache_root / "off", model, *both)
    losses, got = _run(images, tmp_path / "on", cache_root / "off", model, *both, *STREAM)
    streamer = made[-1]
    trained = len(streamer.trainable)
    assert trained and streamer.stats.stepped_on_device == steps * trained
    assert streamer.stats.grads_moved == steps * (accum - 1) * trained
    assert losses == pytest.approx(ref_losses, rel=TOL["rtol"])
    assert ref.keys() == got.keys()
    for key in ref:
        torch.testing.assert_close(got[key].float(), ref[key].float(), **TOL, msg=key)


class HomeGuard(TorchDispatchMode):
    """Records every op that reads a streamed weight's home tensor, except the streamer's own
    copies out of it: compute must only ever see the compute copies."""

    def __init__(self, streamer):
        super().__init__()
        self.homes = {h.untyped_storage().data_ptr() for u in streamer.units for h in u.homes}
        self.bad: list[str] = []

    def _home(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.homes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(self._home(t) for t in tree_leaves((args, kwargs))):
            fetch = func is torch.ops.aten.copy_.default and self._home(args[1]) and not self._home(args[0])
            if not fetch:
                self.bad.append(str(func))
        return func(*args, **kwargs)


def _compute_side_bytes(streamer) -> int:
    """Bytes of the streamed parameters' storages that are not their home tensors."""
    total = 0
    for unit in streamer.units:
        for p, home in zip(unit.params, unit.homes):
            if p.untyped_storage().data_ptr() != home.untyped_storage().data_ptr():
                total += tensor_bytes(p)
    return total


@pytest.mark.parametrize("model,unit_mib,offload,sets", [
    ("tiny:ssd1b", 1.0, True, ("train.precision=fp32",)),
    ("tiny:sd3", 0.05, False, ("train.precision=fp32", "train.gradient_checkpointing=false", "train.mode=lora")),
])
def test_streamed_weights_stay_home_between_uses(images, tmp_path, cache_root, model, unit_mib, offload, sets):
    """Blocks above memory.stream_unit_mib are split; no compute copy exists between uses; at
    most two units' copies during a step; compute never reads a home tensor (HomeGuard); with
    offload_activations no saved activation stays on the compute side."""
    args = train_args(images, tmp_path / "out", cache_root / "off", *STREAM, f"memory.stream_unit_mib={unit_mib}",
                      f"memory.offload_activations={str(offload).lower()}", *sets, model=model)
    cfg = load_config(None, args[3::2])
    device = torch.device("cpu")
    family, bundle, data, _ = prepare(cfg, MemoryTracker(device), device, False)
    streamer = place_denoiser(bundle, cfg, device)
    units = streamer.units
    leaves = [not list(bundle.denoiser.get_submodule(u.name).children()) for u in units]
    assert len(units) > 4 and all(u.nbytes <= unit_mib * 2**20 or leaf for u, leaf in zip(units, leaves))
    blocks = [b for _, b in block_modules(bundle.denoiser, family.block_containers)]
    wanted = {id(p) for b in blocks for p in b.parameters() if cfg.train.mode == "full" or not p.requires_grad}
    assert sorted(id(p) for u in units for p in u.params) == sorted(wanted)  # each streamed weight once
    largest = max(u.nbytes for u in units)
    # between uses: no compute copy exists, every streamed parameter is its home tensor
    assert _compute_side_bytes(streamer) == 0 and streamer.device_copies() == []
    seen_inside = []
    probe = bundle.denoiser.get_submodule(units[len(units) // 2].name)
    handle = probe.register_forward_hook(lambda *a: seen_inside.append(_compute_side_bytes(streamer)))
    generator = torch.Generator().manual_seed(0)
    group = next(data.batches(1, torch.Generator().manual_seed(0), False))
    bundle.denoiser.train()
    with HomeGuard(streamer) as guard:
        loss = micro_step_loss(family, bundle, data.batch(group), cfg.train, generator, device, torch.float32)
        loss.backward()
    handle.remove()
    assert guard.bad == []
    assert seen_inside and seen_inside[0] > 0  # inside a unit's forward its weights are compute copies
    assert _compute_side_bytes(streamer) == 0 and streamer.device_copies() == []
    stats = streamer.stats
    # the peak of compute-side bytes is two units, far below all streamed weights
    assert 0 < stats.peak_device_bytes <= 2 * largest < streamer.streamed_bytes() / 2
    # backward fetched weights again (recompute under checkpointing, saved references without);
    # a full fine-tune needs every weight in backward, so all of them came twice
    assert stats.fetched_bytes > streamer.streamed_bytes()
    if cfg.train.mode == "full":
        assert stats.fetched_bytes >= 2 * streamer.streamed_bytes() - 2 * largest
    if offload:  # the checkpointed blocks' inputs and the rest saved outside checkpoints went to the host
        assert stats.offloaded_bytes > 0 and stats.kept_bytes == 0
    else:
        assert stats.offloaded_bytes == 0 and stats.kept_bytes > 0
    trainable = [p for u in units for p in u.params if p.requires_grad]
    assert stats.grads_moved == len(trainable)
    assert all(p.grad is not None and p.grad.data_ptr() != 0 for p in trainable)


def _half_checkpointed_sd3(images, tmp_path, cache_root, *sets: str):
    """tiny:sd3 in fp32, half of its blocks checkpointed, placed on the CPU with `sets` (in train
    mode), an unplaced copy to compare with, and one batch: (cfg, family, bundle, reference,
    streamer, batch)."""
    args = train_args(images, tmp_path / "out", cache_root / "off", *sets, "train.precision=fp32",
                      "train.gradient_checkpointing=0.5", model="tiny:sd3")
    cfg = load_config(None, args[3::2])
    device = torch.device("cpu")
    family, bundle, data, _ = prepare(cfg, MemoryTracker(device), device, False)
    reference = copy.deepcopy(bundle.denoiser).float().requires_grad_(True)
    streamer = place_denoiser(bundle, cfg, device)
    batch = data.batch(next(data.batches(1, torch.Generator().manual_seed(0), False)))
    bundle.denoiser.train()
    return cfg, family, bundle, reference, streamer, batch


def test_units_are_copied_into_a_few_fixed_slots(images, tmp_path, cache_root):
    """Every copy goes into one of the streamer's slots (each made the size of a unit), the same
    ones step after step, which is what a CUDA graph recording needs;
    gradients equal the unstreamed step's (so no slot was overwritten while autograd still read
    it: on the CPU a copy lands at once)."""
    cfg, family, bundle, reference, streamer, batch = _half_checkpointed_sd3(
        images, tmp_path, cache_root, *STREAM, "memory.stream_unit_mib=0.05")
    device = torch.device("cpu")
    slots = []
    for _ in range(3):
        loss = micro_step_loss(family, bundle, batch, cfg.train, torch.Generator().manual_seed(1), device,
                               torch.float32)
        loss.backward()
        slots.append([b.data_ptr() for slot in streamer._slots for b in slot.buffers.values()])
    # from the second step on (the first learns which unit comes next, to copy it ahead) no slot is
    # made and the same ones are used (a checkpointed block spanning several units holds all of
    # them until its backward is done: more than two slots here)
    assert slots[1] == slots[2] and 2 <= len(streamer._slots) < len(streamer.units)
    sizes = {sum(h.numel() for h in u.homes) for u in streamer.units}
    assert all(b.numel() in sizes for slot in streamer._slots for b in slot.buffers.values())  # each made for a unit
    streamer.free_slots()  # after training (train/loop.py): the save phase holds none; a later step makes them again
    assert streamer.slot_bytes() == 0
    micro_step_loss(family, bundle, batch, cfg.train, torch.Generator().manual_seed(1), device,
                    torch.float32).backward()
    assert streamer.slot_bytes() > 0
    reference.train()
    reference_bundle = dataclasses.replace(bundle, denoiser=reference)
    loss = micro_step_loss(family, reference_bundle, batch, cfg.train, torch.Generator().manual_seed(1), device,
                           torch.float32)
    (4 * loss).backward()  # the streamed weights' gradients summed over the four steps above
    streamed = dict(bundle.denoiser.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(streamed[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_offloaded_activations_live_in_kept_buffers_the_same_every_step(images, tmp_path, cache_root):
    """Saved tensors are copied into pinned buffers the streamer keeps: made in the first step,
    the same ones in the same order in every later step (what a CUDA graph recording needs), all
    free again once backward is done; a save while recording that no buffer fits is an error (a
    recording cannot make pinned memory); gradients equal those of a run that keeps them."""
    cfg, family, bundle, reference, streamer, batch = _half_checkpointed_sd3(images, tmp_path, cache_root, *OFFLOAD)
    device = torch.device("cpu")
    seen, taken = [], []
    original = streamer._host_buffer

    def spy(dtype, numel):
        buffer = original(dtype, numel)
        taken[-1].append(buffer.data.data_ptr())
        return buffer

    streamer._host_buffer = spy
    for _ in range(3):
        taken.append([])
        loss = micro_step_loss(family, bundle, batch, cfg.train, torch.Generator().manual_seed(1), device,
                               torch.float32)
        assert any(b.busy for b in streamer._host_buffers)  # held from forward to backward
        loss.backward()
        del loss
        assert not any(b.busy for b in streamer._host_buffers)
        seen.append([b.data.data_ptr() for b in streamer._host_buffers])
    assert taken[0] and taken[0] == taken[1] == taken[2] and seen[0] == seen[1] == seen[2]
    assert 0 < streamer.host_bytes() <= streamer.stats.offloaded_bytes / 3  # (three steps' worth offloaded)
    # a save that no free buffer fits, while recording: refused, not allocated
    streamer._recording = True
    with pytest.raises(RuntimeError, match="saved only while recording has no pinned buffer"):
        streamer._host_buffer(torch.float32, 1 + max(b.data.numel() for b in streamer._host_buffers))
    streamer._recording = False
    streamer.free_slots()  # after training: the save phase holds no pinned buffer either
    assert streamer.host_bytes() == 0
    reference.train()
    loss = micro_step_loss(family, dataclasses.replace(bundle, denoiser=reference), batch, cfg.train,
                           torch.Generator().manual_seed(1), device, torch.float32)
    (3 * loss).backward()
    offloaded = dict(bundle.denoiser.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(offloaded[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def _one_cuda_step(images, out, cache, *sets: str):
    """Peak allocated bytes (above what was allocated before the denoiser was placed) and loss of
    one forward and backward of tiny:ssd1b on CUDA."""
    import gc

    device = torch.device("cuda")
    args = train_args(images, out, cache, "train.precision=fp32", "memory.stream_unit_mib=1", *sets, model="tiny:ssd1b")
    cfg = load_config(None, args[3::2])
    family, bundle, data, _ = prepare(cfg, MemoryTracker(device), device, False)
    group = next(data.batches(1, torch.Generator().manual_seed(0), False))
    batch = data.batch(group)
    gc.collect()
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    streamer = place_denoiser(bundle, cfg, device)
    bundle.denoiser.train()
    loss = micro_step_loss(family, bundle, batch, cfg.train, torch.Generator().manual_seed(0), device, torch.float32)
    loss.backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start
    if streamer is not None:
        assert streamer.device_copies() == []
        for unit in streamer.units:
            assert all(p.device.type == "cpu" and p.is_pinned() for p in unit.params)
            assert all(p.grad is not None and p.grad.device.type == "cpu" for p in unit.params)
    result = float(loss.detach()), peak
    del family, bundle, data, streamer, loss, batch
    gc.collect()
    torch.cuda.empty_cache()
    return result


@pytest.mark.gpu
def test_cuda_streamed_step_same_loss_lower_peak(images, tmp_path, cache_root):
    """On the GPU: the streamed weights and their gradients are pinned CPU tensors after a step,
    the loss is the plain run's, and the step's peak allocation is lower."""
    plain_loss, plain_peak = _one_cuda_step(images, tmp_path / "a", cache_root / "off")
    loss, peak = _one_cuda_step(images, tmp_path / "b", cache_root / "off", *STREAM, *OFFLOAD)
    assert loss == pytest.approx(plain_loss, rel=1e-4)
    assert peak < plain_peak


def test_forward_without_backward_leaves_no_gradient_behind(images, tmp_path, cache_root):
    """A step whose last backward is skipped (non-finite loss) is followed by zero_grad; the next
    step's gradients of streamed weights must be that step's alone."""
    args = train_args(images, tmp_path / "out", cache_root / "off", *STREAM, "train.precision=fp32",
                      "train.gradient_checkpointing=false", model="tiny:sd3")
    cfg = load_config(None, args[3::2])
    device = torch.device("cpu")
    family, bundle, data, _ = prepare(cfg, MemoryTracker(device), device, False)
    streamer = place_denoiser(bundle, cfg, device)
    batch = data.batch(next(data.batches(1, torch.Generator().manual_seed(0), False)))
    params = [p for p in bundle.denoiser.parameters() if p.requires_grad]

    def loss():
        return micro_step_loss(family, bundle, batch, cfg.train, torch.Generator().manual_seed(1), device,
                               torch.float32)

    loss().backward()
    reference = [p.grad.clone() for p in params]
    loss()  # its backward is skipped, then the loop clears the gradients
    for p in params:
        p.grad = None
    loss().backward()
    assert streamer.trainable and all(torch.equal(p.grad, g) for p, g in zip(params, reference))


def test_a_backward_that_fails_midway_leaves_no_device_step_behind(images, tmp_path, cache_root):
    """A backward stepping streamed weights on the device that raises halfway (here: a gradient
    hook) leaves gradients gathered for the device step; the next forward drops them, so in the
    next backward every streamed weight steps exactly once, none with a stale gradient."""
    args = train_args(images, tmp_path / "out", cache_root / "off", *STREAM, "train.precision=fp32",
                      "train.optimizer_in_backward=true", "train.stochastic_rounding=false", model="tiny:sd3")
    cfg = load_config(None, args[3::2])
    device = torch.device("cpu")
    family, bundle, data, _ = prepare(cfg, MemoryTracker(device), device, False)
    streamer = place_denoiser(bundle, cfg, device)
    params = [p for p in bundle.denoiser.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.train)
    steps = optional_steps(params, optimizer, in_backward=True, round_sums=False, grad_accum=1, max_grad_norm=0.0,
                           device=device)
    streamer.step_on_device(steps)
    batch = data.batch(next(data.batches(1, torch.Generator().manual_seed(0), False)))

    def loss():
        return micro_step_loss(family, bundle, batch, cfg.train, torch.Generator().manual_seed(1), device,
                               torch.float32)

    first = bundle.denoiser.transformer_blocks[0].attn.to_q.weight  # its gradient comes late in backward
    handle = first.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
    steps.begin(last=True)
    with pytest.raises(RuntimeError, match="boom"):
        loss().backward()
    handle.remove()
    gathered = sum(len(u.to_step) for u in streamer.units)
    assert streamer.stats.stepped_on_device > 0 and gathered > 0  # some stepped, some were waiting
    for p in params:
        p.grad = None
    stepped = streamer.stats.stepped_on_device
    steps.begin(last=True)
    loss().backward()
    steps.finish()
    assert streamer.stats.stepped_on_device == stepped + len(streamer.trainable)  # each once, none stale
    assert all(not u.to_step and u.linger is None for u in streamer.units)


def test_a_slot_still_being_copied_home_from_is_not_copied_into_at_once():
    """The slot choice (memory/offload.py `_slot`): the smallest free slot that fits, the one let go
    of longest ago among equals; the one just let go of while its stepped values are still being
    copied home is passed over for a new slot while no more than `capacity` exist, so that in
    backward a unit's copy in does not wait for the previous unit's copy out."""
    model = torch.nn.Module()
    model.transformer_blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
    streamer = WeightStreamer(model, torch.device("cpu"), blocks=("transformer_blocks",), stream=True,
                              stream_trainable=True, max_unit_bytes=2**20, offload_activations=False)
    need = {torch.float32: 8 * 8 + 8}

    def let_go(slot, copying_home):
        slot.released, streamer._releases = streamer._releases, streamer._releases + 1
        slot.read_home = object() if copying_home else None

    first = streamer._slot(need)
    assert streamer._slot(need) is first  # free: nothing made
    let_go(first, copying_home=True)
    second = streamer._slot(need)  # the only free one is being copied home from: a new one
    assert second is not first and len(streamer._slots) == 2
    let_go(second, copying_home=True)
    assert streamer._slot(need) is first  # let go of longer ago (its copies home are older)
    let_go(first, copying_home=True)
    assert streamer._slot(need) is second
    streamer.units[0].slot = second  # held by a unit: not free
    third = streamer._slot(need)  # again only the slot just let go of is free: a third one
    assert third not in (first, second) and len(streamer._slots) == 3
    streamer.units[1].slot = third
    let_go(first, copying_home=True)
    assert streamer._slot(need) is first  # more than `capacity` (2) slots: it waits for the copy instead
    larger = streamer._slot({torch.float32: 1000})  # fits none: a new one of its size
    assert larger.buffers[torch.float32].numel() == 1000 and len(streamer._slots) == 4
    assert streamer._slot({torch.float32: 10}) is first  # the smallest free one that fits


@pytest.mark.parametrize("sets,needs", [
    (["train.optimizer=adafactor"], ["optimizer_in_backward"]),
    (["train.optimizer=adamw", "train.optimizer_in_backward=true"], ["optimizer = \"adafactor\""]),
    (["train.optimizer=adamw8bit"], ["optimizer = \"adafactor\"", "optimizer_in_backward"]),
    (["train.optimizer=adafactor", "train.optimizer_in_backward=true"], None),  # steps on the GPU
    (["train.mode=lora"], None),  # a frozen base: nothing steps
])
def test_a_streamed_full_fine_tune_stepping_in_cpu_memory_is_told_what_steps_it_on_the_gpu(sets, needs):
    from vramfit.config.rules import streamed_step_hint

    hint = streamed_step_hint(load_config(None, ["memory.stream_weights=true", *sets], need_data=False))
    if needs is None:
        assert hint is None
    else:
        assert hint.startswith("memory.stream_weights: the streamed weights step in CPU memory")
        assert [n for n in ("optimizer = \"adafactor\"", "optimizer_in_backward") if n in hint] == needs


def test_the_cli_warns_of_a_streamed_step_in_cpu_memory(images, tmp_path, cache_root, caplog):
    with caplog.at_level("WARNING", logger="vramfit"):
        assert main(train_args(images, tmp_path / "out", cache_root / "off", *STREAM, "train.steps=1")) == 0
    assert "the streamed weights step in CPU memory" in caplog.text
