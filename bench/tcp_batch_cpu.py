"""CPU time per batch of the TCP lane, both ends in one process: one-descriptor writes and one scattered batch.

    .venv/bin/python bench/tcp_batch_cpu.py [--runs 5] [--batches 4000] [--blocks 4096] [--profile]

CPU time (`time.process_time`, every thread of the process: sender, receiver, ACKs) is far less
sensitive to other jobs on the machine than wall time, so small per-batch changes show. Each run
uses a fresh loopback link; the median over runs is printed. `--profile` prints a cProfile of the
4 KiB loop instead (every thread's calls: the profiler is installed with `threading.setprofile`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import threading
import time

import torch
from lanes import REGION, scattered, write_throughput  # bench/lanes.py, beside this script

from smartgen.lanes.tcp_link import loopback_tcp_link


def _link():
    prefill, decode = loopback_tcp_link()
    decode.push.register_region("kv", torch.zeros(REGION, dtype=torch.uint8))
    decode.push.accept("r")
    return prefill, decode


def one_descriptor(size: int, batches: int) -> float:
    """µs of process CPU per pipelined one-descriptor batch of `size` bytes."""
    prefill, decode = _link()
    try:
        write_throughput(prefill, size, 64 * size)  # warm up: first frames, allocator, socket buffers
        return size / write_throughput(prefill, size, batches * size, clock=time.process_time) / 1e3
    finally:
        prefill.close()
        decode.close()


def scattered_cpu(num_blocks: int) -> float:
    """µs of process CPU per descriptor of one batch of `num_blocks` non-adjacent 4 KiB blocks."""
    prefill, decode = _link()
    try:
        scattered(prefill, num_blocks)  # warm up
        return scattered(prefill, num_blocks, clock=time.process_time)[0]
    finally:
        prefill.close()
        decode.close()


def profile(size: int, batches: int, sort: str = "tottime") -> None:
    # cProfile hooks only the thread that enables it: every lane thread runs under its own profiler
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    profilers: list[cProfile.Profile] = [profiler]
    original = threading.Thread.run

    def run(self) -> None:
        own = cProfile.Profile(time.thread_time)  # CPU, not time spent blocked
        profilers.append(own)
        own.enable()
        try:
            original(self)
        finally:
            own.disable()

    threading.Thread.run = run  # type: ignore[method-assign]
    try:
        one_descriptor(size, batches)
    finally:
        threading.Thread.run = original  # type: ignore[method-assign]
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profilers[0], stream=out)
    for own in profilers[1:]:
        stats.add(own)
    stats.sort_stats(sort).print_stats(40)
    print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batches", type=int, default=4000, help="one-descriptor batches per run")
    parser.add_argument("--blocks", type=int, default=4096, help="4 KiB blocks in the scattered batch")
    parser.add_argument("--profile", action="store_true", help="cProfile the 4 KiB loop instead")
    args = parser.parse_args()
    if args.profile:
        profile(4096, args.batches)
        return
    results: dict[str, list[float]] = {"4 KiB us/batch": [], "64 KiB us/batch": [], "scatter us/desc": []}
    for _ in range(args.runs):  # interleaved, so every measure sees the same machine load
        results["4 KiB us/batch"].append(one_descriptor(4096, args.batches))
        results["64 KiB us/batch"].append(one_descriptor(65536, args.batches))
        results["scatter us/desc"].append(scattered_cpu(args.blocks))
    for name, values in results.items():
        runs = " ".join(f"{v:.1f}" for v in values)
        print(f"{name:16} median {statistics.median(values):7.1f}   runs: {runs}")


if __name__ == "__main__":
    main()
