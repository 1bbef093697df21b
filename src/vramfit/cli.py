"""The `vramfit` command: parse argv and call the library. No training logic lives here."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

from tqdm.contrib.logging import logging_redirect_tqdm

from vramfit.config import ConfigError, load_config
from vramfit.config.rules import TRAINED_ENCODERS_KEY

# Start-up: the modules that train, plan or render import torch and diffusers, so the commands
# import them only once the config is read: they took 3.2 of the 3.5 s that reporting a bad config
# took (two idle cores; 8 s and more on busy ones; `python -X importtime -m vramfit train bad.toml`).
# The library's user errors (CheckpointError, SourceError and ResumeError are ValueErrors); the
# others live in torch-heavy modules: user_error() imports them only once an error is met.
USER_ERRORS = (ConfigError, FileNotFoundError, ValueError)
MIN_VRAM = 256 * 2**20  # the smallest GPU `vramfit plan --vram` takes: below it is a typo (10MiB for 10GiB)


def user_error(exc: BaseException) -> bool:
    """Whether `exc` is a user error (printed as one line, exit code 2) rather than a bug."""
    if isinstance(exc, USER_ERRORS):
        return True
    from vramfit.data.cache import CacheWriteError
    from vramfit.formats.safetensors_io import DISK_ERRNOS, OutputWriteError
    from vramfit.train.engine import NonFiniteLoss

    # any other write that found the disk full or read-only names its file (formats/safetensors_io.py)
    return isinstance(exc, (CacheWriteError, OutputWriteError, NonFiniteLoss)) or (
        isinstance(exc, OSError) and exc.errno in DISK_ERRNOS)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, nargs="?", help="TOML run config (optional: defaults apply)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set train.lr=2e-6 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The argument parser; given the `command` about to run, without what only other commands' help
    needs (generate's options and plan's layout names import torch and every model family)."""
    parser = argparse.ArgumentParser(prog="vramfit", description=(
        "Fine-tune SDXL-family, Stable Diffusion 3 and Flux.1 models inside the GPU memory you have."))
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="cache the dataset, train, save a checkpoint and a memory report")
    _add_config_args(p)
    p.add_argument("--resume", metavar="latest|PATH",
                   help="continue from the newest state in output.dir/state (latest) or a state folder")
    p.add_argument("--gpus", type=int, metavar="N", help="train on N GPUs of this machine (data-parallel; "
                   "starts the same command through accelerate launch; docs/multi-gpu.md)")
    p = sub.add_parser("plan", help="predict each phase's peak GPU and host memory; with --vram (or "
                       "memory.vram_budget) choose the fastest settings that fit")
    _add_config_args(p)
    p.add_argument("--vram", metavar="SIZE", help="GPU memory to plan for, e.g. 8GiB or 7.5GB")
    layouts = "see vramfit plan --help"
    if command in (None, "plan"):
        from vramfit.fit.model_facts import shipped_layouts

        layouts = ", ".join(shipped_layouts())
    p.add_argument("--model", metavar="NAME", help="plan for a released architecture from its shipped config "
                   f"instead of model.path, before downloading it: {layouts}")
    p = sub.add_parser("cache", help="only scan the dataset and fill the latent and text cache")
    _add_config_args(p)
    p = sub.add_parser("data", help="preview the datasets: counts, skipped files, buckets, caption lengths, "
                       "a contact sheet; trains nothing")
    _add_config_args(p)
    p.add_argument("--out", type=Path, metavar="PNG",
                   help="the contact sheet's file (default: <output.dir>/data-preview.png)")
    p.add_argument("--html", type=Path, metavar="HTML", help="the report as a self-contained HTML page too")
    p.add_argument("--per-bucket", type=int, default=4, metavar="N",
                   help="images of each bucket on the contact sheet (default 4; 0: no contact sheet)")
    p = sub.add_parser("inspect", help="show a checkpoint's family, layout, parameter counts and dtypes")
    p.add_argument("path", help="single file, diffusers folder, repo id or tiny:<name>")
    p.add_argument("--json", action="store_true", help="print JSON")
    if command in (None, "generate"):
        from vramfit.generate import add_generate_parser

        add_generate_parser(sub)
    _add_lora_parser(sub)
    p = sub.add_parser("demo", help="fine-tune tiny:ssd1b on generated images (no arguments needed)")
    p.add_argument("--output", type=Path, default=Path("vramfit-demo"), help="folder for the demo run")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def _lora_weight(text: str) -> tuple[Path, float]:
    """FILE or FILE:SCALE (a scale that is not a number is refused as argparse refuses types)."""
    path, _, scale = text.rpartition(":") if re.search(r":-?[0-9.]+(e-?[0-9]+)?$", text) else (text, "", "1")
    return Path(path).expanduser(), float(scale)


def _add_lora_parser(sub) -> None:
    lora = sub.add_parser("lora", help="merge a LoRA into a checkpoint, extract one from two checkpoints, "
                          "or resize one to a lower rank")
    tools = lora.add_subparsers(dest="tool", required=True)
    p = tools.add_parser("merge", help="add LoRAs into a checkpoint's weights; saves a single file")
    p.add_argument("model", help="the checkpoint: single file, diffusers folder or tiny:<name>")
    p.add_argument("loras", nargs="+", type=_lora_weight, metavar="LORA[:SCALE]",
                   help="LoRA files (any format vramfit reads), each with an optional scale (default 1)")
    p.add_argument("--out", type=Path, required=True, help="the merged single file to write")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="bf16",
                   help="dtype of the merged denoiser's weights (default bf16)")
    p.add_argument("--tokenizers", help="folder with the tokenizers, where the checkpoint has none beside it")
    p = tools.add_parser("extract", help="a LoRA of a given rank from the difference of two checkpoints (SVD)")
    p.add_argument("base", help="the base checkpoint")
    p.add_argument("tuned", help="the fine-tuned checkpoint of the same model")
    p.add_argument("--rank", type=int, required=True, help="rank of the LoRA")
    p.add_argument("--out", type=Path, required=True, help="the LoRA file to write")
    p.add_argument("--format", action="append", dest="formats", choices=("lora", "lora_kohya"),
                   help="LoRA format(s), the first written to --out, others beside it (default: the family's own)")
    p.add_argument("--device", default="auto", help="where the SVDs run: auto (the GPU if there is one), cpu, cuda")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="bf16", help="dtype of the LoRA's tensors")
    p.add_argument("--min-change", type=float, default=0.0, metavar="X",
                   help="skip layers whose difference is at most X times their weights' norm (default 0)")
    p.add_argument("--tokenizers", help="folder with the tokenizers, where the checkpoints have none beside them")
    p = tools.add_parser("resize", help="re-factor a LoRA at a lower rank (SVD), in its own format")
    p.add_argument("lora", type=Path, help="the LoRA file")
    p.add_argument("--rank", type=int, required=True, help="the new rank")
    p.add_argument("--out", type=Path, required=True, help="the LoRA file to write")
    p.add_argument("--device", default="auto", help="where the SVDs run: auto, cpu, cuda")


def cmd_lora(args) -> int:
    from vramfit import lora_tools

    if args.tool in ("extract", "resize") and args.rank < 1:
        raise ValueError(f"--rank {args.rank}: give a rank of 1 or more")
    for path in [*(p for p, _ in getattr(args, "loras", [])), *([args.lora] if args.tool == "resize" else [])]:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
    if args.tool == "merge":
        result = lora_tools.merge(args.model, args.loras, args.out, args.dtype, args.tokenizers)
        print(f"{args.out}: {sum(result['layers'].values())} layers merged from {len(args.loras)} LoRA file(s)")
    elif args.tool == "extract":
        result = lora_tools.extract(args.base, args.tuned, args.rank, args.out, args.formats or (), args.device,
                                    args.dtype, args.min_change, args.tokenizers)
        left = result["left_out"]
        print(f"{', '.join(result['files'])}: rank {args.rank} on {result['layers']} layers "
              f"({result['unchanged_layers']} unchanged), keeping {100 * result['kept_energy']:.1f}% of the "
              "difference's energy"
              + (f"; {len(left)} layer(s) that differ left out ({100 * sum(v['energy'] for v in left.values()):.1f}%"
                 " of it: no file of this model carries them)" if left else ""))
    else:
        result = lora_tools.resize(args.lora, args.rank, args.out, args.device)
        print(f"{args.out}: {result['resized_layers']} of {result['layers']} layers resized to rank {args.rank}"
              + (f", keeping at least {100 * result['least_kept_energy']:.1f}% of each layer's energy"
                 if result["resized_layers"] else ""))
    return 0


def _named_model_problems(cfg) -> list[str]:
    """models/registry.py named_model_problems, imported once the config has passed the schema."""
    from vramfit.models.registry import named_model_problems

    return named_model_problems(cfg)


def _run_problems(cfg) -> list[str]:
    """What the models and data layers see wrong in a valid config of a command that reads the data:
    the model (models/registry.py) and the datasets (data/datasets.py: folders, kohya configs)."""
    from vramfit.data.datasets import dataset_problems

    return _named_model_problems(cfg) + dataset_problems(cfg) + _optimizer_class_problems(cfg)


def _optimizer_class_problems(cfg) -> list[str]:
    """train.optimizer = "custom": its train.optimizer_class imported now, before any model loads."""
    if cfg.train.optimizer != "custom" or not cfg.train.optimizer_class:
        return []
    from vramfit.optim.wrapped import import_class

    try:
        import_class(cfg.train.optimizer_class)
    except ValueError as exc:
        return [str(exc)]
    return []


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides, model_checks=_run_problems)
    if args.gpus is not None and args.gpus > 1:
        from vramfit.launch import relaunch

        return relaunch(args.gpus, args.argv, cfg)
    from vramfit.run import train_run

    result = train_run(cfg, progress=not args.no_progress, resume=args.resume)
    _ignore_signals()  # the run is done; what is left is to say so
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
    print("\ncheckpoints: " + (", ".join(str(p) for p in result.checkpoints) if result.checkpoints else
                               "none written (stopped before the end)"))
    print(f"memory report, config and logs: {result.output_dir}")


def cmd_plan(args) -> int:
    from vramfit.fit.model_facts import facts_for_layout, read_facts, shipped_layouts
    from vramfit.fit.planner import budget_of, plan_report
    from vramfit.fit.resolve import Environment, resident_by_default, with_automatic_values, with_grad_sums
    from vramfit.models.registry import FAMILIES
    from vramfit.models.sources import ENCODER_PARTS
    from vramfit.train.setup import cache_root

    # --model NAME: the architecture from its shipped config; model.path is not read, nor needed
    try:
        cfg = load_config(args.config, args.overrides, need_data=False, need_model=args.model is None,
                          model_checks=None if args.model else _named_model_problems)
    except ConfigError as exc:
        if not any(p.startswith("model.path:") for p in exc.problems):
            raise
        hint = ("; to plan a released architecture before downloading it: --model "
                + "|".join(shipped_layouts()))
        problems = [p + hint if p.startswith("model.path:") else p for p in exc.problems]
        raise ConfigError(problems, str(args.config or "config")) from None
    env = Environment.detect(cfg)
    cfg = with_automatic_values(cfg, env)  # train.cuda_graphs "auto" on this machine
    budget = budget_of(cfg, args.vram)  # a bad --vram is named before any model file is read
    if args.vram is not None and budget < MIN_VRAM:
        raise ValueError(f"--vram {args.vram} is below the smallest GPU vramfit plans for "
                         f"({MIN_VRAM // 2**20} MiB); give the GPU memory to plan for, e.g. 8GiB")
    if args.model:  # the shipped architecture stands for model.path and the part files beside it
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update=dict.fromkeys(ENCODER_PARTS))})
    facts = facts_for_layout(args.model) if args.model else read_facts(cfg, cache_root(cfg))
    problems = FAMILIES[facts.family].config_problems(cfg)  # what `train` would refuse for this model
    if cfg.model.family not in ("auto", facts.family):
        problems.insert(0, f"model.family: {cfg.model.family}, but --model {args.model} is a "
                           f"{facts.family} model")
    if problems:
        raise ConfigError(problems, f"config for this {facts.family} model")
    if budget is None:  # what `train` decides without a budget (with one, the plan chooses these)
        cfg = with_grad_sums(resident_by_default(cfg), env, facts=facts)
    print(plan_report(cfg, facts, budget))
    return 0


def cmd_cache(args) -> int:
    cfg = load_config(args.config, args.overrides, model_checks=_run_problems)
    from vramfit.memory.accounting import MemoryTracker
    from vramfit.fit.resolve import Environment, resolve
    from vramfit.train.setup import cache_root, prepare

    env = Environment.detect(cfg)
    cfg = resolve(cfg, env, cache_root(cfg))  # the budget's VAE and T5 choices are part of the cache keys
    device = env.device
    tracker = MemoryTracker(device)
    _, _, data, scanned = prepare(cfg, tracker, device, not args.no_progress)
    _ignore_signals()  # the cache is filled; what is left is to say so
    print(f"{len(scanned.items)} images usable, {len(scanned.problems)} skipped")
    print("cache: " + ", ".join(f"{k} {v}" for k, v in data.stats.items()))
    trained = TRAINED_ENCODERS_KEY.get(cfg.text_encoder_training)
    if trained and data.text_part == "frozen text":
        print(f"captions: only T5's outputs are cached ({trained} trains the CLIP encoders, which encode "
              "every caption each step)")
    elif trained:
        print(f"captions not cached: {trained} trains the text encoders, so every caption is encoded each step")
    print("\nmemory by phase:\n" + tracker.report.table())
    return 0


def cmd_data(args) -> int:
    if args.per_bucket < 0:
        raise ValueError(f"--per-bucket {args.per_bucket}: give 0 (no contact sheet) or more images a bucket")
    if args.out is not None and not args.per_bucket:
        raise ValueError(f"--out {args.out} names a contact sheet, which --per-bucket 0 turns off; "
                         "leave one of them out")
    cfg = load_config(args.config, args.overrides, model_checks=_run_problems)
    from vramfit.data.contact_sheet import png_bytes
    from vramfit.train.preview import html_report, preview, sheet_image, text_report, write_file

    progress = not args.no_progress and cfg.logging.progress
    found = preview(cfg, args.per_bucket, progress, name=str(args.config or "config"))
    print(text_report(found))  # first: a file that cannot be written loses none of it
    if args.per_bucket:
        out = args.out or Path(cfg.output.dir).expanduser() / "data-preview.png"
        write_file(out, "--out" if args.out else "output.dir", png_bytes(sheet_image(found)))
        print(f"contact sheet: {out}")
    if args.html:
        write_file(args.html, "--html", html_report(found))
        print(f"HTML report: {args.html}")
    return 0


def cmd_inspect(args) -> int:
    from vramfit.config.schema import ModelConfig
    from vramfit.formats.lora import describe_lora
    from vramfit.models.registry import FAMILIES, detect_family
    from vramfit.models.sources import SourceError, resolve_source

    path = Path(args.path).expanduser()
    repo_id = args.path.startswith("tiny:") or (args.path.count("/") == 1 and not path.suffix)
    if not repo_id and not path.exists():
        raise FileNotFoundError(f"{args.path} does not exist")
    is_file = path.is_file() and path.suffix == ".safetensors"
    lora = describe_lora(path, FAMILIES.values()) if is_file else None
    if lora is not None:
        if args.json:
            print(json.dumps({"kind": "lora", "path": str(path), **lora}, indent=2))
            return 0
        print(f"{path}\n  a LoRA (give it to generate --lora or a LoRA loader; it is not a checkpoint)")
        for key, value in lora.items():
            if key == "targets":
                kinds = ", ".join(f"{k} {n}" for k, n in value["kinds"].items())
                value = f"{value['modules']} modules ({kinds})"
            print(f"  {key.replace('_', ' ')}: {value}")
        return 0
    try:
        source = resolve_source(ModelConfig(path=args.path))
    except SourceError as exc:  # worded for model.path, which inspect's user did not write
        text = str(exc).removeprefix("model.path: ").replace("set model.path to", "give")
        raise SourceError(text) from None
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
    _ignore_signals()  # the run is done; what is left is to say so
    print_summary(result)
    if result.loop.interrupted:
        print(f"\nstopped by {result.loop.interrupted}; the training state is saved in {result.output_dir}. "
              "`vramfit demo` starts the demo over, reusing its images and cache")
        return exit_code(result.loop.interrupted)
    return 0


def cmd_generate(args) -> int:
    from vramfit.generate import generate_device
    from vramfit.train.setup import use_attention_kernels, use_cpu_threads

    # on the CPU, as train.cpu_threads = "auto" does; a --device that cannot be used stops here
    use_cpu_threads("auto", generate_device(args.device))
    use_attention_kernels(generate_device(args.device))
    return args.func(args)


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "cache": cmd_cache, "data": cmd_data,
            "inspect": cmd_inspect, "demo": cmd_demo, "generate": cmd_generate, "lora": cmd_lora}
# What a stop signal leaves behind where the library has not said it (it does for each phase of
# train, cache and demo: train/setup.py Interrupted).
STOPPED = {"train": "while starting: nothing was written", "cache": "while starting: nothing was written",
           "demo": "while starting: run `vramfit demo` again to continue (what it wrote is reused)",
           "plan": "before the plan was done (planning writes nothing)",
           "inspect": "(inspect writes nothing)",
           "lora": "(each file is written whole or not at all)",
           "data": "(the preview writes each of its files whole or not at all)",
           "generate": "before every image was rendered: those whose paths are printed above are kept"}
# Library notices about optional kernels and deprecations, not about the user's run, by the logger
# that emits them: torchao's compiled extras that do not load with this torch build, Triton's
# absence (CPU), and torch's pytree deprecation notice for torchao's enums.
LIBRARY_NOTICES = {"torchao": r"^Failed to load \S+\.so\b", "torchao.kernel.intmm": r"Detected no triton",
                   "torch.utils._pytree": r"is an Enum subclass and is now natively supported"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    program = argv is None  # the process's own command line (the entry point, python -m vramfit)
    argv = list(sys.argv[1:] if program else argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # the top level has flags only
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    args.argv = argv  # what `train --gpus N` passes on to each process
    set_up_logging(args.verbose)
    threads = _torch_threads()  # train.cpu_threads sets them for a run; in-process callers get theirs back
    try:
        with stop_signals(program), logging_redirect_tqdm():  # log lines above progress bars, not in them
            try:
                return COMMANDS[args.command](args)
            except KeyboardInterrupt as exc:  # SIGINT or SIGTERM; the message says what was kept
                _ignore_signals()  # while it says so; stop_signals restores the handlers
                name = exc.args[0] if exc.args else "SIGINT"
                message = exc.args[1] if len(exc.args) > 1 else STOPPED[args.command]
                print(f"\nstopped by {name} {message}", file=sys.stderr)
                return exit_code(name)
            except Exception as exc:
                if args.verbose or not user_error(exc):
                    raise
                print(f"error: {exc}", file=sys.stderr)
                return 2
    finally:
        if threads is not None and _torch_threads() != threads:
            sys.modules["torch"].set_num_threads(threads)


def exit_code(signal_name: str) -> int:
    """The shell's convention: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signal.Signals[signal_name].value


# Frames in which Python ignores an exception ("Exception ignored in ..."): a stop raised there would
# be lost, so the signal is delivered again a moment later, outside them. The import machinery's
# module-lock callback is where a signal during loading lands.
_SWALLOWING = {("<frozen importlib._bootstrap>", "cb"), ("<frozen importlib._bootstrap>", "_get_module_lock")}
REDELIVER_S = 0.05


def _raise_stop(signum, frame) -> None:
    code = frame.f_code if frame is not None else None
    if code is not None and ((code.co_filename, code.co_name) in _SWALLOWING or code.co_name == "__del__"):
        threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum)).start()
        return
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def stop_signals(program: bool = False) -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt(signal name) for the whole command (Python's default
    SIGTERM ends the process without unwinding). The library holds them where it must: the training
    loop finishes its step and saves, a save finishes first (train/setup.py). Afterwards the previous
    handlers return; for the `program` (nothing runs after the command) the signals are ignored
    instead, so that one while the interpreter shuts down does not kill it without a word."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_IGN if program else handler)


def _ignore_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


def _torch_threads() -> Optional[int]:
    torch = sys.modules.get("torch")  # not imported for it: a command that needs torch imports it
    return torch.get_num_threads() if torch is not None else None


class _DropNotice(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def set_up_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "urllib3", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if verbose:
        return
    # diffusers' and transformers' dtype and init notices are about our own deliberate choices; each
    # reads its variable when first imported, and takes the level where it is imported already
    for library in ("diffusers", "transformers"):
        os.environ.setdefault(f"{library.upper()}_VERBOSITY", "error")
        logging.getLogger(library).setLevel(logging.ERROR)
    for name, pattern in LIBRARY_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) for f in logger.filters):
            logger.addFilter(_DropNotice(pattern))


if __name__ == "__main__":
    sys.exit(main())
