"""The `vramfit` command: parse argv and call the library. No training logic lives here."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from vramfit.config import ConfigError, load_config
from vramfit.formats.safetensors_io import CheckpointError
from vramfit.data.cache import CacheWriteError
from vramfit.models.sources import SourceError
from vramfit.train.loop import NonFiniteLoss

USER_ERRORS = (ConfigError, CheckpointError, SourceError, FileNotFoundError, ValueError, NonFiniteLoss,
               CacheWriteError)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, nargs="?", help="TOML run config (optional: defaults apply)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set train.lr=2e-6 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vramfit", description=(
        "Fine-tune SDXL-family and Stable Diffusion 3 models inside the GPU memory you have."))
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="cache the dataset, train, save a checkpoint and a memory report")
    _add_config_args(p)
    p.add_argument("--resume", metavar="latest|PATH",
                   help="continue from the newest state in output.dir/state (latest) or a state folder")
    p.add_argument("--gpus", type=int, metavar="N", help="train on N GPUs of this machine (data-parallel; "
                   "starts the same command through accelerate launch; docs/multi-gpu.md)")
    p = sub.add_parser("plan", help="predict each phase's peak GPU memory; with --vram (or "
                       "memory.vram_budget) choose the fastest settings that fit")
    _add_config_args(p)
    p.add_argument("--vram", metavar="SIZE", help="GPU memory to plan for, e.g. 8GiB or 7.5GB")
    p = sub.add_parser("cache", help="only scan the dataset and fill the latent and text cache")
    _add_config_args(p)
    p = sub.add_parser("inspect", help="show a checkpoint's family, layout, parameter counts and dtypes")
    p.add_argument("path", help="single file, diffusers folder, repo id or tiny:<name>")
    p.add_argument("--json", action="store_true", help="print JSON")
    from vramfit.generate import add_generate_parser

    add_generate_parser(sub)
    p = sub.add_parser("demo", help="fine-tune tiny:ssd1b on generated images (no arguments needed)")
    p.add_argument("--output", type=Path, default=Path("vramfit-demo"), help="folder for the demo run")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def cmd_train(args) -> int:
    from vramfit.train.setup import train_run

    cfg = load_config(args.config, args.overrides)
    if args.gpus is not None and args.gpus > 1:
        from vramfit.launch import relaunch

        return relaunch(args.gpus, args.argv, cfg)
    result = train_run(cfg, progress=not args.no_progress, resume=args.resume)
    if not result.rank:  # rank 0 speaks for a multi-process run
        print_summary(result)
    if result.loop.interrupted:
        print(f"\nstopped by {result.loop.interrupted}; the training state is saved. Continue with:\n"
              f"  vramfit train {args.config or ''} ... --resume latest   (same --set options)")
        return 130 if result.loop.interrupted == "SIGINT" else 143
    return 0


def print_summary(result) -> None:
    last = f"{result.loop.losses[-1]:.4f}" if result.loop.losses else "-"
    print(f"\ntrained {len(result.loop.losses)} steps on {len(result.scan.items)} images "
          f"({len(result.scan.problems)} skipped); final loss {last}")
    print("\nmemory by phase:\n" + result.report.table())
    print("\ncheckpoints: " + ", ".join(str(p) for p in result.checkpoints))
    print(f"memory report, config and logs: {result.output_dir}")


def cmd_plan(args) -> int:
    from vramfit.memory.model_facts import read_facts
    from vramfit.memory.planner import budget_of, plan_report
    from vramfit.train.setup import cache_root

    cfg = load_config(args.config, args.overrides, need_data=False)
    print(plan_report(cfg, read_facts(cfg, cache_root(cfg)), budget_of(cfg, args.vram)))
    return 0


def cmd_cache(args) -> int:
    from vramfit.memory.accounting import MemoryTracker, pick_device
    from vramfit.memory.planner import fit_to_budget
    from vramfit.train.setup import cache_root, prepare

    cfg = load_config(args.config, args.overrides)
    cfg = fit_to_budget(cfg, cache_root(cfg))  # the budget's VAE and T5 choices are part of the cache keys
    device = pick_device(cfg.train.device)
    tracker = MemoryTracker(device)
    _, _, data, scanned = prepare(cfg, tracker, device, not args.no_progress)
    print(f"{len(scanned.items)} images usable, {len(scanned.problems)} skipped")
    print("cache: " + ", ".join(f"{k} {v}" for k, v in data.stats.items()))
    print("\nmemory by phase:\n" + tracker.report.table())
    return 0


def cmd_inspect(args) -> int:
    from vramfit.config.schema import ModelConfig
    from vramfit.models.registry import detect_family
    from vramfit.models.sources import resolve_source

    source = resolve_source(ModelConfig(path=args.path))
    info = detect_family(source).describe(source)
    info["source"] = {"kind": source.kind, "path": str(source.path),
                      "tokenizers": str(source.tokenizers) if source.tokenizers else None}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{source.path}\n  format: {source.kind}")
    for key, value in info.items():  # family, layout and the architecture facts each family reports
        if key not in ("components", "source"):
            print(f"  {key.replace('_', ' ')}: {value}")
    print(f"  tokenizers: {info['source']['tokenizers'] or 'none found (set model.tokenizers)'}")
    for name, c in info["components"].items():
        dtypes = ", ".join(f"{k} {v:,}" for k, v in c["dtypes"].items())
        print(f"  {name:<24}{c['params']:>16,} params   {dtypes}")
    return 0


def cmd_demo(args) -> int:
    from vramfit.demo import run_demo

    result = run_demo(args.output, steps=args.steps, progress=not args.no_progress)
    print_summary(result)
    return 0


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "cache": cmd_cache, "inspect": cmd_inspect, "demo": cmd_demo}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what `train --gpus N` passes on to each process
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "urllib3", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not args.verbose:  # their dtype and init notices are about our own deliberate choices
        import diffusers
        import transformers

        diffusers.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    try:
        return COMMANDS[args.command](args) if args.command in COMMANDS else args.func(args)
    except USER_ERRORS as exc:
        if args.verbose:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
