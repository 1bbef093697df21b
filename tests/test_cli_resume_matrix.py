"""Adapter x optimizer combinations through `vramfit train`, as a user runs them, on tiny:sdxl:
LoHa with Lion, DoRA with CAME under a warm-up and cosine-with-restarts schedule, and plain LoRA on
the convolutions too with a custom class (torch.optim.AdamW by dotted path, with an argument).

Each case trains (exit 0, finite losses, the named optimizer's state in the saved state), and a
run of 4 steps equals a run of 2 steps extended by `--resume latest` to 4 (the documented way to
train on: "train.steps may grow"): the same losses, the same optimizer and schedule state, and
bit-identical saved LoRA files. Each exports the SDXL family's default LoRA formats with the keys
kohya/LyCORIS loaders read. tests/test_adapters.py and tests/test_optimizers.py check the adapters'
maths and these optimizers' resume in-process; nothing there runs these pairs through the CLI,
where the config keys, the schedule rebuilt for the new train.steps, the wrapped optimizer's state
and the exporters meet. With train.warmup_steps = 1 every schedule gives the same rates to the
first two steps (0, then train.lr) whatever train.steps is, so the 2-step run is the 4-step run's
start and the comparison is exact.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_args
from vramfit.cli import main

COMMON = ("train.mode=lora", "lora.rank=4", "train.precision=full_bf16", "train.stochastic_rounding=true",
          "save.name=m", "save.state_every_steps=2", "save.keep_last=5")
RANK, CONV_RANK = 4, 2

CASES = [
    pytest.param("loha", ("lora.type=loha", "train.optimizer=lion"), id="loha-lion"),
    pytest.param("dora", ("lora.type=dora", "train.optimizer=came", "train.lr_scheduler=cosine_with_restarts",
                          "train.lr_cycles=2", "train.warmup_steps=1"), id="dora-came-cosine_restarts"),
    pytest.param("conv", ("lora.type=lora", f"lora.conv_rank={CONV_RANK}", "train.optimizer=custom",
                          "train.optimizer_class=torch.optim.AdamW", "train.optimizer_args={amsgrad = true}"),
                 id="conv_lora-custom_adamw"),
]


def _run(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def _state(out: Path, step: int) -> Path:
    return out / "state" / f"step-{step:06d}"


def _torch(path: Path):
    return torch.load(path, weights_only=True, map_location="cpu")


def _differences(a, b, where: str = "") -> list[str]:
    """Where two saved structures (state dicts, nested) differ; tensors bit for bit, dtype included."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _modules(tensors: dict) -> dict[str, dict[str, torch.Tensor]]:
    """A kohya file's tensors by module: {module: {part: tensor}}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, _, part = key.partition(".")
        out.setdefault(name, {})[part] = t
    return out


def _check_optimizer(kind: str, saved: dict) -> None:
    """The saved optimizer state is the one the config named, with its arguments."""
    assert "rounding_generators" in saved  # the bf16 rounding draws are part of the state
    if kind == "loha":  # vramfit's Lion: one moment, Lion's default betas
        state = next(iter(saved["state"].values()))
        assert set(state) == {"step", "exp_avg"}, set(state)
        assert tuple(saved["param_groups"][0]["betas"]) == (0.9, 0.99)
        return
    inner = saved["wrapped"]
    state = next(iter(inner["state"].values()))
    if kind == "dora":  # pytorch-optimizer's CAME: factored second moment and residual
        assert {"exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row"} <= set(state), set(state)
    else:  # torch.optim.AdamW with train.optimizer_args' amsgrad
        assert set(state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, set(state)
        assert inner["param_groups"][0]["amsgrad"] is True


def _check_exports(kind: str, out: Path) -> None:
    kohya = load_file(str(out / "m.safetensors"))  # the SDXL family's primary LoRA format
    assert kohya and all(k.startswith("lora_unet_") for k in kohya)
    modules = _modules(kohya)
    parts = {p for m in modules.values() for p in m}
    diffusers_file = out / "m-diffusers.safetensors"
    if kind == "loha":
        assert parts == {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}, parts
        assert all(m["hada_w1_b"].shape[0] == RANK and m["hada_w2_b"].shape[0] == RANK for m in modules.values())
        assert not diffusers_file.exists()  # LoHa has no diffusers layout: kohya only, by default
        return
    diffusers = load_file(str(diffusers_file))
    assert diffusers and all(k.startswith("unet.") for k in diffusers)
    downs = [k for k in diffusers if k.endswith(".lora_A.weight")]
    assert len(downs) == len(modules)  # the same modules in both files
    if kind == "dora":
        assert parts == {"lora_down.weight", "lora_up.weight", "alpha", "dora_scale"}, parts
        for m in modules.values():  # one magnitude per output row of the adapted layer
            assert m["dora_scale"].numel() == m["lora_up.weight"].shape[0]
        assert sum(k.endswith(".lora_magnitude_vector") for k in diffusers) == len(modules)
        return
    assert parts == {"lora_down.weight", "lora_up.weight", "alpha"}, parts
    convs = {n: m for n, m in modules.items() if m["lora_down.weight"].dim() == 4}
    linears = {n: m for n, m in modules.items() if n not in convs}
    assert convs and linears
    # kohya's names of the ResNet blocks' convolutions (in_layers_2 = conv1, out_layers_3 = conv2)
    assert any(n.endswith("_in_layers_2") for n in convs) and any(n.endswith("_out_layers_3") for n in convs)
    for m in convs.values():
        down, up = m["lora_down.weight"], m["lora_up.weight"]
        assert down.shape[0] == CONV_RANK and up.shape[1:] == (CONV_RANK, 1, 1)
        assert m["alpha"].numel() == 1 and float(m["alpha"]) > 0  # (its value: tests/test_adapters.py)
    assert any(m["lora_down.weight"].shape[2:] == (3, 3) for m in convs.values())
    for m in linears.values():
        assert m["lora_down.weight"].dim() == 2 and m["lora_down.weight"].shape[0] == RANK
    assert sum(diffusers[k].dim() == 4 for k in downs) == len(convs)
    assert any(".resnets." in k and diffusers[k].dim() == 4 for k in downs)


@pytest.mark.parametrize("kind, sets", CASES)
def test_adapter_and_optimizer_train_resume_exactly_and_export(images, tmp_path, cache_root, kind, sets):
    cache = cache_root / "matrix"
    full, part = tmp_path / "full", tmp_path / "part"

    def args(out: Path, steps: int) -> list[str]:
        return train_args(images, out, cache, *COMMON, *sets, f"train.steps={steps}", model="tiny:sdxl")

    # (1) it trains
    assert main(args(full, 4)) == 0
    losses = _run(full)["losses"]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), losses
    assert len(set(losses)) == 4  # each step its own batch and noise
    mid, end = (load_file(str(_state(full, s) / "weights.safetensors")) for s in (2, 4))
    assert mid.keys() == end.keys() and any(not torch.equal(mid[k], end[k]) for k in mid)  # steps 3-4 trained
    _check_optimizer(kind, _torch(_state(full, 4) / "optimizer.pt"))

    # (2) 2 steps, then --resume latest with train.steps grown to 4: the same run
    assert main(args(part, 2)) == 0
    assert _run(part)["losses"] == losses[:2]
    assert main(args(part, 4) + ["--resume", "latest"]) == 0
    resumed = _run(part)
    assert (resumed["start_step"], resumed["end_step"], resumed["resumes"]) == (2, 4, 1)
    assert resumed["losses"] == losses, (resumed["losses"], losses)
    for name in ("weights.safetensors", "optimizer.pt", "schedule.pt"):
        read = load_file if name.endswith(".safetensors") else _torch
        a, b = read(_state(full, 4) / name), read(_state(part, 4) / name)
        assert not _differences(a, b), (name, _differences(a, b)[:5])
    names = sorted(p.name for p in full.glob("m*.safetensors"))
    assert names == sorted(p.name for p in part.glob("m*.safetensors"))
    for name in names:
        a, b = load_file(str(full / name)), load_file(str(part / name))
        assert a.keys() == b.keys()
        assert [k for k in a if not torch.equal(a[k], b[k])] == [], name

    # (3) it exports the family's default formats, in the keys kohya/LyCORIS loaders read
    _check_exports(kind, full)


def test_a_run_resumed_with_another_learning_rate_trains_at_it(tmp_path, images, cache_root):
    """train.lr changed on resume: the resumed steps run at the new rate (on this run's schedule), not
    at the saved run's."""
    sets = ("train.mode=lora", "lora.rank=2", "train.optimizer=adamw", "save.state_every_steps=1",
            "save.keep_last=5", "train.lr_scheduler=constant", "train.warmup_steps=0")
    out = tmp_path / "run"
    assert main(train_args(images, out, cache_root, *sets, "train.steps=2", "train.lr=1e-3", model="tiny:sdxl")) == 0
    assert main([*train_args(images, out, cache_root, *sets, "train.steps=3", "train.lr=4e-3", model="tiny:sdxl"),
                 "--resume", "latest"]) == 0
    saved = torch.load(out / "state" / "step-000003" / "optimizer.pt", weights_only=True)
    assert [g["lr"] for g in saved["param_groups"]] == [4e-3]
