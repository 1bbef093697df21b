"""train.gradient_checkpointing as a share of the blocks (memory/checkpointing.py): which blocks
recompute, the same training as with every block or none, the config's checks, and the planner's
prediction and choice."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main
from vramfit.config.schema import RunConfig
from vramfit.memory import checkpointing
from vramfit.memory.checkpointing import PartialCheckpoint
from vramfit.fit.model_facts import facts_for_layout
from vramfit.fit.planner import GIB, choose, predict


@pytest.mark.parametrize("share,every", [(0.25, 4), (0.5, 2), (0.75, None)])
def test_a_share_recomputes_that_share_of_the_blocks_spread_evenly(share, every):
    calls: list[int] = []
    blocks = [torch.nn.Identity() for _ in range(24)]
    partial = PartialCheckpoint(share, lambda module, *args: calls.append(blocks.index(module)) or module(*args))
    x = torch.ones(2)
    for _ in range(2):  # the same blocks at every forward
        for block in blocks:
            assert torch.equal(partial(block, x), x)
    recomputed = sorted(set(calls))
    assert len(calls) == 2 * len(recomputed) and partial.counts == (int(24 * share), 24)
    if every:
        assert recomputed == list(range(every - 1, 24, every))
    else:  # three in four: no two blocks in a row keep their activations
        assert all(b - a <= 2 for a, b in zip([-1] + recomputed, recomputed + [24]))
    with pytest.raises(ValueError):
        PartialCheckpoint(1.0)


def test_the_setting_takes_a_share_true_or_false():
    def setting(value):
        return RunConfig.model_validate({"train": {"gradient_checkpointing": value}}).train.gradient_checkpointing

    assert setting(0.25) == 0.25 and setting(1) is True and setting(0.0) is False and setting(True) is True
    with pytest.raises(ValueError, match="between 0 and 1"):
        setting(1.5)


def _run(images, tmp_path, cache_root, name, share):
    out = tmp_path / name
    assert main(train_args(images, out, cache_root / "c", "train.precision=fp32", "train.optimizer=adamw",
                           "save.dtype=fp32", "save.name=m", "train.steps=2",
                           f"train.gradient_checkpointing={json.dumps(share)}")) == 0
    return json.loads((out / "run.json").read_text())["losses"], load_file(str(out / "m.safetensors"))


def test_a_partly_checkpointed_run_trains_as_with_every_block_or_none(images, tmp_path, cache_root, monkeypatch,
                                                                     caplog):
    """tiny SSD-1B through the CLI: half of its checkpointed blocks (resnets and transformer
    blocks) recompute, the run's log says how many, and the losses and weights are those of
    checkpointing all or none."""
    caplog.set_level(logging.INFO, logger="vramfit")
    runs = {share: _run(images, tmp_path, cache_root, str(share), share) for share in (False, True)}
    recomputed: list[int] = []  # the blocks the half-checkpointed run recomputes
    inner = checkpointing.checkpoint_block
    monkeypatch.setattr(checkpointing, "checkpoint_block",
                        lambda module, *args: recomputed.append(id(module)) or inner(module, *args))
    seen: list[PartialCheckpoint] = []
    init = PartialCheckpoint.__init__
    monkeypatch.setattr(PartialCheckpoint, "__init__", lambda self, *a: seen.append(self) or init(self, *a))
    runs[0.5] = _run(images, tmp_path, cache_root, "0.5", 0.5)
    (partial,) = seen
    recomputes, blocks = partial.counts
    assert blocks >= 8 and recomputes == blocks // 2 and len(set(recomputed)) == recomputes
    assert len(recomputed) == 2 * recomputes  # one forward a step, two steps
    told = [r.getMessage() for r in caplog.records if "checkpointable blocks" in r.getMessage()]
    assert told == [f"train.gradient_checkpointing = 0.5: {recomputes} of the denoiser's {blocks} checkpointable "
                    "blocks recompute in backward"]
    for share in (False, True):
        torch.testing.assert_close(runs[0.5][0], runs[share][0], rtol=1e-5, atol=0)
        for key, value in runs[share][1].items():
            torch.testing.assert_close(runs[0.5][1][key], value, rtol=1e-4, atol=1e-6)


def test_the_planner_predicts_and_chooses_a_share():
    """SD3-M LoRA at 1024: each larger share predicts less memory (the activations of the share
    not checkpointed go), and a budget between all and none gets a share, not all."""
    facts = facts_for_layout("sd3m", t5=True)
    base = {"data": {"resolution": 1024, "max_aspect": 1.0}, "train": {"mode": "lora", "optimizer": "adamw8bit"},
            "memory": {"offload_activations": False}, "lora": {"base_quantization": "none"}}

    def train_peak(share) -> int:
        cfg = RunConfig.model_validate({**base, "train": {**base["train"], "gradient_checkpointing": share}})
        return next(p.peak for p in predict(facts, cfg).phases if p.name == "train")

    peaks = [train_peak(s) for s in (False, 0.25, 0.5, 0.75, True)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1] + GIB
    budget = (peaks[2] + peaks[3]) / 2 / 0.9  # 0.75 fits in it with the planner's margin, 0.5 does not
    cfg = RunConfig.model_validate({**base, "train": {**base["train"], "optimizer_in_backward": False}})
    chosen = choose(cfg, int(budget), facts).config.train.gradient_checkpointing
    assert chosen == 0.75


@pytest.mark.parametrize("precision", ["full_bf16", "mixed_bf16"])
def test_no_checkpointing_is_a_share_with_no_block_recomputing(precision):
    """Without checkpointing a UNet keeps what a share keeps, with no block recomputing: a share
    too small to recompute any block predicts the same peak, and every share lies between them
    and full checkpointing (the model had two formulas, and no checkpointing charged the layers
    between blocks at a block's bytes)."""
    facts = facts_for_layout("ssd1b")
    assert not any(checkpointing.recomputed_blocks(0.01, 60))

    def train_peak(share, offload=False):
        cfg = RunConfig.model_validate({"data": {"resolution": 1024}, "train": {
            "optimizer": "adafactor", "precision": precision, "gradient_checkpointing": share,
            "optimizer_in_backward": True}, "memory": {"offload_activations": offload}})
        return next(p.peak for p in predict(facts, cfg).phases if p.name == "train")

    assert train_peak(0.01) == train_peak(False)
    peaks = [train_peak(s) for s in (False, 0.25, 0.5, 0.75, True)]
    assert peaks == sorted(peaks, reverse=True)
    # offloaded, every block's activations come back one block at a time, whatever the share
    assert len({train_peak(s, offload=True) for s in (False, 0.01, 0.25, True)}) == 1


def test_the_planner_takes_a_quarter_of_a_unet_s_blocks_where_it_fits():
    """0.25 of a UNet's blocks is measured now (docs/bench/ssd1b.json): under a budget that holds
    it and not no checkpointing, the planner checkpoints a quarter."""
    facts = facts_for_layout("ssd1b")
    base = {"data": {"resolution": 1024}, "train": {"optimizer": "adafactor", "precision": "full_bf16"}}

    def peak(share):
        return predict(facts, RunConfig.model_validate({**base, "train": {
            **base["train"], "gradient_checkpointing": share, "optimizer_in_backward": True}})).peak

    assert peak(0.25) < peak(False)
    chosen = choose(RunConfig.model_validate(base), int(peak(0.25) / 0.9) + 2**20, facts).config
    assert chosen.train.gradient_checkpointing == 0.25


def test_the_full_bf16_unet_constants_are_the_counted_ones():
    """bf16_resnet and bf16_block are what bench/count_train_memory.py counts on the meta device,
    and the planner's activations without checkpointing are the whole count, the layers between
    blocks included (the tool counts them apart, under "other")."""
    import sys

    from vramfit.fit.planner import _CONSTANTS

    bench = str(Path(__file__).resolve().parent.parent / "bench")
    sys.path.insert(0, bench)
    try:
        from count_train_memory import count
    finally:
        sys.path.remove(bench)
    counted = count(1024, models=("ssd1b", "sdxl", "sd3m"))
    k = _CONSTANTS["sdxl"]
    for name in ("ssd1b", "sdxl"):
        assert counted[name]["bytes_per_resnet_input"] == pytest.approx(k.bf16_resnet, rel=0.02)
        assert counted[name]["bytes_per_block_input"] == pytest.approx(k.bf16_block, rel=0.02)
        cfg = RunConfig.model_validate({"data": {"resolution": 1024}, "train": {
            "optimizer": "adafactor", "precision": "full_bf16", "gradient_checkpointing": False}})
        train = next(p for p in predict(facts_for_layout(name), cfg).phases if p.name == "train")
        assert train.parts["saved"] / GIB == pytest.approx(counted[name]["total_gib"], rel=0.05)
    assert counted["sd3m"]["bytes_per_block_input"] == pytest.approx(_CONSTANTS["sd3"].all_block, rel=0.05)


def test_the_planner_never_offloads_beside_a_share_the_user_set():
    """Offloading every activation of the blocks a share leaves uncheckpointed is slower than
    recomputing them: with the user's share and a budget it does not fit, the planner finds
    other room (a quantized base, here) instead of offloaded activations."""
    facts = facts_for_layout("sd3m", t5=True)
    sections = {"data": {"resolution": 1024, "max_aspect": 1.0}, "model": {"t5_precision": "int8"},
                "train": {"mode": "lora", "optimizer": "adamw8bit", "optimizer_in_backward": False,
                          "gradient_checkpointing": 0.5}}
    cfg = RunConfig.model_validate(sections)
    half = next(p.peak for p in predict(facts, cfg).phases if p.name == "train")
    chosen = choose(cfg, int((half - 1.5 * GIB) / 0.9), facts).config
    assert chosen.train.gradient_checkpointing == 0.5 and not chosen.memory.offload_activations
    assert chosen.lora.base_quantization != "none" or chosen.memory.stream_weights


@pytest.mark.parametrize("layout", ["tiny_ssd1b_unet", "tiny_sdxl_unet", "tiny_sd3_transformer"])
def test_the_planner_lists_the_blocks_the_model_checkpoints_in_its_order(layout):
    """fit/planner.py predicts a share from its own list of the checkpointable blocks; it must
    be the list diffusers calls the checkpointing function with: the same blocks, in the same
    order, with the inputs it counts (SD3: the image tokens of each joint block; the planner's
    count adds the text tokens, the block's other input)."""
    from diffusers import SD3Transformer2DModel, UNet2DConditionModel

    from vramfit.models.registry import FAMILIES
    from vramfit.models.parts import shipped_config

    config = {k: v for k, v in shipped_config(layout).items() if not k.startswith("_")}
    calls: list[tuple[str, int]] = []

    def record(module, *args):
        kind = "resnet" if "Resnet" in type(module).__name__ else "block"
        calls.append((kind, args[0][0].numel()))
        return module(*args)

    lat, batch = 16, 2
    torch.manual_seed(0)
    if "sd3" in layout:
        model = SD3Transformer2DModel(**config)
        model.enable_gradient_checkpointing(record)
        model(hidden_states=torch.randn(batch, config["in_channels"], lat, lat), timestep=torch.tensor([1.0, 2.0]),
              encoder_hidden_states=torch.randn(batch, 154, config["joint_attention_dim"]),
              pooled_projections=torch.randn(batch, config["pooled_projection_dim"]))
        shape = FAMILIES["sd3"].activations(config, lat, lat, 77)
        image = (lat // config["patch_size"]) ** 2 * config["caption_projection_dim"]
        expected = [(kind, image) for kind, n in shape.blocks]
        assert all(n == image * (lat * lat // 4 + 154) // (lat * lat // 4) for _, n in shape.blocks)
    else:
        model = UNet2DConditionModel(**config)
        model.enable_gradient_checkpointing(record)
        resnets: list[int] = []  # every resnet's input, checkpointed or not
        for module in model.modules():
            if "Resnet" in type(module).__name__:
                module.register_forward_pre_hook(lambda m, args: resnets.append(args[0][0].numel()))
        pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
        model(torch.randn(batch, 4, lat, lat), torch.tensor([1, 2]), torch.randn(batch, 77, config["cross_attention_dim"]),
              added_cond_kwargs={"text_embeds": torch.randn(batch, pooled), "time_ids": torch.randn(batch, 6)})
        shape = FAMILIES["sdxl"].activations(config, lat, lat, 0)
        expected = shape.blocks
        checked = sum(n for kind, n in calls if kind == "resnet")
        assert (sum(resnets), sum(resnets) - checked) == (shape.resnet_inputs, shape.unchecked)
    assert calls == expected
