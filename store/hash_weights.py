"""HATA's trained hash weights as the store keeps them: one row per model and training run, the tensors as bytes.

The store does not read the tensors (`smartgen.selectors.hata.weights_from_bytes` does); it keeps
what made them (model, calibration set, rbit, steps) so `smartgen profiles list` can say so.
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import smartgen

__all__ = ["HashWeightsRecord"]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True, slots=True)
class HashWeightsRecord:
    """One set of HATA hash weights for one model (`weights`: safetensors bytes, tensors "layer.<l>")."""

    model_fingerprint: str
    model: str
    rbit: int
    num_layers: int
    calibration: str
    calibration_hash: str
    num_prompts: int
    steps: int
    weights: bytes
    created_at: str = field(default_factory=_now)
    smartgen_version: str = smartgen.__version__
    id: int | None = None

    def __post_init__(self) -> None:
        if self.rbit < 8 or self.rbit % 8:
            raise ValueError(f"rbit must be a positive multiple of 8, got {self.rbit}")
        if self.num_layers < 1 or self.num_prompts < 1 or self.steps < 0:
            raise ValueError("num_layers and num_prompts must be >= 1, steps >= 0")
        if not self.weights:
            raise ValueError("hash weights are empty")

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        if row["id"] is None:
            del row["id"]
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> HashWeightsRecord:
        return cls(**{**row, "weights": bytes(row["weights"])})

    def with_id(self, record_id: int) -> HashWeightsRecord:
        return replace(self, id=record_id)
