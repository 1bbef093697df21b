"""Mistakes a user makes on the command line and the work they could lose by them: a new run into a
finished run's folder, a resume with nothing left to train or from no state, a LoRA given as the
model, inspect's, plan's and demo's messages, and what an interrupted run says (real signals)."""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import train_args
from vramfit.cli import main
from vramfit.data.synth import make_synthetic_dataset
from vramfit.train.state import find_state, read_meta

SETS = ("save.name=m", "save.keep_last=1", "save.every_steps=1")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_root) -> dict:
    """One finished 2-step run, a checkpoint and a state at each step (the newest kept): the images,
    the cache and the output folder. Tests copy the folder before they change it."""
    root = tmp_path_factory.mktemp("finished")
    images = root / "images"
    make_synthetic_dataset(images, n=4, size=64, seed=1)
    cache = cache_root / "user-errors"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("XDG_CACHE_HOME", str(cache_root / "xdg"))
        assert main(train_args(images, root / "out", cache, *SETS)) == 0
    return {"images": images, "cache": cache, "out": root / "out"}


def _args(finished: dict, out: Path, *extra: str, model: str = "tiny:ssd1b") -> list[str]:
    return train_args(finished["images"], out, finished["cache"], *SETS, *extra, model=model)


def _run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def test_a_new_run_into_a_finished_runs_folder_warns_and_keeps_its_own_state(finished, tmp_path, caplog):
    out = shutil.copytree(finished["out"], tmp_path / "out")
    with caplog.at_level("WARNING"):
        assert main(_args(finished, out, "train.steps=1")) == 0
    warned = [r.getMessage() for r in caplog.records if "earlier run" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert warned[0].startswith(f"output.dir {out} holds an earlier run (run.json, m.safetensors, 1 intermediate "
                                "checkpoint (m-step*), state/ (step-000002)): this run writes over them")
    assert "--resume latest continues that run instead" in warned[0]
    # the new run's state is the one kept under its step, though the earlier run's sorts after it
    state = find_state(out, "latest")
    assert state.name == "step-000001" and read_meta(state)["progress"]["step"] == 1
    assert _run_json(out)["end_step"] == 1


def test_a_new_run_keeps_its_own_intermediate_checkpoints_beside_an_earlier_runs_later_ones(finished, tmp_path):
    """Pruning keeps the newest saves up to the one just written: an earlier run's later step is not
    newer than this run's (by name it sorts after it, and pruned this run's own save before)."""
    out = shutil.copytree(finished["out"], tmp_path / "out")
    earlier = out / "m-step000005.safetensors"
    earlier.write_bytes((out / "m-step000001.safetensors").read_bytes())
    assert main(_args(finished, out, "train.steps=3")) == 0  # saves steps 1 and 2 and keeps the last
    assert (out / "m-step000002.safetensors").is_file() and not (out / "m-step000001.safetensors").exists()
    assert earlier.is_file()
    assert all(Path(p).exists() for p in _run_json(out)["checkpoints"])


def test_a_resume_with_nothing_left_to_train_is_refused_before_loading(finished, tmp_path, capsys, caplog,
                                                                       monkeypatch):
    import vramfit.run as run

    out = finished["out"]
    with monkeypatch.context() as mp:
        mp.setattr(run, "load_data", lambda *a, **k: pytest.fail("the model was loaded"))
        for steps in (1, 2):  # the state is at step 2, and the run's final checkpoint is saved
            assert main(_args(finished, out, f"train.steps={steps}") + ["--resume", "latest"]) == 2
            err = capsys.readouterr().err
            assert (f"error: --resume: the state is at step 2 and train.steps is {steps}: nothing to train; "
                    "raise train.steps to continue the run") in err, err
        for value in (str(tmp_path / "nope"), "earliest"):
            assert main(_args(finished, out, "train.steps=4") + ["--resume", value]) == 2
            err = capsys.readouterr().err
            assert f"error: --resume {value}: {value} does not exist; give `latest`" in err, err
            assert "or the path of a state folder" in err and "not a vramfit state folder" not in err
    # a run whose final save failed (a full disk) ends at train.steps without its final checkpoint:
    # resuming it writes that checkpoint, trains nothing, and warns of no earlier run
    copy = shutil.copytree(out, tmp_path / "copy")
    (copy / "m.safetensors").unlink()
    with caplog.at_level("INFO"):
        assert main(_args(finished, copy, "train.steps=2") + ["--resume", "latest"]) == 0
    assert (copy / "m.safetensors").is_file() and "earlier run" not in caplog.text
    assert "nothing to train; writing the final checkpoint" in caplog.text
    assert (_run_json(copy)["start_step"], _run_json(copy)["end_step"]) == (2, 2)


def test_a_lora_given_as_the_model_and_inspect_errors_name_what_the_user_gave(finished, tmp_path, capsys):
    lora = tmp_path / "style.safetensors"
    name = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k"  # a kohya SDXL LoRA, one module
    save_file({f"{name}.lora_down.weight": torch.zeros(4, 2048), f"{name}.lora_up.weight": torch.zeros(64, 4),
               f"{name}.alpha": torch.tensor(4.0)}, str(lora))
    assert main(_args(finished, tmp_path / "out", model=str(lora))) == 2
    err = capsys.readouterr().err
    assert (f"error: {lora}: this is a LoRA file (kohya format, for SDXL-family UNet), not a model: give it "
            "to `vramfit generate --lora` beside its base model, and train on the base model itself") in err
    assert "no known model family" not in err
    assert main(["inspect", "tiny:sdxxl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tiny:sdxxl is not a tiny model; did you mean tiny:sdxl?") and "model.path" not in err


def test_plan_names_vram_and_refuses_a_budget_below_any_gpu(tmp_path, capsys):
    for vram, said in (("0", "--vram: '0' is not a positive size"),
                       ("10MiB", "--vram 10MiB is below the smallest GPU vramfit plans for (256 MiB)"),
                       ("lots", "--vram: 'lots' is not a size")):
        assert main(["plan", "--model", "ssd1b", "--vram", vram]) == 2
        assert f"error: {said}" in capsys.readouterr().err
    assert main(["plan", "--model", "ssd1b", "--vram", "256MiB"]) == 2  # planned: nothing fits in it
    assert "nothing fits in 0.25 GiB" in capsys.readouterr().err


def test_demo_output_that_cannot_be_written_is_named_before_starting(read_only_folder, tmp_path, capsys):
    for output, said in ((read_only_folder, f"cannot write in {read_only_folder}: Read-only file system"),
                         (read_only_folder / "demo", f"cannot write in {read_only_folder} (where "
                                                     f"{read_only_folder / 'demo'} would be made)")):
        assert main(["demo", "--no-progress", "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert f"error: --output: {said}" in err and "Errno" not in err, err
    file = tmp_path / "a-file"
    file.write_text("x")
    assert main(["demo", "--no-progress", "--output", str(file)]) == 2
    assert f"error: --output: {file} is a file, not a folder" in capsys.readouterr().err


def _signals_in_state_save(monkeypatch, at_step: int, count: int) -> None:
    """Send this process `count` real SIGINTs as the training state of step `at_step` first starts
    saving (the final save writes the state of the step the run stopped at again)."""
    import vramfit.run as run

    save_state = run.save_state
    sent = []

    def save(out, model, optimizer, schedule, generator, progress, *rest):
        if progress.step == at_step and not sent:
            sent.append(at_step)
            for _ in range(count):
                signal.raise_signal(signal.SIGINT)  # its handler runs before this returns
        return save_state(out, model, optimizer, schedule, generator, progress, *rest)

    monkeypatch.setattr(run, "save_state", save)


def test_an_interrupted_run_says_no_checkpoint_was_written(finished, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    _signals_in_state_save(monkeypatch, at_step=1, count=1)  # held until the save is done, then stops
    assert main(_args(finished, out, "train.steps=3", "save.every_steps=0", "save.state_every_steps=1")) == 130
    printed = capsys.readouterr().out
    assert "\ncheckpoints: none written (stopped before the end)\n" in printed, printed
    assert "stopped by SIGINT; the training state is saved" in printed
    assert _run_json(out)["end_step"] == 1 and find_state(out, "latest").name == "step-000001"


def test_a_second_signal_while_saving_the_state_says_how_to_continue(finished, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    _signals_in_state_save(monkeypatch, at_step=2, count=2)  # the second stops the save at once
    assert main(_args(finished, out, "train.steps=3", "save.every_steps=0", "save.state_every_steps=1")) == 130
    err = capsys.readouterr().err
    last = out / "state" / "step-000001"
    assert (f"stopped by SIGINT a second time while saving the training state: it was left unfinished, and "
            f"the files from before it are kept as they were; the last saved training state, step-000001 "
            f"({last}), is kept: continue from it with --resume latest") in err, err
    assert find_state(out, "latest") == last and not (out / "state" / "step-000002").exists()
    assert not [p for p in (out / "state").iterdir() if ".tmp" in p.name]
