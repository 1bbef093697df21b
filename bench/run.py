"""The GPU bench: seed recipes and vramfit's own training path, side by side.

For each reference workload it runs, each in a fresh process so that peaks do not mix:
  - the FLOP count of one training step (bench/seeds.py WORKLOAD flops, on the meta device);
  - the seed recipe and the stock "fast" configuration made with stock parts (bench/seeds.py);
  - `python -m vramfit train` on the real architecture with random weights (bench/build.py) and
    a synthetic dataset that vramfit caches itself, once per memory configuration vramfit has:
    the recipe, the recipe with each memory option that exists in RunConfig when the bench runs
    (optimizer inside backward, streamed weights, activation offload, quantized LoRA base; a case
    whose key is absent is listed as skipped), and the fastest configuration (no memory limit).
Per row: peak allocated/reserved in the training phase, median step time (first step left out),
images/s and model FLOP utilization. One JSON per workload under --out (rows of earlier runs of
other cases are kept, so a workload can be split over several commands); bench/report.py renders
them. Not run in CI.

usage: python bench/run.py {ssd1b,sdxl,sd3_lora512,sd3_lora1024,sd3_full,all} --out DIR [--tiny]
           [--cases NAME,...] [--steps N] [--work DIR] [--peak-tflops X]
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from build import ROOT, ensure_model, log, make_images, run_train, train_phase
from report import REF_ROLES
from seeds import SEED_CASES, TINY_RES, WORKLOADS

# Peak dense bf16 matrix rate used for model FLOP utilization, in TFLOP/s. 989 is NVIDIA's
# specification for the H200 SXM (1,979 is the 2:4-sparse figure); the conventional MFU
# denominator. seed-baselines.md divides by about 790 (what dense bf16 matmuls measured on the
# same GPU), so its percentages are 989/790 = 1.25x the ones computed here. --peak-tflops changes it.
H200_DENSE_BF16_TFLOPS = 989.0
TINY_MODELS = {"ssd1b": "tiny:ssd1b", "sdxl": "tiny:sdxl", "sd3m": "tiny:sd3"}


@dataclass
class Case:
    """One vramfit configuration: --set overrides on top of the workload's recipe."""

    name: str
    label: str
    sets: list[str]
    requires: list[str] = field(default_factory=list)  # config keys that must exist in RunConfig
    role: str = "memory_saving"  # or "fastest": no memory limit, compared with the stock fast
    bare: bool = False  # only the workload itself (model, data, batch, mode): vramfit chooses the rest


# memory.vram_budget set to the seed recipe's measured peak: the planner picks the fastest settings
# that fit where the seed fits (the memory-saving target). "{seed_peak}" is filled in at run time.
BUDGET_CASE = Case("budget", "planner at the seed's peak (memory.vram_budget)", ["memory.vram_budget={seed_peak}"],
                   ["memory.vram_budget"], bare=True)


def compiled(case: Case) -> Case:
    """The same configuration with the denoiser's blocks compiled (train.compile)."""
    return Case(f"{case.name}_compile", f"{case.label} + compiled blocks", case.sets + ["train.compile=true"],
                case.requires + ["train.compile"], case.role)


def graphed(case: Case) -> Case:
    """The same configuration with the denoiser's forward and backward replayed as CUDA graphs."""
    return Case(f"{case.name}_graphs", f"{case.label} + CUDA graphs", case.sets + ["train.cuda_graphs=true"],
                case.requires + ["train.cuda_graphs"], case.role)


def partly_checkpointed(case: Case, share: float) -> Case:
    """The same configuration with only a share of the denoiser's blocks checkpointed (a tree from
    before `a895fb2`, whose setting is a bool, fails such a case's config check)."""
    return Case(f"{case.name}_ckpt{round(share * 100)}", f"{case.label}, {share:g} of the blocks checkpointed",
                case.sets + [f"train.gradient_checkpointing={share}"], case.requires, case.role)


FULL_CASES = [
    Case("recipe", "recipe", []),
    Case("inbwd", "recipe + optimizer in backward", ["train.optimizer_in_backward=true"],
         ["train.optimizer_in_backward"]),
    Case("inbwd_offload", "recipe + optimizer in backward + offloaded activations",
         ["train.optimizer_in_backward=true", "memory.offload_activations=true"],
         ["train.optimizer_in_backward", "memory.offload_activations"]),
    Case("stream", "recipe + streamed weights", ["memory.stream_weights=true"], ["memory.stream_weights"]),
    Case("stream_inbwd", "recipe + streamed weights + optimizer in backward",
         ["memory.stream_weights=true", "train.optimizer_in_backward=true"],
         ["memory.stream_weights", "train.optimizer_in_backward"]),
    Case("stream_offload", "recipe + streamed weights + offloaded activations",
         ["memory.stream_weights=true", "memory.offload_activations=true"],
         ["memory.stream_weights", "memory.offload_activations"]),
    Case("rtn", "recipe, round-to-nearest bf16 updates (no stochastic rounding)", ["train.stochastic_rounding=false"],
         ["train.stochastic_rounding"]),
    BUDGET_CASE,
    Case("fastest", "fastest: mixed bf16, AdamW, no checkpointing",
         ["train.precision=mixed_bf16", "train.optimizer=adamw", "train.gradient_checkpointing=false",
          "train.max_grad_norm=0"], role="fastest"),
    # bf16 weights written back with stochastic rounding: no autocast copies, half the optimizer's traffic
    Case("fastest_bf16", "fastest: full bf16 + stochastic rounding, AdamW, no checkpointing",
         ["train.precision=full_bf16", "train.optimizer=adamw", "train.gradient_checkpointing=false",
          "train.max_grad_norm=0"], role="fastest"),
]
LORA_CASES = [
    Case("recipe", "recipe", []),
    *[Case(f"base_{q}", f"recipe + {q} base", [f"lora.base_quantization={q}"], ["lora.base_quantization"])
      for q in ("int8", "fp8", "nf4")],
    Case("stream", "recipe + streamed base", ["memory.stream_weights=true"], ["memory.stream_weights"]),
    Case("inbwd", "recipe + optimizer in backward", ["train.optimizer_in_backward=true"],
         ["train.optimizer_in_backward"]),
    BUDGET_CASE,
    Case("fastest", "fastest: bf16 base, AdamW, no checkpointing",
         ["train.optimizer=adamw", "train.gradient_checkpointing=false", "train.max_grad_norm=0"], role="fastest"),
]
FULL_CASES += [compiled(c) for c in FULL_CASES if c.name in ("recipe", "inbwd", "fastest", "fastest_bf16")]
LORA_CASES += [compiled(c) for c in LORA_CASES if c.name in ("recipe", "base_int8", "base_fp8", "fastest")]
FULL_CASES += [graphed(c) for c in FULL_CASES if c.name in ("recipe", "inbwd", "fastest", "fastest_bf16",
                                                            "recipe_compile", "inbwd_compile", "fastest_compile",
                                                            "stream_inbwd", "inbwd_offload")]
LORA_CASES += [graphed(c) for c in LORA_CASES
               if c.name in ("recipe", "inbwd", "fastest", "base_int8", "base_fp8", "base_nf4", "recipe_compile",
                             "base_int8_compile", "base_fp8_compile", "fastest_compile", "stream")]
# the planner's share model for a UNet in full bf16 at a quarter of the blocks and at none (planner.py
# counts the kept activations with bench/count_train_memory.py; these rows check it)
FULL_CASES += [partly_checkpointed(c, 0.25) for c in FULL_CASES if c.name == "inbwd_graphs"]
FULL_CASES += [Case(f"{c.name}_nockpt", f"{c.label}, no checkpointing", c.sets + ["train.gradient_checkpointing=false"],
                    c.requires, c.role) for c in FULL_CASES if c.name in ("recipe", "inbwd_graphs")]
# a quantized base frees room that activations kept uncheckpointed can take (memory/checkpointing.py)
LORA_CASES += [partly_checkpointed(c, share) for c in LORA_CASES
               if c.name in ("base_int8_graphs", "base_fp8_graphs", "base_nf4_graphs") for share in (0.25, 0.5)]
# Work a run may do besides training that would only cost bench time, switched off where the key exists.
OFF_DURING_BENCH = ["sample.every_steps=0", "memory.fit_probe=false"]
DEFAULT_CASE_SECONDS = {"seed": 30.0, "vramfit": 60.0}  # guesses for --deadline until a case has run
SEED_LABELS = {"seed": "seed recipe", "fused": "seed + Adafactor inside backward", "fast": "stock fast",
               "cached": "seed with latents cached"}


def recipe(workload: str, ckpt: str, images: Path, work: Path, steps: int, tiny: bool) -> tuple[Optional[Path], list[str]]:
    """(config file, overrides) of the workload's recipe as vramfit runs it: the shipped example
    where there is one, batch as the seed, no accumulation, square images, everything cached."""
    sets = workload_sets(workload, ckpt, images, work, steps, tiny)
    w = WORKLOADS[workload]
    if w["kind"] == "unet":
        return ROOT / "examples" / "ssd1b_full_8gb.toml", sets
    if w["mode"] == "lora":
        return ROOT / "examples" / "sd3m_dreambooth_lora.toml", sets
    # SD3-M full fine-tune: no write-up; the SSD-1B recipe's choices (bf16, Adafactor, checkpointing)
    return None, sets + ["train.optimizer=adafactor", "train.lr=4e-7", "train.precision=full_bf16",
                         "train.gradient_checkpointing=true", "train.max_grad_norm=0"]


def workload_sets(workload: str, ckpt: str, images: Path, work: Path, steps: int, tiny: bool) -> list[str]:
    """What defines the workload whatever the configuration: model, data, shape, mode."""
    w = WORKLOADS[workload]
    res = TINY_RES if tiny else w["res"]
    sets = [f"model.path={ckpt}", f"data.path={images}", f"data.resolution={res}", f"data.min_size={res}",
            "data.max_aspect=1.0", f"cache.dir={work / 'cache'}", f"train.steps={steps}",
            f"train.batch_size={w['batch']}", "train.grad_accum=1", "save.every_steps=0"]
    if tiny:
        sets.append("train.device=cpu")
    sets += [s for s in OFF_DURING_BENCH if key_exists(s.partition("=")[0])]
    if w["kind"] == "sd3":
        sets.append("data.instance_prompt=a photo of sks dog")
    if w["mode"] == "lora":  # the write-up's adapter and learning rate
        sets += ["train.mode=lora", "lora.rank=4", "train.lr=1e-4"]
    return sets


def discovered_cases(listed: list[Case]) -> list[Case]:
    """A case for each off-by-default switch of the memory section that no listed case covers
    (options added to vramfit after this bench was written)."""
    from vramfit.config.schema import RunConfig

    section = RunConfig.model_fields.get("memory")
    covered = {s.partition("=")[0] for c in listed for s in c.sets}
    found = []
    for name, f in (section.annotation.model_fields.items() if section else []):
        key = f"memory.{name}"
        if f.annotation is bool and f.default is False and key not in covered:
            found.append(Case(f"mem_{name}", f"recipe + {key}", [f"{key}=true"], [key]))
    return found


def key_exists(dotted: str) -> bool:
    """Whether a config key (section.key) exists in vramfit's RunConfig as installed now."""
    from vramfit.config.schema import RunConfig

    model = RunConfig
    for part in dotted.split("."):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return False
        model = fields[part].annotation
    return True


def config_problem(config: Optional[Path], sets: list[str]) -> Optional[str]:
    from vramfit.config import ConfigError, load_config

    try:
        load_config(config, sets)
    except ConfigError as exc:
        return "; ".join(exc.problems)
    return None


def run_seed(workload: str, case: str, args, timeout: Optional[float] = None) -> dict:
    """bench/seeds.py in a fresh process; its RESULT line, or an error."""
    timeout = timeout or args.timeout
    cmd = [sys.executable, str(ROOT / "bench" / "seeds.py"), workload, case, "--steps", str(args.steps)]
    cmd += ["--tiny"] if args.tiny else []
    try:
        proc = subprocess.run(cmd, text=True, capture_output=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (proc.stdout[-1500:] + proc.stderr[-2500:]).strip() or f"exit {proc.returncode}"}


def seed_row(workload: str, case: str, res: dict) -> dict:
    cases = SEED_CASES[workload]
    role = "seed_ref" if case == cases[0] else "fast_ref" if case == "fast" else "seed_other"
    row = dict(side="seed", case=case, label=SEED_LABELS[case], role=role)
    if "error" in res:
        return dict(row, status="failed", note=res["error"][-600:])
    return dict(row, status="ok", peak_allocated=res["peak_allocated"], peak_reserved=res["peak_reserved"],
                step_s=res["step_s"], step_times=res["step_times"], images_per_step=res["images_per_step"],
                note=res["optimizer"])


def vramfit_row(case: Case, report: dict, images_per_step: int) -> dict:
    row = dict(side="vramfit", case=case.name, label=case.label, role=case.role, sets=case.sets,
               command=report.get("command"), wall_s=report.get("wall_seconds"))
    train = train_phase(report)
    if report.get("error") or train is None:
        return dict(row, status="failed", note=str(report.get("error", "no train phase in the report"))[-1500:])
    gpu = str(report.get("device", "")).startswith("cuda")
    chosen = planner_choice(report.get("log_lines", []))
    if chosen:
        row["note"] = chosen
    return dict(row, status="ok", peak_allocated=train["gpu_peak_allocated"] if gpu else None,
                peak_reserved=train["gpu_peak_reserved"] if gpu else None,
                step_s=round(train["step_seconds"], 4), images_per_step=images_per_step,
                reported_images_per_s=train.get("images_per_second"), phases=report["phases"])


def planner_choice(lines: list[str]) -> Optional[str]:
    """What fit/planner.py logged it chose under memory.vram_budget: its reasons, else its peak line."""
    texts = [line.split(": ", 1)[-1] for line in lines]
    start = next((i for i, t in enumerate(texts) if t.startswith("memory.vram_budget")), None)
    if start is None:
        return None
    reasons = [t.strip().split(":")[0].replace(" = ", "=") for t in texts[start + 1:] if t.startswith("  ")]
    return "chose " + ", ".join(reasons) if reasons else texts[start]


def add_rates(row: dict, flops: dict, peak_tflops: float, cuda: bool) -> dict:
    """images/s and model FLOP utilization (counted FLOPs of one step / step time / peak rate)."""
    if row.get("status") != "ok" or not row.get("step_s"):
        return row
    row["images_per_s"] = round(row["images_per_step"] / row["step_s"], 3)
    tflop = flops.get("train_tflop")
    row["mfu"] = round(tflop / row["step_s"] / peak_tflops, 4) if tflop and cuda else None
    return row


class GroupRun:
    """One workload: its JSON (merged with rows of earlier runs), written after every case."""

    def __init__(self, workload: str, args):
        self.w, self.args = workload, args
        self.path = args.out / f"{workload}.json"
        old = json.loads(self.path.read_text()) if self.path.exists() else {}
        keep = old.get("tiny") == args.tiny and old.get("rows")
        self.rows: list[dict] = [r for r in old.get("rows", [])] if keep else []
        self.data = dict(workload=workload, **WORKLOADS[workload], tiny=args.tiny, steps=args.steps,
                         peak_tflops=args.peak_tflops, **environment(args.tiny))
        if keep and old.get("references"):
            self.data["references"] = old["references"]
        self.walls: dict[str, list[float]] = {}  # seconds each case of a kind took in this command

    def selected(self, name: str) -> bool:
        return not self.args.cases or name in self.args.cases

    def run_case(self, name: str, kind: str, measure) -> None:
        """measure(timeout) -> row, when --deadline leaves time for a case as long as the longest of its
        kind so far (else the case is listed in not_run, for a later command)."""
        left = self.args.deadline - (time.time() - self.args.t0) if self.args.deadline else None
        need = max(self.walls.get(kind, []), default=DEFAULT_CASE_SECONDS[kind])
        if left is not None and left < need:
            self.data.setdefault("not_run", []).append(name)
            log(f"{self.w} {kind} {name}: not run, {left:.0f} s left of --deadline and a {kind} case takes ~{need:.0f} s")
            return
        t0 = time.time()
        self.put(measure(self.args.timeout if left is None else max(30.0, min(self.args.timeout, left - 10))))
        self.walls.setdefault(kind, []).append(time.time() - t0)

    def put(self, row: dict) -> None:
        row = add_rates(row, self.data.get("flops", {}), self.args.peak_tflops, not self.args.tiny and
                        self.data.get("gpu") is not None)
        row = dict(row, commit=self.data.get("commit"), src_digest=self.data.get("src_digest"), date=self.data.get("date"),
                   machine=self.data.get("machine"))
        for old in self.rows:  # a reference replaced keeps judging the rows of its own machine (report.py)
            if (old["side"], old["case"]) == (row["side"], row["case"]) and old.get("role") in REF_ROLES \
                    and old.get("status") == "ok" and old.get("date") != row.get("date"):
                self.data.setdefault("references", []).append(old)
        self.rows = [r for r in self.rows if (r["side"], r["case"]) != (row["side"], row["case"])] + [row]
        self.write()
        brief = {k: row.get(k) for k in ("status", "step_s", "images_per_s", "mfu", "peak_allocated")}
        log(f"{self.w} {row['side']} {row['case']}: {brief}" + (f" ({row.get('note', '')[:300]})"
                                                                 if row["status"] != "ok" else ""))

    def write(self) -> None:
        order = {"seed": 0, "vramfit": 1}
        self.data["rows"] = sorted(self.rows, key=lambda r: order[r["side"]])
        self.path.write_text(json.dumps(self.data, indent=2))


def gpu_name() -> Optional[str]:
    """The GPU's name from nvidia-smi: this process never creates a CUDA context of its own."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0] if out else None


def environment(tiny: bool) -> dict:
    import torch

    stamp = ROOT / "COMMIT"  # a source snapshot (git archive, no .git) carries its commit in this file
    if stamp.is_file() and not (ROOT / ".git").exists():
        commit = stamp.read_text().strip()
    else:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True, text=True,
                               cwd=ROOT).stdout
        commit += "+dirty" if dirty.strip() else ""
    return dict(commit=commit, src_digest=src_digest(ROOT / "src"), torch=torch.__version__,
                gpu=None if tiny else gpu_name(), machine=machine_id(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def src_digest(src: Path) -> str:
    """A digest of the project's source as it ran (every .py file under `src`, by path and bytes),
    which names the code of a row where the commit cannot: a working tree copied to the GPU
    machine may carry git metadata older than its files. `git archive COMMIT src | ...` of the
    commit that holds the same files gives the same digest."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted(src.rglob("*.py")):
        h.update(path.relative_to(src).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def machine_id() -> str:
    """Which machine and boot this ran on: rows are judged against references from the same one
    (bench/report.py), since lent machines of one GPU kind differ in host speed."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "?"
    return f"{platform.node()}/{boot}"


def run_workload(workload: str, args) -> Path:
    w = WORKLOADS[workload]
    group = GroupRun(workload, args)
    log(f"== {workload}: {w['title']}{' (tiny, CPU)' if args.tiny else ''}")
    ckpt = TINY_MODELS[w["layout"]] if args.tiny else str(ensure_model(w["layout"], args.work))
    res = TINY_RES if args.tiny else w["res"]
    n_images = max(4, 2 * w["batch"])
    images = make_images(args.work / f"images{res}x{n_images}", n_images, res)
    flops = run_seed(workload, "flops", args)
    if "error" in flops:
        log(f"FLOP count failed: {flops['error'][-500:]}")
    else:
        log(f"one training step: {flops['train_tflop']:.4g} TFLOP (forward {flops['fwd_tflop']:.4g}), "
            f"counted on {flops['counted_on']}")
    group.data["flops"] = flops
    if not args.tiny and not group.data["gpu"]:
        group.data["gpu"] = flops.get("gpu")  # no nvidia-smi: the name CUDA gave the counting process
    for case in SEED_CASES[workload]:
        if group.selected(case):
            log(f"{workload} seed {case} ...")
            group.run_case(case, "seed", lambda timeout, c=case: seed_row(workload, c, run_seed(workload, c, args, timeout)))
    recipe_cfg = recipe(workload, ckpt, images, args.work, args.steps, args.tiny)
    bare = workload_sets(workload, ckpt, images, args.work, args.steps, args.tiny)
    listed = LORA_CASES if w["mode"] == "lora" else FULL_CASES
    # The recipe, the planner and the fastest first: under --deadline the options are the ones left out.
    first = [c for c in listed if c.name in ("recipe", "budget") or c.role == "fastest"]
    for case in first + [c for c in listed + discovered_cases(listed) if c not in first]:
        if group.selected(case.name):
            config, base = (None, bare) if case.bare else recipe_cfg
            sets = base + eager_unless_graphed(case) + fill(case.sets, group, args.tiny)
            group.run_case(case.name, "vramfit",
                           lambda timeout, c=case, cf=config, s=sets: run_vramfit_case(workload, c, cf, s, args, timeout))
    group.write()
    if group.data.get("not_run"):
        log(f"{workload}: not run for lack of time: {', '.join(group.data['not_run'])}; run them with\n"
            f"  python bench/run.py {workload} --out DIR --cases {','.join(group.data['not_run'])}")
    return group.path


def eager_unless_graphed(case: Case) -> list[str]:
    """train.cuda_graphs=false for a case that does not ask for graphs: on a GPU vramfit records
    them by default (train.cuda_graphs = "auto"), and the rows without "+ CUDA graphs" in their
    label measure the configuration without them. The planner's case chooses for itself."""
    if case.bare or any(s.startswith("train.cuda_graphs=") for s in case.sets):
        return []
    return ["train.cuda_graphs=false"]


def fill(sets: list[str], group: GroupRun, tiny: bool) -> list[str]:
    """Put the seed recipe's measured peak where a case asks for it ({seed_peak})."""
    if not any("{seed_peak}" in s for s in sets):
        return sets
    seed = next((r for r in group.rows if r["role"] == "seed_ref" and r.get("peak_allocated")), None)
    peak = "1GiB" if tiny else f"{seed['peak_allocated'] // 2**20}MiB" if seed else None
    return [s.replace("{seed_peak}", peak) if peak else s for s in sets]


def run_vramfit_case(workload: str, case: Case, config: Optional[Path], sets: list[str], args,
                     timeout: float) -> dict:
    skipped = dict(side="vramfit", case=case.name, label=case.label, role=case.role, sets=case.sets,
                   status="skipped")
    missing = [k for k in case.requires if not key_exists(k)]
    if missing:
        return dict(skipped, note="not in this vramfit: " + ", ".join(missing))
    if any("{seed_peak}" in s for s in sets):
        return dict(skipped, note="needs the seed recipe's GPU peak: run the seed case in the same command")
    problem = config_problem(config, sets)
    if problem:
        return dict(skipped, note="config refused: " + problem)
    log(f"{workload} vramfit {case.name} ...")
    run_dir = args.work / "runs" / f"{workload}-{case.name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    report = run_train(config, sets, run_dir, timeout=timeout, echo=args.verbose)
    if not args.keep_runs:  # states and checkpoints of a full fine-tune are many GB each
        shutil.rmtree(run_dir, ignore_errors=True)
    return vramfit_row(case, report, WORKLOADS[workload]["batch"])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("group", choices=[*WORKLOADS, "all"])
    ap.add_argument("--out", type=Path, required=True, help="folder for <workload>.json")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU, in seconds (a smoke test)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vramfit-bench-run"),
                    help="models, images, cache and run folders (reused on a warm machine)")
    ap.add_argument("--steps", type=int, default=8, help="steps per case; the first is left out of the median")
    ap.add_argument("--cases", type=lambda s: set(s.split(",")), default=None,
                    help="only these case names (seed: seed,fused,fast,cached; vramfit: recipe,inbwd,stream,...)")
    ap.add_argument("--peak-tflops", type=float, default=H200_DENSE_BF16_TFLOPS,
                    help=f"the GPU's peak dense bf16 rate for MFU (default {H200_DENSE_BF16_TFLOPS:g}, H200 spec)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per case before it counts as failed")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from the start this command may take (e.g. 570 under a 10-minute limit): a case "
                    "that would not end in time is left out and named, for a second command")
    ap.add_argument("--keep-runs", action="store_true", help="keep vramfit's output folders")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each vramfit run's output")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = args.t0 = time.time()
    paths = [run_workload(w, args) for w in (WORKLOADS if args.group == "all" else [args.group])]
    from report import render_tables

    print(render_tables([json.loads(p.read_text()) for p in paths]))
    log(f"done in {time.time() - t0:.0f} s; JSON in {args.out}")


if __name__ == "__main__":
    main()
