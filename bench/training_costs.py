"""What each objective, adapter, optimizer, EMA setting and text-encoder training mode costs.

SDXL at 1024x1024, batch 1, the real architecture with random weights (bench/build.py), trained by
`python -m vramfit train` in a fresh process per case so that peaks do not mix. Each case is a few
--set overrides over one of two baselines: a LoRA (rank 16, Adafactor) and a full fine-tune
(Adafactor, full bf16, gradient checkpointing, the step inside backward); cases that cannot step
inside backward (full text encoders, the optimizers that step all parameters at once) are measured
against the full baseline with the step after backward. Per case, from the run's memory report
(<name>.memory.json): the train phase's peak allocated and reserved GPU memory, its peak RSS and
its median step time (the first step left out), beside the planner's prediction of the train phase
for the same config (fit/planner.py `predict`, from the layout's shipped config; CPU, no run). A
case the config refuses, or that fails or times out, is a row with its error. CUDA graphs, the fit
probe and sample grids are off in every case, so that a delta is the option's own.

Writes <out>/training_costs.json (rows, merged with the rows an earlier command wrote there for the
same model, shape, steps and GPU: a second command runs only the cases with no row yet or one that
timed out, unless --rerun; --predict-only fills in the planner's column of saved rows and runs
nothing) and <out>/training_costs.md (a markdown table for docs/training.md).
The cases run in the order of CASES; the last ones (optimizers on the full fine-tune) write training
states of up to about 55 GB (Prodigy's fp32 state of SDXL's UNet) under --work, deleted after each
case. Not run in CI; its CPU smoke test is tests/test_bench_training_costs.py.

usage: python bench/training_costs.py --out DIR [--model sdxl|ssd1b|tiny:sdxl|PATH] [--resolution N]
           [--steps N] [--cases NAME,...] [--timeout S] [--deadline S] [--work DIR] [--rerun]
           [--predict-only]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from vramfit.cli import main as vramfit_main
from vramfit.config import ConfigError, load_config
from vramfit.fit.model_facts import facts_for_layout, shipped_layouts
from vramfit.fit.planner import predict

from build import ROOT, ensure_model, log, make_images, run_train, train_command, train_phase
from run import config_problem, gpu_name, key_exists, src_digest

GIB = 2**30
JSON_NAME, MD_NAME = "training_costs.json", "training_costs.md"
# Seconds a LoRA and a full fine-tune case are assumed to take under --deadline until one has run (on
# an H200: start, load, 4 steps, save; a full fine-tune writes its checkpoint and training state).
GUESS_SECONDS = {"lora": 30.0, "full": 60.0}


@dataclass(frozen=True)
class Case:
    """--set overrides over a baseline; `key` is what the docs name (the table's second column)."""

    name: str
    base: str  # "lora", "full" or "full_after": the baseline the delta is taken against
    key: str
    sets: tuple[str, ...] = ()


# What every run of the bench shares besides model, data and output: one image a step, no accumulation,
# nothing but the steps measured (no graphs, fit probe, samples or intermediate saves).
COMMON = ("train.batch_size=1", "train.grad_accum=1", "train.cuda_graphs=false", "memory.fit_probe=false",
          "sample.every_steps=0", "save.every_steps=0", "data.max_aspect=1.0")
FULL = ("train.mode=full", "train.optimizer=adafactor", "train.lr=4e-7", "train.precision=full_bf16",
        "train.gradient_checkpointing=true", "train.max_grad_norm=0")
BASES = {
    "lora": ("train.mode=lora", "lora.rank=16", "train.optimizer=adafactor", "train.lr=1e-4",
             "train.precision=full_bf16", "train.gradient_checkpointing=true"),
    "full": (*FULL, "train.optimizer_in_backward=true"),
    "full_after": (*FULL, "train.optimizer_in_backward=false"),
}
BASE_LABELS = {"lora": "LoRA rank 16, Adafactor, full_bf16, checkpointing",
               "full": "full fine-tune, Adafactor, full_bf16, checkpointing, the step inside backward",
               "full_after": "the same, the step after backward (what text encoders and the optimizers "
                             "that step all parameters at once need)"}


def _ema(base: str, device: str, dtype: str) -> Case:
    return Case(f"{base}_ema_{device}_{dtype}", base, f'ema.device = "{device}", ema.dtype = "{dtype}"',
                ("ema.enabled=true", f"ema.device={device}", f"ema.dtype={dtype}"))


def _opt(base: str, name: str, *extra: str) -> Case:
    return Case(f"{base}_{name}", base, f'train.optimizer = "{name}"', (f"train.optimizer={name}", *extra))


# In the order they run: under --deadline the last ones are left for a second command.
CASES = [
    Case("lora", "lora", "LoRA r16 (train.mode = \"lora\", lora.rank = 16)"),
    Case("full", "full", "train.mode = \"full\", Adafactor, full_bf16, checkpointing, optimizer_in_backward"),
    Case("lora_dora", "lora", 'lora.type = "dora"', ("lora.type=dora",)),
    Case("lora_lokr", "lora", 'lora.type = "lokr"', ("lora.type=lokr",)),
    Case("lora_loha", "lora", 'lora.type = "loha"', ("lora.type=loha",)),
    Case("lora_conv16", "lora", "lora.conv_rank = 16", ("lora.conv_rank=16",)),
    Case("lora_te16", "lora", "lora.text_encoder_rank = 16 (cache.text off)",
         ("lora.text_encoder_rank=16", "cache.text=false")),
    Case("full_after", "full_after", "train.optimizer_in_backward = false"),
    Case("full_te", "full_after", 'train.text_encoders = "full"', ("train.text_encoders=full",)),
    *[_opt("lora", o, *(("train.lr=1.0",) if o == "prodigy" else ()))
      for o in ("adamw", "adamw8bit", "lion", "prodigy", "schedulefree_adamw", "came")],
    *[_ema(b, d, t) for b in ("full", "lora")
      for d, t in (("gpu", "bf16"), ("gpu", "fp32"), ("cpu", "fp32"))],
    Case("lora_vpred_minsnr_huber", "lora",
         'prediction_type = "v_prediction", min_snr_gamma = 5, loss = "huber"',
         ("train.prediction_type=v_prediction", "train.min_snr_gamma=5", "train.loss=huber")),
    # the same optimizers on the full fine-tune, where their state is the size of the model
    *[_opt("full_after", o, *(("train.lr=1.0",) if o == "prodigy" else ()))
      for o in ("adamw", "adamw8bit", "lion", "came", "prodigy", "schedulefree_adamw")],
]
BY_NAME = {c.name: c for c in CASES}


def case_sets(case: Case) -> list[str]:
    """Every override of the case: the shared ones, its baseline's, its own."""
    return [*COMMON, *BASES[case.base], *case.sets]


def missing_keys(case: Case) -> list[str]:
    """The config keys the case sets that this vramfit does not have."""
    return [k for k in (s.partition("=")[0] for s in case_sets(case)) if not key_exists(k)]


def run_in_process(sets: list[str], run_dir: Path) -> dict:
    """The same run through vramfit.cli.main in this process (the CPU smoke test: peaks mix, no
    timeout), read back as build.run_train reads it."""
    sets = [*sets, f"output.dir={run_dir}", "save.name=bench", "logging.tensorboard=false"]  # as run_train
    cmd = train_command(None, sets)
    t0, err = time.time(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = vramfit_main(cmd[3:])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    path = run_dir / "bench.memory.json"
    report = json.loads(path.read_text()) if rc == 0 and path.exists() else {}
    report.update(command=" ".join(cmd), wall_seconds=round(time.time() - t0, 1), returncode=rc)
    if rc != 0:
        report["error"] = err.getvalue()[-4000:] or f"exit {rc}"
    return report


def measure(case: Case, shape: list[str], args, timeout: float) -> dict:
    """One case's row: run it, read its memory report."""
    row = dict(case=case.name, base=case.base, key=case.key, sets=list(case.sets))
    missing = missing_keys(case)
    if missing:
        return dict(row, status="skipped", error="not in this vramfit: " + ", ".join(missing))
    sets = [*shape, *case_sets(case)]
    problem = config_problem(None, sets)
    if problem:
        return dict(row, status="refused", error="config refused: " + problem)
    run_dir = args.work / "runs" / case.name
    shutil.rmtree(run_dir, ignore_errors=True)
    if args.in_process:
        report = run_in_process(sets, run_dir)
    else:
        report = run_train(None, sets, run_dir, timeout=timeout, echo=args.verbose)
    shutil.rmtree(run_dir, ignore_errors=True)  # a full fine-tune's checkpoint and state: many GB
    row.update(command=report.get("command"), wall_s=report.get("wall_seconds"))
    train = train_phase(report)
    if report.get("returncode") == "timeout":
        return dict(row, status="timeout", error=f"timed out after {timeout:.0f} s (--timeout, --deadline)")
    if report.get("error") or train is None:
        error = str(report.get("error", "no train phase in the report"))
        return dict(row, status="failed", error=error[-1500:])
    gpu = str(report.get("device", "")).startswith("cuda")
    return dict(row, status="ok", device=report.get("device"),
                peak_allocated=train["gpu_peak_allocated"] if gpu else None,
                peak_reserved=train["gpu_peak_reserved"] if gpu else None,
                rss_peak=train["rss_peak"], rss_peak_any_phase=max(p["rss_peak"] for p in report["phases"]),
                step_s=round(train["step_seconds"], 4) if train.get("step_seconds") else None,
                steps=train.get("steps"))


def predicted_train(case: Case, layout: str, resolution: int) -> Optional[int]:
    """The planner's train-phase peak (bytes allocated) for the case's config on a shipped layout (None
    for a checkpoint path or a tiny model, which have no shipped config, and for a refused config)."""
    if layout not in shipped_layouts():
        return None
    sets = [f"data.resolution={resolution}", f"data.min_size={resolution}", *case_sets(case)]
    try:
        cfg = load_config(None, sets, need_data=False, need_model=False)
    except ConfigError:
        return None
    train = predict(facts_for_layout(layout), cfg).phase("train")
    return None if train is None else train.peak


def _gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def delta(row: dict, rows: dict[str, dict]) -> str:
    """Peak allocated (and reserved) above the case's baseline, in GiB; "-" where either is missing."""
    base = rows.get(row["base"])
    if row["case"] == row["base"]:
        return "(baseline)"
    if not base or row.get("peak_allocated") is None or base.get("peak_allocated") is None:
        return f"- (vs {row['base']})"
    da = (row["peak_allocated"] - base["peak_allocated"]) / GIB
    dr = (row["peak_reserved"] - base["peak_reserved"]) / GIB
    return f"{da:+.2f} ({dr:+.2f} resv) vs {row['base']}"


def markdown(data: dict) -> str:
    """The table for docs/training.md: GiB, seconds; failed cases with their error's last line."""
    rows = {r["case"]: r for r in data["rows"]}
    lines = [f"SDXL-family model `{data['model']}` at {data['resolution']}x{data['resolution']}, batch 1, "
             f"{data['steps']} steps (median of all but the first); {data.get('gpu') or data['device']}, "
             f"torch {data['torch']}, source {data['src_digest']}; CUDA graphs off. Baselines: "
             + "; ".join(f"`{name}`: {label}" for name, label in BASE_LABELS.items()) + ".", "",
             "| case | key | peak alloc GiB | planner GiB | peak reserved GiB | delta vs its baseline GiB "
             "| step s | peak RSS GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for case in CASES:
        r = rows.get(case.name)
        if r is None:
            continue
        if r["status"] != "ok":
            last = (r.get("error") or "").strip().splitlines()[-1:] or [""]
            why = last[0][:160].replace("|", "/")
            lines.append(f"| {case.name} | {case.key} | {r['status']}: {why} | | | | | |")
            continue
        step = "-" if r.get("step_s") is None else f"{r['step_s']:.3f}"
        lines.append(f"| {case.name} | {case.key} | {_gib(r.get('peak_allocated'))} | "
                     f"{_gib(r.get('predicted_train'))} | {_gib(r.get('peak_reserved'))} | {delta(r, rows)} | {step} | "
                     f"{_gib(r.get('rss_peak'))} |")
    if data.get("not_run"):
        lines += ["", f"Not run for lack of time: {', '.join(data['not_run'])}."]
    return "\n".join(lines) + "\n"


def model_path(model: str, work: Path) -> str:
    """A layout name is built once with random weights (bench/build.py); anything else is used as given."""
    return str(ensure_model(model, work)) if model in ("sdxl", "ssd1b") else model


def load_earlier(path: Path, same: dict) -> list[dict]:
    """Rows an earlier command wrote for the same model, shape, steps and GPU (else none)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return old.get("rows", []) if all(old.get(k) == v for k, v in same.items()) else []


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help=f"folder for {JSON_NAME} and {MD_NAME}")
    ap.add_argument("--model", default="sdxl",
                    help="sdxl or ssd1b (built with random weights under --work), tiny:sdxl, or a checkpoint")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4,
                    help="steps per case; the first is left out of the median")
    ap.add_argument("--cases", type=lambda s: s.split(","), default=None,
                    help=f"only these cases (of: {', '.join(BY_NAME)})")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per case before it counts as failed")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from the start this command may take: cases that would not end in time are "
                    "left out and named; the same command run again runs them")
    ap.add_argument("--rerun", action="store_true",
                    help="run again the cases an earlier command has a row of (by default only those that "
                    "timed out run again)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vramfit-bench-run"),
                    help="model, images, cache and run folders (reused on a warm machine; bench/run.py's "
                    "default, so that both use one built model)")
    ap.add_argument("--in-process", action="store_true",
                    help="run every case in this process (a CPU smoke test: peaks and RSS mix between cases, "
                    "no --timeout)")
    ap.add_argument("--predict-only", action="store_true",
                    help="add the planner's prediction to the rows saved in --out and redraw the table; run nothing")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each run's command and output")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases or [] if c not in BY_NAME]
    if unknown:
        ap.error(f"--cases: unknown {', '.join(unknown)}; the cases are {', '.join(BY_NAME)}")
    return args


def add_predictions(path: Path) -> dict:
    """--predict-only: the planner's train-phase prediction added to every row saved at `path`, by this
    source (its digest recorded beside the measuring run's)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: no saved rows to add predictions to ({exc}); run the bench first")
    for r in data["rows"]:
        if r["status"] == "ok":
            r["predicted_train"] = predicted_train(BY_NAME[r["case"]], data["model"], data["resolution"])
    data["predicted_src_digest"] = src_digest(ROOT / "src")
    path.write_text(json.dumps(data, indent=2))
    path.with_name(MD_NAME).write_text(markdown(data))
    return data


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.predict_only:
        print(markdown(add_predictions(args.out / JSON_NAME)))
        return 0
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    same = dict(model=args.model, resolution=args.resolution, steps=args.steps, gpu=gpu_name())
    data = dict(same, device="cuda" if same["gpu"] else "cpu", torch=torch.__version__,
                src_digest=src_digest(ROOT / "src"), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    out = args.out / JSON_NAME
    rows = {r["case"]: r for r in load_earlier(out, same)}
    ckpt = model_path(args.model, args.work)
    res = args.resolution
    images = make_images(args.work / f"images{res}", 2, res)
    shape = [f"model.path={ckpt}", f"data.path={images}", f"data.resolution={res}", f"data.min_size={res}",
             f"cache.dir={args.work / 'cache'}", f"train.steps={args.steps}"]
    wanted = [c for c in CASES if args.cases is None or c.name in args.cases]
    todo = [c for c in wanted if args.rerun or rows.get(c.name, {}).get("status", "timeout") == "timeout"]
    walls: dict[str, list[float]] = {}
    not_run = []

    def write() -> None:
        data.update(rows=[rows[c.name] for c in CASES if c.name in rows], not_run=not_run)
        out.write_text(json.dumps(data, indent=2))
        (args.out / MD_NAME).write_text(markdown(data))

    for case in todo:
        left = None if args.deadline is None else args.deadline - (time.time() - t0)
        kind = "lora" if case.base == "lora" else "full"
        need = max(walls.get(kind, []), default=GUESS_SECONDS[kind])
        if left is not None and left < need:
            not_run.append(case.name)
            log(f"{case.name}: not run, {left:.0f} s left of --deadline and a case takes ~{need:.0f} s")
            continue
        timeout = args.timeout if left is None else max(10.0, min(args.timeout, left - 5))
        log(f"{case.name} ({case.key}) ...")
        started = time.time()
        r = rows[case.name] = dict(measure(case, shape, args, timeout), date=data["date"],
                                   src_digest=data["src_digest"])
        if r["status"] == "ok":
            r["predicted_train"] = predicted_train(case, args.model, res)
        if r["status"] in ("ok", "failed", "timeout"):  # it ran (a refused or skipped case took no time)
            walls.setdefault(kind, []).append(time.time() - started)
        said = (f", {_gib(r.get('peak_allocated'))} GiB, {r.get('step_s')} s/step" if r["status"] == "ok"
                else f": {r['error'][-300:]}")
        log(f"{case.name}: {r['status']}{said}")
        write()
    write()
    print(markdown(data))
    if not_run:
        log(f"not run for lack of time: {', '.join(not_run)}; the same command runs them")
    log(f"done in {time.time() - t0:.0f} s: {out}, {args.out / MD_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
