"""Lanes side by side, unpaced, over 127.0.0.1: write throughput (4 KiB to 4 MiB), scattered blocks, fetch round trip.

    .venv/bin/python bench/lanes.py [--lanes inproc,tcp,mooncake,nixl] [--mib 32] [--blocks 4096]

Each lane gets one link in this process; lanes whose package is missing are listed and
skipped. Ratios are against the TCP lane measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

os.environ.setdefault("UCX_TLS", "tcp,self")  # NIXL over loopback TCP, like the others

from smartgen.lanes import Message, MessageKind, WriteOp  # noqa: E402
from smartgen.lanes.backends import loopback_link, unavailable  # noqa: E402

SIZES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20)
REGION = 64 * 2**20


def write_throughput(prefill, size: int, total: int, clock=time.perf_counter) -> float:
    """GB/s for `total` bytes posted as one-descriptor batches of `size` bytes, pipelined (per second of `clock`)."""
    source = torch.ones(REGION, dtype=torch.uint8)
    count = max(total // size, 4)
    started = clock()
    done = None
    for i in range(count):
        offset = (i * size) % REGION
        done = prefill.push.post_writes("r", {"s": source}, [WriteOp("s", "kv", offset, offset, size)], tag="bench")
    assert done is not None and done.wait(600) and done.applied and prefill.push.flush(600)
    return count * size / (clock() - started) / 1e9


def scattered(prefill, num_blocks: int, block: int = 4096, clock=time.perf_counter) -> tuple[float, float]:
    """One batch of `num_blocks` non-adjacent blocks: (µs per descriptor, GB/s), in seconds of `clock`."""
    source = torch.ones(REGION, dtype=torch.uint8)
    ops = [WriteOp("s", "kv", 2 * i * block, 2 * i * block, block) for i in range(num_blocks)]
    started = clock()
    done = prefill.push.post_writes("r", {"s": source}, ops, tag="bench")
    assert done.wait(600) and done.applied
    elapsed = clock() - started
    return elapsed / num_blocks * 1e6, num_blocks * block / elapsed / 1e9


def fetch_round_trip(prefill, decode, payload_bytes: int, repeat: int = 30) -> float:
    """Median ms from FETCH sent to FETCH_REPLY (K and V of `payload_bytes` together) received."""
    half = torch.ones(payload_bytes // 8, dtype=torch.float32)

    def serve() -> None:
        while (message := prefill.control.recv(timeout=30)) is not None:
            reply = {"k": half, "v": half} if payload_bytes else {}
            prefill.control.send(Message(MessageKind.FETCH_REPLY, message.request_id, message.meta, reply))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    times = []
    for i in range(repeat):
        started = time.perf_counter()
        decode.control.send(Message(MessageKind.FETCH, "r", {"fetch_id": i}, {"positions": torch.arange(16)}))
        reply = decode.control.recv(timeout=30)
        assert reply is not None and reply.meta["fetch_id"] == i
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def run_lane(kind: str, mib: int, num_blocks: int) -> dict[str, float]:
    prefill, decode = loopback_link(kind)
    try:
        decode.push.register_region("kv", torch.zeros(REGION, dtype=torch.uint8))
        decode.push.accept("r")
        row = {f"{size // 1024} KiB": write_throughput(prefill, size, mib * 2**20) for size in SIZES}
        row["scatter us/desc"], row["scatter GB/s"] = scattered(prefill, num_blocks)
        row["fetch 0 ms"] = fetch_round_trip(prefill, decode, 0)
        row["fetch 256K ms"] = fetch_round_trip(prefill, decode, 256 * 1024)
        return row
    finally:
        prefill.close()
        decode.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", default="inproc,tcp,mooncake,nixl", help="comma-separated lane names")
    parser.add_argument("--mib", type=int, default=32, help="MiB written per write size")
    parser.add_argument("--blocks", type=int, default=4096, help="4 KiB blocks in the scattered batch")
    args = parser.parse_args()
    rows = {}
    for kind in args.lanes.split(","):
        reason = unavailable(kind)
        if reason:
            print(f"{kind}: skipped ({reason})")
            continue
        rows[kind] = run_lane(kind, args.mib, args.blocks)
    if not rows:
        return
    columns = list(next(iter(rows.values())))
    print(f"unpaced, 127.0.0.1, {os.cpu_count()} CPUs; writes in GB/s (one descriptor per batch, {args.mib} MiB each)")
    print(f"{'lane':10}" + "".join(f"{c:>17}" for c in columns))
    for kind, row in rows.items():
        print(f"{kind:10}" + "".join(f"{row[c]:>17.3f}" for c in columns))
    if "tcp" in rows:
        print("ratio to tcp (throughput: higher is better; us/desc and ms: lower is better)")
        for kind, row in rows.items():
            print(f"{kind:10}" + "".join(f"{row[c] / rows['tcp'][c]:>17.2f}" for c in columns))


if __name__ == "__main__":
    main()
