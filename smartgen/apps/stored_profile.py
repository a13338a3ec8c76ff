"""The stored profile a run needs: looked up in the profile store, made once (calibration set) when missing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ensure_profile"]


def ensure_profile(
    model_path: Path,
    db: Path | None,
    selector: str,
    budget: float,
    blocks: int,
    length: int,
    *,
    calibration: Path | None = None,
    prompts: int = 8,
    say: Callable[[str], None] = print,
) -> tuple[Any, Any, Any]:
    """(profile, model, tokenizer): the store's profile for this model, selector, M and prompt length.

    A model without one is profiled first on `prompts` calibration prompts of length/2 to 2·length
    tokens (default: samples/calibration.jsonl) and the profile stored, so later runs reuse it.
    """
    from transformers import AutoTokenizer

    from smartgen.apps.profiling import LinkSpec, load_calibration, profile
    from smartgen.runtime.fingerprint import model_fingerprint
    from smartgen.runtime.models import load_model
    from smartgen.store import NoProfileError, ProfileStore
    from smartgen.sysinfo import SAMPLES_DIR

    store = ProfileStore(db)  # a bad database fails now, before the model loads
    model = load_model(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    fingerprint = model_fingerprint(model)
    try:
        return store.best(fingerprint, selector, blocks, length).profile, model, tokenizer
    except NoProfileError:
        pass
    calibration = calibration or SAMPLES_DIR / "calibration.jsonl"
    say(f"no profile for {model_path.name} yet: profiling {prompts} calibration prompts ({calibration.name})")
    low, high = max(1, length // 2), length * 2
    profiles = profile(
        model,
        tokenizer,
        load_calibration(calibration),
        selector,
        {"budget": budget},
        num_blocks=blocks,
        length_ranges=[(low, high)],
        decode_tokens=8,
        link=LinkSpec("rate", 15.0),
        limit=prompts,
        model_name=model_path.name,
    )
    if not profiles:
        raise RuntimeError(f"no calibration prompt of {calibration} falls in {low}-{high} tokens")
    store.add(profiles[0])
    return profiles[0], model, tokenizer
