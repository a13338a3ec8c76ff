"""Shared pytest set-up: quiet tokenizer threads, and Triton's interpreter on machines without CUDA."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# triton.jit reads TRITON_INTERPRET when a function is decorated, including triton.language's own
# helpers (tl.cumsum's combine function), so it must be set before anything imports triton. It
# only matters where SMARTGEN_FORCE_TRITON=1 too (tests/test_kernels.py); on CUDA the kernels run natively.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
