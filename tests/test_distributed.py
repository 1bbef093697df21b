"""Data-parallel training on 2 CPU processes (gloo), started by `vramfit train --gpus 2`.

N ranks x grad_accum a must train what 1 process x grad_accum N*a trains (the same global batch):
the same groups per optimizer step, the same noise per micro-batch, averaged gradients. The full
fine-tunes run 2 x 2 against 1 x 4 (so gradients also accumulate unsynchronised on each rank), the
LoRA 2 x 1 against 1 x 2.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import SIZE, train_args
from vramfit.cli import main
from vramfit.data.synth import make_synthetic_dataset
from vramfit.train.distributed import DataParallel, micro_batch_generator
from vramfit.train.state import Progress

# AdamW with eps = 1 steps each weight in proportion to its gradient. With a small eps a
# near-zero gradient moves its weight by about the learning rate in the direction of its sign,
# which float summation order alone can flip; so this makes the weights a measure of the gradients.
FULL = ("train.precision=fp32", "train.optimizer=adamw", "train.eps=1.0", "train.steps=3", "train.grad_accum=2",
        "save.state_every_steps=1", "save.keep_last=5", "save.name=m", "save.dtype=fp32")
LORA = ("train.mode=lora", "lora.rank=4", "train.lr=1e-2", "train.precision=fp32", "train.optimizer=adamw",
        "train.eps=1.0", "train.steps=2", "save.name=m")
WEIGHT_ATOL = 1e-6  # measured differences: ~1e-8 (gradient sums in another order)
LOSS_RTOL = 1e-5


def _run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def _weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "state" / f"step-{step:06d}" / "weights.safetensors"))


def _files(out: Path) -> set[str]:
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and "logs" not in p.parts}


def _close(a: dict, b: dict, atol: float) -> float:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, worst
    return worst


def _continue_on_one_process(images: Path, root: Path, state: Path, out: Path, reference: Path) -> None:
    """Resume `state` on one process with grad_accum 4 and check it finishes as `reference` did."""
    args = train_args(images, out, root / "cache", *FULL, "train.grad_accum=4")
    assert main(args + ["--resume", str(state)]) == 0
    assert _run_json(out)["start_step"] > 0  # the whole run's losses, those before the resume too
    assert _run_json(out)["losses"] == pytest.approx(_run_json(reference)["losses"], rel=LOSS_RTOL)
    _close(_weights(reference, 3), _weights(out, 3), WEIGHT_ATOL)


@pytest.fixture(scope="module", autouse=True)
def stacks_on_crash():
    """A rank that dies of a signal prints every thread's Python stack (faulthandler), so that a
    native crash in a launched process says where it happened."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONFAULTHANDLER", "1")
        yield


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One full fine-tune on 2 processes (fresh cache, TensorBoard on), shared by the tests below."""
    root = tmp_path_factory.mktemp("ddp")
    images = root / "images"
    make_synthetic_dataset(images, n=4, size=SIZE, seed=1)
    with pytest.MonkeyPatch.context() as mp:  # the autouse isolation is per test; this runs before
        mp.setenv("XDG_CACHE_HOME", str(root / "xdg"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        args = train_args(images, root / "ddp", root / "cache", *FULL, "logging.tensorboard=true")
        assert main(["train", "--gpus", "2", *args[1:]]) == 0
    return images, root


@pytest.fixture(scope="module")
def one_process(two_ranks):
    """The same run on one process with twice the accumulation (the same global batch)."""
    images, root = two_ranks
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "xdg"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        assert main(train_args(images, root / "single", root / "cache", *FULL, "train.grad_accum=4",
                               "logging.tensorboard=true")) == 0
    return root / "single"


def test_two_ranks_train_what_one_process_trains_and_only_rank0_writes(two_ranks, one_process):
    images, root = two_ranks
    ddp, single = root / "ddp", one_process
    a, b = _run_json(single), _run_json(ddp)
    assert b["world_size"] == 2 and len(b["losses"]) == 3
    assert b["losses"] == pytest.approx(a["losses"], rel=LOSS_RTOL)
    for key in ("end_step", "epoch", "micro_batches"):
        assert a[key] == b[key], key
    for step in (1, 3):
        _close(_weights(single, step), _weights(ddp, step), WEIGHT_ATOL)
    _close(load_file(str(single / "m.safetensors")), load_file(str(ddp / "m.safetensors")), WEIGHT_ATOL)
    # the cache was split: rank 0 encoded its half of the 4 images (rank 1 the rest), and the
    # single run afterwards found every entry
    assert b["cache"]["latents_cached"] == 2 and a["cache"]["latents_reused"] == 4
    # rank 0 wrote every file; rank 1 only its memory report (and no second event log)
    assert _files(ddp) == _files(single) | {"m.memory.rank1.json"}
    assert len(list((ddp / "logs").glob("events.*"))) == 1
    assert json.loads((ddp / "m.memory.rank1.json").read_text())


def test_resume_across_ranks(two_ranks, tmp_path, capsys):
    images, root = two_ranks
    ddp, ref = root / "ddp", _run_json(root / "ddp")
    # the same world size: exact
    part = tmp_path / "part"
    args = train_args(images, part, root / "cache", *FULL) + ["--resume", str(ddp / "state" / "step-000001")]
    assert main(["train", "--gpus", "2", *args[1:]]) == 0
    run = _run_json(part)
    assert run["start_step"] == 1 and run["losses"] == ref["losses"]
    assert run["micro_batches"] == ref["micro_batches"] and run["epoch"] == ref["epoch"]
    _close(_weights(ddp, 3), _weights(part, 3), 0.0)
    # one process with as many micro-batches per step (1 x 4 = 2 x 2) continues the run
    _continue_on_one_process(images, root, ddp / "state" / "step-000002", tmp_path / "one", ddp)
    # ... and with another number it is refused before anything loads
    capsys.readouterr()
    args = train_args(images, tmp_path / "no", root / "cache", *FULL)
    assert main(args + ["--resume", str(ddp / "state" / "step-000002")]) == 2
    err = capsys.readouterr().err
    assert "2 process(es) x train.grad_accum 2 = 4 micro-batches per optimizer step; now 1 x 2 = 2" in err


def test_two_ranks_lora_train_what_one_process_trains(images, tmp_path, cache_root):
    # with an int8 base and DreamBooth class images, which rank 0 generates while rank 1 waits
    extra = ("lora.base_quantization=int8", "prior.class_prompt=a photo", "prior.num_images=2", "prior.steps=2")
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    args = train_args(images, ddp, cache_root / "d2", *LORA, *extra)
    assert main(["train", "--gpus", "2", *args[1:]]) == 0
    assert main(train_args(images, single, cache_root / "d2", *LORA, *extra, "train.grad_accum=2")) == 0
    assert _run_json(ddp)["cache"]["class_images_generated"] == 2
    assert sorted(p.name for p in (ddp / "class_images").iterdir()) == ["class-00000.png", "class-00001.png"]
    assert _run_json(ddp)["losses"] == pytest.approx(_run_json(single)["losses"], rel=LOSS_RTOL)
    lora = _weights(ddp, 2)
    assert lora and all("lora_" in k for k in lora)
    _close(_weights(single, 2), lora, WEIGHT_ATOL)


def test_what_does_not_compose_is_refused_before_launching(images, tmp_path, capsys):
    args = train_args(images, tmp_path / "run", tmp_path / "cache", "train.optimizer_in_backward=true",
                      "memory.stream_weights=true", "train.grad_accum=2")
    assert main(["train", "--gpus", "2", *args[1:]]) == 2
    err = capsys.readouterr().err
    assert "config for --gpus 2: 3 problem(s)" in err
    assert "train.optimizer_in_backward: does not compose with 2 processes" in err
    assert "memory.stream_weights: does not compose" in err
    assert "train.grad_accum = 2 with full_bf16 weights and stochastic_rounding" in err
    assert not (tmp_path / "run").exists()
    # the same check guards a run started by accelerate launch directly, before any weight loads
    from vramfit.config.load import ConfigError, load_config
    from vramfit.fit.resolve import Environment, resolve

    cfg = load_config(None, args[3::2])  # the --set values
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "2")
        with pytest.raises(ConfigError, match="config for 2 processes: 3 problem"):
            resolve(cfg, Environment.detect(cfg))
    from vramfit.config.schema import RunConfig
    from vramfit.train.distributed import composition_problems

    fsdp = RunConfig.model_validate({"train": {"distributed": "fsdp", "optimizer": "adamw"},
                                     "memory": {"offload_activations": True}})
    assert [p.split(":")[0] for p in composition_problems(fsdp, 2)] == ["memory.offload_activations"]
    compiled = RunConfig.model_validate({"train": {"distributed": "fsdp", "optimizer": "adamw", "compile": True}})
    assert [p.split(":")[0] for p in composition_problems(compiled, 2)] == ["train.compile"]
    ddp = RunConfig.model_validate({"train": {"compile": True}})
    assert composition_problems(ddp, 2) == []
    graphed = RunConfig.model_validate({"train": {"cuda_graphs": True}})
    assert [p.split(":")[0] for p in composition_problems(graphed, 2)] == ["train.cuda_graphs"]
    assert composition_problems(graphed, 1) == []


def test_fsdp_full_fine_tune_matches_one_process_and_its_state_resumes_anywhere(two_ranks, one_process, tmp_path,
                                                                               capsys):
    images, root = two_ranks
    fsdp = tmp_path / "fsdp"
    args = train_args(images, fsdp, root / "cache", *FULL, "train.distributed=fsdp")
    assert main(["train", "--gpus", "2", *args[1:]]) == 0
    a, b = _run_json(one_process), _run_json(fsdp)
    assert b["losses"] == pytest.approx(a["losses"], rel=LOSS_RTOL)
    # checkpoints and states are gathered whole on rank 0: the files a single process writes
    _close(load_file(str(one_process / "m.safetensors")), load_file(str(fsdp / "m.safetensors")), WEIGHT_ATOL)
    for step in (1, 3):
        _close(_weights(one_process, step), _weights(fsdp, step), WEIGHT_ATOL)
    moments = [torch.load(p / "state" / "step-000003" / "optimizer.pt", weights_only=True)["state"]
               for p in (one_process, fsdp)]
    assert moments[0].keys() == moments[1].keys()
    _close({f"{i}.{k}": v for i, s in moments[0].items() for k, v in s.items() if torch.is_tensor(v)},
           {f"{i}.{k}": v for i, s in moments[1].items() for k, v in s.items() if torch.is_tensor(v)}, WEIGHT_ATOL)
    assert _files(fsdp) == _files(one_process) | {"m.memory.rank1.json"}
    # a sharded run's state resumes on one process (and the other way round works alike)
    _continue_on_one_process(images, root, fsdp / "state" / "step-000001", tmp_path / "one", one_process)
    # what FSDP does not do is refused before launching
    capsys.readouterr()
    args = train_args(images, tmp_path / "no", root / "cache", "train.distributed=fsdp", "train.mode=lora",
                      "sample.every_steps=1", "sample.prompts=['x']")
    assert main(["train", "--gpus", "2", *args[1:]]) == 2
    err = capsys.readouterr().err
    assert "'fsdp' shards a full fine-tune" in err and "'adafactor' does not compose with 'fsdp'" in err
    assert "sample grids need the whole denoiser" in err


class _Ranks(DataParallel):
    def __init__(self, rank: int, world: int):
        super().__init__()
        self.rank, self.world = rank, world


def test_ranks_share_the_global_micro_batch_sequence():
    def sequence(progress: Progress):
        while True:
            progress.micro_batches += 1
            yield [f"group{progress.micro_batches - 1}"]

    taken = {}
    for rank in (0, 1, 2):
        progress = Progress()
        it = _Ranks(rank, 3).micro_batches(sequence(progress), progress)
        taken[rank] = [next(it) for _ in range(4)]
        assert progress.micro_batches == 12  # every rank walked all of the others' micro-batches
    indices = sorted(i for got in taken.values() for i, _ in got)
    assert indices == list(range(12))
    assert all(group == [f"group{i}"] for got in taken.values() for i, group in got)
    assert [i for i, _ in taken[1]] == [1, 4, 7, 10]
    # the noise of a micro-batch depends on its index only
    a, b = micro_batch_generator(42, 7), micro_batch_generator(42, 7)
    assert torch.equal(torch.randn(4, generator=a), torch.randn(4, generator=b))
    assert not torch.equal(torch.randn(4, generator=micro_batch_generator(42, 8)),
                           torch.randn(4, generator=micro_batch_generator(42, 7)))
