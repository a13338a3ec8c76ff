"""Shared pytest set-up: quiet tokenizer threads, and Triton's interpreter on machines without CUDA."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# triton.jit reads TRITON_INTERPRET when a function is decorated, including triton.language's own
# helpers (tl.cumsum's combine function), so it must be set before anything imports triton. It
# only matters where SMARTGEN_FORCE_TRITON=1 too (tests/test_kernels.py); on CUDA the kernels run natively.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# -- lanes: every contract test runs on every lane this machine has --------------------------------
import pytest  # noqa: E402

# NIXL's UCX backend over loopback TCP: there is no RDMA device here, and shared memory would skip the network
os.environ.setdefault("UCX_TLS", "tcp,self")

LANE_KINDS = ("inproc", "tcp", "mooncake", "nixl", "rdma")


def _available(name: str) -> str:
    from smartgen.lanes.backends import unavailable

    reason = unavailable(name)
    if reason:
        pytest.skip(f"{name} lane unavailable: {reason}")
    return name


@pytest.fixture(params=LANE_KINDS)
def lane_kind(request) -> str:
    """A lane backend by name; skipped, with the reason, where its package or device is missing."""
    return _available(request.param)


@pytest.fixture(params=LANE_KINDS[1:])
def socket_lane_kind(request) -> str:
    """The lanes whose links are made over authenticated sockets (all but in-process)."""
    return _available(request.param)
