"""Predicted against measured peak GPU memory, per phase, for bench reports (not run in CI).

Each bench report (docs/bench/*.json, or the <run>/bench.memory.json of a bench/*.py run) holds
the `vramfit train` command it ran and the measured phases. This rebuilds that run's config from
the command (its config file and --set list), plans it with fit/planner.py for the same
architecture (read from model.path when that file is here, else from the layout named in the
file name: ssd1b, sdxl, sd3m, with t5 when the name says so) and prints, per phase, predicted,
measured and the error; every error should be within 10%.

    python bench/plan_check.py docs/bench/*.json
    python bench/plan_check.py OUT/*/bench.memory.json --captions 4
    python bench/plan_check.py OUT/ssd1b.json OUT/sd3_lora512.json      # bench/run.py workload files
    python bench/plan_check.py /tmp/vramfit-bench/run-budget4           # a run's output folder

Captions: the text phase holds the hidden states of up to 64 captions at once; a report does not
say how many distinct captions its dataset had, so give --captions (default: 1 with a DreamBooth
instance prompt, else 4, the bench's image count).

--write-calibration FILE (the planner's src/vramfit/fit/calibration.json) plans with FILE's
constants and rewrites its `errors`: for each constant, every compared phase whose prediction
depends on it (it moves when any one of the constant's values is nudged up and down), with
predicted and measured bytes, the error and the report; the values and their provenance are kept.

    python bench/plan_check.py docs/bench/*.json --write-calibration src/vramfit/fit/calibration.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from contextlib import contextmanager
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
    ("2026-12-05 05:30", "", ("samples",),
     "sample prompts encoded in the caption phase: with captions cached a grid holds no text encoder"),
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
    from vramfit.fit.model_facts import facts_for_layout, read_facts

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
    """(phase, predicted bytes, measured bytes) of every phase a run's report and the prediction
    both have."""
    from vramfit.fit.planner import predict

    facts, cfg, captions = planned_run(report, layout, captions)
    return measured_rows(report, predict(facts, cfg, captions))


def planned_run(report: dict, layout: str | None, captions: int | None):
    """(facts, config, captions) the planner predicts a run's report with."""
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
        from vramfit.fit.planner import with_values

        cfg = with_values(cfg, chosen)
    return facts, cfg, captions


def measured_rows(report: dict, prediction) -> list[tuple[str, float, float]]:
    """(phase, predicted, measured) of the phases a report measured and `prediction` has."""
    predicted = {p.name: p.peak for p in prediction.phases}
    rows = []
    for phase in report["phases"]:
        if phase["name"] in predicted and phase["gpu_peak_allocated"]:
            rows.append((phase["name"], predicted[phase["name"]], phase["gpu_peak_allocated"]))
    return rows


def not_compared(run: dict, phase: str, pred: float, meas: float) -> str | None:
    """Why a measured phase is listed but not compared with its prediction, or None."""
    if phase.startswith("cache_") and meas < 0.05 * pred:
        return "the cache was reused: not a measurement"
    old = superseded(run, phase)
    return f"{old}: not compared" if old else None


# ---- --write-calibration -----------------------------------------------------------------------------

def read_calibration(path: Path) -> tuple[dict, dict]:
    """(the file's data, the planner's constants from it); exits naming the file when it is not one."""
    from vramfit.fit.planner import calibration_values

    try:
        data = json.loads(path.read_text())
        return data, calibration_values(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"{path}: not a calibration file the planner reads ({e}); start from a copy of "
                         "src/vramfit/fit/calibration.json")


@contextmanager
def planner_constants(values: dict):
    """The planner's fitted constants set to `values` (calibration_values' names) meanwhile."""
    from vramfit.fit import planner

    kept = {name: getattr(planner, name) for name in values}
    for name, value in values.items():
        setattr(planner, name, value)
    try:
        yield
    finally:
        for name, value in kept.items():
            setattr(planner, name, value)


def _leaves(value, path: tuple = ()):
    """Paths to the numbers in a constant's `value` (nested dicts)."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _leaves(inner, (*path, key))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path


def _nudged(data: dict, name: str, path: tuple, sign: int) -> dict:
    """`data` with one number of constant `name` moved a little (an int by 1: counts index lists)."""
    out = copy.deepcopy(data)
    holder, key = out["constants"][name], "value"
    for part in path:
        holder, key = holder[key], part
    value = holder[key]
    holder[key] = value + sign if isinstance(value, int) else value + sign * max(abs(value), 1.0) * 1e-3
    return out


def report_label(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


def calibration_errors(paths: list[Path], data: dict, layout: str | None, captions: int | None) -> dict:
    """{constant: {"largest_pct", "rows"}}: every compared phase of the reports whose prediction
    moves both ways when one of the constant's values is nudged up and down."""
    from vramfit.fit.planner import calibration_values, predict

    runs_here = []  # (row template, report, planner inputs)
    for path in sorted(paths, key=report_label):
        for _, run in runs(path):
            head = {"report": report_label(path), **({"case": run["case"]} if "case" in run else {})}
            runs_here.append((head, run, planned_run(run, layout, captions)))

    def predictions(values: dict) -> list[list[tuple[str, float, float]]]:
        with planner_constants(values):
            return [measured_rows(run, predict(*inputs)) for _, run, inputs in runs_here]

    base = predictions(calibration_values(data))
    compared = {(i, phase) for i, (_, run, _) in enumerate(runs_here) for phase, pred, meas in base[i]
                if not not_compared(run, phase, pred, meas)}
    out = {}
    for name, entry in data["constants"].items():
        depends: dict[tuple, list[str]] = {}
        for path in _leaves(entry["value"]):
            up, down = (predictions(calibration_values(_nudged(data, name, path, s))) for s in (1, -1))
            for i, rows in enumerate(base):
                for j, (phase, pred, _) in enumerate(rows):
                    if (i, phase) in compared and up[i][j][1] != pred and down[i][j][1] != pred:
                        depends.setdefault((i, j), []).append(".".join(path))
        rows = []
        for i, j in sorted(depends):
            phase, pred, meas = base[i][j]
            err = round((pred - meas) / meas * 100, 1) + 0.0  # no -0.0
            row = {**runs_here[i][0], "phase": phase, "predicted": int(pred), "measured": int(meas),
                   "error_pct": err}
            if depends[i, j] != [""]:
                row["depends_on"] = depends[i, j]
            rows.append(row)
        out[name] = {"largest_pct": max((abs(r["error_pct"]) for r in rows), default=0.0), "rows": rows}
    return out


def nested(values) -> bool:
    return any(isinstance(x, (dict, list)) for x in values)


def dump_calibration(value, indent: int = 0) -> str:
    """JSON of a calibration file: nested objects indented, a flat object (a row) on one line."""
    pad = "  " * indent
    flat = json.dumps(value)
    if isinstance(value, dict) and value:
        if len(flat) <= 200 and all(not isinstance(v, dict) and not (isinstance(v, list) and nested(v))
                                    for v in value.values()):
            return flat
        items = [f"{pad}  {json.dumps(k)}: {dump_calibration(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and value and (len(flat) > 100 or nested(value)):
        return "[\n" + ",\n".join(f"{pad}  {dump_calibration(x, indent + 1)}" for x in value) + f"\n{pad}]"
    return flat


def write_calibration(target: Path, paths: list[Path], data: dict, layout: str | None,
                      captions: int | None) -> None:
    """Rewrite `target`'s errors (and the reports they come from) from the reports; keep the rest."""
    errors = calibration_errors(paths, data, layout, captions)
    out = copy.deepcopy(data)
    for name, entry in out["constants"].items():
        entry["errors"] = errors[name]
    out["reports"] = sorted({report_label(p) for p in paths if runs(p)})
    target.write_text(dump_calibration(out) + "\n")
    rows = {(r["report"], r.get("case"), r["phase"]) for e in errors.values() for r in e["rows"]}
    print(f"wrote {target}: the errors of {len(errors)} constants, {len(rows)} measured phases")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--layout", choices=LAYOUTS, help="architecture, when model.path is not here")
    parser.add_argument("--captions", type=int, help="distinct captions of the run's dataset")
    parser.add_argument("--write-calibration", type=Path, metavar="FILE",
                        help="plan with FILE's constants and rewrite its errors from these reports")
    args = parser.parse_args(argv)
    data, values = read_calibration(args.write_calibration) if args.write_calibration else (None, {})
    worst = 0.0
    print(f"{'report':<40}{'phase':<15}{'predicted':>10}{'measured':>10}{'error':>9}")
    with planner_constants(values):
        for name, run in (r for path in args.reports for r in runs(path)):
            for phase, pred, meas in check_run(run, args.layout, args.captions):
                err = (pred - meas) / meas * 100
                why = not_compared(run, phase, pred, meas)
                if why:
                    flag = f"  ({why})"
                else:
                    worst = max(worst, abs(err))
                    flag = "" if abs(err) <= 10 else "  > 10%"
                print(f"{name:<40}{phase:<15}{pred / 2**30:>9.2f}G{meas / 2**30:>9.2f}G{err:>+8.1f}%{flag}")
    print(f"largest error {worst:.1f}%")
    if data is not None:
        write_calibration(args.write_calibration, args.reports, data, args.layout, args.captions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
