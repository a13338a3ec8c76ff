"""Prefix-cache retention policies compared on a production trace at equal cache bytes: hit rate and seconds saved.

    .venv/bin/python bench/retention.py                               # the Mooncake conversation trace, 6 sizes
    .venv/bin/python bench/retention.py --sizes 256,512 --max-requests 3000

Feeds the trace's requests, in order and on the trace's own clock, through the real `PrefixCache` (the match,
release and insert calls the nodes make: the prefill node matches up to all but the prompt's last token and caches
the blocks it computed; the decode node matches the whole prompt and caches it when the request ends), once per
policy, node and cache size. Prompts are made so that equal `hash_ids` give equal 512-token blocks (the trace's
block). Cache sizes are the model's bytes (--layers, --kv-heads, --head-dim, --dtype-bytes: Llama-3-8B's by
default, 64 MiB a block); the cache runs on a one-float-per-token stand-in of the KV with the same number of blocks
in its budget, which is exact: every block has the same bytes, so what fits, and the cost policy's ranking (seconds
per byte, all blocks divided by the same bytes), are the same at any block size.
This is a simulation of the cache alone: hit rates are the cache's own, exact for this request order; nothing is
prefilled or transferred, and requests do not overlap in time (each is matched and cached before the next).

Per row: the block hit rate (cached leading blocks over whole blocks looked up; every block has the same bytes, so
it is also the byte hit rate), the token hit rate (the cache's own, over all prompt tokens), the bytes found, and
the seconds they saved: on the decode node link seconds (bytes at --link-gbps), on the prefill node prefill seconds
(each block's recompute at its position: 2·params flops a token plus attention growing with position, at
--prefill-tflops). The issue's target: the best policy's hit rate at half the bytes >= LRU's.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from smartgen.engine.prefix_cache import PrefixCache
from smartgen.engine.retention import ComputeCost, LinkCost, MissCost, make_retention

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake-conversation.jsonl"
TRACE_BLOCK = 512  # tokens per hash id in the Mooncake traces
ZEROS = torch.zeros(1, 2**18, 1, 1)  # the stand-in KV (one float a token), sliced per prompt


@dataclass(slots=True)
class Request:
    at: float  # seconds from the trace's start
    hash_ids: list[int]
    length: int


def load(path: Path, max_requests: int | None) -> list[Request]:
    requests = []
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            requests.append(Request(row["timestamp"] / 1e3, row["hash_ids"], row["input_length"]))
            if max_requests and len(requests) >= max_requests:
                break
    return requests


def prompt(request: Request) -> torch.Tensor:
    """Equal hash ids give equal blocks: block `h` is the tokens h·512 ... h·512 + 511."""
    ids = torch.tensor(request.hash_ids, dtype=torch.int64)
    tokens = (ids[:, None] * TRACE_BLOCK + torch.arange(TRACE_BLOCK)).flatten()
    return tokens[: request.length]


@dataclass(slots=True)
class Outcome:
    policy: str
    node: str
    budget_bytes: int
    blocks_looked_up: int = 0
    blocks_hit: int = 0
    bytes_hit: int = 0
    saved_seconds: float = 0.0
    token_hit_rate: float = 0.0
    evicted: int = 0
    declined: int = 0
    wall_s: float = 0.0


def replay(requests: list[Request], policy: str, node: str, budget: int, cost: MissCost, block_bytes: int) -> Outcome:
    """One pass of the trace through a fresh cache of `budget` bytes (blocks of `block_bytes`) under `policy` as
    `node` uses it."""
    clock = [0.0]
    stand_in = 2 * TRACE_BLOCK * 4  # K and V of one float per token
    scaled = budget // block_bytes * stand_in
    cache = PrefixCache(scaled, TRACE_BLOCK, retention=make_retention(policy, cost), clock=lambda: clock[0])
    out = Outcome(policy, node, budget)
    started = time.perf_counter()
    for request in requests:
        clock[0] = request.at
        ids = prompt(request)
        whole = request.length // TRACE_BLOCK
        hit = cache.match(ids, max_tokens=request.length - 1 if node == "prefill" else None)
        found = hit.tokens // TRACE_BLOCK if hit is not None else 0  # whole blocks reused
        cache.release(hit)
        out.blocks_looked_up += whole
        out.blocks_hit += found
        out.bytes_hit += found * block_bytes
        out.saved_seconds += sum(cost.seconds(index, block_bytes) for index in range(found))
        start = found * TRACE_BLOCK if node == "prefill" else 0  # the decode node caches the whole prompt at the end
        kv = ZEROS[:, : request.length - start]
        cache.insert(ids, kv, kv, start=start)
    snap = cache.snapshot()
    out.token_hit_rate, out.evicted = snap["hit_rate"], snap["evicted_blocks"]
    out.declined, out.wall_s = snap["declined_blocks"], time.perf_counter() - started
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--sizes", default="64,128,256,512,1024,2048", help="cache sizes, GiB, comma-separated")
    p.add_argument("--policies", default="lru,cost")
    p.add_argument("--nodes", default="decode,prefill")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype-bytes", type=int, default=2, choices=(2, 4))
    p.add_argument("--params", type=float, default=8.0e9, help="model parameters (the prefill node's linear flops)")
    p.add_argument("--query-width", type=int, default=4096, help="query heads x head dim (attention flops)")
    p.add_argument("--prefill-tflops", type=float, default=400.0, help="the prefill GPU's sustained TFLOP/s")
    p.add_argument("--link-gbps", type=float, default=25.0, help="the link into the decode node")
    p.add_argument("--json", type=Path, default=None, help="write every row here too")
    args = p.parse_args()

    block_bytes = 2 * args.layers * TRACE_BLOCK * args.kv_heads * args.head_dim * args.dtype_bytes
    costs: dict[str, MissCost] = {
        "decode": LinkCost(args.link_gbps),
        "prefill": ComputeCost.for_model(
            int(args.params), args.layers, args.query_width, TRACE_BLOCK, args.prefill_tflops * 1e12
        ),
    }
    requests = load(args.trace, args.max_requests)
    print(
        f"{len(requests)} requests from {args.trace.name}; block {TRACE_BLOCK} tokens = {block_bytes / 2**20:.0f} MiB "
        f"({args.layers} layers, {args.kv_heads} KV heads, head dim {args.head_dim}, {args.dtype_bytes}-byte KV); "
        f"link {args.link_gbps:g} Gbit/s, prefill {args.prefill_tflops:g} TFLOP/s"
    )
    header = (
        f"{'node':8} {'GiB':>6} {'blocks':>7} {'policy':6} {'hit blk':>8} {'hit tok':>8} {'hit GiB':>9} "
        f"{'saved s':>9} {'evicted':>8} {'declined':>8} {'wall s':>7}"
    )
    print(header)
    rows = []
    for node in args.nodes.split(","):
        for size in (float(s) for s in args.sizes.split(",")):
            budget = int(size * 2**30)
            for policy in args.policies.split(","):
                o = replay(requests, policy, node, budget, costs[node], block_bytes)
                rate = o.blocks_hit / max(o.blocks_looked_up, 1)
                print(
                    f"{node:8} {size:>6g} {budget // block_bytes:>7} {policy:6} {rate:>8.4f} {o.token_hit_rate:>8.4f} "
                    f"{o.bytes_hit / 2**30:>9.0f} {o.saved_seconds:>9.1f} {o.evicted:>8} {o.declined:>8} "
                    f"{o.wall_s:>7.1f}",
                    flush=True,
                )
                rows.append({**_row(o), "block_hit_rate": rate, "gib": size})
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


def _row(o: Outcome) -> dict:
    return {name: getattr(o, name) for name in Outcome.__slots__}


if __name__ == "__main__":
    main()
