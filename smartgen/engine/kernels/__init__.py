"""smartgen's Triton kernels: split/reorder and KV gather (CUDA path; interpreter on CPU), when they run, and
the split's result type shared with their PyTorch references in `engine.index_ops`."""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

__all__ = ["use_triton", "triton_available", "IndexSplit"]


class IndexSplit(NamedTuple):
    """A KV index reordered remote-first, with the mask value of each entry."""

    # a field named `index` shadows tuple.index (never called on an IndexSplit); renaming it would change the API
    index: torch.Tensor  # type: ignore[assignment]  # [R, k] int64: remote entries, then local, then padding (stable)
    status: torch.Tensor  # [R, k] int8: mask value of each reordered entry
    num_remote: torch.Tensor  # [R] int32
    num_local: torch.Tensor  # [R] int32


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when triton imports cleanly (it is absent on macOS and on some CPU installs)."""
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install raises more than ImportError; the torch path still works
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """True when `t`'s op should run as a Triton kernel: on CUDA, or on CPU when forced under the interpreter.

    CPU runs need SMARTGEN_FORCE_TRITON=1 and TRITON_INTERPRET=1, both set before the
    kernel modules are imported (triton.jit reads TRITON_INTERPRET at decoration time).
    """
    # Cheap checks first: importing triton costs ~0.3 s, and a CPU tensor rarely needs it.
    if not t.is_cuda and not (
        os.environ.get("SMARTGEN_FORCE_TRITON") == "1" and os.environ.get("TRITON_INTERPRET") == "1"
    ):
        return False
    return triton_available()
