"""`smartgen demo` states its regime as the bench defines it, before its results, and shows a bar only on a terminal."""

import inspect
import io
import json
import math

import pytest
from rich.console import Console
from typer.testing import CliRunner

from smartgen.apps.bench.config import PAPER_STALL_RATIO, BenchConfig, Point
from smartgen.apps.bench.runner import _regime as bench_regime
from smartgen.apps.cluster import node_cpus
from smartgen.apps.demo import (
    PAPER_DECODE_RATIO,
    DemoConfig,
    DemoRegime,
    SchemeResult,
    cpu_words,
    demo_regime,
    last_token_time,
    native_note,
)
from smartgen.apps.regime import decode_side, emulate_flags
from smartgen.cli import demo as demo_cli
from smartgen.cli.app import app
from smartgen.lanes.rate import bytes_per_second, transfer_seconds
from smartgen.sysinfo import SAMPLES_DIR

runner = CliRunner()
SAMPLE = SAMPLES_DIR / "sample-model"
KV = 6.0 * 2**20  # the sample model's KV of a 2044-token prompt
SELECTED = 0.2 * KV * 4 / 6  # budget 0.2 of the four layers past the two sent whole
LAYERS = 6


def test_the_regime_paces_the_link_to_the_stall_ratio_and_measures_the_decode_side_against_it():
    regime = demo_regime(
        KV, SELECTED, prefill_s=0.49, step_s=0.016, stall_ratio=4.7, lane="tcp", split=([0], [1]), num_layers=LAYERS
    )
    assert regime.emulate_layer_ms == 0  # native unless asked
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
        "step 16 ms, CPUs prefill 0, decode 1",
    ):
        assert words in line
    assert "emulated" not in line


def test_the_regime_says_when_the_nodes_share_the_cpus_and_one_process():
    line = demo_regime(KV, SELECTED, 0.3, 0.01, 4.7, "inproc", split=None, num_layers=LAYERS).line()
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


def test_a_native_note_names_the_flag_only_where_emulation_can_help():
    low = native_note(DemoRegime("tcp", 0.02, 4.7, 0.49, 0.016, 0.05, "shared"))
    assert low is not None and "`--decode-ratio 0.15` emulates it" in low
    high = native_note(DemoRegime("tcp", 0.02, 4.7, 0.49, 0.016, 0.5, "shared"))
    assert high is not None and "--decode-ratio" not in high  # emulation only slows a step down


def test_the_regime_emulates_the_papers_decode_side_per_layer():
    native = demo_regime(KV, SELECTED, 0.49, 0.016, 4.7, "tcp", ([0], [1]), num_layers=LAYERS)
    regime = demo_regime(KV, SELECTED, 0.49, 0.016, 4.7, "tcp", ([0], [1]), num_layers=LAYERS, decode_ratio=0.15)
    rate = bytes_per_second(regime.link_gbps)
    step = regime.step_s + LAYERS * regime.emulate_layer_ms / 1e3  # the step the decode node will take
    assert native.decode_ratio < 0.15 / 1.5  # far below the paper's natively, so emulation has work to do
    assert regime.decode_ratio == pytest.approx(0.15) == pytest.approx(rate * step / SELECTED)
    assert regime.emulate_layer_ms == pytest.approx((0.15 * SELECTED / rate - 0.016) / LAYERS * 1e3)
    assert (regime.link_gbps, regime.stall_ratio, regime.step_s) == (native.link_gbps, native.stall_ratio, 0.016)
    line = regime.line()
    assert "\n" not in line
    assert "decode-side ratio 0.150 (link bytes" in line
    assert f"step 16 ms + {regime.emulate_layer_ms:.2f} ms/layer emulated, CPUs prefill 0, decode 1" in line
    assert native_note(regime) is None and native_note(native) is not None
    assert emulate_flags(regime.emulate_layer_ms) == ("--emulate-layer-ms", f"{regime.emulate_layer_ms:.4f}")
    assert emulate_flags(native.emulate_layer_ms) == ()


def test_emulation_only_slows_a_step_down():
    slow = 20 * 0.016  # natively above the target ratio already: nothing to add, the native ratio is said
    regime = demo_regime(KV, SELECTED, 0.49, slow, 4.7, "tcp", None, num_layers=LAYERS, decode_ratio=0.15)
    assert regime.emulate_layer_ms == 0 and regime.decode_ratio > 0.15 * 1.5
    note = native_note(regime)
    assert note is not None and "own speed" in note and "emulated" not in regime.line()


def test_the_demo_emulates_exactly_as_the_bench_does():
    """The bench's regime and the demo's, from the same pilot, link and selection, set the same decode side."""
    length, token_bytes, budget = 2044, 3072, 0.2
    for target in (None, 0.15, 0.4):
        config = BenchConfig(decode_ratio=target)
        point = Point(1, length, 4.7, 1024, budget, 0.1, 1)
        bench = bench_regime(config, point, {length: (0.49, 0.016)}, token_bytes, LAYERS)
        kv = token_bytes * length
        demo = demo_regime(
            kv,
            budget * kv * (LAYERS - 2) / LAYERS,
            0.49,
            0.016,
            4.7,
            "tcp",
            None,
            num_layers=LAYERS,
            decode_ratio=target,
        )
        assert demo.link_gbps == pytest.approx(bench.link_gbps)
        assert demo.emulate_layer_ms == pytest.approx(bench.emulate_layer_ms)
        assert demo.decode_ratio == pytest.approx(bench.decode_ratio)
        assert (demo.emulate_layer_ms > 0) == (target is not None)


def test_decode_side_is_the_benchs_formula():
    side = decode_side(0.15, selected_bytes=1e6, link_bytes_per_s=4e6, step_s=0.01, num_layers=4)
    assert side.emulate_layer_ms == pytest.approx((0.15 * 1e6 / 4e6 - 0.01) / 4 * 1e3)  # 6.875 ms
    assert side.decode_ratio == pytest.approx(0.15)
    assert decode_side(None, 1e6, 4e6, 0.01, 4) == (0.0, pytest.approx(0.04), 0.0)
    floor = decode_side(0.15, selected_bytes=1e6, link_bytes_per_s=4e6, step_s=0.01, num_layers=4, floor=True)
    assert floor.emulate_layer_ms == 0 and floor.decode_ratio == pytest.approx(0.15)
    assert floor.emulate_floor_ms == pytest.approx(0.15 * 1e6 / 4e6 / 4 * 1e3)  # the target step's share: 9.375 ms
    assert decode_side(0.15, 1e6, 4e6, 0.1, 4, floor=True).emulate_floor_ms == 0  # native already slower: no floor


def test_the_results_table_says_the_emulation():
    regime = demo_regime(KV, SELECTED, 0.49, 0.016, 4.7, "tcp", None, num_layers=LAYERS, decode_ratio=0.15)
    setup = {"model": "m", "prompt_tokens": 2044, "selector": "quest 0.2", "link_gbps": regime.link_gbps}
    setup |= {"transfer_s": 2.3, "prefill_s": 0.49, "regime": regime}
    out = io.StringIO()
    Console(file=out, width=200).print(demo_cli.results_table([SchemeResult("full", [0.5], [2.0], [0.05])], setup))
    text = " ".join(out.getvalue().split())  # the title wraps
    assert f"decode-side ratio 0.150 (+{regime.emulate_layer_ms:.2f} ms/layer emulated)" in text
    # the last token's arrival beside the mean TBT: a long wait before the third token shows in TBT's mean alone
    result = SchemeResult("smartgen", [0.5], [0.6], [1.0], [last_token_time(USAGE)])
    out = io.StringIO()
    Console(file=out, width=200).print(demo_cli.results_table([result], setup))
    [row] = [line.split() for line in out.getvalue().splitlines() if line.split()[:1] == ["smartgen"]]
    assert row[1:5] == ["500", "600", "1000", "8600"] and "last token ms" in " ".join(out.getvalue().split())


USAGE = {"ttft": 0.5, "ttst": 0.6, "tbt": 1.0, "completion_tokens": 10}


def test_the_last_token_comes_ttst_plus_a_mean_gap_for_each_token_after_the_second():
    assert last_token_time(USAGE) == pytest.approx(0.6 + 8 * 1.0)
    assert last_token_time({**USAGE, "completion_tokens": 2}) == 0.6
    assert last_token_time({**USAGE, "completion_tokens": 1, "ttst": None, "tbt": None}) == 0.5


def test_the_demo_runs_in_the_benchs_regime_by_default():
    assert DemoConfig(SAMPLE).transfer_ratio == PAPER_STALL_RATIO == BenchConfig().stall_ratio[0]
    assert demo_cli.PAPER_STALL_RATIO == PAPER_STALL_RATIO  # the CLI's copy, kept so --help imports no torch
    assert DemoConfig(SAMPLE).separate_cpus and BenchConfig().separate_cpus
    default = inspect.signature(demo_cli.demo).parameters["decode_ratio"].default
    assert demo_cli.parse_decode_ratio(default) == DemoConfig(SAMPLE).decode_ratio  # the CLI's and the library's
    assert demo_cli.PAPER_DECODE_RATIO == PAPER_DECODE_RATIO
    assert demo_cli.parse_decode_ratio("native") is None and demo_cli.parse_decode_ratio(" Native ") is None
    assert demo_cli.parse_decode_ratio("0.3") == 0.3
    for bad in (0.0, -0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="decode-side ratio"):
            DemoConfig(SAMPLE, decode_ratio=bad)


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
        (["--decode-ratio", "0"], "--decode-ratio must be a positive number or 'native', got '0'"),
        (["--decode-ratio", "-0.1"], "--decode-ratio must be a positive number or 'native', got '-0.1'"),
        (["--decode-ratio", "fast"], "--decode-ratio must be a positive number or 'native', got 'fast'"),
        (["--decode-ratio", "nan"], "--decode-ratio must be a positive number"),
        (["--decode-ratio", "inf"], "--decode-ratio must be a positive number"),
    ],
)
def test_demo_mistakes_are_one_line_errors(args, says):
    result = runner.invoke(app, ["demo", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {says}")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


# slow: CI runs `make demo` itself, which states its regime before its results the same way
@pytest.mark.slow
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
    if "ms/layer emulated" in text:  # the default: the decode side emulated to the paper's ratio, no native note
        assert ratio == 0.15 and "own speed" not in text
        assert "decode-side ratio 0.150 (+" in text  # the results' title says it too
    else:  # only where this machine's all-local step is already slower than the paper's ratio asks
        assert ratio >= 0.15
        far = abs(math.log(ratio / 0.15)) > math.log(1.5)
        assert ("runs at this machine's own speed" in text) == far
    assert text.index("regime: ") < text.index("full: 2 requests done") < text.index("TTFT ms")
    assert "…" not in result.stdout and "\x1b[" not in result.stdout  # piped: no bar, nothing cut
