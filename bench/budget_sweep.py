"""The budget curve: each shipped example as written, run under a series of GPU memory budgets.

For every budget the example runs with `memory.vram_budget` set (the planner chooses the settings
the user left free, the fit probe checks them); one row per budget: what the planner chose, the
training phase's peak allocated and reserved GPU memory, the largest reserved peak of any phase
(every one should stay under the budget), the peak resident host memory, and the time per image
(the median step over the images a step trains). With --seed the seed recipe's point is measured
in the same command (bench/seeds.py) for the plot. Writes <out>/budget_<example>.json, a markdown
table beside it and, where matplotlib is installed, a plot of time per image against the budget.
Not run in CI.

usage: python bench/budget_sweep.py {ssd1b,sd3m} --out DIR [--budgets 2,3,4,6,8] [--steps 3] [--seed]
       [--tiny]
       python bench/budget_sweep.py {ssd1b,sd3m} --out DIR --from ROWS.json [ROWS.json ...]
         (the table and plot again from earlier runs' rows, joined by budget: the later file's row wins)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

from build import ROOT, ensure_model, log, make_images, run_train, train_phase
from run import planner_choice

EXAMPLES = {"ssd1b": ("ssd1b_full_8gb.toml", "2,3,4,6,8", 1024, "seed"),
            "sd3m": ("sd3m_dreambooth_lora.toml", "3,4,6,8,16", 512, "seed")}
SEED_WORKLOAD = {"ssd1b": "ssd1b", "sd3m": "sd3_lora512"}
GIB = 2**30


def checkpoint(example: str, work: Path, tiny: bool) -> str:
    if tiny:
        return "tiny:ssd1b" if example == "ssd1b" else "tiny:sd3"
    if example == "ssd1b":
        return str(ensure_model("ssd1b", work))
    from sd3m_example import build_with_t5  # SD3-M with its fp8 T5-XXL, as the example expects

    return str(build_with_t5(work))


def row_of(budget: str, report: dict) -> dict:
    """One budget's row from the run's memory report."""
    row = {"budget": budget, "command": report.get("command")}
    train = train_phase(report)
    if report.get("error") or train is None:
        return dict(row, status="failed", note=str(report.get("error", "no train phase"))[-1500:])
    phases = report.get("phases", [])
    ips = train.get("images_per_second")
    lines = report.get("log_lines", [])
    return dict(row, status="ok", choice=planner_choice(lines), probe=probe_peak(lines),
                train_alloc_gib=round(train["gpu_peak_allocated"] / GIB, 2),
                train_reserved_gib=round(train["gpu_peak_reserved"] / GIB, 2),
                max_reserved_gib=round(max(p["gpu_peak_reserved"] for p in phases) / GIB, 2),
                peak_rss_gib=round(max(p["rss_peak"] for p in phases) / GIB, 2),
                pinned_gib=round(max(p.get("pinned", 0) for p in phases) / GIB, 2),
                s_per_image=round(1 / ips, 4) if ips else None)


def probe_peak(lines: list[str]) -> Optional[str]:
    """What the fit probe measured, as its log line says ("... peaked at 1.23 GiB of 4.00 GiB")."""
    found = next((x for x in lines if "fit probe:" in x and "peaked at" in x), None)
    return found.split("peaked at", 1)[1].strip() if found else None


def seed_point(example: str, steps: int, tiny: bool) -> Optional[dict]:
    """The seed recipe's peak and time per image, measured in a fresh process."""
    cmd = [sys.executable, str(ROOT / "bench" / "seeds.py"), SEED_WORKLOAD[example], "seed", "--steps", str(steps)]
    proc = subprocess.run(cmd + (["--tiny"] if tiny else []), text=True, capture_output=True, cwd=ROOT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        log(f"seed recipe failed: {(proc.stdout + proc.stderr)[-1500:]}")
        return None
    res = json.loads(line[len("RESULT "):])
    peak = res.get("peak_allocated")
    return {"peak_gib": round(peak / GIB, 2) if peak else None,
            "s_per_image": round(res["step_s"] / res["images_per_step"], 4)}


def markdown(example: str, rows: list[dict], seed: Optional[dict]) -> str:
    lines = [f"### {EXAMPLES[example][0]} under a budget", "",
             "| budget | planner's choice | train alloc GiB | train resv GiB | max resv GiB | peak RSS GiB "
             "| pinned GiB | s / image |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['budget']} | failed: {r['note'][-200:]!r} | | | | | | |")
            continue
        lines.append(f"| {r['budget']} | {r['choice'] or 'as written'} | {r['train_alloc_gib']} | "
                     f"{r['train_reserved_gib']} | {r['max_reserved_gib']} | {r['peak_rss_gib']} | "
                     f"{r.get('pinned_gib', '')} | {r['s_per_image']} |")
    if seed:
        lines += ["", f"Seed recipe: {seed['peak_gib']} GiB peak allocated, {seed['s_per_image']} s per image."]
    return "\n".join(lines) + "\n"


def plot(example: str, rows: list[dict], seed: Optional[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in rows if r["status"] == "ok" and r["s_per_image"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([float(r["budget"].removesuffix("GiB")) for r in ok], [r["s_per_image"] for r in ok], "o-",
            label="vramfit, the example under a budget")
    if seed and seed["peak_gib"]:
        ax.plot([seed["peak_gib"]], [seed["s_per_image"]], "s", label="seed recipe (its peak)")
    ax.set_xlabel("GPU memory budget, GiB")
    ax.set_ylabel("seconds per image")
    ax.set_title(EXAMPLES[example][0])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("example", choices=sorted(EXAMPLES))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vramfit-bench-sweep"))
    ap.add_argument("--budgets", help="GiB, comma-separated (default: the example's series)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", action="store_true", help="also measure the seed recipe's point")
    ap.add_argument("--tiny", action="store_true", help="tiny models at 64x64 on the CPU (checks the script)")
    ap.add_argument("--from", dest="sources", nargs="+", type=Path, help="rows of earlier runs: no run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sources:
        rows, seed = joined(args.sources)
        report(args.example, rows, seed, args.out)
        return
    toml, default_budgets, res, _ = EXAMPLES[args.example]
    res = 64 if args.tiny else res
    ckpt = checkpoint(args.example, args.work, args.tiny)
    images = make_images(args.work / f"images{res}", 4, res)
    base = [f"model.path={ckpt}", f"data.path={images}", f"data.resolution={res}", f"data.min_size={res}",
            f"train.steps={args.steps}", "save.every_steps=0", f"cache.dir={args.work / 'cache'}"]
    if args.tiny:
        base += ["train.device=cpu", "data.bucket_step=32", "train.batch_size=1", "train.grad_accum=2",
                 "sample.steps=2"]
    rows: list[dict] = []
    out = args.out / f"budget_{args.example}.json"
    for gib in (args.budgets or default_budgets).split(","):
        budget = f"{gib}GiB"
        log(f"{args.example} at {budget} ...")
        memory = run_train(ROOT / "examples" / toml, [*base, f"memory.vram_budget={budget}"],
                           args.work / f"run-{args.example}-{gib}", echo=False)
        rows.append(row_of(budget, memory))
        log(json.dumps({k: v for k, v in rows[-1].items() if k != "command"}))
        out.write_text(json.dumps({"example": toml, "rows": rows}, indent=2))  # kept if a later one is cut
    seed = seed_point(args.example, args.steps, args.tiny) if args.seed else None
    out.write_text(json.dumps({"example": toml, "rows": rows, "seed": seed}, indent=2))
    report(args.example, rows, seed, args.out)


def joined(sources: list[Path]) -> tuple[list[dict], Optional[dict]]:
    """The rows of several runs' JSON by budget (a later file's row replaces an earlier one's), in
    budget order, and the last seed point found."""
    by_budget: dict[str, dict] = {}
    seed = None
    for path in sources:
        data = json.loads(path.read_text())
        by_budget.update({r["budget"]: r for r in data["rows"]})
        seed = data.get("seed") or seed
    return sorted(by_budget.values(), key=lambda r: float(r["budget"].removesuffix("GiB"))), seed


def report(example: str, rows: list[dict], seed: Optional[dict], out: Path) -> None:
    """The markdown table (printed too) and, where matplotlib is installed, the plot."""
    table = markdown(example, rows, seed)
    (out / f"budget_{example}.md").write_text(table)
    print(table)
    if plot(example, rows, seed, out / f"budget_{example}.png"):
        log(f"plot: {out / f'budget_{example}.png'}")


if __name__ == "__main__":
    sys.exit(main())
