"""The model a benchmark serves: the bundled sample, a folder, or random weights in a deeper shape ("random:32")."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from smartgen.sysinfo import SAMPLES_DIR

__all__ = ["resolve_model", "SAMPLE_MODEL", "SAMPLE_MODEL_16"]

SAMPLE_MODEL = SAMPLES_DIR / "sample-model"
SAMPLE_MODEL_16 = SAMPLES_DIR / "sample-model-16"  # 16 layers: layers 0-1 are 1/8 of the KV, as in deep models
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "smartgen" / "bench-models"


def resolve_model(spec: str, seed: int = 0) -> tuple[Path, bool]:
    """(model folder, trained?) for a `--model` value.

    "random:L" is the sample model's shape with L layers and random weights (timing only: its answers
    are noise, so accuracy is not reported); it is built once under $XDG_CACHE_HOME/smartgen.
    """
    if spec == "sample":
        return SAMPLE_MODEL, True
    if spec == "sample16":
        return SAMPLE_MODEL_16, True
    if spec.startswith("random:"):
        try:
            layers = int(spec.partition(":")[2])
        except ValueError:
            raise ValueError(f"--model {spec!r}: write random:LAYERS, e.g. random:32") from None
        if not 2 < layers <= 256:
            raise ValueError(f"--model {spec!r}: between 3 and 256 layers")
        return _random_model(layers, seed), False
    folder = Path(spec).expanduser()
    if not (folder / "config.json").exists():
        raise ValueError(
            f"--model {spec!r}: no model folder there (no config.json); or use sample, sample16 or random:LAYERS"
        )
    return folder, True


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
