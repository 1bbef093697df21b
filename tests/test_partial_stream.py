"""Partial streaming (memory.resident_blocks): some stream blocks (the denoiser's blocks, cut into
their parts above memory.stream_unit_mib) stay on the device, the rest stream.

Same losses and weights as the resident and the all-streamed runs (LoRA, a full fine-tune stepping
streamed weights on the CPU and one stepping them on their compute copies in backward); which
blocks stay (spread, nested) and where their weights are; the planner's prediction grows with the
count and its choice under a budget between all streamed and all resident; the refusals; and, on
a GPU, a partially streamed step recorded with CUDA graphs.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import SIZE, train_args
from vramfit.cli import main
from vramfit.config.schema import RunConfig
from vramfit.fit.model_facts import facts_for_layout, read_facts
from vramfit.fit.planner import MARGIN, block_count, choose, device_terms, predict, with_values
from vramfit.fit.resolve import Environment, resolve
from vramfit.memory.accounting import tensor_bytes
from vramfit.memory.offload import block_modules, resident_blocks, split_units
from vramfit.memory.offload.units import recomputed_whole, stream_blocks
from vramfit.models.registry import detect_family
from vramfit.models.sources import resolve_source
from vramfit.train.setup import place_denoiser

CUDA = torch.cuda.is_available()
TOL = {"rtol": 1e-2, "atol": 1e-2} if CUDA else {"rtol": 1e-6, "atol": 1e-6}
STREAM = ("memory.stream_weights=true",)
CASES = {  # settings of every run of the case
    "lora": ("train.mode=lora", "train.lr=1e-2", "train.gradient_checkpointing=false"),
    # streamed weights step in CPU memory after backward, resident ones where they are
    "full-step-after-backward": ("train.stochastic_rounding=false",),
    # streamed weights step on their compute copies inside backward (Adafactor), resident ones in their hooks
    "full-step-in-backward": ("train.optimizer_in_backward=true", "train.stochastic_rounding=false"),
}


def _run(images, out, cache, *sets: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    assert main(train_args(images, out, cache, "save.name=m", *sets)) == 0
    return json.loads((out / "run.json").read_text())["losses"], load_file(str(out / "m.safetensors"))


def _same(a, b) -> None:
    (losses_a, weights_a), (losses_b, weights_b) = a, b
    assert losses_a == pytest.approx(losses_b, rel=TOL["rtol"])
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        torch.testing.assert_close(weights_a[key].float(), weights_b[key].float(), **TOL, msg=key)


@pytest.mark.parametrize("case", list(CASES))
def test_partial_streaming_trains_as_resident_and_as_all_streamed(images, tmp_path, cache_root, caplog, case):
    """40 of tiny SSD-1B's 123 stream blocks resident (its 7 blocks cut at 0.5 MiB, so some blocks
    are partly resident): the losses and saved weights of the run with every block resident (and,
    for the full fine-tune stepping after backward, of the all-streamed one)."""
    sets, cache = CASES[case], cache_root / "partial"
    with caplog.at_level("INFO", logger="vramfit"):
        partial = _run(images, tmp_path / "partial", cache, *sets, *STREAM, "memory.resident_blocks=40",
                       "memory.stream_unit_mib=0.5")
    assert "40 of 123 stream blocks resident (memory.resident_blocks)" in caplog.text
    _same(partial, _run(images, tmp_path / "resident", cache, *sets))
    if case == "full-step-after-backward":
        _same(partial, _run(images, tmp_path / "streamed", cache, *sets, *STREAM))
        # left out without a budget: resolved to every block streamed (fit/resolve.py)
        assert "resident_blocks = 0" in (tmp_path / "streamed" / "config.toml").read_text()
    written = (tmp_path / "partial" / "config.toml").read_text()
    assert "resident_blocks = 40" in written and "stream_weights = true" in written


def _placed(cfg: RunConfig, device: torch.device):
    source = resolve_source(cfg.model)
    family = detect_family(source)
    bundle = family.load(source)
    return family, bundle, place_denoiser(bundle, cfg, device)


def test_resident_blocks_are_spread_and_each_count_keeps_the_blocks_of_the_one_below():
    for n in (1, 2, 7, 24):
        below: set[int] = set()
        for count in range(n + 1):
            kept = {i for i, k in enumerate(resident_blocks(n, count)) if k}
            assert len(kept) == count and below <= kept
            below = kept
            # spread: no run of streamed blocks longer than twice the shortest the count allows
            runs = "".join("R" if i in kept else "s" for i in range(n)).split("R")
            assert max(map(len, runs)) <= 2 * -(-(n - count) // (count + 1)), (n, count)
    assert resident_blocks(7, 3) == [False, True, False, True, False, True, False]
    with pytest.raises(ValueError):
        resident_blocks(7, 8)
    # by size: the largest block of the largest run goes first, then the middle of the run beside it
    assert resident_blocks(5, 1, [1, 1, 1, 10, 1]) == [False, False, False, True, False]
    assert resident_blocks(5, 1) == [False, False, True, False, False]
    assert resident_blocks(5, 2, [1, 1, 1, 10, 1]) == [False, True, False, True, False]
    sizes = torch.randint(1, 100, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    below = set()
    for count in range(41):
        kept = {i for i, k in enumerate(resident_blocks(40, count, sizes)) if k}
        assert len(kept) == count and below <= kept
        below = kept


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_resident_blocks_live_on_the_device_and_the_others_at_home(mode):
    """The blocks cut at memory.stream_unit_mib are the stream blocks; the streamer's units are
    exactly those not kept, in order, cut as in an all-streamed run; every weight of a kept one is
    on the compute device, never a unit's, and stays the same tensor through a step, while
    streamed weights are their homes (CPU) again after it; the planner counts the same stream
    blocks and predicts the weights and slots of this placement."""
    device = torch.device("cuda" if CUDA else "cpu")
    memory = {"stream_weights": True, "resident_blocks": 60, "stream_unit_mib": 0.05}
    # no checkpointing: a LoRA's frozen base is cut as finely as a full fine-tune's weights
    cfg = RunConfig.model_validate({"model": {"path": "tiny:ssd1b"}, "data": {"resolution": SIZE},
                                    "train": {"mode": mode, "device": device.type, "gradient_checkpointing": False},
                                    "memory": memory})
    family, bundle, streamer = _placed(cfg, device)

    def streams(p: torch.nn.Parameter) -> bool:  # a LoRA streams its frozen weights only
        return mode == "full" or not p.requires_grad

    found = stream_blocks(bundle.denoiser, family.block_containers, int(0.05 * 2**20), streams, 60)
    stats, facts = streamer.stats, read_facts(cfg)
    assert (stats.blocks, stats.resident_blocks, stats.streamed_blocks) == (len(found), 60, len(found) - 60)
    assert len(found) == block_count(facts, cfg) > 60 > 7  # the blocks were cut: more choices than 7
    assert [u.name for u in streamer.units] == [name for name, _, kept in found if not kept]
    # the cut does not depend on the count: with none kept the units are the blocks' split_units
    cut = [unit for name, block in block_modules(bundle.denoiser, family.block_containers)
           for unit in split_units(name, block, int(0.05 * 2**20), streams)]
    assert [(name, module) for name, module, _ in found] == cut
    in_units = {id(p) for u in streamer.units for p in u.params}
    resident = [p for _, module, kept in found if kept for p in module.parameters() if streams(p)]
    assert resident and not any(id(p) in in_units for p in resident)
    assert all(p.device.type == device.type for p in resident)
    streamed = [p for _, module, kept in found if not kept for p in module.parameters() if streams(p)]
    assert streamed and {id(p) for p in streamed} == in_units
    before = [p.data_ptr() for p in resident]
    batch = family.synthetic_batch(dict(bundle.denoiser.config), 1, (SIZE, SIZE), cfg)
    dtype = next(p for p in bundle.denoiser.parameters() if not p.requires_grad or mode != "lora").dtype
    family.training_loss(bundle, batch, cfg.train, torch.Generator().manual_seed(0), device, dtype).backward()
    assert [p.data_ptr() for p in resident] == before
    homes = {h.data_ptr() for u in streamer.units for h in u.homes}
    assert all(p.device.type == "cpu" and p.data_ptr() in homes for p in streamed)
    if mode == "full":  # resident trained weights keep their gradients on the device
        assert all(p.grad is not None and p.grad.device.type == device.type for p in resident)
    # the planner places the same stream blocks: what stays on the device and the two largest units' slots
    terms = device_terms(facts, cfg)
    held = sum(tensor_bytes(t) for t in [*bundle.denoiser.parameters(), *bundle.denoiser.buffers()])
    units = sorted(u.nbytes for u in streamer.units)
    assert terms["weights"] == held - streamer.streamed_bytes()
    assert terms["stream unit"] == units[-1] + units[-2]


def test_left_out_it_resolves_to_every_block_streamed_without_a_budget():
    """As if written: the fit probe's suggestion keeps it rather than add blocks to a step too large."""
    env = Environment(torch.device("cpu"))
    run = resolve(RunConfig.model_validate({"memory": {"stream_weights": True}}), env)
    assert run.memory.resident_blocks == 0 and "resident_blocks" in run.memory.model_fields_set
    assert resolve(RunConfig(), env).memory.resident_blocks is None  # nothing streams: nothing to say


@pytest.fixture(scope="module")
def sd3m():
    return facts_for_layout("sd3m", t5=True)


# every memory setting written but the resident count: the planner chooses only that
SD3_FULL = {"data": {"resolution": 1024},
            "train": {"optimizer": "adafactor", "optimizer_in_backward": True, "gradient_checkpointing": True,
                      "cuda_graphs": False},
            "cache": {"vae_dtype": "bf16", "vae_tiling": True},
            "model": {"t5_precision": "nf4"},
            "memory": {"stream_weights": True, "offload_activations": False, "stream_encoders": True}}


def test_the_planner_keeps_the_most_blocks_that_fit(sd3m):
    """More resident blocks predict more train-phase memory; under a budget between all streamed and
    all resident the planner keeps the largest count that fits: count + 1 does not."""
    cfg = RunConfig.model_validate(SD3_FULL)
    n = block_count(sd3m, cfg)
    assert n == 24  # each joint block under memory.stream_unit_mib: one stream block

    def phases(count: int):
        return predict(sd3m, with_values(cfg, {"memory.resident_blocks": count})).phases

    # (with fewer units streamed than slots, 3 here, each one more kept takes a whole slot: the top
    # counts may take less than the ones below, and the planner tries them first)
    train = [next(p.peak for p in phases(c) if p.name == "train") for c in range(n - 2)]
    assert all(a <= b for a, b in zip(train, train[1:])) and train[0] < train[n // 2] < train[-1]
    budget = int((train[0] + train[-1]) / 2 / (1 - MARGIN))
    choice = choose(cfg, budget, sd3m)
    count = choice.config.memory.resident_blocks
    usable = int(budget * (1 - MARGIN))
    assert 0 < count < n and choice.chosen["memory.resident_blocks"] == count
    assert max(p.peak for p in phases(count)) <= usable < max(p.peak for p in phases(count + 1))
    assert any(r.startswith(f"memory.resident_blocks = {count} of {n} stream blocks: ")
               for r in choice.reasons)
    assert choice.after.peak == max(p.peak for p in phases(count))
    # a count the user wrote is kept
    mine = RunConfig.model_validate({**SD3_FULL, "memory": {**SD3_FULL["memory"], "resident_blocks": 2}})
    assert choose(mine, budget, sd3m).config.memory.resident_blocks == 2


def test_resident_blocks_with_the_step_in_backward_and_accumulation_count_the_measured_share(sd3m):
    """The measured term (fit/calibration.json RESIDENT_ACCUM_SHARE): that share of the resident
    stream blocks' weight bytes in the train phase where the step runs inside backward over several
    micro-batches, none with one micro-batch or no block resident."""
    from vramfit.fit.planner import RESIDENT_ACCUM_SHARE

    term = "resident blocks, accumulating (measured)"

    def train(accum: int, resident: int = 6):
        cfg = RunConfig.model_validate({**SD3_FULL, "train": {**SD3_FULL["train"], "grad_accum": accum}})
        cfg = with_values(cfg, {"memory.resident_blocks": resident})
        return cfg, next(p for p in predict(sd3m, cfg).phases if p.name == "train")

    cfg, phase = train(4)
    kept = device_terms(sd3m, cfg)["kept block bytes"]
    assert kept > 0 and phase.parts[term] == int(RESIDENT_ACCUM_SHARE * kept)
    assert term not in train(1)[1].parts
    none, phase = train(4, resident=0)
    assert term not in phase.parts
    assert device_terms(sd3m, none)["kept block bytes"] == 0
    assert term not in next(p for p in predict(sd3m, none).phases if p.name == "train").parts


def test_resident_blocks_without_streaming_or_beyond_the_block_count_are_refused(images, tmp_path, cache_root,
                                                                                 capsys):
    assert main(["plan", "--set", "model.path=tiny:ssd1b", "--set", "memory.resident_blocks=2"]) == 2
    err = capsys.readouterr().err
    assert "memory.resident_blocks: applies to memory.stream_weights = true" in err
    assert "Traceback" not in err
    # too many: `vramfit plan` says so, with a budget or without, and so does `train` before anything
    # loads or caches; the count is of stream blocks, so a smaller memory.stream_unit_mib allows more
    plan = ["plan", "--set", "model.path=tiny:ssd1b", "--set", "memory.stream_weights=true"]
    too_many = "memory.resident_blocks: 8 is more than the 7 stream blocks of this denoiser"
    assert main([*plan, "--set", "memory.resident_blocks=8"]) == 2
    assert too_many in capsys.readouterr().err
    assert main([*plan, "--set", "memory.resident_blocks=8", "--vram", "8GiB"]) == 2
    assert too_many in capsys.readouterr().err
    assert main([*plan, "--set", "memory.resident_blocks=8", "--set", "memory.stream_unit_mib=0.5"]) == 0
    capsys.readouterr()
    cache = tmp_path / "cache"
    args = train_args(images, tmp_path / "out", cache, *STREAM, "memory.resident_blocks=8")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert too_many in err and "set at most 7" in err and "memory.stream_unit_mib = 256 MiB" in err
    assert "Traceback" not in err
    # refused before caching: the cache folder holds only the tiny model's files
    assert [p.name for p in cache.iterdir()] == ["tiny"] and not (tmp_path / "out" / "run.json").exists()


@pytest.mark.gpu
def test_a_partially_streamed_step_records_with_cuda_graphs(images, tmp_path, cache_root, caplog):
    """Streamed units between resident blocks, stepped on their copies in backward, recorded: the
    losses of the same run without graphs."""
    sets = ("train.device=cuda", "memory.fit_probe=false", "train.steps=4", "train.precision=full_bf16",
            "train.optimizer=adafactor", "train.optimizer_in_backward=true",
            "train.gradient_checkpointing=0.5", "memory.resident_blocks=3",
            "memory.stream_unit_mib=0.5", "save.dtype=fp32", *STREAM)
    cache = cache_root / "partial-cuda"
    plain, _ = _run(images, tmp_path / "plain", cache, *sets, "train.cuda_graphs=false")
    with caplog.at_level("INFO", logger="vramfit"):
        graphed, _ = _run(images, tmp_path / "graphed", cache, *sets, "train.cuda_graphs=true")
    assert "recorded the denoiser's forward and backward" in caplog.text
    assert "run without CUDA graphs" not in caplog.text
    assert graphed == pytest.approx(plain, rel=1e-3, abs=1e-5)


@pytest.mark.parametrize("model", ["tiny:flux", "tiny:ssd1b"])
def test_a_streamed_frozen_base_is_never_cut_finer_than_a_recomputed_block(model):
    """Under gradient checkpointing a LoRA's frozen base streams in units no smaller than the blocks
    checkpointing recomputes whole (torch keeps what a recomputation saves as the Parameters, whose
    data goes home with their unit: units.py `recomputed_whole`); a full fine-tune's trained weights
    (saved as detached views, which keep the copy) are still cut at memory.stream_unit_mib; the
    planner counts the same stream blocks."""
    device = torch.device("cuda" if CUDA else "cpu")
    units, counted = {}, {}
    for mode in ("lora", "full"):
        cfg = RunConfig.model_validate({
            "model": {"path": model}, "data": {"resolution": SIZE},
            "train": {"mode": mode, "device": device.type, "gradient_checkpointing": True},
            "memory": {"stream_weights": True, "resident_blocks": 0, "stream_unit_mib": 0.01}})
        _, bundle, streamer = _placed(cfg, device)
        whole = recomputed_whole(bundle.denoiser)
        modules = dict(bundle.denoiser.named_modules())
        inside = {name for name, m in modules.items() if id(m) in whole for name in
                  [f"{name}.{sub}" for sub, _ in m.named_modules() if sub]}
        units[mode] = [u.name for u in streamer.units]
        counted[mode] = block_count(read_facts(cfg), cfg)
        assert counted[mode] == len(units[mode])
        cut = [name for name in units[mode] if name in inside]
        if mode == "lora":
            assert whole and not cut, cut
            assert any(id(modules[name]) in whole for name in units[mode])
        else:
            assert cut  # trained weights: parts of the recomputed blocks are units of their own
    assert len(units["lora"]) < len(units["full"])
