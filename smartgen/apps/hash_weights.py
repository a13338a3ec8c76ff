"""HATA's hash weights for a model: trained on a calibration set and kept in the profile store beside its profiles.

`smartgen profile --selector hata` calls `ensure_hash_weights` before profiling; `smartgen eval` and
`smartgen serve` read the newest weights of the model with `stored_hash_weights`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from smartgen.apps.profiling import CalibrationSet, tokenize_calibration
from smartgen.runtime.fingerprint import model_fingerprint
from smartgen.runtime.models import model_info
from smartgen.runtime.prefill import capture_qk
from smartgen.selectors.hata import HashWeights, weights_from_bytes, weights_to_bytes
from smartgen.selectors.hata_train import HashTrainingConfig, train_hash_weights
from smartgen.store import HashWeightsRecord, ProfileStore

__all__ = ["DEFAULT_PROMPTS", "train_for_model", "stored_hash_weights", "ensure_hash_weights"]

DEFAULT_PROMPTS = 24  # samples/sample-model/hata_weights.safetensors was trained on 24 calibration prompts


def train_for_model(
    model,
    tokenizer: Any,
    calibration: CalibrationSet,
    *,
    num_prompts: int = DEFAULT_PROMPTS,
    config: HashTrainingConfig | None = None,
    on_progress: Callable[[int, float], None] | None = None,
) -> tuple[HashWeights, int]:
    """Weights trained on the first `num_prompts` calibration prompts (HATA's loss), and how many were used."""
    ids = tokenize_calibration(tokenizer, calibration)[:num_prompts]
    if not ids:
        raise ValueError(f"the calibration set {calibration.name} has no prompts to train HATA's hash weights on")
    captured = (capture_qk(model, prompt) for prompt in ids)
    return train_hash_weights(model_info(model), captured, config, on_progress), len(ids)


def stored_hash_weights(store: ProfileStore, model, rbit: int | None = None) -> tuple[int, HashWeights] | None:
    """(id, weights) of the newest hash weights stored for `model` (of `rbit` bits if given), or None."""
    record = store.hash_weights(model_fingerprint(model), rbit)
    if record is None or record.id is None:
        return None
    return record.id, weights_from_bytes(record.weights)


def ensure_hash_weights(
    store: ProfileStore,
    model,
    tokenizer: Any,
    calibration: CalibrationSet,
    *,
    retrain: bool = False,
    num_prompts: int = DEFAULT_PROMPTS,
    config: HashTrainingConfig | None = None,
    model_name: str = "",
    on_progress: Callable[[int, float], None] | None = None,
) -> tuple[int, HashWeights, bool]:
    """(id, weights, trained now): the store's newest for the model and rbit, else trained here and stored."""
    config = config or HashTrainingConfig()
    found = None if retrain else stored_hash_weights(store, model, config.rbit)
    if found is not None:
        return found[0], found[1], False
    weights, used = train_for_model(
        model, tokenizer, calibration, num_prompts=num_prompts, config=config, on_progress=on_progress
    )
    record = HashWeightsRecord(
        model_fingerprint=model_fingerprint(model),
        model=model_name or str(getattr(model.config, "_name_or_path", "") or model.config.model_type),
        rbit=config.rbit,
        num_layers=len(weights),
        calibration=calibration.name,
        calibration_hash=calibration.sha256,
        num_prompts=used,
        steps=config.steps,
        weights=weights_to_bytes(weights),
    )
    return store.add_hash_weights(record), weights, True
