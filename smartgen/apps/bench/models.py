"""The model a benchmark serves: the bundled sample, a folder, or random weights in a deeper shape ("random:32")."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from smartgen.sysinfo import SAMPLES_DIR

__all__ = ["resolve_model", "check_model_spec", "SAMPLE_MODEL", "SAMPLE_MODEL_16"]

SAMPLE_MODEL = SAMPLES_DIR / "sample-model"
SAMPLE_MODEL_16 = SAMPLES_DIR / "sample-model-16"  # 16 layers: layers 0-1 are 1/8 of the KV, as in deep models
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "smartgen" / "bench-models"


def check_model_spec(spec: str) -> int | Path | None:
    """Checks a `--model` value without building anything (a user's typo fails before any node starts): the
    layers of "random:L", the folder of a model folder, None for the bundled samples; ValueError says what is
    wrong."""
    if spec in ("sample", "sample16"):
        return None
    if spec.startswith("random:"):
        try:
            layers = int(spec.partition(":")[2])
        except ValueError:
            raise ValueError(f"--model {spec!r}: write random:LAYERS, e.g. random:32") from None
        if not 2 < layers <= 256:
            raise ValueError(f"--model {spec!r}: between 3 and 256 layers")
        return layers
    folder = Path(spec).expanduser()
    if not (folder / "config.json").exists():
        raise ValueError(
            f"--model {spec!r}: no model folder there (no config.json); or use sample, sample16 or random:LAYERS"
        )
    return folder


def resolve_model(spec: str, seed: int = 0) -> tuple[Path, bool]:
    """(model folder, trained?) for a `--model` value.

    "random:L" is the sample model's shape with L layers and random weights (timing only: its answers
    are noise, so accuracy is not reported); it is built once under $XDG_CACHE_HOME/smartgen.
    """
    checked = check_model_spec(spec)
    if checked is None:
        return (SAMPLE_MODEL if spec == "sample" else SAMPLE_MODEL_16), True
    if isinstance(checked, int):
        return _random_model(checked, seed), False
    return checked, True


def _random_model(layers: int, seed: int) -> Path:
    folder = _cache_dir() / f"random-L{layers}-seed{seed}"
    if (folder / "model.safetensors").exists():
        return folder
    from transformers import AutoConfig

    from smartgen.runtime.models import model_from_config

    config = AutoConfig.from_pretrained(SAMPLE_MODEL, local_files_only=True)
    config.num_hidden_layers = layers
    model = model_from_config(config, seed=seed)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.config._attn_implementation = "sdpa"  # the saved config must load anywhere; SmartGen sets its own
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (SAMPLE_MODEL / name).exists():
            shutil.copy(SAMPLE_MODEL / name, tmp / name)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)  # atomic: a half-written model is never picked up
    return folder
