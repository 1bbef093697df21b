"""Render bench/run.py's JSON as markdown and a PNG plot: a short summary table per workload (seed
recipes and the configurations a user runs: peak allocated memory and step time, each against the
reference measured on the same machine, and the command that measures them) for docs/benchmarks.md,
and the full tables (reserved memory, images/s, MFU, each row's distance from its target, commit and
run) for the log, docs/bench/log.md. Each goes between the markers `<!-- bench:begin -->` and
`<!-- bench:end -->` of its file; the rest of the file (hand-written text, the measured history of
the log) stays as it is.

Targets: every memory-saving configuration's median step time <= 0.5x the seed recipe's for the
same workload at equal or lower peak allocated memory; the fastest configuration <= 0.7x the stock
"fast" configuration's step time.

usage: python bench/report.py DIR_OR_JSON... [--md docs/benchmarks.md] [--log docs/bench/log.md]
           [--plot docs/bench/benchmarks.png] [--merge-into docs/bench]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Optional

GIB = 2**30
MEMORY_TARGET, FAST_TARGET = 0.5, 0.7
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
ORDER = ["ssd1b", "sdxl", "sd3_lora512", "sd3_lora1024", "sd3_full"]


def load(paths: list[Path]) -> list[dict]:
    files = []
    for p in paths:
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    merged: dict[str, dict] = {}
    for f in files:  # one workload may have been run in several commands: rows of later files win
        g = json.loads(f.read_text())
        if "rows" not in g or "workload" not in g:
            continue
        old = merged.setdefault(g["workload"], dict(g, rows=[]))
        if not old.get("flops", {}).get("train_tflop"):
            old["flops"] = g.get("flops", {})
        # the commits of every run merged, each once (a merged file's field already lists several)
        seen = list(dict.fromkeys(str(old.get("commit")).split(", ")))
        old["commit"] = ", ".join(seen + [c for c in dict.fromkeys(str(g.get("commit")).split(", ")) if c not in seen])
        old["not_run"] = list(dict.fromkeys([*old.get("not_run", []), *g.get("not_run", [])]))
        refs = old.setdefault("references", [])
        for r in [*g.get("references", []), *g["rows"]]:  # every run's own references stay for its rows
            if r.get("role") in REF_ROLES and r.get("status") == "ok" and \
                    not any((x["role"], run_of(x)) == (r["role"], run_of(r)) for x in refs):
                refs.append(r)
        new = {(r["side"], r["case"]): r for r in g["rows"]}
        old["rows"] = [newer(new.pop((r["side"], r["case"]), r), r) for r in old["rows"]] + list(new.values())
    for g in merged.values():
        ran = {r["case"] for r in g["rows"]}  # failed or not (seed and vramfit cases have names apart)
        g["not_run"] = [c for c in g.get("not_run", []) if c not in ran]  # a later command may have run it
        shown = {(r["role"], run_of(r)) for r in g["rows"]}
        g["references"] = [r for r in g["references"] if (r["role"], run_of(r)) not in shown]
        g["rows"].sort(key=lambda r: (r["side"] != "seed", r.get("role") == "fastest"))
    return sorted(merged.values(), key=lambda g: ORDER.index(g["workload"]) if g["workload"] in ORDER else 99)


def newer(row: dict, earlier: dict) -> dict:
    """The row of the later command (by its date) wins, unless it only says the case was skipped."""
    if row.get("status") == "skipped" and earlier.get("status") == "ok":
        return earlier
    return earlier if str(earlier.get("date", "")) > str(row.get("date", "")) else row


REF_ROLES = ("seed_ref", "fast_ref")


def run_of(row: dict) -> Optional[str]:
    """Where a row was measured: its machine and boot (bench/run.py), else its command's start."""
    return row.get("machine") or row.get("date")


def reference(group: dict, role: str, run: Optional[str] = None) -> Optional[dict]:
    """The reference row of `role`: the one measured on the machine `run` (run_of) where there is
    one, else the table's own."""
    rows = [r for r in group["rows"] if r.get("role") == role and r.get("status") == "ok"]
    same = [r for r in rows + group.get("references", []) if run and r.get("role") == role
            and r.get("status") == "ok" and run_of(r) == run]
    return (same or rows or [None])[0]


def target_check(row: dict, group: dict) -> tuple[str, str]:
    """(step time against its reference, how far from the target) for one row. The lent GPU
    machines differ in host speed (a launch-bound step more than doubles on a slow host), so a
    row is judged against the reference measured on its own machine; without one it is compared
    with the table's reference and marked as not comparable."""
    if row.get("status") != "ok":
        return "", ""
    role = "fast_ref" if row["role"] == "fastest" else "seed_ref"
    ref = reference(group, role, run_of(row))
    if not ref:
        return "", "no stock fast row" if role == "fast_ref" else "no seed row"
    elsewhere = " (reference from another machine)" if run_of(ref) != run_of(row) else ""
    own = ref is not reference(group, role) and not elsewhere
    where = f" of its machine ({ref['step_s']:.3f} s)" if own else elsewhere
    ratio = row["step_s"] / ref["step_s"]
    if row["role"] == "fastest":
        verdict = "met" if ratio <= FAST_TARGET else f"missed: {ratio:.2f}x > {FAST_TARGET}x"
        return f"{ratio:.2f}x fast{where}", verdict + ("; not comparable" if elsewhere else "")
    seed = ref
    if row["side"] == "seed":
        return f"{ratio:.2f}x seed{where}", ""
    misses = [f"{ratio:.2f}x > {MEMORY_TARGET}x"] if ratio > MEMORY_TARGET else []
    peak = ""
    if row.get("peak_allocated") is not None and seed.get("peak_allocated") is not None:
        over = (row["peak_allocated"] - seed["peak_allocated"]) / GIB
        peak = f"peak {over:+.2f} GiB"
        misses += [peak] if over > 0 else []
    verdict = f"missed: {', '.join(misses)}" if misses else "met" + (f" ({peak})" if peak else "")
    return f"{ratio:.2f}x seed{where}", verdict + ("; not comparable" if elsewhere else "")


def gib(x) -> str:
    return f"{x / GIB:.2f}" if isinstance(x, (int, float)) else "-"


def fmt(x, spec: str, scale: float = 1.0) -> str:
    return format(x * scale, spec) if isinstance(x, (int, float)) else "-"


def render_group(group: dict) -> str:
    flops = group.get("flops", {})
    tflop = f"{flops['train_tflop']:.4g} TFLOP a step (forward {flops['fwd_tflop']:.4g})" if "train_tflop" in flops \
        else "FLOPs not counted"
    where = group.get("gpu") or "CPU, tiny models (not a measurement of speed)"
    lines = [f"### {group['title']}", "",
             f"{where}; torch {group.get('torch', '?')}; {group['steps']} steps per case, median after the first; "
             f"{tflop}. Last column: the vramfit commit and the start (UTC) of the bench command of each row; "
             "each row is judged against the reference measured on the same lent machine."
             + (f" Not run (out of time): {', '.join(group['not_run'])}." if group.get("not_run") else ""), "",
             "| side | configuration | peak alloc GiB | peak resv GiB | step s | img/s | MFU | vs reference | target | note "
             "| commit, run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    cases = {row["case"]: row for row in group["rows"] if row.get("side") == "vramfit"}
    for row in group["rows"]:
        ratio, target = target_check(row, group)
        twin = cases.get(f"{row['case']}_graphs") if row.get("side") == "vramfit" else None
        if twin is not None and target.startswith("missed") and twin.get("status") == "ok":
            # the bench turns graphs off for this row; a GPU run records them by default
            twin_ratio, twin_target = target_check(twin, group)
            target += f"; with CUDA graphs (on by default): {twin_ratio.split(' ')[0]}, {twin_target.split(';')[0]}"
        note = row.get("note", "")
        if row.get("status") != "ok":
            note = f"{row.get('status')}: {note}"
        note = " ".join(str(note).split())[:200].replace("|", "/")
        lines.append(f"| {row['side']} | {row['label']} | {gib(row.get('peak_allocated'))} | "
                     f"{gib(row.get('peak_reserved'))} | {fmt(row.get('step_s'), '.3f')} | "
                     f"{fmt(row.get('images_per_s'), '.2f')} | {fmt(row.get('mfu'), '.1f', 100)}{'%' if row.get('mfu') else ''} | "
                     f"{ratio} | {target} | {note} | {row.get('commit', '?')} {str(row.get('date', ''))[5:16]} |")
    return "\n".join(lines)


def render_tables(groups: list[dict]) -> str:
    peak = {g.get("peak_tflops") for g in groups}
    head = ("MFU: model FLOPs of one training step (forward and backward, counted with "
            "`torch.utils.flop_counter.FlopCounterMode` on the meta device; the denoiser only: recomputation "
            "under gradient checkpointing and the seed's live VAE encoding not counted) / step time / "
            f"{', '.join(f'{p:g}' for p in peak)} TFLOP/s "
            "(H200 SXM dense bf16 specification; seed-baselines.md divides by a measured ~790, so its "
            "percentages are 1.25x these). Peaks: `torch.cuda.max_memory_allocated` / `max_memory_reserved` "
            "over the training phase (vramfit: its memory report's train phase; seeds: after the model and "
            "optimizer are built). Each case ran in a fresh process, produced by `python bench/run.py GROUP --out DIR`.")
    targets = (f"Targets: each memory-saving configuration's median step <= {MEMORY_TARGET}x the seed "
               "recipe's at equal or lower peak allocated memory (\"peak\": its peak minus the seed's); the fastest "
               f"configuration <= {FAST_TARGET}x the stock fast step. The reference is the one measured on the same lent "
               "machine (its step time is named where it is not the table's); a row without one on its machine is "
               "marked \"not comparable\": machines of the same GPU differ in host speed, and steps bound by kernel "
               "launches follow the host.")
    return "\n\n".join([head, targets] + [render_group(g) for g in groups])


SUMMARY_ORDER = ["ssd1b", "sdxl", "sd3_full", "sd3_lora512", "sd3_lora1024"]
SUMMARY_HEAD = (
    "Peak: `torch.cuda.max_memory_allocated` over the training phase, GiB (2^30 bytes). Step: the "
    "median of the steps after the first, in seconds; each case runs in a fresh process. \"vs\": the "
    "step against the seed recipe's (for the fastest configurations, the stock fast one's) measured "
    "on the same machine, whose step is named: the H200 machines the bench ran on differ in host "
    "speed, and a step bound by kernel launches follows the host; \"-\" where that machine ran no "
    "reference. On one GPU vramfit records CUDA graphs by default, so a configuration measured both "
    "ways is shown with them (the log has both); a row without \"CUDA graphs\" in its name ran with "
    "`train.cuda_graphs=false`. Each table's command runs all its rows' cases; the log names the "
    "commit and run each row came from.")


def summary_rows(group: dict) -> list[dict]:
    """The rows a user compares: the seed cases, then vramfit's configurations as a run gets them (a
    configuration measured with CUDA graphs, on by default, stands for its run without them), by peak."""
    ok = [r for r in group["rows"] if r.get("status") == "ok"]
    cases = {r["case"] for r in ok if r["side"] == "vramfit"}
    seeds = [r for r in ok if r["side"] == "seed"]
    own = [r for r in ok if r["side"] == "vramfit" and f"{r['case']}_graphs" not in cases]
    return seeds + sorted(own, key=lambda r: (r.get("peak_allocated") or 0, r["step_s"]))


def versus(row: dict, group: dict) -> str:
    """The row's step against the reference measured on its own machine, or "-" without one."""
    role = "fast_ref" if row.get("role") == "fastest" else "seed_ref"
    if row.get("role") == role:
        return ""
    ref = reference(group, role, run_of(row))
    if not ref or run_of(ref) != run_of(row):
        return "-"
    name = "stock fast" if role == "fast_ref" else "seed"
    return f"{row['step_s'] / ref['step_s']:.2f}x {name} ({ref['step_s']:.3f} s)"


def render_summary(groups: list[dict]) -> str:
    """One short table per workload for docs/benchmarks.md, with the command that measures its rows."""
    parts = [SUMMARY_HEAD]
    order = {w: i for i, w in enumerate(SUMMARY_ORDER)}
    for group in sorted(groups, key=lambda g: order.get(g["workload"], 99)):
        rows = summary_rows(group)
        steps = str(group.get("steps", 6)).split()[0]
        where = group.get("gpu") or "CPU, tiny models (not a measurement of speed)"
        command = (f"python bench/run.py {group['workload']} --out OUT --steps {steps} "
                   f"--cases {','.join(dict.fromkeys(r['case'] for r in rows))}")
        lines = [f"### {group['title']}", "", f"{where}, torch {group.get('torch', '?')}: `{command}`", "",
                 "| configuration | case | peak GiB | step s | vs |", "|---|---|---|---|---|"]
        for row in rows:
            label = row["label"] if row["side"] == "vramfit" else f"**{row['label']}**"
            lines.append(f"| {label} | `{row['case']}` | {gib(row.get('peak_allocated'))} | "
                         f"{fmt(row.get('step_s'), '.3f')} | {versus(row, group)} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def plot(groups: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 0.45 * sum(len(g["rows"]) for g in groups) + 1.2 * len(groups)),
                             squeeze=False)
    colours = {"seed_ref": "0.35", "fast_ref": "0.6", "seed_other": "0.8", "memory_saving": "tab:blue",
               "fastest": "tab:orange"}
    for (ax_t, ax_m), g in zip(axes, groups):
        rows = [r for r in g["rows"] if r.get("status") == "ok"]
        labels = [f"{r['side']}: {r['label']}" for r in rows]
        cols = [colours.get(r["role"], "0.5") for r in rows]
        ax_t.barh(labels, [r["step_s"] for r in rows], color=cols)
        ax_m.barh(labels, [(r.get("peak_allocated") or 0) / GIB for r in rows], color=cols)
        seed = reference(g, "seed_ref")
        if seed:
            ax_t.axvline(seed["step_s"] * MEMORY_TARGET, ls="--", c="tab:blue", lw=1, label="0.5x seed")
            if seed.get("peak_allocated"):
                ax_m.axvline(seed["peak_allocated"] / GIB, ls="--", c="0.35", lw=1, label="seed peak")
        fast = reference(g, "fast_ref")
        if fast:
            ax_t.axvline(fast["step_s"] * FAST_TARGET, ls=":", c="tab:orange", lw=1, label="0.7x fast")
        ax_t.set_title(f"{g['title']}: median step (s)", fontsize=9)
        ax_m.set_title("peak allocated (GiB)", fontsize=9)
        ax_m.set_yticks([])
        for ax in (ax_t, ax_m):
            ax.invert_yaxis()
            ax.tick_params(labelsize=7)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def update_markdown(md: Path, body: str, image: Optional[Path], title: str) -> None:
    """Replace the text between the markers (or put it after the first paragraph after the title)."""
    text = md.read_text() if md.exists() else f"# {title}\n"
    if image is not None:
        rel = os.path.relpath(image.resolve(), md.resolve().parent)
        body += f"\n\n![step time and peak memory per configuration]({Path(rel).as_posix()})"
    block = f"{BEGIN}\n## {title}\n\n{body}\n{END}"
    if BEGIN in text and END in text:
        start, end = text.index(BEGIN), text.index(END) + len(END)
        text = text[:start] + block + text[end:]
    else:
        head, sep, rest = text.partition("\n## ")
        text = head.rstrip("\n") + "\n\n" + block + "\n\n" + (sep.lstrip("\n") + rest if sep else "")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text.rstrip("\n") + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", type=Path, nargs="+", help="folders of bench/run.py JSON, or JSON files")
    ap.add_argument("--md", type=Path, help="markdown file for the summary tables (between the markers)")
    ap.add_argument("--log", type=Path, help="markdown file for the full tables (between the markers)")
    ap.add_argument("--plot", type=Path, help="PNG to draw (needs matplotlib) and link from both files")
    ap.add_argument("--merge-into", type=Path, help="write each merged workload to FOLDER/<workload>.json")
    args = ap.parse_args(argv)
    groups = load(args.inputs)
    if not groups:
        raise SystemExit("no bench JSON found in " + ", ".join(map(str, args.inputs)))
    if args.merge_into:
        args.merge_into.mkdir(parents=True, exist_ok=True)
        for g in groups:
            (args.merge_into / f"{g['workload']}.json").write_text(json.dumps(g, indent=2))
    drew = plot(groups, args.plot) if args.plot else False
    image = args.plot if args.plot and (drew or args.plot.exists()) else None  # an earlier plot still holds
    if args.md:
        update_markdown(args.md, render_summary(groups), image, "Seed recipes and vramfit, side by side")
        print(f"wrote the summary tables into {args.md}")
    if args.log:
        title = "Seed recipes and vramfit, side by side (bench/run.py)"
        update_markdown(args.log, render_tables(groups), image, title)
        print(f"wrote the full tables into {args.log}")
    if not args.md and not args.log:
        print(render_summary(groups) + "\n\n" + render_tables(groups))


if __name__ == "__main__":
    main()
