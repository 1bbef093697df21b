"""Profile a few steps of `vramfit train` on one bench workload and configuration (torch.profiler).

The run is the bench's own (bench/run.py's recipe plus a case's --set overrides), in this process,
so the profiler sees the training loop as a user's run executes it. Steps are counted at the loop's
step boundary: the first `--skip` steps run unprofiled (allocator and autotuning warm-up), the
next `--active` are recorded. Writes under --out:
  <tag>.trace.json.gz   the Chrome trace (open in Perfetto or chrome://tracing)
  <tag>.ops.txt         operators by total device time, and by CPU time
  <tag>.summary.json    per recorded step: wall time, device busy time, and device time by phase
                        (forward, backward, optimizer step, other)
With --memory the profiler is off and the CUDA allocator's history is recorded from the start
instead (torch.cuda.memory._record_memory_history, Python stacks), and <tag>.peak.json says
where the measured steps' allocation peaked (vramfit's train phase; a seed case's timed steps):
the peak, the allocation that reached it (its stack), and what was live then, summed by the
innermost frame of this project's code (or of bench/seeds.py's, for a seed case) and by the
innermost frame of any code, and its largest blocks; and the peak of every phase.
Not run in CI.

usage: python bench/trace_steps.py WORKLOAD CASE|seed:CASE --out DIR [--tiny] [--skip N] [--active N]
                                   [--memory] [--set K=V ...]
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from build import ROOT, ensure_model, log, make_images
from run import FULL_CASES, LORA_CASES, TINY_MODELS, eager_unless_graphed, recipe
from seeds import TINY_RES, WORKLOADS


def case_sets(workload: str, case: str) -> list[str]:
    listed = LORA_CASES if WORKLOADS[workload]["mode"] == "lora" else FULL_CASES
    found = next((c for c in listed if c.name == case), None)
    if found is None:
        raise SystemExit(f"unknown case {case!r} for {workload}: one of {', '.join(c.name for c in listed)}")
    return eager_unless_graphed(found) + found.sets


class Ranges:
    """Non-overlapping CPU time ranges of one kind (e.g. optimizer steps), looked up by time."""

    def __init__(self, events: list[dict]):
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
        self.starts, self.spans = [a for a, _ in spans], spans

    def __contains__(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and self.spans[i][0] <= t <= self.spans[i][1]


def summarize(trace_path: Path, step_walls: list[float]) -> dict:
    """Device busy time per phase from the Chrome trace: each kernel is matched to the CPU call that
    launched it (correlation id), and that call's time to the optimizer-step and backward ranges."""
    events = [e for e in json.loads(gzip.open(trace_path).read())["traceEvents"] if e.get("ph") == "X"]
    optimizer = Ranges([e for e in events if e["name"].startswith("Optimizer.step")])
    backward = Ranges([e for e in events if e["name"].startswith("autograd::engine::evaluate_function")])
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    by_phase: dict[str, float] = {}
    by_kind: dict[str, float] = {}
    for k in events:
        if k.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        t = launches.get(k.get("args", {}).get("correlation"))
        phase = "unmatched" if t is None else "optimizer" if t in optimizer else "backward" if t in backward \
            else "forward and other"
        by_phase[phase] = by_phase.get(phase, 0.0) + k["dur"] / 1e6
        by_kind[k["cat"]] = by_kind.get(k["cat"], 0.0) + k["dur"] / 1e6
    n = max(1, len(step_walls))
    return dict(steps=len(step_walls), step_wall_s=step_walls, mean_step_s=sum(step_walls) / n,
                device_busy_s_per_step=round(sum(by_kind.values()) / n, 5),
                device_s_per_step_by_phase={k: round(v / n, 5) for k, v in sorted(by_phase.items())},
                device_s_per_step_by_kind={k: round(v / n, 5) for k, v in sorted(by_kind.items())})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workload", choices=list(WORKLOADS))
    ap.add_argument("case", help="a bench/run.py vramfit case name (recipe, fastest, inbwd, ...)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vramfit-bench-run"))
    ap.add_argument("--skip", type=int, default=2, help="steps run before recording")
    ap.add_argument("--active", type=int, default=3, help="steps recorded")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra overrides")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--memory", action="store_true", help="record the allocator's history, not a profile")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or f"{args.workload}_{args.case}".replace(":", "-")
    w = WORKLOADS[args.workload]
    seed = args.case.startswith("seed:")
    ckpt = TINY_MODELS[w["layout"]] if args.tiny or seed else str(ensure_model(w["layout"], args.work))
    res = TINY_RES if args.tiny else w["res"]
    n_images = max(4, 2 * w["batch"])
    images = make_images(args.work / f"images{res}x{n_images}", n_images, res)
    steps = args.skip + args.active
    config, sets = recipe(args.workload, ckpt, images, args.work, steps, args.tiny)
    run_dir = args.work / "runs" / f"profile-{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = sets + ([] if seed else case_sets(args.workload, args.case)) + args.sets + [
        f"output.dir={run_dir}", "logging.tensorboard=false", "save.name=profile"]

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                     if torch.cuda.is_available() else [])
    trace = args.out / f"{tag}.trace.json.gz"
    walls: list[float] = []

    def ready(prof) -> None:
        prof.export_chrome_trace(str(trace))
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        (args.out / f"{tag}.ops.txt").write_text(
            prof.key_averages().table(sort_by=sort, row_limit=60) + "\n\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))

    if args.memory:
        prof, resets = _NoProfile(), []
        mark_peak_resets(resets)
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES, stacks="python")
    else:
        prof = torch.profiler.profile(activities=acts, schedule=torch.profiler.schedule(
            wait=max(0, args.skip - 1), warmup=1 if args.skip else 0, active=args.active, repeat=1),
            on_trace_ready=ready)
    with prof:
        if args.case.startswith("seed:"):
            rc = _seed_case(args, prof, walls, steps)
        else:
            rc = _vramfit_case(config, sets, args, prof, walls)
    if rc:
        sys.exit(f"vramfit train exited with {rc}")
    if args.memory:
        # the window of the measured steps: vramfit's train phase; the seed's timed steps (its last reset)
        peak = memory_peak(torch.cuda.memory._snapshot(), "seeds.py" if seed else "vramfit", resets,
                           "reset" if seed else "train", kept=MEMORY_ENTRIES)
        if peak["truncated"]:
            log(f"the allocator history overflowed its {MEMORY_ENTRIES} entries: the sums miss what was "
                "allocated before it (fewer --skip/--active steps keep all of it)")
        torch.cuda.memory._record_memory_history(enabled=None)
        # pinned CPU memory as torch's caching host allocator holds it (asked for, and reserved)
        peak.update(workload=args.workload, case=args.case, commit=_commit(), step_wall_s=walls,
                    gpu=torch.cuda.get_device_name(), host_allocator=torch.cuda.host_memory_stats())
        (args.out / f"{tag}.peak.json").write_text(json.dumps(peak, indent=1))
        print(json.dumps({k: peak[k] for k in ("windows", "peak_bytes", "reached_by", "by_own_frame",
                                               "host_allocator")},
                         indent=1)[:6000])
        return
    summary = summarize(trace, walls) if trace.exists() else dict(step_wall_s=walls)
    summary.update(workload=args.workload, case=args.case, sets=sets, commit=_commit(),
                   gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    (args.out / f"{tag}.summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "sets"}, indent=2))


MEMORY_ENTRIES = 3_000_000  # allocator events kept: a few SDXL-sized steps and the load before them


class _NoProfile:
    """Stands in for the profiler while the allocator's history is recorded (and, taking
    torch.profiler.profile's arguments, for bench/host_samples.py's runs)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def step(self) -> None:
        pass


def _frame(frames: list[dict], own: str = "") -> str:
    """The innermost frame whose file name contains `own` ("" for any), as file:line function."""
    for f in frames:
        if own in f["filename"]:
            return f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']} {f['name']}"
    return "(no such frame)"


def _memory_mark(device) -> None:
    """A one-block allocation whose stack names this function: where the run reset its peak
    statistics, found again in the allocator's history (`memory_peak`)."""
    torch.empty(MARK_BYTES, dtype=torch.uint8, device=device)


MARK_BYTES = 512


def mark_peak_resets(labels: list[str]) -> None:
    """Wrap torch.cuda.reset_peak_memory_stats so that each call leaves a mark in the history and
    its label in `labels`: the phase name where vramfit's memory report resets (its `name`),
    else the calling function's name (bench/seeds.py's `reset`)."""
    original = torch.cuda.reset_peak_memory_stats

    def reset(device=None):
        caller = sys._getframe(1)
        labels.append(str(caller.f_locals.get("name", caller.f_code.co_name)))
        original(device)
        _memory_mark(device if device is not None else torch.cuda.current_device())

    torch.cuda.reset_peak_memory_stats = reset


def memory_peak(snapshot: dict, own: str, labels: list[str], window: str, top: int = 40,
                kept: int = 0) -> dict:
    """Where allocated bytes peaked in the recorded history of `snapshot` (torch.cuda.memory._snapshot).
    A block counts from its alloc until its free was requested, as torch's allocated-bytes
    statistic counts it. The history is cut at the marks `mark_peak_resets` left (labelled by
    `labels`, in order; what came before the first is "start"); each piece's peak is reported, and
    for the last piece labelled `window`: the event that reached its peak (its stack), the live
    blocks then summed by the innermost frame of code whose file contains `own` and by the
    innermost frame of any code, and the largest live blocks. The sums can come out below torch's
    own statistic (SD3-M full, step in backward + graphs, `c6fec83`: 4.597 against 4.645 GiB):
    read them for where the memory is, and the bench's row for how much.

    torch keeps the newest `kept` events only (MEMORY_ENTRIES): a history that long, or with fewer
    marks than `labels`, lost its start. Its pieces are then named from the last mark back, and
    `truncated` says that blocks allocated before the kept history (the weights) are missing
    from every sum."""
    events = next((t for t in snapshot["device_traces"] if t), [])
    cuts = [i for i, e in enumerate(events)
            if e["action"] == "alloc" and any(f["name"] == "_memory_mark" for f in e["frames"])]
    truncated = bool(kept and len(events) >= kept) or len(cuts) < len(labels)
    names = ["start"] + list(labels)[:len(cuts)]
    if len(cuts) < len(labels):  # the oldest marks were dropped: the newest ones are the last labels
        names = ["(before the kept history)"] + list(labels)[len(labels) - len(cuts):]
    bounds = list(zip([0] + cuts, cuts + [len(events)]))
    live: dict[int, dict] = {}
    total = 0
    pieces: list[dict] = []
    for name, (lo, hi) in zip(names, bounds):
        best, best_at = total, None
        for i in range(lo, hi):
            e = events[i]
            if e["action"] == "alloc":
                live[e["addr"]] = e
                total += e["size"]
                if total > best:
                    best, best_at = total, i
            elif e["action"] == "free_requested" and e["addr"] in live:
                total -= live.pop(e["addr"])["size"]
        pieces.append(dict(window=name, peak_gib=round(best / 2**30, 4), peak_bytes=best, peak_event=best_at))
    chosen = next((p for p in reversed(pieces) if p["window"] == window), None)
    report = dict(events=len(events), windows=pieces, window=window, truncated=truncated)
    if chosen is None or chosen["peak_event"] is None:
        return dict(report, peak_bytes=None, reached_by=None, by_own_frame={}, by_frame={}, largest=[])
    at = chosen["peak_event"]
    alive: dict[int, dict] = {}  # the live set at the peak: the history replayed once more up to it
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_requested":
            alive.pop(e["addr"], None)

    def summed(key) -> dict[str, float]:
        sums: dict[str, int] = {}
        for e in alive.values():
            name = key(e["frames"])
            sums[name] = sums.get(name, 0) + e["size"]
        return {k: round(v / 2**20, 2) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])[:top]}

    def stack(e: dict, depth: int) -> list[str]:
        return [_frame([f]) for f in e["frames"][:depth]]

    largest = sorted(alive.values(), key=lambda e: -e["size"])[:top]
    return dict(report, peak_bytes=chosen["peak_bytes"], peak_gib=chosen["peak_gib"], peak_event=at,
                reached_by=dict(size=events[at]["size"], stack=stack(events[at], 25)),
                by_own_frame=summed(lambda frames: _frame(frames, own)), by_frame=summed(_frame),
                largest=[dict(mib=round(e["size"] / 2**20, 2), stack=stack(e, 8)) for e in largest])


def _vramfit_case(config, sets: list[str], args, prof, walls: list[float]) -> int:
    """`vramfit train` in this process; the profiler steps at the loop's step boundary."""
    import vramfit.train.loop as loop
    from vramfit.cli import main as vramfit_main

    original, marks = loop._after_step, [time.perf_counter()]

    def after_step(hooks, progress, value, schedule, cfg):
        original(hooks, progress, value, schedule, cfg)
        now = time.perf_counter()
        if progress.step > args.skip:
            walls.append(round(now - marks[-1], 5))
        marks.append(now)
        prof.step()

    loop._after_step = after_step  # the loop looks this name up at each step
    cmd = ["train", "--no-progress"] + ([str(config)] if config else [])
    for s in sets:
        cmd += ["--set", s]
    log("vramfit " + " ".join(cmd))
    try:
        return vramfit_main(cmd)
    except SystemExit as exc:
        return exc.code


def _seed_case(args, prof, walls: list[float], steps: int) -> int:
    """A bench/seeds.py case (seed:fast, seed:seed, ...): its steps, the profiler stepping after each."""
    import seeds

    original, count = seeds.timed_steps, [0]

    def timed(step, n, device):
        def profiled():
            t0 = time.perf_counter()
            step()
            seeds.sync(device)
            count[0] += 1
            if count[0] > args.skip:
                walls.append(round(time.perf_counter() - t0, 5))
            prof.step()  # after the time is taken: the last one writes the trace

        return original(profiled, n, device)

    seeds.timed_steps = timed
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    log(f"seeds {args.workload} {args.case[5:]}")
    seeds.Bench(args.workload, args.tiny, device).run(args.case[5:], steps)
    return 0


def _commit() -> str:
    stamp = ROOT / "COMMIT"
    return stamp.read_text().strip() if stamp.is_file() else "working tree"


if __name__ == "__main__":
    main()
