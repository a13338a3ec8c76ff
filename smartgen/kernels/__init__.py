"""smartgen's Triton kernels: split/reorder and KV gather (CUDA path; interpreter on CPU)."""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["use_triton", "triton_available"]


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
