"""`make gpu-check` stays runnable: the CPU half of its fast checks (the Triton kernels under the interpreter, a staged
pool's copies), a broken kernel caught, a raising check recorded and the rest run, a check past its budget killed
with what it started, and the files it writes."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from smartgen.apps import gpu_check
from smartgen.apps.gpu_check import Check, run_checks, run_in_process, table
from smartgen.apps.gpu_check_base import Context, Row
from smartgen.engine.kernels import IndexSplit

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()  # on a CUDA machine these are the CUDA halves (conftest: no interpreter there)
FAST = ("kernels.split", "kernels.gather", "staging")


def test_the_fast_checks_pass(tmp_path):
    rows = run_in_process(FAST, CUDA, tmp_path, say=lambda line: None)
    assert {r.check for r in rows} == set(FAST)
    assert all(r.result == "pass" for r in rows), table(rows)
    assert all(r.max_error == 0 for r in rows), "kernels and staging move bytes: exact"
    assert {r.dtype for r in rows if r.check == "kernels.gather"} == {"fp16", "bf16"}


def test_a_kernel_that_differs_from_its_reference_fails(tmp_path, monkeypatch):
    import smartgen.engine.kernels.launch as launch

    real = launch.split_reorder_triton

    def off_by_one(*args, **kwargs) -> IndexSplit:
        split = real(*args, **kwargs)
        return split._replace(num_remote=split.num_remote + 1)

    monkeypatch.setattr(launch, "split_reorder_triton", off_by_one)
    rows = run_in_process(["kernels.split"], CUDA, tmp_path, say=lambda line: None)
    assert rows and all(r.result == "fail" and "num_remote" in r.note for r in rows)


def _boom(ctx: Context) -> None:
    ctx.add(Row("boom", ctx.device_name, "one", "-", "pass"))
    raise RuntimeError("the device fell over")


def _sleeper(ctx: Context) -> None:
    """Emits a row, starts a process, then hangs: the runner must kill both and keep the row."""
    ctx.add(Row("sleeper", ctx.device_name, "before the hang", "-", "pass"))
    child = subprocess.Popen(["sleep", "60"])
    (ctx.workdir / "sleep.pid").write_text(str(child.pid))
    time.sleep(60)


def test_a_raising_check_fails_with_its_error_and_the_next_one_runs(tmp_path, monkeypatch):
    checks = (Check("boom", f"{__name__}:_boom", 5, 5, "raises"), *gpu_check.CHECKS[:1])
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    rows = run_in_process(["boom", "kernels.split"], CUDA, tmp_path, say=lambda line: None)
    assert [r.result for r in rows if r.check == "boom"] == ["pass", "fail"]
    assert "RuntimeError: the device fell over" in rows[1].note
    assert any(r.check == "kernels.split" and r.result == "pass" for r in rows)


def test_a_check_past_its_budget_is_killed_with_what_it_started(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    began = time.monotonic()
    rows, records = run_checks([Check("sleeper", f"{__name__}:_sleeper", 8, 8, "hangs")], CUDA, 60, tmp_path)
    assert time.monotonic() - began < 30
    assert [(r.shape, r.result) for r in rows] == [("before the hang", "pass"), ("-", "fail")]
    assert "killed past its budget of 8 s" in rows[1].note and records[0]["ended"] == rows[1].note
    stat = Path(f"/proc/{int((tmp_path / 'sleep.pid').read_text())}/stat")
    assert not stat.exists() or stat.read_text().rpartition(")")[2].split()[0] == "Z", "the check's process lives on"


def test_main_writes_the_table_and_the_json(tmp_path, capsys):
    assert gpu_check.main(["--only", "kernels.split", "--out", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert said.splitlines()[0].startswith("gpu-check: " + ("the CUDA half" if CUDA else "no CUDA here"))
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["half"] == ("cuda" if CUDA else "cpu") and report["counts"]["fail"] == 0
    lines = (tmp_path / "gpu_check.txt").read_text().splitlines()
    assert lines[0].split()[:5] == ["check", "device", "shape", "dtype", "result"]
    assert len(lines) == len(report["rows"]) + 2 and lines[-1].startswith(f"{len(report['rows'])} pass, 0 fail")


def test_the_table_has_one_line_per_row_and_aligned_columns():
    rows = [
        Row("kernels.gather", "cpu", "B1 H2 N128", "fp16", "pass", 0.0, 0.12, 25.0, "note"),
        Row("serve", "cuda:0", "start", "fp32", "fail", None, None, 1234.5, "exit 1"),
    ]
    lines = table(rows).splitlines()
    assert len(lines) == 3 and lines[2].endswith("exit 1")
    assert len({line.index(" pass") if " pass" in line else line.index(" fail") for line in lines[1:]}) == 1
    assert " 1234.5 " in lines[2] and "0.120" in lines[1]


def test_a_failed_request_row_names_the_last_traceback_a_node_logged(tmp_path):
    from smartgen.apps.gpu_check_nodes import _last_traceback

    quiet, noisy = tmp_path / "decode.log", tmp_path / "prefill0.log"
    quiet.write_text("INFO ready\n")
    noisy.write_text(
        "Traceback (most recent call last):\n  File a\nValueError: old\n"
        "INFO again\nTraceback (most recent call last):\n  File b\nRuntimeError: devices differ\n"
    )
    assert _last_traceback([quiet, tmp_path / "missing.log"]) == ""
    trace = _last_traceback([quiet, noisy])
    assert trace.startswith("prefill0.log: Traceback") and trace.endswith("RuntimeError: devices differ")
    assert "old" not in trace


def test_every_check_fits_the_run_budget_on_cuda():
    assert sum(check.cuda_budget_s for check in gpu_check.CHECKS) <= gpu_check.RUN_BUDGET_S["cuda"]
    assert "serve.tcp" in {check.name for check in gpu_check.CHECKS}
