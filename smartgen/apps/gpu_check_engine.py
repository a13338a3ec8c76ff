"""GPU checks of the engine: each Triton kernel against its PyTorch reference, and a staged pool's host->device copies.

On CUDA the shapes are real models' (4 requests, 8 KV heads, head size 64 and 128, fp16 and bf16, 2K-32K tokens,
a 10% selection budget); the CPU half runs the same code at tiny shapes, the kernels under Triton's interpreter
(TRITON_INTERPRET=1 set before the kernels are defined: `gpu_check.main` does it). Every comparison is exact:
the kernels and the staging only move bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from smartgen.apps.gpu_check_base import Context, Row, max_abs_diff, time_ms
from smartgen.engine.kernels import IndexSplit
from smartgen.engine.layout import KVLayout
from smartgen.engine.mask import LOCAL, PAD, REMOTE

__all__ = ["check_split", "check_gather", "check_staging"]

BATCH, HEADS, BUDGET = 4, 8, 0.1  # on CUDA: 4 requests of a model with 8 KV heads, 10% of the tokens selected
CUDA_TOKENS = (2048, 8192, 32768)
CPU_TOKENS = (64, 200)
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _rate(nbytes: int, ms: float) -> str:
    per_s = nbytes / max(ms, 1e-6) * 1e3
    return f"{per_s / 2**30:.2f} GiB/s" if per_s >= 2**30 else f"{per_s / 2**20:.1f} MiB/s"


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def _jit_ms(fn: Callable[[], object], cuda: bool) -> float:
    """The first launch, compile included (what a node's first decode step pays)."""
    began = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3


# -- split / reorder -------------------------------------------------------------------------
def _split_inputs(
    tokens: int, heads: int, batch: int, k: int, per_head: bool, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index [B*H, k] with ~5% padding, mask [S, N, H] (or [S, N]) with local, remote and a padded tail, slots [B])."""
    gen = _generator(device, seed)
    slots = batch + 1
    shape = (slots, tokens, heads) if per_head else (slots, tokens)
    mask = torch.randint(LOCAL, REMOTE + 1, shape, generator=gen, device=device, dtype=torch.int8)
    mask[:, tokens - tokens // 20 :] = PAD  # past each prompt's end: padding
    index = torch.randint(0, tokens, (batch * heads, k), generator=gen, device=device)
    index[torch.rand(index.shape, generator=gen, device=device) < 0.05] = -1
    order = torch.randperm(slots, generator=gen, device=device)[:batch]  # batch entry b is rarely slot b
    return index, mask, order.contiguous()


def check_split(ctx: Context) -> None:
    """split_reorder_triton vs split_reorder_reference: every field of the result equal."""
    batch, heads = (BATCH, HEADS) if ctx.cuda else (2, 2)
    cases = [(n, True) for n in (CUDA_TOKENS if ctx.cuda else CPU_TOKENS)]
    cases.append((CUDA_TOKENS[1] if ctx.cuda else 64, False))  # one mask shared by the heads, [S, N]
    for seed, (tokens, per_head) in enumerate(cases):
        k = max(1, int(tokens * BUDGET))
        shape = f"B{batch} H{heads} N{tokens} k{k} mask[S,N{',H' if per_head else ''}]"
        if not ctx.over_time("kernels.split", shape, "int64/int8", reserve_s=2):
            ctx.add(_split_case(ctx, _split_inputs(tokens, heads, batch, k, per_head, ctx.device, seed), heads, shape))


def _split_case(ctx: Context, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], heads: int, shape: str) -> Row:
    from smartgen.engine.index_ops import split_reorder_reference
    from smartgen.engine.kernels.launch import split_reorder_triton

    index, mask, slots = inputs
    got: list[IndexSplit] = []

    def ours() -> None:
        got[:] = [split_reorder_triton(index=index, mask=mask, slots=slots, num_heads=heads)]

    jit = _jit_ms(ours, ctx.cuda)
    [split] = got
    want = split_reorder_reference(index, mask, slots, heads)
    bad = [n for n, a, b in zip(want._fields, split, want) if a.dtype != b.dtype or not a.equal(b)]
    error = max(max_abs_diff(a, b) for a, b in zip(split, want))
    repeat = 20 if ctx.cuda else 2
    ref_ms = time_ms(lambda: split_reorder_reference(index, mask, slots, heads), ctx.cuda, repeat)
    ours_ms = time_ms(ours, ctx.cuda, repeat)
    note = f"{int(want.num_remote.sum())} remote entries; first launch {jit:.0f} ms" + _mode(ctx)
    if bad:
        note = f"differs from the reference in {', '.join(bad)}; " + note
    result = "fail" if bad else "pass"
    return Row("kernels.split", ctx.device_name, shape, "int64/int8", result, error, ref_ms, ours_ms, note)


def _mode(ctx: Context) -> str:
    return "" if ctx.cuda else " (interpreter)"


# -- gather ---------------------------------------------------------------------------------
def check_gather(ctx: Context) -> None:
    """gather_kv_triton vs gather_kv_reference over one layer of a pool [S, N, H, d]: outputs equal bit for bit,
    including the entries outside each row's window, which both must leave untouched."""
    batch, heads = (BATCH, HEADS) if ctx.cuda else (1, 2)
    seed = 0
    for dim in (64, 128):
        for dtype in (torch.float16, torch.bfloat16):
            for tokens in CUDA_TOKENS if ctx.cuda else (128,):
                seed += 1
                k = max(1, int(tokens * BUDGET)) if ctx.cuda else 16
                shape = f"B{batch} H{heads} N{tokens} k{k} d{dim}"
                if not ctx.over_time("kernels.gather", shape, DTYPES[dtype], reserve_s=3):
                    ctx.add(_gather_case(ctx, (batch, heads, tokens, k, dim), dtype, seed, shape))
                    if ctx.cuda:
                        torch.cuda.empty_cache()  # the 32K pools are 0.5 GiB each


def _gather_case(ctx: Context, sizes: tuple[int, int, int, int, int], dtype: torch.dtype, seed: int, shape: str) -> Row:
    from smartgen.engine.index_ops import gather_kv_reference
    from smartgen.engine.kernels.launch import gather_kv_triton

    batch, heads, tokens, k, dim = sizes
    rows, device = batch * heads, ctx.device
    gen = _generator(device, seed)
    pool_shape = (batch + 1, tokens, heads, dim)  # one layer of the pool: [S, N, H, d]
    k_pool = torch.randn(pool_shape, generator=gen, device=device, dtype=dtype)
    v_pool = torch.randn(pool_shape, generator=gen, device=device, dtype=dtype)
    slots = torch.randperm(batch + 1, generator=gen, device=device)[:batch].contiguous()
    index = torch.randint(0, tokens, (rows, k), generator=gen, device=device)
    start = torch.randint(0, k // 2 + 1, (rows,), generator=gen, device=device, dtype=torch.int32)
    width = torch.randint(0, k + 1, (rows,), generator=gen, device=device, dtype=torch.int32)
    stop = (start + width).clamp(max=k)  # [start, stop): this lane's share of each row
    garbage = torch.randn((rows, k, dim), generator=gen, device=device, dtype=dtype)
    outs = [garbage.clone() for _ in range(4)]  # K and V of the reference, then of the kernel

    def ref() -> None:
        gather_kv_reference(k_pool, v_pool, slots, index, start, stop, outs[0], outs[1])

    def ours() -> None:
        gather_kv_triton(k_pool, v_pool, slots, index, start, stop, outs[2], outs[3])

    ref()
    jit = _jit_ms(ours, ctx.cuda)
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32
    equal = all(outs[i].view(bits).equal(outs[i + 2].view(bits)) for i in (0, 1))
    error = max(max_abs_diff(outs[i], outs[i + 2]) for i in (0, 1))
    repeat = 20 if ctx.cuda else 2
    ref_ms, ours_ms = time_ms(ref, ctx.cuda, repeat), time_ms(ours, ctx.cuda, repeat)
    moved = 2 * int((stop - start).clamp(min=0).sum()) * dim * dtype.itemsize
    note = f"{_size(moved)} gathered; first launch {jit:.0f} ms" + _mode(ctx)
    if not equal:
        note = "outputs differ from the reference bit for bit; " + note
    result = "pass" if equal else "fail"
    return Row("kernels.gather", ctx.device_name, shape, DTYPES[dtype], result, error, ref_ms, ours_ms, note)


# -- staged pool ----------------------------------------------------------------------------
def check_staging(ctx: Context) -> None:
    """DecodePool(staged=True) on the device: what a lane lands in the host mirrors (and marks in the landing mask)
    reaches the device K and V bit for bit on `sync_staged`, nothing else is copied, and the mask table says LOCAL
    exactly there; then a fetch reply's entries (`entries_landed`) the same way."""
    cases = [(2, 2048, 64, torch.float16), (4, 8192, 128, torch.bfloat16), (2, 32768, 128, torch.float16)]
    if not ctx.cuda:
        cases = [(2, 64, 64, torch.float16), (2, 48, 128, torch.bfloat16)]
    heads = HEADS if ctx.cuda else 2
    for seed, (layers, tokens, dim, dtype) in enumerate(cases):
        shape = f"L{layers} H{heads} N{tokens} d{dim}"
        if ctx.over_time("staging", shape, DTYPES[dtype], reserve_s=3):
            continue
        ctx.add(_staging_case(ctx, KVLayout(layers, heads, dim, dtype), tokens, seed, shape))


def _staging_case(ctx: Context, layout: KVLayout, tokens: int, seed: int, shape: str) -> Row:
    from smartgen.engine.pool import DecodePool

    pool = DecodePool(layout, num_slots=2, max_tokens=tokens, device=ctx.device, staged=True)
    assert pool.staging is not None
    slot = pool.allocate(tokens)
    views = pool.byte_views()
    full = pool.k.shape  # [L, S, N, H, d]
    k_host, v_host = (views[n].view(layout.dtype).view(full)[:, slot] for n in ("k", "v"))  # what a lane writes
    landing = views["mask"].view(torch.int8).view(full[:4])[:, slot]
    gen = torch.Generator().manual_seed(seed)
    k_host.copy_(torch.randn(k_host.shape, generator=gen).to(layout.dtype))  # whole blocks, landed or not
    v_host.copy_(torch.randn(v_host.shape, generator=gen).to(layout.dtype))
    landed = torch.rand(landing.shape, generator=gen) < 0.3  # [L, N, H]: the entries whose mask byte came
    landing[landed] = LOCAL

    began = time.perf_counter()
    moved = pool.sync_staged(None, [slot])
    ours_ms = (time.perf_counter() - began) * 1e3  # sync returns once the device holds the rows
    problems = []
    if moved != int(landed.sum()):
        problems.append(f"moved {moved} entries, {int(landed.sum())} landed")
    k_dev, v_dev = pool.k[:, slot].cpu(), pool.v[:, slot].cpu()
    bits = torch.int16
    for name, dev, host in (("K", k_dev, k_host), ("V", v_dev, v_host)):
        if not dev[landed].view(bits).equal(host[landed].view(bits)):
            problems.append(f"{name} rows differ from the host mirror")
        if bool(dev[~landed].view(bits).any()):
            problems.append(f"{name} rows that never landed were copied")
    table = pool.masks.values[:, slot, :tokens].cpu()
    if not table.equal(torch.where(landed, LOCAL, REMOTE).to(torch.int8)):
        problems.append("the mask table is not LOCAL exactly where entries landed")
    # a fetch reply scattered into the mirrors: 8 entries of layer 0 that had not landed
    left = (~landed[0]).flatten().nonzero().flatten()[:8]
    pool.entries_landed(0, slot, left)
    head_dim = layout.head_dim
    fetched = pool.k[0, slot].reshape(-1, head_dim)[left].cpu()
    if not fetched.view(bits).equal(k_host[0].reshape(-1, head_dim)[left].view(bits)):
        problems.append("a fetch reply's entries differ from the mirror")
    if not bool((pool.masks.values[0, slot].reshape(-1)[left.to(pool.masks.values.device)] == LOCAL).all()):
        problems.append("a fetch reply's entries are not LOCAL")
    error = max(max_abs_diff(k_dev[landed], k_host[landed]), max_abs_diff(v_dev[landed], v_host[landed]))

    nbytes = 2 * moved * head_dim * layout.itemsize
    ref_ms = _plain_copy_ms(nbytes, ctx)
    pinned = pool.staging.k.is_pinned()
    note = f"{moved} entries, {_size(nbytes)}: {_rate(nbytes, ours_ms)}"
    note += f"; host mirrors pinned: {'yes' if pinned else 'no'}"
    if problems:
        note = "; ".join(problems) + "; " + note
    dtype = DTYPES[layout.dtype]
    return Row("staging", ctx.device_name, shape, dtype, "fail" if problems else "pass", error, ref_ms, ours_ms, note)


def _plain_copy_ms(nbytes: int, ctx: Context) -> float:
    """One contiguous copy of `nbytes` from (pinned, on CUDA) host memory to the device: the floor for a sync."""
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda)
    if not ctx.cuda:
        return time_ms(source.clone, False, 2)  # a host memcpy: there is no device to copy to
    return time_ms(lambda: source.to(ctx.device, non_blocking=True), True, 5)
