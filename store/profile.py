"""A calibration profile: which KV blocks a selector tends to pick for one model, plus the timings that size K_r.

`Profile` is what `smartgen profile` produces and the store keeps; `to_row`/`from_row` map it
to the `profiles` table, `to_dict`/`from_dict` to the JSON of `smartgen profiles export`.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import json
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

import smartgen
from smartgen.engine.planning import proactive_budget
from smartgen.lanes.rate import transfer_seconds

__all__ = ["Profile", "EXPORT_FORMAT", "EXPORT_VERSION", "importance_to_bytes", "importance_from_bytes"]

EXPORT_FORMAT = "smartgen-profile"
EXPORT_VERSION = 1


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def importance_to_bytes(importance: torch.Tensor) -> bytes:
    """float32 little-endian, row-major: the same bytes on every machine."""
    return importance.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()


def importance_from_bytes(blob: bytes, num_layers: int, num_blocks: int) -> torch.Tensor:
    if len(blob) != 4 * num_layers * num_blocks:
        raise ValueError(f"importance holds {len(blob)} bytes, expected 4 x {num_layers} x {num_blocks}")
    array = np.frombuffer(blob, dtype="<f4").astype(np.float32).reshape(num_layers, num_blocks)
    return torch.from_numpy(array.copy())


@dataclass(frozen=True, slots=True, eq=False)
class Profile:
    """Block importance I[l, m] over M relative blocks for prompts of length [length_lo, length_hi), and T_p / T_t.

    prefill_seconds (T_p) and transfer_seconds (T_t) are for a prompt of `mean_length` tokens;
    both grow with the length, so the per-token values scale them to any request.
    """

    model_fingerprint: str
    model: str
    selector: str
    selector_params: dict[str, Any]
    length_lo: int
    length_hi: int
    calibration: str
    calibration_hash: str
    num_prompts: int
    decode_tokens: int
    mean_length: float
    prefill_seconds: float
    transfer_seconds: float
    kv_bytes_per_token: int
    link: str
    importance: torch.Tensor  # [L, M] float32
    created_at: str = field(default_factory=_now)
    smartgen_version: str = smartgen.__version__
    id: int | None = None

    def __post_init__(self) -> None:
        if self.importance.dim() != 2 or self.importance.dtype != torch.float32:
            raise ValueError(
                f"importance must be a float32 [L, M] tensor, got {self.importance.dtype} {tuple(self.importance.shape)}"
            )
        if self.num_layers < 2 or self.num_blocks < 1:
            raise ValueError(f"importance must be at least [2, 1], got {tuple(self.importance.shape)}")
        if not 1 <= self.length_lo < self.length_hi:
            raise ValueError(f"length range must satisfy 1 <= lo < hi, got [{self.length_lo}, {self.length_hi})")
        if self.mean_length <= 0 or self.prefill_seconds < 0 or self.transfer_seconds < 0:
            raise ValueError("mean_length must be > 0 and T_p, T_t >= 0")
        if self.num_prompts < 1 or self.decode_tokens < 1 or self.kv_bytes_per_token < 1:
            raise ValueError("num_prompts, decode_tokens and kv_bytes_per_token must be >= 1")

    def __eq__(self, other: object) -> bool:
        """Field by field; the importance matrices compare by their bytes (bit-exact, NaN included)."""
        if not isinstance(other, Profile):
            return NotImplemented
        return all(
            importance_to_bytes(self.importance) == importance_to_bytes(other.importance)
            and self.importance.shape == other.importance.shape
            if f.name == "importance"
            else getattr(self, f.name) == getattr(other, f.name)
            for f in fields(self)
        )

    # -- shape and timings ----------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.importance.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.importance.shape[1])

    @property
    def length_range(self) -> str:
        return f"{self.length_lo}-{self.length_hi}"

    @property
    def prefill_seconds_per_token(self) -> float:
        return self.prefill_seconds / self.mean_length

    @property
    def transfer_seconds_per_token(self) -> float:
        return self.transfer_seconds / self.mean_length

    def transfer_seconds_at(self, gbps: float, length: float | None = None) -> float:
        """T_t of a full KV transfer of `length` tokens (default the mean) at `gbps` Gbit/s."""
        tokens = self.mean_length if length is None else length
        return transfer_seconds(self.kv_bytes_per_token * tokens, gbps)

    def k_r(self, gbps: float | None = None) -> int:
        """K_r from the stored T_p and T_t (or T_t at another link rate); scale-free in the prompt length."""
        transfer = self.transfer_seconds if gbps is None else self.transfer_seconds_at(gbps)
        return proactive_budget(self.num_layers, self.num_blocks, self.prefill_seconds, transfer)

    def contains(self, length: int) -> bool:
        return self.length_lo <= length < self.length_hi

    def distance(self, length: int) -> int:
        """Tokens between `length` and this profile's range (0 inside it)."""
        if length < self.length_lo:
            return self.length_lo - length
        return max(0, length - (self.length_hi - 1))

    def with_id(self, profile_id: int) -> Profile:
        return replace(self, id=profile_id)

    # -- rows and JSON ----------------------------------------------------------------
    def to_row(self) -> dict[str, Any]:
        row = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("id", "importance", "selector_params")
        }
        row["selector_params"] = json.dumps(self.selector_params, sort_keys=True)
        row["num_layers"] = self.num_layers
        row["num_blocks"] = self.num_blocks
        row["importance"] = importance_to_bytes(self.importance)
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Profile:
        values = {f.name: row[f.name] for f in fields(cls) if f.name not in ("importance", "selector_params")}
        values["selector_params"] = json.loads(row["selector_params"])
        values["importance"] = importance_from_bytes(row["importance"], row["num_layers"], row["num_blocks"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the importance keeps its exact float32 bytes (base64)."""
        out: dict[str, Any] = {"format": EXPORT_FORMAT, "format_version": EXPORT_VERSION}
        for f in fields(self):
            if f.name not in ("id", "importance"):
                out[f.name] = getattr(self, f.name)
        out["importance"] = {
            "shape": [self.num_layers, self.num_blocks],
            "dtype": "float32",
            "byteorder": "little",
            "base64": base64.b64encode(importance_to_bytes(self.importance)).decode("ascii"),
        }
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Reads `to_dict`'s JSON; a ValueError says what is wrong with it."""
        if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
            raise ValueError(f'not a SmartGen profile export (expected "format": "{EXPORT_FORMAT}")')
        if data.get("format_version") != EXPORT_VERSION:
            raise ValueError(
                f"profile export version {data.get('format_version')!r} is not supported (this SmartGen reads {EXPORT_VERSION})"
            )
        try:
            matrix = data["importance"]
            num_layers, num_blocks = (int(x) for x in matrix["shape"])
            if matrix.get("dtype") != "float32" or matrix.get("byteorder") != "little":
                raise ValueError("importance must be float32, little-endian")
            importance = importance_from_bytes(
                base64.b64decode(matrix["base64"], validate=True), num_layers, num_blocks
            )
            values = {
                f.name: data[f.name] for f in fields(cls) if f.name not in ("id", "importance") and f.name in data
            }
            missing = [
                f.name
                for f in fields(cls)
                if f.name not in ("id", "importance", "created_at", "smartgen_version") and f.name not in data
            ]
            if missing:
                raise ValueError(f"missing fields: {', '.join(missing)}")
            return cls(importance=importance, **values)
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise ValueError(f"bad profile export: {exc}") from None

    def summary(self) -> dict[str, Any]:
        """The scalar fields, for tables and `profiles show`."""
        return {
            "id": self.id,
            "created_at": self.created_at,
            "smartgen_version": self.smartgen_version,
            "model": self.model,
            "model_fingerprint": self.model_fingerprint,
            "selector": self.selector,
            "selector_params": self.selector_params,
            "shape": f"{self.num_layers} x {self.num_blocks}",
            "lengths": f"[{self.length_lo}, {self.length_hi})",
            "mean_length": round(self.mean_length, 1),
            "calibration": self.calibration,
            "calibration_hash": self.calibration_hash,
            "num_prompts": self.num_prompts,
            "decode_tokens": self.decode_tokens,
            "prefill_seconds": self.prefill_seconds,
            "transfer_seconds": self.transfer_seconds,
            "link": self.link,
            "k_r": self.k_r(),
        }


def short(fingerprint: str) -> str:
    """A model fingerprint's first 12 hex digits, as `smartgen profiles list` shows them."""
    return fingerprint[:12]
