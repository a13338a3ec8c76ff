"""Unpaced TCP lane throughput next to a plain socket on the same machine (loopback), as a ratio.

    .venv/bin/python bench/tcp_lane.py [--mib 512] [--repeat 3]

Goal (issue 6): the lane reaches at least 90% of the plain socket.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import torch

from smartgen.lanes import WriteOp
from smartgen.lanes.tcp_link import loopback_tcp_link


def plain_socket_gbps(num_bytes: int) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    payload = memoryview(bytearray(num_bytes))
    sink = bytearray(num_bytes)
    done = threading.Event()

    def receive() -> None:
        conn, _ = server.accept()
        view = memoryview(sink)
        while view.nbytes:
            got = conn.recv_into(view)
            if not got:
                break
            view = view[got:]
        conn.sendall(b"k")  # like the lane's ACK: the sender knows the bytes are in
        conn.close()
        done.set()

    thread = threading.Thread(target=receive)
    thread.start()
    client = socket.create_connection(server.getsockname())
    started = time.perf_counter()
    client.sendall(payload)
    client.recv(1)
    elapsed = time.perf_counter() - started
    client.close()
    thread.join()
    server.close()
    return num_bytes * 8 / elapsed / 1e9


def lane_gbps(num_bytes: int) -> float:
    prefill, decode = loopback_tcp_link()
    try:
        region = torch.zeros(num_bytes, dtype=torch.uint8)
        decode.push.register_region("kv", region)
        decode.push.accept("r")
        source = torch.ones(num_bytes, dtype=torch.uint8)
        started = time.perf_counter()
        prefill.push.post_writes("r", {"s": source}, [WriteOp("s", "kv", 0, 0, num_bytes)], tag="bench").wait(600)
        return num_bytes * 8 / (time.perf_counter() - started) / 1e9
    finally:
        prefill.close()
        decode.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes per transfer, in MiB")
    parser.add_argument("--repeat", type=int, default=3, help="alternating runs of each (median reported)")
    args = parser.parse_args()
    num_bytes = args.mib * 2**20
    plain, lane = [], []
    for _ in range(args.repeat):  # alternate so both see the same machine load
        plain.append(plain_socket_gbps(num_bytes))
        lane.append(lane_gbps(num_bytes))
    p, q = statistics.median(plain), statistics.median(lane)
    print(
        f"{args.mib} MiB over 127.0.0.1, median of {args.repeat}: plain socket {p:.2f} Gbit/s, "
        f"SmartGen TCP lane {q:.2f} Gbit/s, lane/plain {q / p:.2f}"
    )


if __name__ == "__main__":
    main()
