"""memory/offload/staging.py: gradients added into sums at home through a few kept sheets, by a
worker thread (on the CPU here: the copy into a sheet is a plain one)."""
from __future__ import annotations

import pytest
import torch

from vramfit.memory.offload.staging import StagedSums


def test_sums_equal_plain_additions_through_three_sheets():
    """Many gradients of several units, over two micro-batches: each sum equals the plain sum (the
    first copied in, fp32 sums of bf16 gradients), while no more than three sheets are ever made."""
    torch.manual_seed(0)
    units = [[torch.randn(4, 8).bfloat16() for _ in range(3)] for _ in range(5)]
    sums = [[torch.full((4, 8), float("nan")) for _ in unit] for unit in units]  # copied over first
    staged = StagedSums({torch.bfloat16: 3 * 32}, back=None, sheets=3)
    expect = [[torch.zeros(4, 8) for _ in unit] for unit in units]
    for micro in range(2):
        for u, unit in enumerate(units):
            for i, g in enumerate(unit):
                grad = g * (micro + 1)
                staged.add(sums[u][i], grad, owner=u, first=micro == 0)
                expect[u][i] += grad.float()
        staged.wait()
    assert len(staged.sheets) == 3 and staged.nbytes() == 3 * 3 * 32 * 2
    for u in range(len(units)):
        for i in range(3):
            assert torch.equal(sums[u][i], expect[u][i])


def test_a_sheet_holds_one_unit_and_refuses_a_gradient_larger_than_it():
    """A new unit's gradient starts a new sheet even where the current one has room; a gradient
    larger than a sheet is refused with the sizes named."""
    staged = StagedSums({torch.float32: 100}, back=None, sheets=2)
    a, b = torch.zeros(10), torch.zeros(10)
    staged.add(a, torch.ones(10), owner="first", first=True)
    staged.add(b, torch.ones(10), owner="second", first=True)
    staged.wait()
    assert len(staged.sheets) == 2 and torch.equal(a, torch.ones(10)) and torch.equal(b, torch.ones(10))
    with pytest.raises(ValueError, match="does not fit a sheet"):
        staged.add(torch.zeros(101), torch.ones(101), owner="third", first=True)


def test_an_addition_that_fails_is_raised_at_the_wait_and_drop_clears():
    """The worker's error comes back to the caller; after `drop` the sheets are free again."""
    staged = StagedSums({torch.float32: 10}, back=None, sheets=2)
    staged.add(torch.zeros(3), torch.ones(4), owner=0, first=False)  # 3 += 4 values: the worker fails
    with pytest.raises(RuntimeError):
        staged.wait()
    staged.add(torch.zeros(4), torch.ones(4), owner=0, first=False)
    staged.drop()
    total = torch.zeros(4)
    staged.add(total, torch.ones(4), owner=1, first=False)
    staged.wait()
    assert torch.equal(total, torch.ones(4))
