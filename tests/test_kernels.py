"""Tests the Triton split/reorder and KV gather kernels against their PyTorch references (interpreter on CPU)."""

import os

# triton.jit picks the interpreter when a kernel is defined, so these come before any import of it.
_FORCE_BEFORE = os.environ.get("SMARTGEN_FORCE_TRITON")
os.environ["TRITON_INTERPRET"] = "1"
os.environ["SMARTGEN_FORCE_TRITON"] = "1"

import sys  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

import smartgen.engine.kernels as kernels  # noqa: E402
import smartgen.engine.kernels.launch as launch  # noqa: E402
from smartgen.engine import index_ops  # noqa: E402
from smartgen.engine.index_ops import gather_kv_reference, split_reorder_reference  # noqa: E402
from smartgen.engine.kernels.launch import gather_kv_triton, split_reorder_triton  # noqa: E402
from smartgen.engine.mask import LOCAL, PAD, REMOTE  # noqa: E402

# pytest imports every test module before running any, so the force flag is put back now and
# set again only around this module's tests: other modules keep their CPU (reference) path.
if _FORCE_BEFORE is None:
    del os.environ["SMARTGEN_FORCE_TRITON"]
else:
    os.environ["SMARTGEN_FORCE_TRITON"] = _FORCE_BEFORE

NUM_SLOTS = 5


@pytest.fixture(autouse=True, scope="module")
def force_triton():
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SMARTGEN_FORCE_TRITON", "1")
        yield


def test_kernels_run_in_the_interpreter() -> None:
    """Fails clearly if some earlier module imported the kernels before TRITON_INTERPRET was set."""
    from triton.runtime.interpreter import InterpretedFunction

    from smartgen.engine.kernels.gather import gather_kv_kernel
    from smartgen.engine.kernels.index_split import split_reorder_kernel

    for kernel in (split_reorder_kernel, gather_kv_kernel):
        assert isinstance(kernel, InterpretedFunction), "kernels were defined before TRITON_INTERPRET=1 was set"


def make_mask(num_tokens: int, gen: torch.Generator, strided: bool = False) -> torch.Tensor:
    """[S, N] int8 with all three values; strided gives a non-contiguous view of a wider table."""
    width = 2 * num_tokens if strided else num_tokens
    table = torch.randint(PAD, REMOTE + 1, (NUM_SLOTS, width), generator=gen, dtype=torch.int8)
    table[0] = REMOTE  # a slot that is still all remote
    table[1, : width // 2] = LOCAL  # a slot half received
    return table[:, ::2] if strided else table


def make_slots(batch: int, gen: torch.Generator) -> torch.Tensor:
    """[B] int64: distinct, shuffled pool slots, so batch entry b is rarely slot b."""
    return torch.randperm(NUM_SLOTS, generator=gen)[:batch].flip(0).contiguous()


def make_index(rows: int, k: int, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[R, k] int64 positions with -1 padding and a few out-of-range entries mixed in."""
    index = torch.randint(0, num_tokens, (rows, k), generator=gen)
    index[torch.rand(rows, k, generator=gen) < 0.2] = -1
    index[torch.rand(rows, k, generator=gen) < 0.05] = num_tokens + 3
    index[torch.rand(rows, k, generator=gen) < 0.05] = -7
    return index


def assert_split_equal(got: index_ops.IndexSplit, want: index_ops.IndexSplit) -> None:
    for name, g, w in zip(want._fields, got, want):
        assert g.dtype == w.dtype, name
        assert torch.equal(g, w), f"{name}:\n{g}\n!=\n{w}"


# ---------------------------------------------------------------- split / reorder


@pytest.mark.parametrize("num_tokens", [5, 13])
@pytest.mark.parametrize("k", [1, 7, 37])
@pytest.mark.parametrize("num_heads", [1, 2, 3, 8])
@pytest.mark.parametrize("batch", [1, 3])
def test_split_reorder_matches_reference(batch: int, num_heads: int, k: int, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(batch * 1000 + num_heads * 100 + k * 10 + num_tokens)
    mask = make_mask(num_tokens, gen)
    slots = make_slots(batch, gen)
    index = make_index(batch * num_heads, k, num_tokens, gen)
    got = split_reorder_triton(index=index, mask=mask, slots=slots, num_heads=num_heads)
    assert_split_equal(got, split_reorder_reference(index, mask, slots, num_heads))


def test_split_reorder_non_contiguous_inputs() -> None:
    gen = torch.Generator().manual_seed(7)
    batch, num_heads, k, num_tokens = 3, 3, 11, 17
    mask = make_mask(num_tokens, gen, strided=True)  # [S, N] with stride 2 along N
    slots = torch.stack([make_slots(batch, gen), torch.zeros(batch, dtype=torch.int64)], 1)[:, 0]  # stride 2
    index = make_index(k, batch * num_heads, num_tokens, gen).t()  # [R, k] column-major
    assert not (mask.is_contiguous() or slots.is_contiguous() or index.is_contiguous())
    got = split_reorder_triton(index=index, mask=mask, slots=slots, num_heads=num_heads)
    assert_split_equal(got, split_reorder_reference(index, mask, slots, num_heads))


def test_split_reorder_many_rows_and_wide_k() -> None:
    # 40 rows cover several row blocks with a ragged last one; k = 300 is over one 256 tile.
    gen = torch.Generator().manual_seed(11)
    batch, num_heads, k, num_tokens = 5, 8, 300, 257
    mask = make_mask(num_tokens, gen)
    slots = torch.randperm(NUM_SLOTS, generator=gen)
    index = make_index(batch * num_heads, k, num_tokens, gen)
    got = split_reorder_triton(index=index, mask=mask, slots=slots, num_heads=num_heads)
    assert_split_equal(got, split_reorder_reference(index, mask, slots, num_heads))


def make_head_mask(num_tokens: int, num_heads: int, gen: torch.Generator, strided: bool = False) -> torch.Tensor:
    """[S, N, H] int8, one value per token and KV head; strided gives a view with stride 2 along N and H."""
    width, heads = (2 * num_tokens, 2 * num_heads) if strided else (num_tokens, num_heads)
    table = torch.randint(PAD, REMOTE + 1, (NUM_SLOTS, width, heads), generator=gen, dtype=torch.int8)
    table[1, : width // 2, 0] = LOCAL  # a token whose first head arrived (a fetch) and the others did not
    return table[:, ::2, ::2] if strided else table


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("num_heads", [1, 2, 3])
def test_split_reorder_per_head_mask_matches_reference(num_heads: int, strided: bool) -> None:
    gen = torch.Generator().manual_seed(31 + num_heads + 10 * strided)
    batch, k, num_tokens = 3, 9, 13
    mask = make_head_mask(num_tokens, num_heads, gen, strided)
    slots = make_slots(batch, gen)
    index = make_index(batch * num_heads, k, num_tokens, gen)
    got = split_reorder_triton(index=index, mask=mask, slots=slots, num_heads=num_heads)
    assert_split_equal(got, split_reorder_reference(index, mask, slots, num_heads))


def test_split_reorder_per_head_status_is_the_rows_own_head() -> None:
    """Row r reads head r % H: a token local in one head and remote in the other splits two ways."""
    mask = torch.full((NUM_SLOTS, 4, 2), REMOTE, dtype=torch.int8)
    mask[2, :, 0] = LOCAL  # slot 2: head 0 holds every token, head 1 none
    index = torch.tensor([[0, 1, 2], [0, 1, 2]])
    for split in (
        split_reorder_triton(index=index, mask=mask, slots=torch.tensor([2]), num_heads=2),
        split_reorder_reference(index, mask, torch.tensor([2]), 2),
    ):
        assert split.num_local.tolist() == [3, 0] and split.num_remote.tolist() == [0, 3]


def test_split_reorder_rejects_a_mask_of_other_heads() -> None:
    with pytest.raises(ValueError, match=r"mask must be \[S, N, H=2\]"):
        split_reorder_triton(
            index=torch.zeros(2, 1, dtype=torch.int64),
            mask=torch.zeros(NUM_SLOTS, 4, 3, dtype=torch.int8),
            slots=torch.tensor([0]),
            num_heads=2,
        )


def test_split_reorder_empty_k() -> None:
    index = torch.empty(4, 0, dtype=torch.int64)
    mask = torch.zeros(NUM_SLOTS, 3, dtype=torch.int8)
    got = split_reorder_triton(index=index, mask=mask, slots=torch.tensor([1, 2]), num_heads=2)
    assert got.index.shape == (4, 0) and got.status.shape == (4, 0)
    assert torch.equal(got.num_remote, torch.zeros(4, dtype=torch.int32))
    assert torch.equal(got.num_local, torch.zeros(4, dtype=torch.int32))


@settings(max_examples=25, deadline=None)
@given(
    num_heads=st.integers(1, 4),
    k=st.integers(1, 20),
    num_tokens=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_split_reorder_partitions_the_row(num_heads: int, k: int, num_tokens: int, seed: int) -> None:
    """The reordered row is a permutation of the input: remote, then local, then padding."""
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(num_tokens, gen)
    slots = make_slots(2, gen)
    index = make_index(2 * num_heads, k, num_tokens, gen)
    got = split_reorder_triton(index=index, mask=mask, slots=slots, num_heads=num_heads)
    assert torch.equal(got.index.sort(dim=1).values, index.sort(dim=1).values)
    cols = torch.arange(k).unsqueeze(0)
    nr, nl = got.num_remote.long().unsqueeze(1), got.num_local.long().unsqueeze(1)
    expected = torch.where(cols < nr, REMOTE, torch.where(cols < nr + nl, LOCAL, PAD)).to(torch.int8)
    assert torch.equal(got.status, expected)
    assert_split_equal(got, split_reorder_reference(index, mask, slots, num_heads))


# ---------------------------------------------------------------- gather


def make_pool(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """[S, N, H, d] pool, contiguous or as a strided view (heads interleaved, every other d)."""
    if layout == "contiguous":
        return torch.randn(NUM_SLOTS, num_tokens, num_heads, head_dim).to(dtype)
    # Head-major storage seen token-major, with a stride of 2 on d: no stride is the contiguous one.
    storage = torch.randn(NUM_SLOTS, num_heads, num_tokens, 2 * head_dim).to(dtype)
    return storage.permute(0, 2, 1, 3)[..., ::2]


def run_both(k_pool, v_pool, slots, index, start, stop, k_out, v_out):
    """Runs the kernel and the reference on copies of the outputs; returns both pairs."""
    want_k, want_v = k_out.clone(), v_out.clone()
    gather_kv_reference(k_pool, v_pool, slots, index, start, stop, want_k, want_v)
    gather_kv_triton(
        k_pool=k_pool, v_pool=v_pool, slots=slots, index=index, start=start, stop=stop, k_out=k_out, v_out=v_out
    )
    return (k_out, v_out), (want_k, want_v)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize(("num_heads", "k"), [(1, 37), (2, 1), (3, 7), (8, 7)])
@pytest.mark.parametrize("head_dim", [8, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gather_kv_matches_reference(dtype: torch.dtype, head_dim: int, num_heads: int, k: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(head_dim * 100 + num_heads * 10 + k)
    torch.manual_seed(head_dim * 100 + num_heads * 10 + k)
    batch, num_tokens = 2, 13
    rows = batch * num_heads
    k_pool = make_pool(num_tokens, num_heads, head_dim, dtype, layout)
    v_pool = make_pool(num_tokens, num_heads, head_dim, dtype, layout)
    slots = make_slots(batch, gen)
    index = torch.randint(0, num_tokens, (rows, k), generator=gen)
    # Windows cover empty, whole-row, stop past k and start > stop cases.
    start = torch.randint(0, k + 1, (rows,), generator=gen)
    stop = start + torch.randint(-1, k + 2, (rows,), generator=gen)
    start[0], stop[0] = 0, k
    # Padding outside the windows: the kernel must never look at it.
    cols = torch.arange(k).unsqueeze(0)
    index[(cols < start.unsqueeze(1)) | (cols >= stop.unsqueeze(1))] = -1
    sentinel = torch.full((rows, k, head_dim), 7.0, dtype=dtype)
    got, want = run_both(k_pool, v_pool, slots, index, start, stop, sentinel.clone(), sentinel.clone())
    for g, w in zip(got, want):
        assert torch.equal(g, w)  # a copy: bit-exact
    assert torch.equal(got[0][0], k_pool[slots[0], index[0], 0])


def test_gather_kv_two_lanes_after_split() -> None:
    """The decode path: split, then fill remote [0, nr) and local [nr, nr + nl) as two launches."""
    gen = torch.Generator().manual_seed(3)
    batch, num_heads, k, num_tokens, head_dim = 3, 2, 9, 11, 17
    rows = batch * num_heads
    mask = make_mask(num_tokens, gen)
    slots = make_slots(batch, gen)
    index = make_index(rows, k, num_tokens, gen)
    split = split_reorder_triton(index=index, mask=mask, slots=slots, num_heads=num_heads)
    k_pool = make_pool(num_tokens, num_heads, head_dim, torch.bfloat16, "strided")
    v_pool = make_pool(num_tokens, num_heads, head_dim, torch.bfloat16, "contiguous")
    nr, nl = split.num_remote, split.num_remote + split.num_local  # [R] int32
    zero = torch.zeros(rows, dtype=torch.int32)
    outs = torch.zeros(2, rows, k, head_dim, dtype=torch.bfloat16)
    want = outs.clone()
    for lo, hi in ((zero, nr), (nr, nl)):
        gather_kv_triton(
            k_pool=k_pool,
            v_pool=v_pool,
            slots=slots,
            index=split.index,
            start=lo,
            stop=hi,
            k_out=outs[0],
            v_out=outs[1],
        )
        gather_kv_reference(k_pool, v_pool, slots, split.index, lo, hi, want[0], want[1])
    assert torch.equal(outs, want)
    assert bool((outs[:, rows - 1, nl[-1] :] == 0).all())  # padding columns untouched


def test_gather_kv_non_contiguous_outputs_and_int32_windows() -> None:
    gen = torch.Generator().manual_seed(5)
    batch, num_heads, k, num_tokens, head_dim = 2, 3, 7, 9, 8
    rows = batch * num_heads
    k_pool = make_pool(num_tokens, num_heads, head_dim, torch.float16, "contiguous")
    v_pool = make_pool(num_tokens, num_heads, head_dim, torch.float16, "strided")
    slots = make_slots(batch, gen)
    index = torch.randint(0, num_tokens, (k, rows), generator=gen).t()  # [R, k] column-major
    start = torch.tensor([0, 1, 2, 3, 0, 6], dtype=torch.int32)
    stop = torch.tensor([7, 5, 2, 7, 1, 7], dtype=torch.int32)
    k_out = torch.zeros(k, rows, head_dim, dtype=torch.float16).transpose(0, 1)  # [R, k, d] view
    v_out = torch.zeros(rows, k, 2 * head_dim, dtype=torch.float16)[..., head_dim:]
    got, want = run_both(k_pool, v_pool, slots, index, start, stop, k_out, v_out)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_gather_kv_skips_out_of_range_positions_in_window() -> None:
    """The reference would wrap -1 or raise; the kernel leaves such entries untouched instead."""
    k_pool = torch.arange(NUM_SLOTS * 4 * 1 * 8, dtype=torch.float32).reshape(NUM_SLOTS, 4, 1, 8)
    index = torch.tensor([[2, -1, 4, 0]])
    out = torch.full((2, 1, 4, 8), -1.0)
    gather_kv_triton(
        k_pool=k_pool,
        v_pool=k_pool,
        slots=torch.tensor([3]),
        index=index,
        start=torch.tensor([0]),
        stop=torch.tensor([4]),
        k_out=out[0],
        v_out=out[1],
    )
    assert torch.equal(out[0, 0, 0], k_pool[3, 2, 0])
    assert torch.equal(out[0, 0, 3], k_pool[3, 0, 0])
    assert bool((out[:, 0, 1:3] == -1.0).all())


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_gather_valid_on_the_kernel_matches_its_reference(layout: str) -> None:
    """index_ops.gather_valid dispatches to the gather kernel (outputs zeroed first); it must equal the reference,
    which gathers the whole grid and zeroes the padding, bit for bit."""
    gen = torch.Generator().manual_seed(13)
    batch, num_heads, k, num_tokens, head_dim = 3, 2, 9, 11, 16
    rows = batch * num_heads
    split = split_reorder_reference(
        make_index(rows, k, num_tokens, gen), make_mask(num_tokens, gen), make_slots(batch, gen), num_heads
    )
    slots = make_slots(batch, gen)
    k_pool = make_pool(num_tokens, num_heads, head_dim, torch.float16, layout)
    v_pool = make_pool(num_tokens, num_heads, head_dim, torch.float16, "contiguous")
    num_valid = split.num_remote + split.num_local
    got = torch.full((2, rows, k, head_dim), 3.0, dtype=torch.float16)
    want = torch.full((2, rows, k, head_dim), 3.0, dtype=torch.float16)
    assert kernels.use_triton(k_pool)
    index_ops.gather_valid(k_pool, v_pool, slots, split.index, num_valid, got[0], got[1])
    index_ops.gather_valid_reference(k_pool, v_pool, slots, split.index, num_valid, want[0], want[1])
    assert torch.equal(got, want)


# ---------------------------------------------------------------- launcher checks


def _split_args(**overrides):
    args = dict(
        index=torch.zeros(4, 3, dtype=torch.int64),
        mask=torch.zeros(NUM_SLOTS, 6, dtype=torch.int8),
        slots=torch.tensor([0, 1]),
        num_heads=2,
    )
    return {**args, **overrides}


def _gather_args(**overrides):
    args = dict(
        k_pool=torch.zeros(NUM_SLOTS, 6, 2, 8),
        v_pool=torch.zeros(NUM_SLOTS, 6, 2, 8),
        slots=torch.tensor([0, 1]),
        index=torch.zeros(4, 3, dtype=torch.int64),
        start=torch.zeros(4, dtype=torch.int32),
        stop=torch.full((4,), 3, dtype=torch.int32),
        k_out=torch.zeros(4, 3, 8),
        v_out=torch.zeros(4, 3, 8),
    )
    return {**args, **overrides}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"index": torch.zeros(4, 3, dtype=torch.int32)}, "index must be torch.int64"),
        ({"index": torch.zeros(5, 3, dtype=torch.int64)}, r"index must be \[B\*H, k\]"),
        ({"mask": torch.zeros(NUM_SLOTS, 6, dtype=torch.uint8)}, "mask must be torch.int8"),
        ({"mask": torch.zeros(6, dtype=torch.int8)}, "mask must be 3-D"),
        ({"slots": torch.tensor([0, 1], dtype=torch.int32)}, "slots must be torch.int64"),
        ({"num_heads": 0}, "num_heads must be a positive int"),
        ({"index": [[0, 1, 2]]}, "index must be a torch.Tensor"),
        ({"mask": torch.zeros(NUM_SLOTS, 6, dtype=torch.int8, device="meta")}, "mask is on meta"),
    ],
)
def test_split_reorder_rejects_bad_inputs(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_reorder_triton(**_split_args(**overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"v_pool": torch.zeros(NUM_SLOTS, 6, 2, 4)}, "v_pool shape"),
        ({"v_pool": torch.zeros(NUM_SLOTS, 6, 2, 8, dtype=torch.float16)}, "v_pool must be torch.float32"),
        ({"k_out": torch.zeros(4, 3, 8, dtype=torch.float16)}, "k_out must be torch.float32"),
        ({"v_out": torch.zeros(4, 4, 8)}, r"v_out must be \[R, k, d\] = \[4, 3, 8\]"),
        ({"start": torch.zeros(3, dtype=torch.int32)}, r"start must be \[R\] = \[4\]"),
        ({"stop": torch.zeros(4)}, "stop must be torch.int32 or torch.int64"),
        ({"index": torch.zeros(6, 3, dtype=torch.int64)}, r"index must be \[B\*H, k\]"),
        ({"k_pool": torch.zeros(NUM_SLOTS, 6, 16)}, "k_pool must be 4-D"),
    ],
)
def test_gather_kv_rejects_bad_inputs(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gather_kv_triton(**_gather_args(**overrides))


# ---------------------------------------------------------------- dispatch


def test_use_triton_follows_device_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(1)
    assert kernels.use_triton(cpu)
    assert kernels.use_triton(types.SimpleNamespace(is_cuda=True))
    monkeypatch.setenv("SMARTGEN_FORCE_TRITON", "0")
    assert not kernels.use_triton(cpu)
    monkeypatch.setenv("SMARTGEN_FORCE_TRITON", "1")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not kernels.use_triton(cpu)


def test_use_triton_is_false_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
            kernels.triton_available.cache_clear()
            assert not kernels.use_triton(torch.zeros(1))
            assert not kernels.use_triton(types.SimpleNamespace(is_cuda=True))
    finally:
        kernels.triton_available.cache_clear()
    assert kernels.use_triton(torch.zeros(1))


@pytest.mark.parametrize("forced", [True, False])
def test_index_ops_dispatch(monkeypatch: pytest.MonkeyPatch, forced: bool) -> None:
    calls = []
    for name in ("split_reorder_triton", "gather_kv_triton"):
        real = getattr(launch, name)
        monkeypatch.setattr(
            launch, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw)
        )
    if not forced:
        monkeypatch.delenv("SMARTGEN_FORCE_TRITON")

    gen = torch.Generator().manual_seed(1)
    batch, num_heads, k, num_tokens, head_dim = 2, 2, 7, 9, 17
    mask = make_mask(num_tokens, gen)
    slots = make_slots(batch, gen)
    index = make_index(batch * num_heads, k, num_tokens, gen)
    split = index_ops.split_reorder(index, mask, slots, num_heads)
    assert_split_equal(split, split_reorder_reference(index, mask, slots, num_heads))

    k_pool = make_pool(num_tokens, num_heads, head_dim, torch.float16, "strided")
    v_pool = make_pool(num_tokens, num_heads, head_dim, torch.float16, "contiguous")
    stop = split.num_remote + split.num_local
    got = torch.zeros(2, batch * num_heads, k, head_dim, dtype=torch.float16)
    want = got.clone()
    index_ops.gather_kv(k_pool, v_pool, slots, split.index, torch.zeros_like(stop), stop, got[0], got[1])
    gather_kv_reference(k_pool, v_pool, slots, split.index, torch.zeros_like(stop), stop, want[0], want[1])
    assert torch.equal(got, want)
    assert calls == (["split_reorder_triton", "gather_kv_triton"] if forced else [])
