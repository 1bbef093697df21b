"""Host-GPU copy bandwidth of this machine, from pinned memory: to the GPU, back, and both at once
on two streams (what weight streaming uses: memory/offload/weights.py copies units in on one side
stream and stepped values home on another).

A streamed run moves its streamed weights across this link once in forward and once in backward
(plus, for a full fine-tune, the new values home), so bytes / bandwidth is the floor of its step
time however the copies overlap the compute: the figure that says whether a streamed step is bound
by the link or by the GPU. Not run in CI.

usage: python bench/link_bandwidth.py [--out DIR] [--gib 2] [--repeats 10]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def timed(copies, repeats: int) -> float:
    """Seconds of one round of `copies` (callables that queue copies), median of `repeats`."""
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for copy in copies:
            copy()
        for stream in {s for s in (getattr(c, "stream", None) for c in copies) if s is not None}:
            torch.cuda.current_stream().wait_stream(stream)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times[1:])[repeats // 2]  # the first round warms up


class Copy:
    def __init__(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream):
        self.dst, self.src, self.stream = dst, src, stream

    def __call__(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.dst.copy_(self.src, non_blocking=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("link_bandwidth.py measures the host-GPU link: it needs a CUDA GPU")
    n = int(args.gib * 2**30)
    host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_out = torch.empty(n, dtype=torch.uint8, device="cuda")
    side, back = torch.cuda.Stream(), torch.cuda.Stream()
    to_gpu, to_host = Copy(dev_in, host_in, side), Copy(host_out, dev_out, back)
    rows = {"to the GPU": timed([to_gpu], args.repeats), "to the host": timed([to_host], args.repeats),
            "both at once": timed([to_gpu, to_host], args.repeats)}
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "bytes": n,
              "gb_per_s": {name: round(n * (2 if name == "both at once" else 1) / s / 1e9, 1)
                           for name, s in rows.items()}}
    for name, rate in result["gb_per_s"].items():
        print(f"{name:<14}{rate:>8.1f} GB/s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "link_bandwidth.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
