"""What the bench (bench/run.py) and users read from a run: step time and images per second in the
memory report's train phase, its printed table and the run's log."""
from __future__ import annotations

import json
import logging
import re

import pytest

from conftest import train_args
from vramfit.cli import main
from vramfit.memory.accounting import MemoryReport, PhaseMemory

BATCH, ACCUM, STEPS = 2, 2, 3


def _run(images, out, cache, caplog) -> dict:
    caplog.set_level(logging.INFO, logger="vramfit")
    extra = [f"train.batch_size={BATCH}", f"train.grad_accum={ACCUM}", f"train.steps={STEPS}", "data.max_aspect=1.0",
             "save.name=m"]
    assert main(train_args(images, out, cache, *extra)) == 0
    report = json.loads((out / "m.memory.json").read_text())
    return next(p for p in report["phases"] if p["name"] == "train")


def test_train_phase_has_step_seconds_and_the_log_images_per_second(images, tmp_path, cache_root, caplog, capsys):
    train = _run(images, tmp_path / "run", cache_root / "b1", caplog)
    assert train["steps"] == STEPS
    assert 0 < train["step_seconds"] < train["seconds"]
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("phase"))
    assert header.split()[-2:] == ["s/step", "img/s"]
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trained ")]
    assert len(summary) == 1
    step_s, rate = map(float, re.search(r"median ([\d.]+) s/step, ([\d.]+) images/s", summary[0]).groups())
    assert rate == pytest.approx(BATCH * ACCUM / step_s, rel=0.01)
    lines = [r.getMessage() for r in caplog.records if re.match(r"step \d+/3: loss", r.getMessage())]
    assert lines and all("img/s" in line for line in lines) and lines[-1].startswith("step 3/3")


def test_train_phase_has_images_per_second(images, tmp_path, cache_root, caplog):
    train = _run(images, tmp_path / "run", cache_root / "b2", caplog)
    assert train["images_per_second"] == pytest.approx(BATCH * ACCUM / train["step_seconds"], rel=1e-9)


def test_phase_images_per_second_and_table():
    phase = PhaseMemory("train", seconds=2.0, steps=4)
    phase.set_images_per_step(8)
    assert phase.images_per_second is None  # no step time, no throughput
    phase.step_seconds = 0.25
    phase.set_images_per_step(8)
    assert phase.images_per_second == 32.0
    report = MemoryReport("cpu", phases=[PhaseMemory("load", seconds=1.0), phase])
    header, load, train = report.table().splitlines()
    assert header.split()[-2:] == ["s/step", "img/s"]
    assert load.split()[-2:] == ["-", "-"] and train.split()[-2:] == ["0.250", "32.00"]
    assert report.to_dict()["phases"][1]["images_per_second"] == 32.0


def test_merged_workload_reports_list_each_commit_once(tmp_path):
    """bench/report.py merges one workload's files, run at several commits: the merged file's
    commit field names each commit once, also when one of the files is itself a merge."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, bench)
    try:
        import report
    finally:
        sys.path.remove(bench)
    row = {"side": "vramfit", "case": "inbwd", "role": "memory_saving", "status": "ok"}
    files = []
    for name, commit in (("a", "c1, c2, c1"), ("b", "c2"), ("c", "c3, c2")):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"workload": "sd3_full", "commit": commit, "rows": [dict(row, commit=commit)]}))
    first = json.loads(files[0].read_text())
    files[0].write_text(json.dumps(dict(first, not_run=["recipe", "inbwd"])))
    (merged,) = report.load(files)
    assert merged["commit"] == "c1, c2, c3" and len(merged["rows"]) == 1
    assert merged["not_run"] == ["recipe"]  # a later file ran inbwd


def test_the_memory_trace_finds_the_peak_and_what_was_live_then():
    """bench/trace_steps.py --memory: per window between peak resets (found by their marks), the
    peak of allocated bytes over an allocator history; for the chosen window the allocation that
    reached it and the live blocks then, summed by the innermost frame of the project's code."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, bench)
    try:
        import trace_steps
    finally:
        sys.path.remove(bench)

    def at(*names):
        return [{"filename": f"/x/{n.split(':')[0]}", "line": 1, "name": n.split(":")[1]} for n in names]

    MIB = 2 ** 20
    weights, temp = at("torch/nn.py:load", "vramfit/load.py:weights"), at("torch/ops.py:mul", "vramfit/step.py:update")
    mark = at("torch/ops.py:empty", "bench/trace_steps.py:_memory_mark")

    def marked(addr):
        return [dict(action="alloc", addr=addr, size=512, frames=mark), dict(action="free_requested", addr=addr)]

    events = [dict(action="alloc", addr=1, size=100 * MIB, frames=weights),
              dict(action="alloc", addr=9, size=300 * MIB, frames=temp),  # before the train window: not its peak
              dict(action="free_requested", addr=9),
              *marked(90),
              dict(action="alloc", addr=2, size=30 * MIB, frames=temp),
              dict(action="free_requested", addr=2),
              dict(action="alloc", addr=3, size=50 * MIB, frames=temp),
              dict(action="alloc", addr=4, size=7 * MIB, frames=temp),  # the train peak: 157 MiB
              dict(action="free_requested", addr=3),
              dict(action="alloc", addr=5, size=40 * MIB, frames=weights),  # 147: under it
              *marked(91),
              dict(action="alloc", addr=6, size=20 * MIB, frames=temp)]  # save: 167
    peak = trace_steps.memory_peak({"device_traces": [[], events]}, "vramfit", ["train", "save"], "train")
    assert [(w["window"], w["peak_bytes"] // MIB) for w in peak["windows"]] == [("start", 400), ("train", 157),
                                                                                 ("save", 167)]
    assert peak["peak_bytes"] == 157 * MIB and peak["peak_event"] == 8 and peak["reached_by"]["size"] == 7 * MIB
    assert peak["by_own_frame"] == {"vramfit/load.py:1 weights": 100.0, "vramfit/step.py:1 update": 57.0}
    assert list(peak["by_frame"]) == ["torch/nn.py:1 load", "torch/ops.py:1 mul"]
    assert [b["mib"] for b in peak["largest"]] == [100.0, 50.0, 7.0] and not peak["truncated"]
    # a history whose oldest events torch dropped (the first mark among them): the pieces are named
    # from the last mark back, no piece passes for the train phase, and it says it is truncated
    cut = trace_steps.memory_peak({"device_traces": [events[4:]]}, "vramfit", ["train", "save"], "train")
    assert [w["window"] for w in cut["windows"]] == ["(before the kept history)", "save"]
    assert cut["truncated"] and cut["peak_bytes"] is None
    full = trace_steps.memory_peak({"device_traces": [events]}, "vramfit", ["train", "save"], "train", kept=len(events))
    assert full["truncated"] and full["peak_bytes"] == 157 * MIB  # as long as torch keeps: perhaps cut


def test_the_source_digest_names_the_code_that_ran(tmp_path):
    """bench/run.py's src_digest: equal for equal source trees wherever they lie, different when
    one .py file differs by a byte or moves; files that are not Python do not count."""
    import shutil
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bench = str(root / "bench")
    sys.path.insert(0, bench)
    try:
        import run
    finally:
        sys.path.remove(bench)
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(root / "src", a, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(a, b)
    assert run.src_digest(a) == run.src_digest(b) == run.src_digest(root / "src")
    (b / "vramfit" / "notes.txt").write_text("not code")
    assert run.src_digest(b) == run.src_digest(a)
    loop = b / "vramfit" / "train" / "loop.py"
    loop.write_bytes(loop.read_bytes() + b" ")
    assert run.src_digest(b) != run.src_digest(a)
    loop.write_bytes(loop.read_bytes()[:-1])
    loop.rename(b / "vramfit" / "loop.py")
    assert run.src_digest(b) != run.src_digest(a)
