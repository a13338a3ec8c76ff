"""Shared pytest set-up: quiet tokenizer threads; TRITON_INTERPRET is left to tests/test_kernels.py."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
