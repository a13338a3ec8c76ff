"""CPU time per batch of the TCP lane, both ends in one process: one-descriptor writes and one scattered batch.

    .venv/bin/python bench/tcp_batch_cpu.py [--runs 5] [--batches 4000] [--blocks 4096] [--profile]
    .venv/bin/python bench/tcp_batch_cpu.py --rows 1000 [--runs 5]

`--rows N` measures instead a frame of N hinted entries (a K and a V row of 256 bytes each and a mask
byte: what a speculative slice of hints is), landed row by row against as a row table (`row_table`,
`scatter`), side by side: ms of CPU per frame of the sending lane's transmit thread and of the
receiving lane's receive thread (each thread's own CPU, `roles/thread_cpu.py`), the median over runs.

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

from smartgen.lanes import WriteOp
from smartgen.lanes.tcp_link import loopback_tcp_link
from smartgen.roles.thread_cpu import thread_cpu_seconds


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


def rows_cpu(entries: int, frames: int = 200, by_row: bool = False, gbps: float | None = None) -> tuple[float, float]:
    """(sender's transmit thread, receiver's receive thread) ms of CPU per frame of `entries` hinted entries, on a
    link paced at `gbps` (None: unpaced); `by_row`: with the row table turned off, every row walked one by one."""
    from smartgen.lanes import tcp

    unit, size = 256, 3 * 256 * entries
    ops = [WriteOp(name, name, 3 * unit * i, 3 * unit * i, unit) for i in range(entries) for name in ("k", "v")]
    ops += [WriteOp("ones", "mask", 0, 3 * i, 1) for i in range(entries)]
    saved = tcp.worth_gathering
    if by_row:
        tcp.worth_gathering = lambda rows, payload: False  # type: ignore[assignment]
    prefill, decode = loopback_tcp_link(gbps)
    try:
        for name in ("k", "v", "mask"):
            decode.push.register_region(name, torch.zeros(size, dtype=torch.uint8))
        decode.push.accept("r")
        sources = {"k": torch.ones(size, dtype=torch.uint8), "v": torch.ones(size, dtype=torch.uint8)}
        sources["ones"] = torch.ones(16, dtype=torch.uint8)
        for _ in range(2):  # warm up
            prefill.push.post_writes("r", sources, ops, tag="bench").wait(60)
        before = thread_cpu_seconds()
        for _ in range(frames):
            assert prefill.push.post_writes("r", sources, ops, tag="bench").wait(60)
        after = thread_cpu_seconds()
        used = {name: (after[name] - before.get(name, 0.0)) / frames * 1e3 for name in after}
        return used["prefill.push-tx"], used["decode.push-rx"]  # roles: `thread_cpu.role_of`
    finally:
        tcp.worth_gathering = saved  # type: ignore[assignment]
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
    parser.add_argument("--rows", type=int, default=0, help="hinted entries a frame: row by row against a row table")
    parser.add_argument("--frames", type=int, default=200, help="frames a run (with --rows)")
    parser.add_argument("--gbps", type=float, default=None, help="pace the link (with --rows; default unpaced)")
    args = parser.parse_args()
    if args.rows:
        measured: dict[str, list[tuple[float, float]]] = {"row by row": [], "row table": []}
        for _ in range(args.runs):  # interleaved, so both see the same machine load
            measured["row by row"].append(rows_cpu(args.rows, args.frames, by_row=True, gbps=args.gbps))
            measured["row table"].append(rows_cpu(args.rows, args.frames, gbps=args.gbps))
        print(f"{args.rows} hinted entries a frame ({3 * args.rows} rows), ms of CPU a frame, median of {args.runs}:")
        for name, runs in measured.items():
            sender = statistics.median(r[0] for r in runs)
            receiver = statistics.median(r[1] for r in runs)
            print(f"  {name:10}  sender's transmit thread {sender:6.2f}   receiver's receive thread {receiver:6.2f}")
        return
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
