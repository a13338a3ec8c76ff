"""What every GPU check shares: its result rows, where it runs (device, time left, progress lines) and a timer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["RESULTS", "Row", "Context", "time_ms", "max_abs_diff"]

RESULTS = ("pass", "fail", "skip")


@dataclass(slots=True)
class Row:
    """One line of the table: what was checked, where, at which shape and dtype, and how it went."""

    check: str
    device: str
    shape: str
    dtype: str
    result: str  # pass | fail | skip
    max_error: float | None = None  # largest |ours - reference| (0 for the copies and index ops: they are exact)
    ref_ms: float | None = None  # the reference's time (the torch reference, HF, a plain copy...; README)
    ours_ms: float | None = None  # SmartGen's time for the same work
    note: str = ""

    def __post_init__(self) -> None:
        if self.result not in RESULTS:
            raise ValueError(f"a row's result is one of {', '.join(RESULTS)}, got {self.result!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Row:
        return cls(**data)


@dataclass(slots=True)
class Context:
    """Where a check runs: CUDA (real shapes) or the CPU half (tiny shapes), the device, a soft deadline, and
    `emit`, which records a row at once (a child killed over its budget keeps the rows it emitted)."""

    cuda: bool
    deadline: float  # time.monotonic() by which the check should be done; a check stops adding shapes past it
    emit: Callable[[Row], None]
    workdir: Path  # a scratch folder of this run (removed after it)
    say: Callable[[str], None] = print

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    @property
    def device_name(self) -> str:
        return "cuda:0" if self.cuda else "cpu"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, row: Row) -> Row:
        self.emit(row)
        self.say(f"  {row.result:<4} {row.check} {row.shape} {row.dtype} {row.note}".rstrip())
        return row

    def over_time(self, check: str, shape: str, dtype: str, reserve_s: float = 0.0) -> bool:
        """True (and a skip row) when less than `reserve_s` is left before the deadline: the shapes left unrun."""
        if self.left() > reserve_s:
            return False
        self.add(Row(check, self.device_name, shape, dtype, "skip", note="no time left in this check's budget"))
        return True


def time_ms(fn: Callable[[], object], cuda: bool, repeat: int) -> float:
    """Median wall time of `fn` in ms over `repeat` runs after one warm-up (CUDA events on the GPU, so the time is
    the kernels', not the launch's)."""
    fn()
    samples = []
    for _ in range(repeat):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
        else:
            began = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - began) * 1e3)
    return statistics.median(samples)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| (in float64: int64 positions and half-precision values alike); inf on a shape mismatch."""
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    return float((a.double() - b.double()).abs().max())
