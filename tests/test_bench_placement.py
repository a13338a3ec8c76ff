"""The bench's shared decode link and placement behind SGLang's router: the decode node gets `--ingress-gbps` and the
regime line says which pacing its /status reported; trace prompts as text encode to the ids the trace says; the
placement table and its refusals; (slow) a tiny trace replayed through the router with two decode nodes per policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from smartgen.apps.bench.config import BenchConfig, TraceSpec
from smartgen.apps.bench.goodput import SLOs
from smartgen.apps.bench.load import LoadRun
from smartgen.apps.bench.results import BenchResult, Regime
from smartgen.apps.bench.runner import _spec
from smartgen.apps.bench.tables import placement_table, regime_line
from smartgen.apps.bench.trace import TraceRequest, prompt_text, prompt_tokens, read_trace, single_token_words
from smartgen.apps.bench.watch import cache_counts, num_links
from smartgen.apps.cluster import ClusterSpec, LocalCluster
from smartgen.apps.router import RouterUnavailable, ensure_router
from smartgen.cli.app import app

runner = CliRunner()
REGIME = Regime(0.03, 4.7, 1024, {1024: 0.3}, {1024: 0.008}, 0.0, 0.02, 3072, 6)


def _text(console_width: int, *renderables: object) -> str:
    console = Console(width=console_width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    for renderable in renderables:
        console.print(renderable)
    return " ".join(console.export_text().split())


def test_shared_link_gives_the_decode_node_the_ingress_at_the_regime_rate_and_keeps_the_prefill_rate(
    tmp_path: Path,
) -> None:
    config = BenchConfig(schemes=("full",), strategies=(), prefill_nodes=(2,), shared_link=True)
    point = config.points()[0]
    spec = _spec(config, tmp_path, point, REGIME)
    assert spec.decode_extra[-2:] == ("--ingress-gbps", f"{REGIME.link_gbps:.9f}")
    assert spec.link_gbps == REGIME.link_gbps and spec.prefill_nodes == 2  # each prefill node keeps its own NIC
    assert num_links(config, point) == 1  # utilisation is over the one shared link
    plain = BenchConfig(schemes=("full",), strategies=(), prefill_nodes=(2,))
    assert "--ingress-gbps" not in _spec(plain, tmp_path, plain.points()[0], REGIME).decode_extra
    assert num_links(plain, plain.points()[0]) == 2


def test_the_regime_line_says_which_pacing_the_decode_node_reported(tmp_path: Path) -> None:
    config = BenchConfig(schemes=("full",), strategies=(), prefill_nodes=(2,), shared_link=True)
    result = BenchResult(config, "m", False, config.points(), [REGIME])
    REGIME.link = {"pacing": "shared ingress", "ingress_gbps": 0.03}
    line = regime_line(result, 0)
    assert "pacing: shared ingress, one 30.0 Mbit/s link into the decode node for 2 prefill nodes" in line
    REGIME.link = {"pacing": "per prefill node", "ingress_gbps": None}
    assert "pacing: per prefill node (2 prefill nodes, a link each)" in regime_line(result, 0)
    REGIME.link = {}
    assert "pacing" not in regime_line(result, 0)


@pytest.mark.slow  # real node processes: about 15 s here
def test_a_decode_node_started_as_the_bench_starts_it_reports_the_shared_ingress(tmp_path: Path) -> None:
    """The flags of `_spec` on real processes: the decode node's /status link is what the regime line reads."""
    from smartgen.apps.bench.models import resolve_model
    from smartgen.apps.bench.watch import read_link

    model, _ = resolve_model("random:3", 0)
    config = BenchConfig(model="random:3", schemes=("full",), strategies=(), shared_link=True, separate_cpus=False)
    spec = _spec(config, model, config.points()[0], REGIME)
    with LocalCluster(ClusterSpec(**{**_fields(spec), "max_tokens": 256})) as cluster:
        link = read_link(cluster.url)
        prefill = cluster.status()["prefill"][0]["link"]
    assert link["pacing"] == "shared ingress" and link["ingress_gbps"] == pytest.approx(REGIME.link_gbps)
    assert prefill["egress_gbps"] == pytest.approx(REGIME.link_gbps)


def _fields(spec: ClusterSpec) -> dict:
    return {name: getattr(spec, name) for name in ClusterSpec.__dataclass_fields__}


def test_text_prompts_encode_to_the_ids_their_blocks_say() -> None:
    """Equal hash ids give equal text blocks, one token per word, so the caches see the same reuse as with ids."""
    from transformers import AutoTokenizer

    from smartgen.apps.bench.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("random:3", 0)[0])
    words = single_token_words(tokenizer)
    a = TraceRequest(0, 0.0, 32, 4, (7, 8))
    b = TraceRequest(1, 0.0, 32, 4, (7, 9))
    text_a, text_b = prompt_text(a, 16, words), prompt_text(b, 16, words)
    ids_a = tokenizer.encode(text_a, add_special_tokens=False)
    assert len(ids_a) == 32 and ids_a == [tokenizer.encode(w, add_special_tokens=False)[0] for w in _words(text_a)]
    ids_b = tokenizer.encode(text_b, add_special_tokens=False)
    assert ids_a[:16] == ids_b[:16] and ids_a[16:32] != ids_b[16:32]
    assert prompt_tokens(a, 16, 3 + len(words)) != ids_a  # words, not ids: the same draw, other tokens


def _words(text: str) -> list[str]:
    return [" " + w for w in text.split(" ") if w]


def test_the_decode_nodes_of_a_router_run_are_summed() -> None:
    link = {"push": {"bytes_sent": 100}, "control": {"bytes_sent": 10}}
    node = {"prefix_cache": {"lookup_tokens": 50, "hit_tokens": 20}, "links": [link]}
    status = {"decode": [node, node], "prefill": [{"prefix_cache": {}, "links": [link, link]}]}
    counts = cache_counts(status)
    assert counts["decode_lookup"] == 100 and counts["decode_hit"] == 40 and counts["egress"] == 220


def test_the_placement_table_has_a_row_per_scheme_and_policy(tmp_path: Path) -> None:
    config = BenchConfig(
        schemes=("full",), strategies=(), trace=TraceSpec(tmp_path), decode_nodes=2, routers=("cache_aware",)
    )
    result = BenchResult(config, "m", False, config.points(), [REGIME])
    record = {"outcome": "served", "ttft": 0.5, "ttst": 0.75, "tbt": 0.01, "output_tokens": 4, "itl": [], "e2e": 1}
    nodes = {"prefix_hit_rate": {"decode": 0.25, "prefill": 0.5}, "link_bytes": 2e6, "link_bytes_back": 1e4}
    for router in ("cache_aware", "round_robin"):
        run = LoadRun(0, "full", None, 5.0, 2.0, SLOs(ttft_s=1), [record], mode="trace", nodes=nodes, router=router)
        result.loads.append(run)
    text = _text(80, placement_table(result, 0))
    assert "full/cache_aware 25.0 50.0 2.0 0.01 500 500 750 750" in text
    assert "full/round_robin" in text
    result.loads = [LoadRun(0, "full", None, 5.0, 2.0, SLOs(ttft_s=1), [record], mode="trace", nodes=nodes)]
    assert placement_table(result, 0) is None


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--decode-nodes", "2"], "--decode-nodes above 1 runs in trace mode behind the router"),
        (["--trace", "TRACE", "--router", "cache_aware"], "give --decode-nodes 2 or more"),
        (["--trace", "TRACE", "--decode-nodes", "2", "--router", "nearest"], "unknown: nearest"),
        (["--shared-link", "--lane", "inproc"], "--shared-link paces what the tcp lane's sockets read"),
        (["--trace", "TRACE", "--decode-nodes", "2", "--router", "round_robin", "--router-python", "/nonexistent"],
         "cannot import sglang_router"),
    ],
)  # fmt: skip
def test_bench_refuses_bad_placement_options_in_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 100, "output_length": 4, "hash_ids": [1]}) + "\n")
    args = [str(trace) if a == "TRACE" else a for a in args]
    result = runner.invoke(app, ["bench", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split()) and "Traceback" not in result.output


# (timestamp ms, input_length, output_length, hash_ids): conversations 10-11-.. and 20-21-.., each turn extending its
# own; the third and fourth turns of each find their prefix on the node the router sent the earlier turn to
TINY = [
    (0, 1300, 48, [10, 11, 12]),
    (400, 1300, 48, [20, 21, 22]),
    (2000, 1800, 48, [10, 11, 12, 13]),
    (2400, 1800, 48, [20, 21, 22, 23]),
    (4000, 2300, 48, [10, 11, 12, 13, 14]),
    (4400, 2300, 48, [20, 21, 22, 23, 24]),
]


@pytest.mark.slow  # a pilot and fresh nodes plus the router per policy: about two minutes here
def test_a_tiny_trace_replays_through_the_router_per_policy(tmp_path: Path) -> None:
    try:
        ensure_router(install=False)
    except RouterUnavailable as exc:
        pytest.skip(f"SGLang's router cannot be had here: {exc}")
    trace = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) for t, n, o, ids in TINY
    ]
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "smartgen", "bench", "--model", "random:3", "--trace", str(trace)]
    command += ["--length-scale", "0.125", "--blocks", "32", "--schemes", "full", "--strategies", "", "--out", str(out)]
    command += ["--decode-nodes", "2", "--router", "cache_aware,round_robin", "--shared-link"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    flat = " ".join(done.stdout.split())
    assert "placement over 2 decode nodes by SGLang's router" in flat
    assert "full/cache_aware" in flat and "full/round_robin" in flat
    assert "pacing: shared ingress" in flat
    data = json.loads((out / "results.json").read_text())
    requests = read_trace(trace, length_scale=0.125).requests
    assert [(run["scheme"], run["router"]) for run in data["loads"]] == [
        ("full", "cache_aware"),
        ("full", "round_robin"),
    ]
    for run in data["loads"]:
        records = run["requests"]
        assert [r["outcome"] for r in records] == ["served"] * 6, [r.get("error") for r in records]
        assert [r["prompt_tokens"] for r in records] == [r.input_tokens + 1 for r in requests]  # the text, and BOS
        assert run["nodes"]["link_bytes"] > 0 and run["nodes"]["prefix_lookup_tokens"]["decode"] > 0
    assert data["points"][0]["regime"]["link"]["pacing"] == "shared ingress"
