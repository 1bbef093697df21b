"""Flux.1's activation constants in fit/calibration.json are what their provenance says: the
meta-device count of bench/count_train_memory.py, and the constants it does not settle scaled from
it by SD3-M's fitted over counted figure. (SAMPLE_WORK's count, bench/count_sample_memory.py, is
left out: two more seconds of meta forwards.)"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from vramfit.fit.planner import _CONSTANTS

BENCH = str(Path(__file__).resolve().parent.parent / "bench")


def _bench(module: str):
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(BENCH)


def test_flux_constants_are_its_counts_and_sd3s_relation_to_them():
    """Counted at 512 (the figures are per element: 1024 gives them within 0.6%)."""
    counted = _bench("count_train_memory").count(512, models=("sd3m", "flux1_dev"))
    flux, sd3 = counted["flux1_dev"], counted["sd3m"]
    k, fitted = _CONSTANTS["flux"], _CONSTANTS["sd3"]
    # the double-stream blocks keep more than the single-stream ones: the recompute's is the larger
    assert flux["bytes_per_double_block_input"] > flux["bytes_per_single_block_input"]
    assert k.bf16_block == pytest.approx(flux["bytes_per_block_input"], rel=0.01)
    scale = fitted.all_block / sd3["bytes_per_block_input"]
    assert k.all_block == pytest.approx(flux["bytes_per_block_input"] * scale, rel=0.01)
    scale = fitted.work / sd3["bytes_per_block_input"]
    assert k.work == pytest.approx(flux["bytes_per_double_block_input"] * scale, rel=0.01)
    scale = fitted.lora_block / sd3["bytes_per_block_input_lora"]
    assert k.lora_block == pytest.approx(flux["bytes_per_block_input_lora"] * scale, rel=0.01)
    # a LoRA's frozen linears save no input
    assert flux["bytes_per_block_input_lora"] < 0.6 * flux["bytes_per_block_input"]
