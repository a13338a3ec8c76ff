"""Times split + reorder + gather per decode step next to the sparse attention it feeds, as a ratio
(and, for context, both together next to dense attention over every token).

    .venv/bin/python bench/engine_ops.py            # the issue's grid (B 1..6, H 8, d 128, N 4K..16K, k 10-20%)
    .venv/bin/python bench/engine_ops.py --quick    # a smaller grid

On CPU this times the PyTorch reference path (the CPU path); on CUDA the Triton kernels.
Half of every row's entries are remote (landed before the remote gather, as after a fetch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from smartgen.engine.attention import sparse_decode_attention
from smartgen.engine.index_ops import gather_kv, split_reorder
from smartgen.engine.mask import LOCAL, REMOTE


def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def run_case(
    batch: int,
    heads: int,
    group: int,
    head_dim: int,
    n: int,
    ratio: float,
    dtype: torch.dtype,
    device: str,
    repeat: int,
) -> dict:
    k = max(1, int(ratio * n))
    g = torch.Generator().manual_seed(0)
    k_pool = torch.randn(batch, n, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    v_pool = torch.randn(batch, n, heads, head_dim, generator=g).to(dtype=dtype, device=device)
    mask = torch.where(torch.rand(batch, n, generator=g) < 0.5, LOCAL, REMOTE).to(torch.int8).to(device)
    slots = torch.arange(batch, device=device)
    index = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(batch * heads)]).to(device)
    query = torch.randn(batch, heads * group, head_dim, generator=g).to(dtype=dtype, device=device)
    k_out = torch.zeros(batch * heads, k, head_dim, dtype=dtype, device=device)
    v_out = torch.zeros_like(k_out)

    def ops() -> None:
        split = split_reorder(index, mask, slots, heads)
        zeros = torch.zeros_like(split.num_remote)
        gather_kv(
            k_pool, v_pool, slots, split.index, split.num_remote, split.num_remote + split.num_local, k_out, v_out
        )
        gather_kv(k_pool, v_pool, slots, split.index, zeros, split.num_remote, k_out, v_out)

    valid = torch.full((batch * heads,), k, device=device)

    def attention() -> None:
        sparse_decode_attention(query, k_out, v_out, valid)

    dense_k = k_pool.permute(0, 2, 1, 3).reshape(batch * heads, n, head_dim).contiguous()
    dense_v = v_pool.permute(0, 2, 1, 3).reshape(batch * heads, n, head_dim).contiguous()
    all_valid = torch.full((batch * heads,), n, device=device)

    def dense() -> None:
        sparse_decode_attention(query, dense_k, dense_v, all_valid)

    t_ops, t_attn, t_dense = _time(ops, repeat), _time(attention, repeat), _time(dense, repeat)
    return {
        "B": batch,
        "N": n,
        "k": k,
        "ops_ms": t_ops * 1e3,
        "attn_ms": t_attn * 1e3,
        "ratio": t_ops / t_attn,
        "dense_ms": t_dense * 1e3,
        "vs_dense": (t_ops + t_attn) / t_dense,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid (B 1,4; N 4K,8K; k 10%%)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions per case (median reported)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="KV element type"
    )
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head (GQA)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    batches, lengths, ratios = (
        ((1, 4), (4096, 8192), (0.1,)) if args.quick else ((1, 2, 4, 6), (4096, 8192, 16384), (0.1, 0.2))
    )
    print(
        f"device {device}, dtype {args.dtype}, H=8 KV heads x {args.group} query heads each, d=128, median of {args.repeat}"
    )
    print(
        f"{'B':>3} {'N':>6} {'k':>5} {'split+reorder+gather ms':>24} {'attention ms':>13} {'ratio':>7} "
        f"{'dense attn ms':>14} {'(ops+attn)/dense':>17}"
    )
    for ratio in ratios:
        for n in lengths:
            for batch in batches:
                row = run_case(batch, 8, args.group, 128, n, ratio, dtype, device, args.repeat)
                print(
                    f"{row['B']:>3} {row['N']:>6} {row['k']:>5} {row['ops_ms']:>24.2f} {row['attn_ms']:>13.2f} {row['ratio']:>7.2f} "
                    f"{row['dense_ms']:>14.2f} {row['vs_dense']:>17.2f}"
                )


if __name__ == "__main__":
    main()
