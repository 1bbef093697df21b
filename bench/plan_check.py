"""Predicted against measured peak GPU memory, per phase, for bench reports (not run in CI).

Each bench report (docs/bench/*.json, or the <run>/bench.memory.json of a bench/*.py run) holds
the `vramfit train` command it ran and the measured phases. This rebuilds that run's config from
the command (its config file and --set list), plans it with memory/planner.py for the same
architecture (read from model.path when that file is here, else from the layout named in the
file name: ssd1b, sdxl, sd3m, with t5 when the name says so) and prints, per phase, predicted,
measured and the error; issue 4 wants every error within 10%.

    python bench/plan_check.py docs/bench/*.json
    python bench/plan_check.py OUT/*/bench.memory.json --captions 4
    python bench/plan_check.py OUT/ssd1b.json OUT/sd3_lora512.json      # bench/run.py workload files
    python bench/plan_check.py /tmp/vramfit-bench/run-budget4           # a run's output folder

Captions: the text phase holds the hidden states of up to 64 captions at once; a report does not
say how many distinct captions its dataset had, so give --captions (default: 1 with a DreamBooth
instance prompt, else 4, the bench's image count).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DROPPED = ("model.path", "data.path", "cache.dir", "output.dir")
LAYOUTS = ("ssd1b", "sdxl", "sd3m")
# Changes of what a run holds on the GPU: (commit time UTC, the setting of the runs it changed, the
# phases, what changed). A row measured before such a change is not compared with today's prediction.
CHANGES = [
    ("2026-12-04 13:51", "memory.stream_weights=true", ("train", "save"),
     "ca544c6: streamed units are copied into slots kept while training"),
    ("2026-12-04 14:25", "memory.stream_weights=true", ("save",),
     "0b80d70: the slots are let go before the final save"),
]


def superseded(run: dict, phase: str) -> str | None:
    """Why a measured phase of a run no longer compares with the planner's prediction (a change
    in CHANGES came after it), or None. A run's date is its bench row's (`date`); without one
    (single runs, older rows) it counts as before every change."""
    date = (run.get("date") or "")[:16]
    # the settings as given, and as the planner chose them (a budget row's note)
    settings = (run.get("command") or "").replace("--set ", "") + " " + (run.get("note") or "")
    for when, setting, phases, what in CHANGES:
        if phase in phases and setting in settings and date < when:
            return f"measured before {what}"
    return None


def run_config(command: str):
    """(RunConfig, overrides as given) of a `vramfit train` command line; model and data paths
    are replaced, so the config loads on any machine."""
    from vramfit.config.load import load_config

    # The reports join argv with spaces, unquoted: a --set value runs to the next option.
    words = command.split()
    words = words[words.index("train") + 1:]
    config = None
    if words and not words[0].startswith("-"):
        config = Path(words[0]) if Path(words[0]).is_absolute() else ROOT / words[0]
        if not config.exists() and config.parent.name == "examples":  # run in another checkout
            config = ROOT / "examples" / config.name
    sets, current = [], None
    for word in words:
        if word.startswith("--"):
            current = [] if word == "--set" else None
            if current is not None:
                sets.append(current)
        elif current is not None:
            current.append(word)
    sets = [" ".join(parts) for parts in sets if parts]
    kept = [s for s in sets if s.split("=", 1)[0] not in DROPPED]
    model = next((s.split("=", 1)[1] for s in sets if s.startswith("model.path=")), "")
    return load_config(config, [*kept, "model.path=tiny:ssd1b"], need_data=False), model, sets


def facts_for(model_path: str, layout: str | None, cfg):
    from vramfit.memory.model_facts import facts_for_layout, read_facts

    if Path(model_path).is_file() or model_path.startswith("tiny:"):
        return read_facts(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_path})}))
    name = layout or next((n for n in LAYOUTS if n in Path(model_path).name.lower()), None)
    if name is None:
        raise SystemExit(f"{model_path}: not here and no layout in its name; give --layout {'|'.join(LAYOUTS)}")
    return facts_for_layout(name, t5="t5" in Path(model_path).name.lower())


def runs(report_path: Path) -> list[tuple[str, dict]]:
    """(name, run) of each measured vramfit run in a file: a single run's report, the vramfit
    rows of a bench/run.py workload file (each with its command and phases), or a run's output
    folder (its resolved config.toml, with the settings a budget chose, and its *.memory.json)."""
    if report_path.is_dir():
        report = json.loads(next(report_path.glob("*.memory.json")).read_text())
        return [(report_path.name, dict(report, config=str(report_path / "config.toml")))]
    data = json.loads(report_path.read_text())
    if "rows" not in data:  # a single run's report; other JSON (e.g. precision.json) has no runs
        return [(report_path.name, data)] if "phases" in data and "command" in data else []
    return [(f"{report_path.stem}:{row['case']}", row) for row in data["rows"]
            if row.get("side") == "vramfit" and row.get("status") == "ok" and row.get("command")]


def chosen_settings(note: str) -> dict:
    """{key: value} of a planner row's note ("chose train.cuda_graphs=true, cache.vae_dtype="fp32", ...")."""
    if not note.startswith("chose "):
        return {}
    pairs = [item.split("=", 1) for item in note[len("chose "):].split(", ")]
    return {key: json.loads(value) for key, value in pairs}


def recorded_graphs(report: dict) -> bool:
    """Whether a single run's log says it recorded CUDA graphs."""
    return any("train.cuda_graphs: recorded" in line for line in report.get("log_lines") or [])


def check(report_path: Path, layout: str | None, captions: int | None) -> list[tuple[str, float, float]]:
    """(phase, predicted bytes, measured bytes) of every phase a single run's report and the
    prediction both have."""
    return check_run(json.loads(report_path.read_text()), layout, captions)


def check_run(report: dict, layout: str | None, captions: int | None) -> list[tuple[str, float, float]]:
    from vramfit.memory.planner import predict

    if "config" in report:  # an output folder: its resolved config as the run used it
        from vramfit.config.load import load_config

        cfg = load_config(Path(report["config"]), need_data=False)
        model, sets = cfg.model.path, []
    else:
        cfg, model, sets = run_config(report["command"])
    if captions is None:
        captions = 1 if any(s.startswith("data.instance_prompt=") for s in sets) or cfg.data.instance_prompt else 4
    facts = facts_for(model, layout, cfg)
    # a bench row of the planner's case: the settings it chose on the GPU machine, as the run used
    # them (choosing again here, on a machine without a GPU, would leave CUDA graphs out)
    chosen = chosen_settings(report.get("note") or "")
    if "cuda_graphs" not in cfg.train.model_fields_set:  # the default decided where the run ran, not here
        chosen.setdefault("train.cuda_graphs", recorded_graphs(report))
    if chosen:
        from vramfit.memory.planner import with_values

        cfg = with_values(cfg, chosen)
    predicted = {p.name: p.peak for p in predict(facts, cfg, captions).phases}
    rows = []
    for phase in report["phases"]:
        if phase["name"] in predicted and phase["gpu_peak_allocated"]:
            rows.append((phase["name"], predicted[phase["name"]], phase["gpu_peak_allocated"]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--layout", choices=LAYOUTS, help="architecture, when model.path is not here")
    parser.add_argument("--captions", type=int, help="distinct captions of the run's dataset")
    args = parser.parse_args(argv)
    worst = 0.0
    print(f"{'report':<40}{'phase':<15}{'predicted':>10}{'measured':>10}{'error':>9}")
    for name, run in (r for path in args.reports for r in runs(path)):
        for phase, pred, meas in check_run(run, args.layout, args.captions):
            err = (pred - meas) / meas * 100
            old = superseded(run, phase)
            if phase.startswith("cache_") and meas < 0.05 * pred:
                flag = "  (the cache was reused: not a measurement)"
            elif old:
                flag = f"  ({old}: not compared)"
            else:
                worst = max(worst, abs(err))
                flag = "" if abs(err) <= 10 else "  > 10%"
            print(f"{name:<40}{phase:<15}{pred / 2**30:>9.2f}G{meas / 2**30:>9.2f}G{err:>+8.1f}%{flag}")
    print(f"largest error {worst:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
