"""bench/training_costs.py on tiny:sdxl on the CPU: its cases run through the real training path, a
refused or failing case is a row with its error, and the JSON and the markdown table carry every row."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = str(Path(__file__).resolve().parents[1] / "bench")


@pytest.fixture
def costs(monkeypatch, tmp_path):
    """The bench module, with two extra cases: one the config refuses, one whose run fails (a
    checkpoint that is no safetensors file: the config check passes, loading it does not)."""
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"this is not a safetensors file")
    sys.path.insert(0, BENCH)
    try:
        import training_costs
    finally:
        sys.path.remove(BENCH)
    case = training_costs.Case
    extra = [case("dora_int8", "lora", "dora over int8", ("lora.type=dora", "lora.base_quantization=int8")),
             case("no_model", "lora", "a broken checkpoint", (f"model.path={broken}",))]
    cases = [*training_costs.CASES, *extra]
    monkeypatch.setattr(training_costs, "CASES", cases)
    monkeypatch.setattr(training_costs, "BY_NAME", {c.name: c for c in cases})
    return training_costs


def test_cases_run_and_failures_are_rows(costs, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    base = ["--out", str(out), "--work", str(work), "--model", "tiny:sdxl", "--resolution", "64",
            "--steps", "2", "--in-process"]
    assert costs.main([*base, "--cases", "lora,lora_dora,dora_int8"]) == 0
    data = json.loads((out / "training_costs.json").read_text())
    rows = {r["case"]: r for r in data["rows"]}
    assert list(rows) == ["lora", "lora_dora", "dora_int8"]
    for name in ("lora", "lora_dora"):
        r = rows[name]
        assert r["status"] == "ok" and r["steps"] == 2 and r["step_s"] > 0 and r["rss_peak"] > 0
        assert {"peak_allocated", "peak_reserved", "key", "base", "sets", "command"} <= set(r)
        assert (r["peak_allocated"] is None) == (not torch.cuda.is_available())  # no GPU: none, not a zero
    assert "lora.type=dora" in rows["lora_dora"]["command"]
    assert "lora.type=dora" not in rows["lora"]["command"]
    assert rows["dora_int8"]["status"] == "refused" and "lora.type" in rows["dora_int8"]["error"]
    table = (out / "training_costs.md").read_text().splitlines()
    body = {line.split(" | ")[0].strip("| "): line for line in table
            if line.startswith("| ") and "---" not in line}
    assert list(body) == ["case", "lora", "lora_dora", "dora_int8"]
    assert body["case"].startswith("| case | key | peak alloc") and "| delta vs its baseline" in body["case"]
    assert "(baseline)" in body["lora"] and "vs lora" in body["lora_dora"] and "refused" in body["dora_int8"]
    # the same command with more cases runs only the missing ones; the earlier rows stay as measured
    earlier = rows["lora"]
    assert costs.main([*base, "--cases", "lora,lora_dora,no_model"]) == 0
    rows = {r["case"]: r for r in json.loads((out / "training_costs.json").read_text())["rows"]}
    assert rows["lora"] == earlier and set(rows) == {"lora", "lora_dora", "dora_int8", "no_model"}
    failed = rows["no_model"]
    assert failed["status"] == "failed" and "broken.safetensors" in failed["error"]
    # no time left: nothing runs, the cases are named
    assert costs.main([*base, "--cases", "lora_lokr,lora_loha", "--deadline", "0"]) == 0
    data = json.loads((out / "training_costs.json").read_text())
    assert data["not_run"] == ["lora_lokr", "lora_loha"]
    assert "lora_lokr" not in {r["case"] for r in data["rows"]}
    assert "Not run for lack of time: lora_lokr, lora_loha." in (out / "training_costs.md").read_text()


def test_every_case_passes_the_config_check(costs, tmp_path):
    """No GPU minute is lost to a case the config refuses: each listed case is accepted as written."""
    shape = ["model.path=tiny:sdxl", f"data.path={tmp_path}", "data.resolution=64", "data.min_size=64",
             f"cache.dir={tmp_path / 'cache'}", "train.steps=4"]
    listed = [c for c in costs.CASES if c.name not in ("dora_int8", "no_model")]
    assert {c.base for c in listed} == set(costs.BASES) and all(c.base in costs.BY_NAME for c in listed)
    problems = {c.name: costs.config_problem(None, [*shape, *costs.case_sets(c)]) for c in listed}
    assert {k: v for k, v in problems.items() if v} == {}
    assert all(not costs.missing_keys(c) for c in listed)


def test_predict_only_adds_the_planners_train_phase_to_saved_rows(costs, tmp_path):
    """--predict-only reads saved rows of a shipped layout, adds the planner's train-phase peak of each
    case's config (the table's "planner" column) and runs nothing; a refused case gets none."""
    out = tmp_path / "out"
    out.mkdir()
    names = ["lora", "full_after", "full_after_prodigy", "full_after_adamw", "dora_int8"]
    rows = [dict(case=n, base=costs.BY_NAME[n].base, key=costs.BY_NAME[n].key, status="ok",
                 peak_allocated=2**30, peak_reserved=2**30, rss_peak=2**30, step_s=1.0) for n in names]
    rows[-1].update(status="refused", error="config refused: lora.type")
    saved = dict(model="sdxl", resolution=1024, steps=4, gpu="a GPU", device="cuda", torch="x",
                 src_digest="d", rows=rows, not_run=[])
    (out / "training_costs.json").write_text(json.dumps(saved))
    assert costs.main(["--out", str(out), "--work", str(tmp_path / "work"), "--predict-only"]) == 0
    data = json.loads((out / "training_costs.json").read_text())
    pred = {r["case"]: r.get("predicted_train") for r in data["rows"]}
    assert pred["dora_int8"] is None and data["gpu"] == "a GPU" and data["predicted_src_digest"]
    # a full fine-tune's gradients and AdamW's two moments: the model's size in bf16 three times more
    assert 4 * 2**30 < pred["lora"] < pred["full_after"] < pred["full_after_adamw"] < pred["full_after_prodigy"]
    assert pred["full_after_adamw"] - pred["full_after"] > 9 * 2**30  # two fp32 moments of 2.6 B values
    assert "| planner GiB |" in (out / "training_costs.md").read_text()
    assert not (tmp_path / "work").exists()


def test_predict_only_without_saved_rows_says_so(costs, tmp_path):
    with pytest.raises(SystemExit, match="no saved rows"):
        costs.main(["--out", str(tmp_path), "--predict-only"])
