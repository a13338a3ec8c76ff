"""Identifies a model for the profile store: a hash of its config and of its weights' names, shapes and sampled values.

Rules (docs/profiles.md says the same):
- Config: `config.to_dict()`, recursively without keys that say how the model was loaded or run
  rather than what it is: every key starting with "_" (`_name_or_path`, `_attn_implementation`,
  `_commit_hash`, ...), and `VOLATILE_KEYS` (dtype, transformers version, output switches, ...).
  Serialised as JSON with sorted keys.
- Weights: every parameter (tied ones once), sorted by name: its name, its shape and
  `SAMPLES_PER_TENSOR` elements at evenly spaced flat positions (first and last included),
  widened to float32 and hashed as little-endian bytes.
- Precision: widening is exact, so a bf16 checkpoint loaded in float32 has the same fingerprint
  as loaded in bf16; a model whose weights were rounded to a narrower type computes with other
  numbers and gets another fingerprint (its profile may still be close; profile it again).
- The device does not matter (values are read on the CPU).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

__all__ = ["VOLATILE_KEYS", "SAMPLES_PER_TENSOR", "model_fingerprint", "config_identity"]

VOLATILE_KEYS = frozenset(
    {
        "dtype",
        "torch_dtype",
        "transformers_version",
        "architectures",  # set by save_pretrained, absent on a model built from a config
        "attn_implementation",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "name_or_path",
    }
)
SAMPLES_PER_TENSOR = 64
FINGERPRINT_VERSION = "1"  # part of the hash: changing the rules must not make old fingerprints collide


def config_identity(config: Any) -> dict[str, Any]:
    """The config as a dict without its volatile keys (recursively, for nested sub-configs)."""

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if not str(k).startswith("_") and k not in VOLATILE_KEYS}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return clean(config.to_dict())


def _sample(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1)
    count = min(SAMPLES_PER_TENSOR, flat.numel())
    if count == 0:
        return b""
    positions = torch.linspace(0, flat.numel() - 1, count, dtype=torch.float64).round().long()
    values = flat[positions.to(flat.device)].to("cpu", torch.float32).numpy()
    return values.astype("<f4").tobytes()


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hex SHA-256 of the model's identity: config without volatile keys, weight names, shapes, sampled values."""
    digest = hashlib.sha256()
    digest.update(f"smartgen-fingerprint-v{FINGERPRINT_VERSION}\n".encode())
    config = getattr(model, "config", None)
    if config is not None:
        digest.update(json.dumps(config_identity(config), sort_keys=True, default=str).encode())
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(f"\n{name}:{list(param.shape)}:".encode())
        digest.update(_sample(param))
    return digest.hexdigest()
