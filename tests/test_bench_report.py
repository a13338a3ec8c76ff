"""What `smartgen bench` reports, on synthetic rounds: medians and spread across rounds, the 80-column tables,
accuracy against full, the client's timings beside the node's, the joins of a batch, the bandwidth figure's series,
the phases its progress bar shows, and its --help."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from smartgen.apps.bench.config import BenchConfig, Point
from smartgen.apps.bench.figures import bandwidth_series, link_panels
from smartgen.apps.bench.joins import find_joins
from smartgen.apps.bench.load import LoadRun
from smartgen.apps.bench.output import write_outputs
from smartgen.apps.bench.phases import Phases
from smartgen.apps.bench.runner import BenchResult, Group, Regime, step_deltas, thread_deltas
from smartgen.apps.bench.stats import summarize
from smartgen.apps.bench.tables import fetch_waits_table, load_table, point_tables, regime_line, steps_table
from smartgen.cli.app import app

runner = CliRunner()
SCHEMES = ("full", "partial+profile+parallel", "smartgen")


def _regime(gbps: float = 0.03) -> Regime:
    return Regime(gbps, 4.7, 1024, {1024: 0.3}, {1024: 0.008}, 0.0, 0.02, 3072, 6)


LAG = 0.002  # the client's TTFT and TTST over the node's in these rounds


def _request(ttft: float, ttst: float, tbt: float, score: float | None = 1.0) -> dict:
    node = {"node_ttft": ttft - LAG, "node_ttst": ttst - LAG, "node_tbt": tbt}
    return {"ttft": ttft, "ttst": ttst, "tbt": tbt, **node, "score": score, "error": None, "prompt_tokens": 1024}


def _group(scheme: str, rep: int, requests: list[dict], point: int = 0, back: int = 0) -> Group:
    return Group(point, scheme, rep, rep == 0, 2.0, requests, {"full": 10**6}, 10, 0.001, 10**6, back)


def _rounds_result() -> BenchResult:
    """One warm-up round (rep 0, far off) and three measured ones of a batch of three per scheme; smartgen is
    twice as fast as full to its second token, half as accurate, and its third round has a failed request."""
    config = BenchConfig(schemes=SCHEMES, strategies=("sequential",), batch=(3,), reps=3)
    groups = []
    for k, scheme in enumerate(config.all_schemes):
        scale = 0.5 if scheme == "smartgen" else 1.0
        score = 0.5 if scheme == "smartgen" else 1.0
        groups.append(_group(scheme, 0, [_request(9.0, 99.0, 9.0)] * 3))  # warm-up: left out of everything
        for rep, base in ((1, 1.0), (2, 1.4), (3, 1.2)):
            requests = [_request(0.3, scale * (base + d), 0.010 + 0.001 * rep + d / 100, score) for d in (0, 0.1, 0.5)]
            if scheme == "smartgen" and rep == 3:
                requests[0] = {"error": "HTTP Error 500", "task": "passkey"}
            groups.append(_group(scheme, rep, requests, back=1000 * (k + 1)))
    return BenchResult(config, "m", True, [Point(3, 1024, 4.7, 256, 0.2, 0.1, 1)], [_regime()], groups)


def test_medians_and_spread_are_over_measured_rounds() -> None:
    result = _rounds_result()
    summaries = {s.scheme: s for s in summarize(result)}
    full, ours = summaries["full"], summaries["smartgen"]
    # each round's median request (1.0 + 0.1, ...), in round order; the warm-up's 99 s nowhere
    assert full.rounds["ttst"]["per_round"] == pytest.approx([1.1, 1.5, 1.3])
    assert (full.rounds["ttst"]["median"], full.rounds["ttst"]["min"], full.rounds["ttst"]["max"]) == pytest.approx(
        (1.3, 1.1, 1.5)
    )
    assert full.rounds["tbt"]["per_round"] == pytest.approx([0.012, 0.013, 0.014])
    # a failed request leaves its round's median to the others: (0.5 * 1.3, 0.5 * 1.7) -> 0.75
    assert ours.rounds["ttst"]["per_round"] == pytest.approx([0.55, 0.75, 0.75])
    assert ours.failed == 1 and ours.ttst["max"] < 9
    assert ours.vs_full["ttst_speedup_median"] == pytest.approx(1.3 / 0.75)
    assert ours.vs_full["tbt_median"] == pytest.approx(0.013 / 0.013)
    assert ours.vs_full["accuracy"] == pytest.approx(0.5)
    # the decode node's bytes back, over the same rate x wall time as the KV's direction
    rate = 0.03e9 / 8
    assert full.link_utilisation_back == pytest.approx(3 * 1000 / (rate * 6.0))
    assert summaries["smartgen[sequential]"].link_utilisation_back == pytest.approx(3 * 4000 / (rate * 6.0))


def test_the_files_hold_the_spread_and_the_way_back(tmp_path: Path) -> None:
    result = _rounds_result()
    written = write_outputs(result, summarize(result), tmp_path)
    assert tmp_path / "summary.csv" in written
    with (tmp_path / "summary.csv").open() as handle:
        rows = {row["scheme"]: row for row in csv.DictReader(handle)}
    full = rows["full"]
    assert int(full["rounds"]) == 3
    assert float(full["ttst_round_median_s"]) == pytest.approx(1.3)
    assert (float(full["ttst_round_min_s"]), float(full["ttst_round_max_s"])) == pytest.approx((1.1, 1.5))
    assert float(full["tbt_round_max_s"]) == pytest.approx(0.014)
    assert float(rows["smartgen"]["ttst_speedup_median_vs_full"]) == pytest.approx(1.3 / 0.75)
    assert float(rows["smartgen"]["accuracy_vs_full"]) == pytest.approx(0.5)
    assert float(full["link_utilisation_back"]) > 0
    assert full["decode_emulation"] == "native"  # this regime emulates nothing


@pytest.mark.parametrize(("added", "floor", "says"), [(3.1, 0.0, "added"), (0.0, 4.7, "floor")])
def test_the_files_and_the_regime_line_say_how_the_decode_device_was_emulated(
    tmp_path: Path, added: float, floor: float, says: str
) -> None:
    result = _rounds_result()
    result.regimes[0].emulate_layer_ms, result.regimes[0].emulate_floor_ms = added, floor
    write_outputs(result, summarize(result), tmp_path)
    with (tmp_path / "summary.csv").open() as handle:
        assert {row["decode_emulation"] for row in csv.DictReader(handle)} == {says}
    assert ("each layer at least 4.70 ms (floor)" if floor else "+ 3.10 ms/layer emulated") in regime_line(result, 0)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["summaries"][0]["rounds"]["ttst"]["per_round"] == pytest.approx([1.1, 1.5, 1.3])


def _render(tables: tuple, width: int) -> list[str]:
    console = Console(width=width, file=io.StringIO(), record=True)
    for table in tables:
        console.print(table)
    return console.export_text().splitlines()


def test_the_tables_show_medians_spread_and_accuracy_vs_full_within_80_columns() -> None:
    result = _rounds_result()
    tables = point_tables(result, summarize(result), 0)
    lines = _render(tables, 80)
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if line.lstrip().startswith("scheme") and "TTST" in line)
    assert header.split() == ["scheme", "TTFT", "TTST", "rng", "TBT", "rng", "p99", "TTST", "x", "TBT", "x", "bound"]
    full = next(line.split() for line in lines if line.split()[:1] == ["full"])
    # TTFT, TTST median 1300 ms, range 1500 - 1100 = 400, TBT median 13 ms, range 2 ms, p99 of the nine
    # requests' TBTs 17.9 ms, TTST x 1.00 (of medians)
    assert full[1:7] == ["300", "1300", "400", "13", "2", "18"] and full[7] == "1.00"
    ours = [line.split() for line in lines if line.split()[:1] == ["smartgen"]]
    assert ours[0][2:4] == ["750", "200"] and ours[0][7] == f"{1.3 / 0.75:.2f}"
    acc = ours[2]  # the transfers table (after the timings and the node's clock): acc% and acc x
    assert acc[-2:] == ["50.0", "0.50"]
    assert "(1" in " ".join(acc) and "failed)" in " ".join(acc)  # "smartgen (1 failed)"
    for scheme in (*SCHEMES, "smartgen[sequential]"):  # names stay whole at any width
        for width in (80, 60):
            assert any(line.split()[:1] == [scheme] for line in _render(tables, width))
    assert not any("…" in line for line in _render(tables, 60))  # narrower: folded, never cut


def test_one_round_shows_no_spread() -> None:
    result = _rounds_result()
    result.groups = [g for g in result.groups if g.rep in (0, 1)]
    lines = _render(point_tables(result, summarize(result), 0), 80)
    full = next(line.split() for line in lines if line.split()[:1] == ["full"])
    assert full[2:4] == ["1100", "-"]


def test_the_nodes_clock_sits_beside_the_clients_in_the_tables_and_files(tmp_path: Path) -> None:
    result = _rounds_result()
    result.regimes[0].batch_step_s = {1024: {3: 0.01}}  # the pilot's all-local step of the batch of three
    summaries = {s.scheme: s for s in summarize(result)}
    full = summaries["full"]
    assert full.node_ttft["mean"] == pytest.approx(0.3 - LAG) and full.ttft["mean"] == pytest.approx(0.3)
    assert full.rounds["node_ttst"]["median"] == pytest.approx(1.3 - LAG)
    assert full.minus_node["ttft"]["p50"] == pytest.approx(LAG) and full.minus_node["tbt"]["max"] == 0.0
    assert summaries["smartgen"].vs_full["ttst_speedup_median"] == pytest.approx(1.3 / 0.75)  # the client's
    lines = _render(point_tables(result, list(summaries.values()), 0), 80)
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if line.lstrip().startswith("scheme") and "Δ" in line)
    assert header.split() == ["scheme", "TTFT", "Δ", "max", "TTST", "Δ", "TBT", "Δ", "short", "loc", "x"]
    node_row = [line.split() for line in lines if line.split()[:1] == ["full"]][1]
    assert node_row[1:-1] == ["298", "2.0", "2.0", "1298", "2.0", "13", "0.0", "0"]
    # loc x: the client's mean TBT over the pilot's all-local step at the batch (10 ms, no emulation here)
    assert full.tbt_local == pytest.approx(0.01) and node_row[-1] == f"{full.tbt['mean'] / 0.01:.2f}"
    write_outputs(result, list(summaries.values()), tmp_path)
    with (tmp_path / "summary.csv").open() as handle:
        row = next(r for r in csv.DictReader(handle) if r["scheme"] == "full")
    assert float(row["node_ttft_mean_s"]) == pytest.approx(0.3 - LAG)
    assert float(row["ttft_minus_node_max_s"]) == pytest.approx(LAG)
    assert float(row["node_ttst_round_median_s"]) == pytest.approx(1.3 - LAG)
    assert float(row["tbt_local_s"]) == pytest.approx(0.01)
    assert float(row["tbt_vs_local"]) == pytest.approx(full.tbt["mean"] / 0.01)
    assert row["joins"] == "0" and row["join_p99_median_s"] == ""  # a batch sent at once, no timings: no join


def _times(start: float, gap: float, count: int) -> list[float]:
    return [round(start + i * gap, 6) for i in range(count)]


def _timed(sent: float, ctl: list[float]) -> dict:
    """A finished request of a round: sent `sent` s after the round began, its chunks at `ctl` from then."""
    return {**_request(ctl[0], ctl[1], 0.01), "sent": sent, "ctl": ctl}


def _joining_round() -> list[dict]:
    """A decodes every 10 ms from 1.1 s to 2.0 s but for one 400 ms gap (1.5 - 1.9 s); B, sent 5 ms later, gets its
    first token at 1.455 s and its second at 1.955 s: it joins A, and its window holds that gap. C failed; D starts
    after A and B are done, so it joins nobody; A joined nobody either (B was not decoding yet)."""
    a = [1.0, *_times(1.1, 0.01, 41), *_times(1.9, 0.01, 11)]
    b = _timed(0.005, [1.45, 1.95, 1.96, 1.97])
    return [_timed(0.0, a), b, {"error": "HTTP 503: overloaded", "task": "passkey"}, _timed(0.0, _times(3.0, 0.01, 5))]


def test_a_join_reports_the_p99_of_the_running_requests_gaps_in_its_window() -> None:
    [join] = find_joins(_joining_round())
    assert (join.request, join.running) == (1, 1)
    assert (join.start, join.end) == pytest.approx((1.455, 1.955))
    # A's gaps overlapping (1.455, 1.955): five of 10 ms before 1.5 s, the 400 ms one, six of 10 ms from 1.9 s
    assert join.gaps == 12
    assert join.p99 == pytest.approx(0.01 + 0.39 * (11 * 0.99 - 10))  # linear between the 11th and 12th gap
    assert find_joins([_timed(0.0, _times(1.0, 0.01, 5))]) == []  # alone: no join
    # X starts decoding (1.3 s) while Y waits for its second token (0.9 - 2.45 s): Y joined X all the same
    x, y = _timed(0.0, [0.6, *_times(1.3, 0.1, 15)]), _timed(0.0, [0.9, 2.45, 2.5])
    [join] = find_joins([x, y])
    assert (join.request, join.running, join.gaps) == (1, 1, 12) and join.p99 == pytest.approx(0.1)
    assert find_joins([]) == []
    # the prefill node gave Y's second token (0.95 s): its window runs to its third, the first its decode node
    # computed, and Y waiting for that step (0.95 - 2.45 s) is not decoding: its long gap stretches nobody
    y = {**_timed(0.0, [0.9, 0.95, 2.45, 2.5]), "prefill_tokens": 2}
    [join] = find_joins([x, y])
    assert (join.request, join.end, join.gaps) == (1, pytest.approx(2.45), 12) and join.p99 == pytest.approx(0.1)
    # Z decodes from 1.7 s: it joins X alone (Y, waiting for its step until 2.45 s, is not decoding then), and Y
    # joins X and Z
    z = {**_timed(0.0, [1.0, 1.05, *_times(1.7, 0.1, 10)]), "prefill_tokens": 2}
    assert [(j.request, j.running) for j in find_joins([x, y, z])] == [(1, 2), (2, 1)]


def test_joins_reach_the_summary_the_waits_table_and_the_files(tmp_path: Path) -> None:
    config = BenchConfig(schemes=("full", "smartgen"), strategies=(), batch=(4,), reps=1, warmup=0)
    groups = []
    for scheme, scale in (("full", 1.0), ("smartgen", 2.0)):  # smartgen's stall twice as long
        requests = _joining_round()
        a = requests[0]["ctl"]
        requests[0]["ctl"] = [t if t <= 1.5 else 1.5 + scale * (t - 1.5) for t in a]
        group = _group(scheme, 0, requests)
        group.warmup = False
        group.joins = [asdict(j) for j in find_joins(requests)]
        groups.append(group)
    result = BenchResult(config, "m", True, [Point(4, 1024, 4.7, 256, 0.2, 0.1, 1)], [_regime()], groups)
    summaries = {s.scheme: s for s in summarize(result)}
    assert summaries["full"].joins == 1 and summaries["smartgen"].joins == 1
    full_p99, ours_p99 = summaries["full"].join_p99["p50"], summaries["smartgen"].join_p99["p50"]
    assert full_p99 == pytest.approx(groups[0].joins[0]["p99"]) and ours_p99 > full_p99 > 0.3
    lines = _render(point_tables(result, list(summaries.values()), 0), 80)
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if line.lstrip().startswith("scheme") and "cov1%" in line)
    assert header.split()[-2:] == ["join", "rtt"]
    waits = [line.split() for line in lines if line.split()[:1] == ["full"]][3]
    assert waits[-2:] == [f"{full_p99 * 1e3:.0f}", "-"]  # no fetches: no round trip
    write_outputs(result, list(summaries.values()), tmp_path)
    with (tmp_path / "summary.csv").open() as handle:
        rows = {r["scheme"]: r for r in csv.DictReader(handle)}
    assert rows["smartgen"]["joins"] == "1"
    assert float(rows["smartgen"]["join_p99_max_s"]) == pytest.approx(ours_p99)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["groups"][0]["joins"][0]["request"] == 1 and data["summaries"][1]["joins"] == 1


def test_the_load_table_shows_the_clients_ttft_minus_the_nodes_within_80_columns() -> None:
    config = BenchConfig(schemes=("full", "partial+profile+parallel"), strategies=(), load_rate=(2.0,))
    requests = [
        {"ttft": 0.5 + i / 100, "node_ttft": 0.497 + i / 100, "tbt": 0.01, "outcome": "served", "error": None}
        for i in range(5)
    ] + [{"outcome": "failed", "error": "HTTP 503: overloaded"}]
    runs = [LoadRun(0, scheme, 2.0, 30.0, 31.0, config.slos(), requests) for scheme in config.all_schemes]
    result = BenchResult(config, "m", False, config.points(), [_regime()], loads=runs)
    assert runs[0].ttft_minus_node() == pytest.approx({"p50": 0.003, "max": 0.003})
    lines = _render((load_table(result, 0),), 80)
    assert max(len(line) for line in lines) <= 80
    row = next(line.split() for line in lines if line.split()[:1] == ["partial+profile+parallel"])
    assert row[-1] == "3.0"
    assert not any("…" in line for line in lines)


def _sweep(config: BenchConfig) -> tuple[BenchResult, list]:
    """A result of `config`'s points with no rounds, each summary's mean TTST set to batch + Gbit/s (+ 0.5 for
    smartgen): a value that says which point and scheme it came from."""
    points = config.points()
    result = BenchResult(config, "m", True, points, [_regime(p.link) for p in points])
    summaries = summarize(result)
    for s in summaries:
        point = points[s.point]
        s.ttst["mean"] = point.batch + point.link + (0.5 if s.scheme == "smartgen" else 0.0)
    return result, summaries


def _flat(pairs: list[tuple[float, float]]) -> list[float]:
    return [v for pair in pairs for v in pair]


def test_bandwidth_lines_never_mix_batch_sizes() -> None:
    config = BenchConfig(schemes=("full", "smartgen"), strategies=(), batch=(1, 2), link_gbps=(0.1, 0.02, 0.05))
    series = bandwidth_series(*_sweep(config))
    assert list(series) == ["batch 1", "batch 2"]
    for title, batch in (("batch 1", 1), ("batch 2", 2)):
        assert list(series[title]) == ["full", "smartgen"]
        rates = (0.02, 0.05, 0.1)  # sorted by rate, each point of this batch once
        assert _flat(series[title]["full"]) == pytest.approx(_flat([(g, batch + g) for g in rates]))
        assert _flat(series[title]["smartgen"]) == pytest.approx(_flat([(g, batch + g + 0.5) for g in rates]))
    # only the link swept: one untitled panel; two sweeps besides it: every combination, both named
    alone = BenchConfig(schemes=("full",), strategies=(), link_gbps=(0.02, 0.05))
    assert list(bandwidth_series(*_sweep(alone))) == [""]
    both = BenchConfig(schemes=("full",), strategies=(), batch=(1, 2), lengths=(512, 1024), link_gbps=(0.02, 0.05))
    series = bandwidth_series(*_sweep(both))
    assert sorted(series) == sorted(f"batch {b}, {n} tokens" for b in (1, 2) for n in (512, 1024))
    assert all(len(line) == 2 for panel in series.values() for line in panel.values())


def test_phases_report_a_total_wherever_one_is_known() -> None:
    seen: list[tuple[str, int, int | None]] = []
    phases = Phases(lambda what, done, total: seen.append((what, done, total)))
    phases.start("model", None, "loading the model")
    phases.say("no profile yet: profiling 8 calibration prompts")
    phases.start("pilot", 2)
    phases.step("pilot: 512 tokens")
    phases.step("pilot: 512 tokens")
    phases.start("rounds", 3, "starting the paced nodes")
    phases.say("starting nodes")
    for _ in range(3):
        phases.step("full")
    phases.end()
    assert seen[:2] == [("loading the model", 0, None), ("no profile yet: profiling 8 calibration prompts", 0, None)]
    assert seen[2:5] == [("pilot", 0, 2), ("pilot: 512 tokens", 1, 2), ("pilot: 512 tokens", 2, 2)]
    assert [done for _, done, total in seen[5:]] == [0, 0, 1, 2, 3] and {t for _, _, t in seen[5:]} == {3}
    recorded = phases.to_json()
    assert [(p["phase"], p["done"], p["total"]) for p in recorded] == [
        ("model", 0, None),
        ("pilot", 2, 2),
        ("rounds", 3, 3),
    ]
    assert all(p["seconds"] >= 0 for p in recorded)


def test_the_bar_gives_each_phase_its_own_task() -> None:
    from smartgen.cli.bench import phase_bar

    console = Console(file=io.StringIO(), width=100)
    with phase_bar(console) as (bar, progress):
        progress("loading the model", 0, None)
        assert [(t.description, t.total) for t in bar.tasks] == [("loading the model", None)]
        progress("pilot", 0, 4)  # a total now: a new task, whose ETA is the pilot's alone
        progress("pilot: 512 tokens", 3, 4)
        [pilot] = bar.tasks
        assert (pilot.description, pilot.completed, pilot.total) == ("pilot: 512 tokens", 3, 4)
        progress("starting the paced nodes", 0, 24)  # done drops: the rounds' own task
        progress("full (batch 1, 512 tokens)", 1, 24)
        [rounds] = bar.tasks
        assert rounds.id != pilot.id and (rounds.completed, rounds.total) == (1, 24)


def _help(command: str) -> str:
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.replace("│", " ").split())


def test_bench_help_keeps_every_default() -> None:
    text = _help("bench")
    for default in (
        "prompt lengths in tokens (default 2048; 1024 with --quick)",
        "KV blocks M per layer (default 1024; 256 with --quick)",
        "EOS ignored (default 64; 16 with --quick)",
        "(default 3; 1 with --quick)",
        "passkey, niah_single, niah_multikey, kv_retrieval, vt",
        "[default: passkey,niah_single]",
    ):
        assert default in text
    assert " ." not in text  # what rich leaves where it took help text for markup


def test_bench_tasks_must_be_eval_suite_tasks() -> None:
    from smartgen.apps.bench.config import DEFAULT_TASKS
    from smartgen.cli.bench import DEFAULT_TASKS as CLI_DEFAULT_TASKS

    assert CLI_DEFAULT_TASKS == DEFAULT_TASKS  # the CLI keeps its own copy so --help imports no torch
    for tasks, says in (("passkey,needles", "unknown: needles"), (",", "none given")):
        result = runner.invoke(app, ["bench", "--tasks", tasks], env={"COLUMNS": "200"})
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --tasks must name some of passkey, niah_single")
        assert says in lines[0] and "Traceback" not in result.output + result.stderr


def test_the_decode_step_by_batch_size_reaches_the_summary_and_its_table() -> None:
    """The decode node counts each step's wall, its thread's CPU, the emulated compute, the link waits and the times
    it was preempted by batch size; a group holds the difference over its round, the summary the mean per step and
    the rest as `other`; a results file from before the preemption count still reads, with "-" for it."""
    from smartgen.engine.metrics import PathCounters

    counters = PathCounters()
    counters.add_step(1, 0.5, 0.2, 0.1, 0.1, 3)
    before = {
        f"steps.{b}.{name}": value for b, parts in counters.snapshot()["steps"].items() for name, value in parts.items()
    }
    counters.add_step(4, 0.6, 0.3, 0.1, 0.05, 7)
    counters.add_step(4, 0.4, 0.2, 0.1, 0.05, 5)
    after = {
        f"steps.{b}.{name}": value for b, parts in counters.snapshot()["steps"].items() for name, value in parts.items()
    }
    deltas = step_deltas(before, after)
    assert list(deltas) == ["4"]  # batch 1 ran no step in between: left out
    # the decode node's threads over a group: busiest first, idle ones left out, a replaced thread from zero
    threads_before = {"threads.decode-scheduler": 5.0, "threads.http-api": 1.0, "threads.decode.push-rx": 3.0}
    threads_after = {"threads.decode-scheduler": 7.5, "threads.http-api": 1.0, "threads.decode.push-rx": 0.4}
    assert thread_deltas(threads_before, threads_after) == {"decode-scheduler": 2.5, "decode.push-rx": 0.4}
    assert deltas["4"] == pytest.approx([2, 1.0, 0.5, 0.2, 0.1, 12])
    result = _rounds_result()
    for group in result.groups:
        group.steps = {"4": [2, 1.0, 0.5, 0.2, 0.1, 12]} if group.scheme == "smartgen" else {}
    summaries = summarize(result)
    ours = next(s for s in summaries if s.scheme == "smartgen")
    # the measured rounds' steps (three rounds of two): means per step; other = wall - cpu - emulated - wait
    assert ours.step_by_batch["4"] == pytest.approx(
        {"steps": 6, "wall_s": 0.5, "cpu_s": 0.25, "emulated_s": 0.1, "wait_s": 0.05, "other_s": 0.1, "preempted": 6}
    )
    assert all(not s.step_by_batch for s in summaries if s.scheme != "smartgen")
    lines = _render((steps_table(summaries, 0),), 80)
    assert max(len(line) for line in lines) <= 80
    assert next(line.split() for line in lines if line.split()[:1] == ["smartgen"]) == [
        "smartgen",
        "4",
        "6",
        "500",
        "250",
        "100",
        "50",
        "100",
        "6",
    ]
    for group in result.groups:  # an older results file: five fields a batch size, no preemption count
        group.steps = {"4": [2, 1.0, 0.5, 0.2, 0.1]} if group.scheme == "smartgen" else {}
    older = next(s for s in summarize(result) if s.scheme == "smartgen").step_by_batch["4"]
    assert "preempted" not in older and older["other_s"] == pytest.approx(0.1)
    assert (
        next(line.split() for line in _render((steps_table(summarize(result), 0),), 80) if "smartgen" in line)[-1]
        == "-"
    )
    for group in result.groups:
        group.steps = {}
    assert steps_table(summarize(result), 0) is None  # nothing recorded (an older results file): no table


def test_a_steps_fetch_waits_by_kind_reach_the_summary_the_table_and_the_files(tmp_path: Path) -> None:
    """fetch_wait_by_kind: the decode steps' waits for fetch replies, by the kind waited for, per step over the
    measured rounds (the warm-up left out); none from results that predate the waits, nor where no step ran."""
    result = _rounds_result()
    for group in result.groups:
        if group.scheme == "smartgen":
            group.steps = {"3": [4, 1.0, 0.5, 0.2, 0.1, 0]}
            group.fetch_kinds = {"step": [10, 0.05, 0.08], "prefetch": [5, 0.04, 0.02], "forecast": [1, 0.5, 0.0]}
    summaries = {s.scheme: s for s in summarize(result)}
    # three measured rounds of four steps: 3 x 0.08 s over 12 steps is 20 ms a step
    assert summaries["smartgen"].fetch_wait_by_kind == pytest.approx({"step": 0.02, "prefetch": 0.005, "forecast": 0})
    assert summaries["full"].fetch_wait_by_kind == {}
    lines = _render((fetch_waits_table(list(summaries.values()), 0),), 80)
    assert next(line.split() for line in lines if line.split()[:1] == ["smartgen"]) == [
        "smartgen",
        "20.0",
        "5.0",
        "0.0",
    ]
    assert not any(line.split()[:1] == ["full"] for line in lines)
    write_outputs(result, list(summaries.values()), tmp_path)
    with (tmp_path / "summary.csv").open() as handle:
        rows = {r["scheme"]: r for r in csv.DictReader(handle)}
    assert float(rows["smartgen"]["fetch_wait_step_s"]) == pytest.approx(0.02)
    assert rows["full"]["fetch_wait_prefetch_s"] == ""
    for group in result.groups:  # an older results file: two fields a kind, no waits
        group.fetch_kinds = {kind: values[:2] for kind, values in group.fetch_kinds.items()}
    older = summarize(result)
    assert all(s.fetch_wait_by_kind == {} for s in older) and fetch_waits_table(older, 0) is None


def test_late_hints_reach_the_summary_and_the_files(tmp_path: Path) -> None:
    """late_hint_share: of the entries decode steps fetched for themselves, over the measured rounds' requests, the
    share an earlier idle notice had hinted; none where no step fetched (full transfer)."""
    result = _rounds_result()
    for group in result.groups:
        for request in group.requests:
            if group.scheme == "smartgen" and "error" in request and request["error"] is None:
                request["step_fetched"], request["step_fetched_hinted"] = 40, 30 if group.rep == 1 else 10
    summaries = {s.scheme: s for s in summarize(result)}
    # rounds 1-3 (the warm-up left out): three requests of 30 of 40, five of 10 of 40 (one of round 3 failed)
    assert summaries["smartgen"].late_hint_share == pytest.approx((3 * 30 + 5 * 10) / (8 * 40))
    assert summaries["full"].late_hint_share is None
    write_outputs(result, list(summaries.values()), tmp_path)
    with (tmp_path / "summary.csv").open() as handle:
        rows = {r["scheme"]: r for r in csv.DictReader(handle)}
    assert float(rows["smartgen"]["late_hint_share"]) == pytest.approx(140 / 320)
    assert rows["full"]["late_hint_share"] == ""


def test_bench_timeline_prints_each_requests_milestones_in_the_order_they_were_sent(tmp_path: Path, capsys) -> None:
    """bench/timeline.py: one line per measured request, sorted by when it was sent, and where the round's TBT went;
    a joiner's wait shows as the span from its first token to its join; warm-up rounds and other schemes are left
    out unless asked."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("timeline", Path(__file__).parents[1] / "bench" / "timeline.py")
    assert spec is not None and spec.loader is not None
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    joiner = {
        "sent": 0.02, "node_ctl": [1.0, 1.1, 2.5, 2.7], "prefill_tokens": 2, "token_waits": [0, 0, 0.2, 0.05],
        "milestones": {"dense_local": 1.5, "forecast_asked": 1.5, "forecast_landed": 2.3, "joined": 2.3},
    }  # fmt: skip
    first = {"sent": 0.01, "node_ctl": [0.5, 0.6, 0.9], "prefill_tokens": 2, "token_waits": [0, 0, 0.1],
             "milestones": {"joined": 0.6}}  # fmt: skip
    assert timeline.request_line(joiner) == ["20", "1000", "1500", "1500", "2300", "-", "2300", "-", "2500", "2",
                                             "200", "50", "50", "-"]  # fmt: skip
    line = timeline.request_line({**joiner, "forecast_entries": 96, "deferred_steps": 3})
    assert line[5] == "96" and line[-1] == "3"  # the entries its forecast asked for; its steps taken back
    assert timeline.request_line({"sent": 0.0, "error": "timeout"})[1] == "failed: timeout"
    groups = [
        {"scheme": "smartgen", "point": 0, "rep": 0, "warmup": True, "requests": [first]},
        {
            "scheme": "smartgen",
            "point": 0,
            "rep": 1,
            "warmup": False,
            "requests": [joiner, first],
            "decode_threads": {"decode-scheduler": 2.5, "decode.push-rx": 0.25},
            # the last first token at 1.02 s: seconds 0-1 are the prefills', 2-3 after
            "cpu_timeline": {"prefill": {"prefill-work": [900, 850, 300, 100], "prefill-serve": [60, 40, 0, 5]}},
        },
        {"scheme": "full", "point": 0, "rep": 1, "warmup": False, "requests": [first]},
    ]
    (tmp_path / "results.json").write_text(json.dumps({"groups": groups}))
    argv = sys.argv
    try:
        sys.argv = ["timeline.py", str(tmp_path), "--scheme", "smartgen"]
        timeline.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert "round 0" not in out and "full," not in out and "smartgen, point 0, round 1" in out
    lines = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [line[0] for line in lines] == ["10", "20"]  # in the order they were sent
    # where the TBT went: the joiner's one later gap (after every prefill), and each first own token apart
    assert "after: 1 gaps, mean 200, link wait 50; first own token: 300, 1400" in out
    assert "decode node CPU by thread (s): decode-scheduler 2.50, decode.push-rx 0.25" in out
    # each node's CPU by phase, ms a second; a role under 10 ms a second in a phase is left out of it
    assert (
        "prefill node CPU by thread (ms a second): during prefills (2 s): prefill-work 875, prefill-serve 50; "
        "after (2 s): prefill-work 200" in out
    )
    # a gap that ends while another request's forecast picks cross counts apart (the joiner's window: 1.52-2.32 s)
    running = {"sent": 0.0, "node_ctl": [0.5, 0.6, 0.9, 1.2, 1.9, 2.0, 2.6], "prefill_tokens": 2,
               "token_waits": [0, 0, 0.1, 0.1, 0.3, 0.05, 0.0]}  # fmt: skip
    assert timeline.phases([joiner, running]) == (
        "beside a joiner's forecast: 2 gaps, mean 400, link wait 175; after: 3 gaps, mean 367, link wait 50; "
        "first own token: 1400, 300"
    )
    # a run from before the timeline has no waits: shown as unknown, not as none
    assert "link wait -" in timeline.phases([{k: v for k, v in joiner.items() if k != "token_waits"}])
    (tmp_path / "bad.json").write_text("[1]")  # not a bench run: the script says so, no traceback
    try:
        sys.argv = ["timeline.py", str(tmp_path / "bad.json")]
        with pytest.raises(SystemExit) as exited:
            timeline.main()
    finally:
        sys.argv = argv
    assert exited.value.code == 2 and "not a `smartgen bench` results.json" in capsys.readouterr().err


def test_link_png_draws_each_schemes_first_measured_round_as_shares_of_the_link():
    """link_panels: the first measured round of each scheme (not the warm-up, not later rounds), each tag's bytes a
    second over the point's link rate (0.03 Gbit/s: 3.75 MB/s), busiest tag first; rounds without a timeline none."""
    result = _rounds_result()
    for group in result.groups:
        if group.scheme == "smartgen":
            group.link_timeline = {"proactive": [375_000, 0], "on_demand": [1_875_000, 3_750_000]}
    panels = link_panels(result)
    assert [title.split(":")[0] for title, _ in panels] == ["smartgen"]  # rep 1 only; full had no timeline
    (_, shares), *_ = panels
    assert list(shares) == ["on_demand", "proactive"]
    assert shares["on_demand"] == pytest.approx([50.0, 100.0]) and shares["proactive"] == pytest.approx([10.0, 0.0])
