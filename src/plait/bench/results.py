"""What one benchmark run measured: the rows the timing loop (:mod:`plait.bench.loop`)
fills and the report (:mod:`plait.bench.report`) prints and saves. They live here, apart
from both, so that neither of those two modules has to import the other for them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Measurement:
    """One backend and mode of one row. ``samples_us``: per-repetition times (rank average)."""

    samples_us: list[float] = field(default_factory=list)
    wrong: int = 0
    skipped: str | None = None

    @property
    def time_us(self) -> float | None:
        return statistics.median(self.samples_us) if self.samples_us else None


@dataclass
class Row:
    op: str
    size: int
    count: int
    dtype: str
    redop: str | None
    root: int | None
    bus_factor: float
    results: dict[str, dict[str, Measurement]]  # backend label -> mode -> measurement
    algorithm: str | None = None

    def algbw(self, time_us: float | None) -> float | None:
        """GB/s (1e9 bytes), nccl-tests' algorithm bandwidth."""
        return None if not time_us else self.size / time_us / 1e3

    def busbw(self, time_us: float | None) -> float | None:
        a = self.algbw(time_us)
        return None if a is None else a * self.bus_factor
