"""Tests the `smartgen` command line through typer's CliRunner: help everywhere, `info`, `--version`, `python -m`."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

import smartgen
from smartgen.cli.app import app
from smartgen.sysinfo import PACKAGES

runner = CliRunner()


def _walk(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """Yields (`smartgen sub cmd`, command) for the root and every command and sub-command below it.

    Duck-typed: typer >= 0.20 vendors click, so its commands are not `click.Group` instances.
    """
    yield " ".join(("smartgen", *path)), cmd
    for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
        yield from _walk(sub, (*path, name))


COMMANDS = list(_walk(typer.main.get_command(app)))


def test_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    names = list(typer.main.get_command(app).commands)
    assert "info" in names
    for name in names:
        assert name in result.output


def test_no_args_shows_help() -> None:
    result = runner.invoke(app, [])
    assert "Usage" in result.output


def test_walk_finds_subcommands() -> None:
    assert "smartgen info" in [path for path, _ in COMMANDS]


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=[path for path, _ in COMMANDS])
def test_every_command_has_help(path: str, cmd: Any) -> None:
    assert (cmd.help or cmd.short_help or "").strip(), f"`{path}` has no help text"
    for param in cmd.params:
        # Options and typer Arguments both carry `help`; a bare click Argument has none to check.
        if param.param_type_name == "option" or hasattr(param, "help"):
            assert (getattr(param, "help", None) or "").strip(), f"`{path}` {param.opts} has no help text"
    # --help must render, not only exist
    result = runner.invoke(app, [*path.split()[1:], "--help"])
    assert result.exit_code == 0, result.output


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"smartgen {smartgen.__version__}"


def test_info_prints_versions() -> None:
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    for name in ("python", "smartgen", *PACKAGES, "CUDA", "RDMA", "GPUDirect RDMA", "Triton", "Profile DB"):
        assert name in result.output


def test_info_json() -> None:
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report) == {"versions", "cuda", "rdma", "gpudirect", "triton", "db_path"}
    assert set(report["versions"]) == {"python", "smartgen", *PACKAGES}
    assert report["versions"]["smartgen"] == smartgen.__version__
    assert {"status", "devices"} <= set(report["cuda"]) and {"status", "devices"} <= set(report["rdma"])
    assert set(report["gpudirect"]) == {"routes", "status"}


def test_verbose_sets_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    # -v configures logging; put the root handlers and smartgen's level back for the tests after this one.
    root, log = logging.getLogger(), logging.getLogger("smartgen")
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(log, "level", log.level)
    result = runner.invoke(app, ["-vv", "info", "--json"])
    assert result.exit_code == 0, result.output
    assert log.level == logging.DEBUG


def test_python_dash_m() -> None:
    proc = subprocess.run([sys.executable, "-m", "smartgen", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "info" in proc.stdout


def test_serve_refuses_to_start_without_a_secret(monkeypatch):
    monkeypatch.delenv("SMARTGEN_SECRET", raising=False)
    result = runner.invoke(app, ["serve", "--role", "prefill", "--model", "samples/sample-model"])
    assert result.exit_code != 0 and "no shared secret" in result.stderr and "--insecure" in result.stderr


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--handshake-timeout", "0", "0.1"),
        ("--confirm-timeout", "-1", "0.1"),
        ("--flush-timeout", "nan", "greater than or equal to 0.1"),
        ("--handshake-timeout", "inf", "--handshake-timeout must be a finite number"),
        ("--fetch-timeout", "soon", "valid number"),
    ],
)
def test_serve_refuses_a_bad_timeout_with_a_clear_error(option, value, says):
    args = ["serve", "--role", "prefill", "--model", "samples/sample-model", "--insecure", option, value]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert says in result.stderr and option in result.stderr and "Traceback" not in result.output + result.stderr


def test_every_timeout_of_serve_is_an_option_with_help():
    result = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in (
        "--lease",
        "--first-token-timeout",
        "--queue-timeout",
        "--fetch-timeout",
        "--fetch-stall-ms",
        "--step-share",
        "--no-step-share",
        "--handshake-timeout",
        "--confirm-timeout",
        "--write-timeout",
        "--flush-timeout",
    ):
        assert option in result.output, option


def test_byte_sizes_parse_one_way_and_a_bad_one_names_the_option():
    from smartgen.cli.sizes import half_of_memory, parse_size

    assert parse_size("1073741824", "--x") == parse_size("1G", "--x") == parse_size("1GiB", "--x") == 2**30
    assert parse_size("512m", "--x") == 512 * 2**20 and parse_size("1.5K", "--x") == 1536
    assert half_of_memory() > 0
    args = ["serve", "--role", "prefill", "--model", "samples/sample-model", "--insecure"]
    for bad in ("lots", "-5G", "0"):
        result = runner.invoke(app, [*args, "--max-store-bytes", bad], env={"COLUMNS": "200"})
        assert result.exit_code == 2 and "--max-store-bytes" in result.stderr, (bad, result.output)
        assert "Traceback" not in result.output + result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--rdma-device", "mlx5_0"], "apply to --lane rdma only, not --lane tcp"),
        (["--lane", "nixl", "--gid-index", "3"], "apply to --lane rdma only, not --lane nixl"),
        (["--lane", "rdma", "--rdma-port", "0"], "greater than or equal to 1"),
    ],
)
@pytest.mark.parametrize(
    "command",
    [["serve", "--role", "prefill", "--model", "samples/sample-model", "--insecure"], ["bench"], ["demo"]],
)
def test_serve_bench_and_demo_take_rdma_choices_for_the_rdma_lane_only(command, args, says):
    result = runner.invoke(app, [*command, *args], env={"COLUMNS": "200"})
    assert result.exit_code != 0 and says in result.stderr, result.output + result.stderr
    assert "Traceback" not in result.output + result.stderr


def test_the_nodes_a_bench_or_demo_starts_get_its_rdma_choice():
    from smartgen.apps.cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(Path("m"), lane="rdma", lane_flags=("--rdma-device", "rxe0", "--gid-index", "1"))
    flags = LocalCluster(spec)._common()
    assert flags[flags.index("--lane") : flags.index("--lane") + 6] == [
        "--lane",
        "rdma",
        "--rdma-device",
        "rxe0",
        "--gid-index",
        "1",
    ]
