"""bench/partial_attention_rtt.py: the partial attention it times merges to attention over every entry, and a short
run over a real loopback TCP lane prints a row per size and kind."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "bench" / "partial_attention_rtt.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("partial_attention_rtt", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parts_merge_to_attention_over_every_entry(bench) -> None:
    """The attention and merge the script times (the engine's own) against plain softmax attention per KV head."""
    generator = torch.Generator().manual_seed(3)
    heads, per_kv, dim, entries = 2, 4, 16, 90
    query = torch.randn(heads * per_kv, dim, generator=generator)
    k, v = torch.randn(entries, dim, generator=generator), torch.randn(entries, dim, generator=generator)
    head = torch.randint(0, heads, (entries,), generator=generator)
    out, stats = bench.partial_attention(query, k, v, head, heads)
    out, stats = out.view(heads, per_kv, dim), stats.view(heads, per_kv, 2)
    # against plain softmax attention, one KV head at a time
    for h in range(heads):
        mine = head == h
        scores = query.view(heads, per_kv, dim)[h] @ k[mine].T * dim**-0.5
        assert torch.allclose(out[h], torch.softmax(scores, -1) @ v[mine], atol=1e-6)
        assert torch.allclose(stats[h, :, 0], scores.amax(-1))
    cuts = [0, 17, 60, entries]  # three uneven parts
    parts = [bench.partial_attention(query, k[a:b], v[a:b], head[a:b], heads) for a, b in zip(cuts, cuts[1:])]
    assert torch.allclose(bench.merge_partials(parts).view(heads, per_kv, dim), out, atol=1e-6)
    assert bench.merge_error(heads, per_kv, dim) < 1e-5


def test_a_short_run_prints_both_kinds_for_each_size(bench, monkeypatch, capsys) -> None:
    argv = ["partial_attention_rtt.py", "--mbps", "10000", "--entries", "5,40", "--repeat", "2", "--layers", "2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--tokens", "64"])
    bench.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["5"], ["40"])]
    assert [(r[0], r[1]) for r in rows] == [("5", "fetch"), ("5", "attention"), ("40", "fetch"), ("40", "attention")]
    by = {(r[0], r[1]): int(r[2]) for r in rows}
    assert by[("40", "fetch")] == 40 * 2 * 32 * 2  # K and V of 40 entries, d 32, fp16
    assert by[("5", "attention")] == by[("40", "attention")] == 2 * 4 * (32 + 2) * 4  # whatever the entries


def test_bad_options_are_refused(bench, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["partial_attention_rtt.py", "--entries", "a,b"])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2
