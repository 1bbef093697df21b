"""Where the host's time goes in `vramfit train`, on every Python thread: a sampling profiler.

cProfile and torch.profiler's Python tracer see the thread that starts them; the gradient hooks
(the optimizer step inside backward, accumulation's rounded sums) run on autograd's device thread.
This runs bench/trace_steps.py (its profiler off) while a thread reads `sys._current_frames()`
every --interval seconds over the steps after the first --skip, and counts each thread's stacks
(innermost 8 frames) and, per function, the samples it is on the stack of. The sampling thread
takes the GIL at each read (the switch interval is set to 0.1 ms), so steps run slower while it
samples: compare shares, not times. Writes <out>/<tag>.samples.txt. Not run in CI.

usage: python bench/host_samples.py TAG WORKLOAD CASE --out DIR [--interval S] [trace_steps.py options]
"""
from __future__ import annotations

import collections
import runpy
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


class Sampler:
    def __init__(self, interval: float):
        self.interval = interval
        self.stacks: collections.Counter = collections.Counter()
        self.inclusive: collections.Counter = collections.Counter()
        self.per_thread: collections.Counter = collections.Counter()
        self.active, self.done = threading.Event(), threading.Event()

    def run(self) -> None:
        me = threading.get_ident()
        main = threading.main_thread().ident
        while not self.done.is_set():
            time.sleep(self.interval)
            if not self.active.is_set():
                continue
            for tid, frame in sys._current_frames().items():
                if tid != me:
                    self._count("main" if tid == main else f"t{tid % 10000}", frame)

    def _count(self, kind: str, frame) -> None:
        chain = []
        while frame is not None and len(chain) < 40:
            code = frame.f_code
            chain.append(f"{'/'.join(code.co_filename.split('/')[-2:])}:{code.co_name}:{frame.f_lineno}")
            frame = frame.f_back
        self.per_thread[kind] += 1
        self.stacks[(kind, " < ".join(chain[:8]))] += 1
        for function in dict.fromkeys(c.rsplit(":", 1)[0] for c in chain):
            self.inclusive[(kind, function)] += 1

    def report(self, steps: int, wall: float) -> str:
        lines = [f"steps sampled {steps}, wall {wall:.3f} s, per step {wall / max(1, steps):.4f} s, "
                 f"interval {self.interval}", f"samples per thread: {dict(self.per_thread)}", "",
                 "inclusive by function (count, share of its thread's samples):"]
        lines += [f"{c:7d} {c / max(1, self.per_thread[kind]):6.1%} {kind} {fn}"
                  for (kind, fn), c in self.inclusive.most_common(120)]
        lines += ["", "stacks:"] + [f"{c:7d} {kind} {s}" for (kind, s), c in self.stacks.most_common(60)]
        return "\n".join(lines)


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or "--out" not in args:
        raise SystemExit(__doc__.split("usage: ")[1])
    tag = args.pop(0)
    interval = 0.0005
    if "--interval" in args:
        at = args.index("--interval")
        interval = float(args[at + 1])
        del args[at:at + 2]
    out = Path(args[args.index("--out") + 1])
    skip = int(args[args.index("--skip") + 1]) if "--skip" in args else 2
    sampler = Sampler(interval)

    import vramfit.run as run

    run_loop, marks, count = run.run_loop, {}, [0]

    def sampled_loop(*a, **k):
        hooks = k.get("hooks", a[5] if len(a) > 5 else None)  # run_loop(engine, data, schedule, cfg, progress, hooks)
        if hooks is not None:
            earlier = hooks.on_step

            def on_step(step, value, lr):
                count[0] += 1
                if count[0] == skip:
                    marks["start"] = time.perf_counter()
                    sampler.active.set()
                if earlier is not None:
                    earlier(step, value, lr)
            hooks.on_step = on_step
        try:
            return run_loop(*a, **k)
        finally:
            sampler.active.clear()
            marks["end"] = time.perf_counter()

    sys.path.insert(0, str(HERE))
    from trace_steps import _NoProfile  # its stand-in for the profiler, which stays off here

    run.run_loop = sampled_loop
    torch.profiler.profile = _NoProfile
    sys.setswitchinterval(0.0001)
    sys.argv = [str(HERE / "trace_steps.py"), *args]
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    try:
        runpy.run_path(str(HERE / "trace_steps.py"), run_name="__main__")
    finally:
        sampler.done.set()
    text = sampler.report(count[0] - skip, marks.get("end", 0.0) - marks.get("start", 0.0))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.samples.txt").write_text(text)
    print(text[:5000])


if __name__ == "__main__":
    main()
