"""`make gpu-check`: every CUDA path of SmartGen checked in one run of under 10 minutes; without CUDA, its CPU half.

    python -m smartgen.apps.gpu_check [--out DIR] [--only NAME,...] [--cpu] [--list]

Each check (CHECKS) runs in a child process of its own, under a time budget: a CUDA error poisons the context of
the process it happens in, and a hung check must not hold up the rest. A check past its budget is killed, with
every process it started (its own process group), and recorded as failed; one that raises is recorded as failed
with the error; the others run either way. Rows reach the parent as the child writes them, so a killed check keeps
what it finished. Writes DIR/gpu_check.json and DIR/gpu_check.txt (the table; README, GPU check) and exits 1 when
any row failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smartgen.apps.gpu_check_base import RESULTS, Context, Row

__all__ = ["Check", "CHECKS", "run_in_process", "run_checks", "table", "main"]

DEFAULT_OUT = Path("gpu-check-results")
RUN_BUDGET_S = {"cuda": 570.0, "cpu": 300.0}  # the whole run; the CUDA half must fit a 10-minute window


@dataclass(frozen=True, slots=True)
class Check:
    """A check: `target` ("module:function", called with a Context) and its budgets in seconds, child start included."""

    name: str
    target: str
    cuda_budget_s: float
    cpu_budget_s: float
    what: str

    def budget(self, cuda: bool) -> float:
        return self.cuda_budget_s if cuda else self.cpu_budget_s


_ENGINE, _MODEL, _NODES = (
    "smartgen.apps.gpu_check_engine",
    "smartgen.apps.gpu_check_model",
    "smartgen.apps.gpu_check_nodes",
)
CHECKS = (
    Check("kernels.split", f"{_ENGINE}:check_split", 30, 30, "Triton split/reorder vs its torch reference"),
    Check("kernels.gather", f"{_ENGINE}:check_gather", 40, 40, "Triton KV gather vs its torch reference"),
    Check("staging", f"{_ENGINE}:check_staging", 30, 30, "a staged pool's host->device copies, bit for bit"),
    Check("decode.sample16", f"{_MODEL}:check_sample16", 60, 50, "the decode step vs HF, the 16-layer sample"),
    Check("decode.random32", f"{_MODEL}:check_random32", 60, 60, "the decode step vs HF, random:32"),
    Check("gpudirect", f"{_NODES}:check_gpudirect", 30, 30, "GPUDirect RDMA registration of GPU memory"),
    Check("serve", f"{_NODES}:check_serve", 70, 90, "serve --role both: /v1/completions with every scheme"),
    Check("serve.tcp", f"{_NODES}:check_serve_tcp", 80, 90, "a prefill and a decode process over TCP, every scheme"),
    Check("bench", f"{_NODES}:check_bench", 165, 100, "smartgen bench --quick (CPU: a smaller run)"),
)


def cuda_status() -> tuple[bool, str]:
    """(CUDA usable?, one line saying what this machine has)."""
    import torch

    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA device"
    props = torch.cuda.get_device_properties(0)
    return True, f"cuda:0 {props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"


def _call(check: Check, ctx: Context) -> None:
    """Runs one check; an exception becomes a failed row with the error (the traceback goes to stderr)."""
    module, _, function = check.target.partition(":")
    try:
        getattr(importlib.import_module(module), function)(ctx)
    except Exception as exc:
        traceback.print_exc()
        error = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
        ctx.add(Row(check.name, ctx.device_name, "-", "-", "fail", note=f"raised {error}"))


def run_in_process(names: Sequence[str], cuda: bool, workdir: Path, say: Callable[[str], None] = print) -> list[Row]:
    """The checks named, one after the other in this process (the tests' way; no budgets enforced, no isolation)."""
    rows: list[Row] = []
    for check in _select(names):
        ctx = Context(cuda, time.monotonic() + check.budget(cuda), rows.append, workdir, say)
        _call(check, ctx)
    return rows


def _select(names: Sequence[str]) -> list[Check]:
    known = {c.name: c for c in CHECKS}
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"gpu-check: unknown check(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [c for c in CHECKS if not names or c.name in names]


def _child(check: Check, rows_file: Path, cuda: bool, seconds: float, workdir: Path) -> None:
    """A check in this (child) process: rows appended to `rows_file` as they come, one JSON object a line."""
    with rows_file.open("a") as out:

        def emit(row: Row) -> None:
            out.write(json.dumps(row.to_json()) + "\n")
            out.flush()

        # the soft deadline leaves the check time to finish its current shape before the parent's hard one
        _call(check, Context(cuda, time.monotonic() + 0.85 * seconds, emit, workdir, lambda s: print(s, flush=True)))


def _run_child(check: Check, cuda: bool, seconds: float, workdir: Path) -> tuple[list[Row], str]:
    """One check in a child process with a hard timeout; (its rows, how it ended)."""
    rows_file = workdir / f"{check.name}.jsonl"
    command = [sys.executable, "-m", "smartgen.apps.gpu_check", "--child", check.name, "--target", check.target]
    command += ["--rows", str(rows_file)]
    command += ["--child-seconds", f"{seconds:.1f}", "--workdir", str(workdir)] + ([] if cuda else ["--cpu"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, env=env, start_new_session=True)  # its own group: killed with its children
    ended = "ok"
    try:
        rc = process.wait(seconds)
        if rc != 0:
            ended = f"its process exited with {rc}" if rc > 0 else f"its process died of signal {-rc}"
    except subprocess.TimeoutExpired:
        ended = f"killed past its budget of {seconds:.0f} s"
    finally:
        _kill_group(process)
    text = rows_file.read_text() if rows_file.exists() else ""
    rows = [Row.from_json(json.loads(line)) for line in text[: text.rfind("\n") + 1].splitlines()]  # whole lines
    if ended != "ok":
        rows.append(Row(check.name, "cuda:0" if cuda else "cpu", "-", "-", "fail", note=ended))
    return rows, ended


def _kill_group(process: subprocess.Popen) -> None:
    """SIGTERM to the child's process group (a node it started stops cleanly), then SIGKILL to what is left 5 s on."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + 5
        try:
            os.killpg(process.pid, sig)
            while time.monotonic() < deadline:
                process.poll()  # reaps the child once it exits
                time.sleep(0.1)
                os.killpg(process.pid, 0)
        except (ProcessLookupError, PermissionError):
            return  # nothing of the group is left (or its id went to a process not ours)
    process.wait()


def run_checks(checks: Sequence[Check], cuda: bool, run_budget_s: float, workdir: Path) -> tuple[list[Row], list[dict]]:
    """Every check in a child under its budget, never past the run's; (rows, per-check records)."""
    rows: list[Row] = []
    records: list[dict[str, Any]] = []
    run_end = time.monotonic() + run_budget_s
    for number, check in enumerate(checks, 1):
        seconds = min(check.budget(cuda), run_end - time.monotonic())
        head = f"[{number}/{len(checks)}] {check.name}"
        if seconds < min(10.0, check.budget(cuda)):
            row = Row(check.name, "cuda:0" if cuda else "cpu", "-", "-", "skip", note="no time left in the run")
            rows.append(row)
            records.append({"name": check.name, "budget_s": 0, "seconds": 0, "ended": "not run"})
            print(f"{head}: skipped, no time left of the run's {run_budget_s:.0f} s", flush=True)
            continue
        print(f"{head} ({check.what}; budget {seconds:.0f} s)", flush=True)
        began = time.monotonic()
        found, ended = _run_child(check, cuda, seconds, workdir)
        took = time.monotonic() - began
        rows += found
        records.append({"name": check.name, "budget_s": round(seconds, 1), "seconds": round(took, 1), "ended": ended})
        counts = ", ".join(
            f"{sum(r.result == x for r in found)} {x}" for x in RESULTS if any(r.result == x for r in found)
        )
        print(f"{head}: {counts or 'no rows'} in {took:.1f} s", flush=True)
    return rows, records


def _number(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "error":
        return "0" if value == 0 else f"{value:.2e}"
    return f"{value:.3f}" if value < 1 else f"{value:.1f}"


def table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table, one line per row (README, GPU check, says what each column means)."""
    head = ("check", "device", "shape", "dtype", "result", "max err", "ref ms", "ours ms", "note")
    lines = [
        (r.check, r.device, r.shape, r.dtype, r.result, _number(r.max_error, "error"))
        + (_number(r.ref_ms, "ms"), _number(r.ours_ms, "ms"), r.note)
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in [head, *lines]) for i in range(len(head) - 1)]
    right = {5, 6, 7}  # the numbers
    out = []
    for line in [head, *lines]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells + [str(line[-1])]).rstrip())
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for gpu_check.json and gpu_check.txt")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all; --list names them)")
    parser.add_argument("--cpu", action="store_true", help="run the CPU half even where CUDA is")
    parser.add_argument("--run-budget", type=float, default=None, help="seconds for the whole run (570 CUDA, 300 CPU)")
    parser.add_argument("--list", action="store_true", help="list the checks and their budgets, then exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list:
        for c in CHECKS:
            print(f"{c.name:<16} CUDA {c.cuda_budget_s:>4.0f} s  CPU {c.cpu_budget_s:>4.0f} s  {c.what}")
        return 0
    cuda, said = cuda_status()
    cuda = cuda and not args.cpu
    if not cuda:
        # the kernels run under Triton's interpreter; triton.jit reads this when a kernel is defined, so before any
        # import of smartgen.engine.kernels' kernel modules (children inherit it)
        os.environ["TRITON_INTERPRET"] = "1"
    if args.child:
        check = Check(args.child, args.target, args.child_seconds, args.child_seconds, "")
        _child(check, args.rows, cuda, args.child_seconds, args.workdir)
        return 0

    checks = _select([n for n in args.only.split(",") if n])
    half = "cuda" if cuda else "cpu"
    run_budget = args.run_budget or RUN_BUDGET_S[half]
    if cuda:
        print(f"gpu-check: the CUDA half on {said}; {len(checks)} checks, at most {run_budget:.0f} s", flush=True)
    else:
        print(
            f"gpu-check: no CUDA here ({said}): running the CPU half of each check (tiny shapes, Triton's "
            "interpreter); the CUDA half needs a CUDA machine (README: GPU check)",
            flush=True,
        )
    began, started = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    workdir = Path(tempfile.mkdtemp(prefix="smartgen-gpu-check-"))
    try:
        rows, records = run_checks(checks, cuda, run_budget, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    wall = time.monotonic() - began
    counts = {x: sum(r.result == x for r in rows) for x in RESULTS}
    summary = f"{counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip in {wall:.0f} s ({half} half)"
    text = table(rows) + summary + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.txt").write_text(text)
    report = {"half": half, "machine": said, "started": started, "wall_s": round(wall, 1), "counts": counts}
    report |= {"checks": records, "rows": [r.to_json() for r in rows]}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + text + f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.txt'}", flush=True)
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
