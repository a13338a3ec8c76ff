"""What a step's remote entries cost over the paced link: fetched, or attended where they are (a feasibility bench).

    .venv/bin/python bench/partial_attention_rtt.py                   # random:32's shape, the bench's 25 Mbit/s
    .venv/bin/python bench/partial_attention_rtt.py --mbps 25000 --entries 20,150,1000

The measurement behind `smartgen-attend` (docs/results/2026-12-08-partial-attention-feasibility.md), over one lane alone.
Today a decode step FETCHes the remote entries it selected and waits for their K and V to cross the link; on a slow
link the reply's bytes are most of the wait. The alternative measured here sends the same FETCH (the entry ids)
and has the serving end attend to those entries with the step's query, replying with the partial result: per query
head the output [d] and the softmax's max and sum (fp32), which the decode node would merge exactly with its local
part (the log-sum-exp merge of split attention), whatever the number of entries. The attention and the merge are
the engine's own (`engine.attention`), as `smartgen-attend` serves and merges them.

Both run over one real TCP lane on loopback, paced at `--mbps` both ways, with the real `Fetch` and `FetchReply`
messages; the partial result travels as a `FetchReply` whose K is the output [Hq, d] and whose V is (max, sum)
[Hq, 2]. The serving end gathers the entries from a [L, N, H, d] fp16 KV as the prefill node does and, for the
partial attention, scores them against a random query of `--q-per-kv` heads per KV head. Prints per size and kind
the reply's bytes, the round trip (median over `--repeat` after 10 warm-ups; the client waits for each reply
before it sends the next) and the serving thread's CPU per ask (median).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from smartgen.engine import messages as msg
from smartgen.engine.attention import merge_partials, partial_attention
from smartgen.engine.decode.move import fetch_message
from smartgen.lanes.tcp_link import loopback_tcp_link

WARMUP = 10


def merge_error(heads: int, q_per_kv: int, dim: int, entries: int = 400) -> float:
    """Largest difference between attention over `entries` at once and the merge of its two halves' partials."""
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(heads * q_per_kv, dim, generator=generator)
    k, v = torch.randn(entries, dim, generator=generator), torch.randn(entries, dim, generator=generator)
    head = torch.arange(entries) % heads
    whole, _ = partial_attention(query, k, v, head, heads)
    half = entries // 2
    parts = [
        partial_attention(query, k[:half], v[:half], head[:half], heads),
        partial_attention(query, k[half:], v[half:], head[half:], heads),
    ]
    return float((merge_partials(parts) - whole).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbps", type=float, default=25.0, help="the link's rate each way, Mbit/s")
    parser.add_argument("--entries", default="20,150,1000", help="remote entries per ask, comma-separated")
    parser.add_argument("--repeat", type=int, default=50, help="timed asks per size and kind")
    parser.add_argument("--layers", type=int, default=32, help="layers of the served KV")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens of the served KV")
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads (random:32: 2)")
    parser.add_argument("--q-per-kv", type=int, default=4, help="query heads per KV head (random:32: 4)")
    parser.add_argument("--head-dim", type=int, default=32, help="head size (random:32: 32)")
    args = parser.parse_args()
    try:
        sizes = [int(e) for e in args.entries.split(",")]
    except ValueError:
        parser.error("--entries takes whole numbers, comma-separated")
    if min(args.layers, args.tokens, args.kv_heads, args.q_per_kv, args.head_dim) < 1:
        parser.error("--layers, --tokens, --kv-heads, --q-per-kv and --head-dim must be positive")
    if args.mbps <= 0 or args.repeat < 1 or min(sizes) < 1 or max(sizes) > args.tokens * args.kv_heads:
        parser.error("--mbps and --repeat must be positive, --entries within the served KV")
    torch.set_num_threads(1)
    heads, dim = args.kv_heads, args.head_dim
    shape = (args.layers, args.tokens, heads, dim)
    keys, values = torch.randn(shape, dtype=torch.float16), torch.randn(shape, dtype=torch.float16)
    prefill, decode = loopback_tcp_link(args.mbps / 1000, 0.0)
    mode = {"attend": False}
    serve_cpu: list[float] = []

    failed: list[BaseException] = []
    stop = threading.Event()

    def serve() -> None:
        try:
            answer()
        except BaseException as exc:  # the client says why it got no reply, rather than waiting out its timeout
            failed.append(exc)
            raise

    def answer() -> None:
        while not stop.is_set():
            raw = prefill.control.recv(timeout=0.5)
            if raw is None:
                continue
            started = time.thread_time()
            ask = msg.unpack(raw)
            ids = (ask.positions.unsqueeze(1) * heads + torch.arange(heads)).view(-1)
            if ask.heads is not None:
                ids = ids[ask.heads.reshape(-1)]
            k = keys[ask.layer].view(-1, dim).index_select(0, ids)
            v = values[ask.layer].view(-1, dim).index_select(0, ids)
            if mode["attend"]:
                query = torch.randn(heads * args.q_per_kv, dim)
                out, stats = partial_attention(query, k, v, ids % heads, heads)
                reply = msg.FetchReply(ask.request_id, ask.fetch_id, out, stats)
            else:
                reply = msg.FetchReply(ask.request_id, ask.fetch_id, k, v)
            packed = reply.pack()
            serve_cpu.append(time.thread_time() - started)
            prefill.control.send(packed, tag="on_demand")

    threading.Thread(target=serve, name="serve", daemon=True).start()
    generator = torch.Generator().manual_seed(0)
    layer = args.layers // 2
    print(f"{args.mbps:g} Mbit/s each way; KV {args.layers} x {args.tokens} x {heads} heads x d {dim}, fp16")
    print(
        f"merging two halves' partial attention: largest difference from attending at once {merge_error(heads, args.q_per_kv, dim):.1e}"
    )
    print(f"{'entries':>7} {'kind':>9} {'reply B':>8} {'round trip ms':>14} {'serve CPU ms':>13}")
    try:
        for size in sizes:
            for attend in (False, True):
                mode["attend"] = attend
                serve_cpu.clear()
                trips = []
                reply_bytes = 0
                for i in range(WARMUP + args.repeat):
                    ids = torch.randperm(args.tokens * heads, generator=generator)[:size].sort().values
                    started = time.monotonic()
                    decode.control.send(fetch_message("r", layer, i, ids, heads).pack(), tag="on_demand")
                    raw = None
                    for _ in range(600):  # up to 60 s, looking for a failed serving end every 0.1 s
                        if failed or (raw := decode.control.recv(timeout=0.1)) is not None:
                            break
                    if raw is None:
                        why = f"failed: {failed[0]!r}" if failed else "did not answer within 60 s"
                        raise SystemExit(f"the serving end {why}")
                    trips.append(time.monotonic() - started)
                    reply = msg.unpack(raw)
                    reply_bytes = sum(t.numel() * t.element_size() for t in (reply.k, reply.v) if t is not None)
                kind = "attention" if attend else "fetch"
                trip = statistics.median(trips[WARMUP:]) * 1e3
                cpu = statistics.median(serve_cpu[WARMUP:]) * 1e3
                print(f"{size:>7} {kind:>9} {reply_bytes:>8} {trip:>14.2f} {cpu:>13.3f}")
    finally:
        stop.set()
        prefill.close()
        decode.close()


if __name__ == "__main__":
    main()
