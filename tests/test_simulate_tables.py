"""`smartgen simulate`'s tables: whole at 80 columns and when piped, never cut to "sch…"."""

import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

from smartgen.apps.simulate import SimulationResult
from smartgen.cli.app import app
from smartgen.cli.simulate import result_tables

SCHEMES = ("full", "partial", "partial+profile", "partial+profile+parallel", "smartgen", "smartgen[random]")
HEADERS = ("scheme", "TTFT", "TTST", "x first", "TBT", "KV ok", "push", "fetch", "spec", "od%", "local")
TABLE_COLUMNS = 6  # each of the two tables: scheme and five figures
MIB = 2**20


def _result(policy: str, ttst: float, on_demand_mib: float, speculative_mib: float) -> SimulationResult:
    """A row as the issue's 32-layer run produced them: seconds and bytes of that size."""
    requests = [{"ttft": 0.412, "ttst": ttst, "tbt": 0.0625}, {"ttft": 0.398, "ttst": ttst * 0.9, "tbt": 0.0721}]
    paths = {
        "proactive": int(118.4 * MIB),
        "on_demand": int(on_demand_mib * MIB),
        "speculative": int(speculative_mib * MIB),
    }
    return SimulationResult(
        policy=policy,
        requests=requests,
        path_bytes=paths,
        push_descriptors=4096,
        on_demand_ratio=0.123,
        max_fetch_count=3,
        prefill_requests_left=0,
        pool_equals_prefill=True,
        all_local=policy != "partial",
        mismatches=0 if policy != "smartgen[random]" else 12,
    )


def _render(width: int) -> str:
    results = [_result(s, 4.923 / (i + 1), 203.25 * i, 1024.5 * i) for i, s in enumerate(SCHEMES)]
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    for table in result_tables(results):
        console.print(table)
    return out.getvalue()


def test_the_tables_hold_every_scheme_and_header_whole_at_80_columns():
    text = _render(80)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for scheme in SCHEMES:
        assert sum(line.split()[:1] == [scheme] for line in text.splitlines()) == 2  # one row per table
    header_words = " ".join(line for line in text.splitlines() if line.lstrip().startswith("scheme"))
    for header in HEADERS:
        assert header in header_words
    assert "NO (12)" in text  # a KV mismatch is shown, not cut


@pytest.mark.parametrize("width", [40, 60])
def test_a_narrower_console_folds_cells_instead_of_cutting_them(width):
    text = _render(width)
    assert "…" not in text
    for scheme in SCHEMES:
        assert scheme in text  # scheme names never fold


def test_simulate_piped_prints_whole_tables(monkeypatch):
    """The command itself on a tiny shape (a few seconds), its output captured as a pipe would take it."""
    monkeypatch.setenv("COLUMNS", "80")
    args = ["simulate", "--layers", "4", "--lengths", "512,300", "--steps", "3", "--blocks", "32"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    rows = [line.split() for line in result.output.splitlines() if len(line.split()) == TABLE_COLUMNS]
    for scheme in ("full", "partial", "partial+profile+parallel", "smartgen"):
        assert [row[0] for row in rows].count(scheme) == 2  # one row in each table
    for header in HEADERS:
        assert header in result.output
    assert (
        next(row for row in rows if row[0] == "full")[-1] == "yes"
    )  # full transfer's assembled KV checked equal to the ground truth
