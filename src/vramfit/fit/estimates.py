"""A prediction by phase, as the planner gives it for GPU memory (fit/planner.py) and the host
prediction for CPU memory (fit/host.py): the two print their own tables of the same shape."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GIB = 2**30
MIB = 2**20


def size_text(n: int) -> str:
    """Bytes as the plan's tables print them: GiB with two decimals, MiB under a tenth of a GiB."""
    return f"{n / GIB:.2f}G" if n >= GIB // 10 else f"{n / MIB:.1f}M"


@dataclass
class PhaseEstimate:
    name: str
    peak: int
    parts: dict[str, int]


@dataclass
class Phases:
    phases: list[PhaseEstimate]

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.phases)

    def phase(self, name: str) -> Optional[PhaseEstimate]:
        return next((p for p in self.phases if p.name == name), None)
