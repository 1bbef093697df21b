"""train/loop.py Feeder: the next micro-batch's loss inputs made ahead, while the GPU works."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vramfit.config.schema import TrainConfig
from vramfit.train.distributed import DataParallel
from vramfit.train.loop import Feeder, epoch_batches
from vramfit.train.state import Progress


class Family:
    """Stands in for a model family: the inputs are the batch plus a draw from the micro-batch's generator."""

    def loss_inputs(self, bundle, batch, cfg, generator, dtype=None):
        return {"x": batch["x"] + torch.rand(batch["x"].shape, generator=generator)}


class Data:
    """Three items in an epoch; `bad` names one whose cache entry cannot be read."""

    def __init__(self, bad=None):
        self.bad = bad
        self.trained = [0, 1, 2]

    def batches(self, batch_size, generator, shuffle, epoch):
        order = torch.randperm(3, generator=generator).tolist()
        return ([i] for i in order)

    def batch(self, group):
        if group[0] == self.bad:
            raise RuntimeError(f"the latent cache entry of item {group[0]} became unreadable")
        return {"x": torch.tensor([float(group[0])])}


def _feeder(progress: Progress, data=None) -> Feeder:
    cfg = TrainConfig(seed=5, batch_size=1)
    data = data or Data()
    batches = DataParallel().micro_batches(epoch_batches(data, cfg, progress, shuffle=True), progress)
    return Feeder(Family(), None, data, cfg, batches, progress, torch.device("cpu"))


def _position(p: Progress) -> tuple:
    return p.epoch, p.batch_in_epoch, p.micro_batches


def test_inputs_made_ahead_equal_those_made_when_taken_and_leave_the_position_alone():
    on_time, early = Progress(), Progress()
    plain, ahead = _feeder(on_time), _feeder(early)
    for _ in range(7):  # over two epoch boundaries
        index, group, inputs = plain.take()
        before = _position(early)
        ahead.ahead()
        ahead.ahead()  # a second call makes nothing new
        assert _position(early) == before  # not taken yet: a state saved now resumes with it
        index2, group2, inputs2 = ahead.take()
        assert (index2, group2) == (index, group) and torch.equal(inputs2["x"], inputs["x"])
        assert _position(early) == _position(on_time)
    assert on_time.epoch == 2


def test_a_state_saved_between_ahead_and_take_resumes_with_that_micro_batch():
    progress = Progress()
    feeder = _feeder(progress)
    feeder.take()
    feeder.ahead()
    saved = dataclasses.replace(progress)  # what a training state written now holds
    index, group, inputs = feeder.take()
    resumed = _feeder(saved)
    index2, group2, inputs2 = resumed.take()
    assert (index2, group2) == (index, group) and torch.equal(inputs2["x"], inputs["x"])
    assert _position(saved) == _position(progress)


def test_an_error_made_ahead_is_raised_when_that_micro_batch_is_taken():
    first = _feeder(Progress()).take()[1][0]
    progress = Progress()
    feeder = _feeder(progress, Data(bad=first))
    feeder.ahead()  # the unreadable entry is met here, and kept
    assert _position(progress) == (0, 0, 0)
    with pytest.raises(RuntimeError, match=f"item {first} became unreadable"):
        feeder.take()
    assert _position(progress) == (0, 1, 1)  # where taking it without ahead leaves the run


@pytest.mark.parametrize("model", ["tiny:sdxl", "tiny:sd3"])
def test_conditioning_cast_ahead_gives_the_loss_of_conditioning_cast_by_the_loss(model):
    """The Feeder asks `loss_inputs` for the training dtype (fewer bytes pinned and copied): the
    loss is the one of fp32 inputs that `loss_from` casts itself, to the bit."""
    from vramfit.config.schema import ModelConfig
    from vramfit.models.registry import detect_family
    from vramfit.models.sources import resolve_source

    source = resolve_source(ModelConfig(path=model))
    family = detect_family(source)
    bundle = family.load(source)
    bundle = dataclasses.replace(bundle, denoiser=bundle.denoiser.to(torch.bfloat16))
    cpu = torch.device("cpu")
    torch.manual_seed(1)
    batch = family.encode_images(bundle, torch.rand(2, 3, 64, 64) * 2 - 1, cpu, torch.float32, tiling=False)
    batch.update(family.encode_text(bundle, ["a red circle", "a blue square"], cpu, torch.float32))
    if model == "tiny:sdxl":
        batch["time_ids"] = torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)
    cfg = TrainConfig(precision="full_bf16", noise_offset=0.05 if model == "tiny:sdxl" else 0.0)
    with torch.no_grad():
        losses = [family.loss_from(bundle, family.loss_inputs(bundle, batch, cfg, torch.Generator().manual_seed(2),
                                                              dtype), cfg, cpu, torch.bfloat16)
                  for dtype in (None, torch.bfloat16)]
    cast = family.loss_inputs(bundle, batch, cfg, torch.Generator().manual_seed(2), torch.bfloat16)
    assert cast["prompt_embeds"].dtype == torch.bfloat16 and batch["prompt_embeds"].dtype == torch.float32
    assert cast["latents"].dtype == cast["noise"].dtype == torch.float32  # the noise arithmetic stays fp32
    assert torch.equal(losses[0], losses[1]) and torch.isfinite(losses[0])
