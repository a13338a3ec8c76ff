"""`smartgen demo` states its regime as the bench defines it, before its results, and shows a bar only on a terminal."""

import io
import json
import math

import pytest
from rich.console import Console
from typer.testing import CliRunner

from smartgen.apps.bench.config import PAPER_STALL_RATIO, BenchConfig
from smartgen.apps.cluster import node_cpus
from smartgen.apps.demo import DemoConfig, DemoRegime, cpu_words, demo_regime, native_note
from smartgen.cli import demo as demo_cli
from smartgen.cli.app import app
from smartgen.lanes.rate import bytes_per_second, transfer_seconds
from smartgen.sysinfo import SAMPLES_DIR

runner = CliRunner()
SAMPLE = SAMPLES_DIR / "sample-model"
KV = 6.0 * 2**20  # the sample model's KV of a 2044-token prompt
SELECTED = 0.2 * KV * 4 / 6  # budget 0.2 of the four layers past the two sent whole


def test_the_regime_paces_the_link_to_the_stall_ratio_and_measures_the_decode_side_against_it():
    regime = demo_regime(KV, SELECTED, prefill_s=0.49, step_s=0.016, stall_ratio=4.7, lane="tcp", split=([0], [1]))
    assert transfer_seconds(KV, regime.link_gbps) == pytest.approx(4.7 * 0.49)
    assert regime.stall_ratio == pytest.approx(4.7)
    assert regime.decode_ratio == pytest.approx(bytes_per_second(regime.link_gbps) * 0.016 / SELECTED)
    line = regime.line()
    assert "\n" not in line and line.startswith("regime: ")
    for words in (
        "tcp lane (separate processes)",
        f"link {regime.link_gbps * 1e3:.1f} Mbit/s",
        "stall ratio 4.70 (full transfer / prefill",
        f"decode-side ratio {regime.decode_ratio:.3f} (link bytes per all-local step / selected bytes per step",
        "prefill 490 ms",
        "step 16 ms",
        "CPUs prefill 0, decode 1",
    ):
        assert words in line


def test_the_regime_says_when_the_nodes_share_the_cpus_and_one_process():
    line = demo_regime(KV, SELECTED, 0.3, 0.01, 4.7, "inproc", split=None).line()
    assert "inproc lane (one process)" in line and line.endswith("CPUs shared")
    assert cpu_words(([0, 1], [2, 3, 4])) == "prefill 0,1, decode 2,3,4"


def test_a_regime_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match="positive"):
        DemoRegime("tcp", 0.02, 4.7, 0.0, 0.01, 0.05, "shared")


@pytest.mark.parametrize(("ratio", "far"), [(0.049, True), (0.09, True), (0.11, False), (0.15, False), (0.2, False)])
def test_a_native_decode_side_far_from_the_papers_is_said_in_one_line(ratio, far):
    regime = DemoRegime("tcp", 0.02, 4.7, 0.49, 0.016, ratio, "shared")
    note = native_note(regime)
    assert (note is not None) == far
    if note:
        assert "\n" not in note and "own speed" in note and f"{ratio:.3f}" in note and "0.15" in note
        assert "not the paper's regime" in note
    high = native_note(DemoRegime("tcp", 0.02, 4.7, 0.49, 0.016, 0.5, "shared"))
    assert high is not None and "hides more of its selection" in high


def test_the_demo_runs_in_the_benchs_regime_by_default():
    assert DemoConfig(SAMPLE).transfer_ratio == PAPER_STALL_RATIO == BenchConfig().stall_ratio[0]
    assert demo_cli.PAPER_STALL_RATIO == PAPER_STALL_RATIO  # the CLI's copy, kept so --help imports no torch
    assert DemoConfig(SAMPLE).separate_cpus and BenchConfig().separate_cpus


def test_the_request_bar_stays_off_when_the_output_is_not_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=80)
    with demo_cli.request_bar(console) as progress:
        for done in range(4):
            progress("full", done, 3)
        console.print("a line")
    assert out.getvalue() == "a line\n"  # no bar, no control codes
    tty = io.StringIO()
    console = Console(file=tty, force_terminal=True, width=80)
    with demo_cli.request_bar(console) as progress:
        progress("smartgen", 1, 3)
        console.print("a line")
    assert "1/3" in tty.getvalue() and "eta" in tty.getvalue()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--schemes", "full,warp"], "unknown scheme 'warp'"),
        (["--schemes", ""], "--schemes is empty"),
    ],
)
def test_demo_mistakes_are_one_line_errors(args, says):
    result = runner.invoke(app, ["demo", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {says}")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.skipif(not (SAMPLE / "config.json").exists(), reason="the sample model is not in this checkout")
def test_the_demo_states_its_regime_before_its_results(tmp_path):
    """The real demo, small: 1K-token prompts, one per task, full transfer only, profiled on two prompts."""
    calibration = tmp_path / "calibration.jsonl"
    lines = (SAMPLES_DIR / "calibration.jsonl").read_text().splitlines()
    calibration.write_text("\n".join(lines[:2]) + "\n")
    assert all(json.loads(line)["prompt"] for line in lines[:2])
    args = ["demo", "--length", "1024", "--per-task", "1", "--schemes", "full", "--db", str(tmp_path / "p.db")]
    result = runner.invoke(app, [*args, "--calibration", str(calibration)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())  # rich wraps at 80 columns
    assert "regime: tcp lane (separate processes), link " in text
    assert "stall ratio 4.70 (full transfer / prefill" in text
    assert f"CPUs {cpu_words(node_cpus(True, 'tcp'))}" in text
    ratio = float(text.split("decode-side ratio ")[1].split()[0])
    assert ratio > 0
    far = abs(math.log(ratio / 0.15)) > math.log(1.5)
    assert ("runs at this machine's own speed" in text) == far
    assert text.index("regime: ") < text.index("full: 2 requests done") < text.index("TTFT ms")
    assert "…" not in result.stdout and "\x1b[" not in result.stdout  # piped: no bar, nothing cut
