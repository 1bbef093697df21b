"""`vramfit train --gpus N`: start the same command on N processes through `accelerate launch`.

The command line is passed through unchanged except for `--gpus`; each process then finds itself
in a launched world (train/distributed.py). The config is checked for what does not compose with
several processes before anything starts. Without CUDA the processes run on CPU cores (gloo), which
is how the tests exercise it.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Sequence

import torch

from vramfit.config.load import ConfigError
from vramfit.config.schema import RunConfig
from vramfit.train.distributed import composition_problems


def without_gpus(argv: Sequence[str]) -> list[str]:
    """`argv` with its --gpus N (or --gpus=N) taken out."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--gpus":
            skip = True
        elif not arg.startswith("--gpus="):
            out.append(arg)
    return out


def _free_port() -> int:
    # Each launch gets its own rendezvous port, so two runs on one machine do not meet each other.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(n: int, argv: Sequence[str]) -> list[str]:
    """The `accelerate launch` command that runs `vramfit <argv>` on n processes of this machine."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(n),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(_free_port()), "-m", "vramfit", *without_gpus(argv)]


def relaunch(n: int, argv: Sequence[str], cfg: RunConfig) -> int:
    """Check `cfg` for n processes, then run `vramfit <argv>` on n processes and wait; returns the
    launcher's exit status."""
    problems = composition_problems(cfg, n)
    if problems:
        raise ConfigError(problems, f"config for --gpus {n}")
    if os.environ.get("WORLD_SIZE"):
        raise ValueError("--gpus: this process was already started by a launcher; drop --gpus")
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise ValueError(f"--gpus {n}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # n processes share the cores; torch's default oversubscribes
    return subprocess.call(launch_command(n, argv), env=env)
