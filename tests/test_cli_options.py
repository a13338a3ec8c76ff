"""The options several commands share: one name and one help per concept, old spellings still working (with a note)."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from smartgen.cli.app import app
from smartgen.cli.options import RENAMED

runner = CliRunner()
ROOT = typer.main.get_command(app)
COMMANDS = ("serve", "bench", "demo", "eval", "profile", "simulate")
SHARED = (
    "--link-gbps",
    "--stall-ratio",
    "--delay-ms",
    "--decode-ratio",
    "--budget",
    "--blocks",
    "--speculative-ratio",
    "--lane",
    "--rdma-device",
    "--rdma-port",
    "--gid-index",
    "--separate-cpus",
    "--db",
    "--calibration",
)
LIST_PREFIX = "One or more, comma-separated: "  # the same option taking several values (a sweep)


def _options(command: str) -> dict[str, object]:
    """Every option name of `smartgen <command>` (hidden ones too) -> its click parameter."""
    return {name: param for param in ROOT.commands[command].params for name in param.opts + param.secondary_opts}


def _simulate(*args: str):
    small = ["simulate", "--layers", "2", "--lengths", "64", "--steps", "2", "--blocks", "8"]
    return runner.invoke(app, [*small, "--kv-heads", "1", "--head-dim", "8", *args], env={"COLUMNS": "200"})


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_option_means_one_thing_wherever_it_is_taken(name):
    """The same help (a sweep's says so first; bench's --blocks adds its --quick default) in every command."""
    helps = {
        command: re.sub(f"^{LIST_PREFIX}", "", params[name].help or "").split(" (")[0]
        for command in COMMANDS
        if name in (params := _options(command))
    }
    assert len(helps) >= 2, f"{name} is taken by {sorted(helps)} only"
    assert len(set(helps.values())) == 1, helps


def test_no_command_declares_an_old_spelling():
    for command in COMMANDS:
        old = sorted(f"--{name}" for name in RENAMED if f"--{name}" in _options(command))
        assert not old, f"smartgen {command} declares {old}: they are renamed ({RENAMED})"


@pytest.mark.parametrize(
    ("old", "new"),
    [("--gbps", "--link-gbps"), ("--transfer-ratio", "--stall-ratio"), ("--policies", "--schemes")],
)
def test_an_old_spelling_works_and_names_the_new_one(old, new):
    values = {"--gbps": "0.5", "--transfer-ratio": "2", "--policies": "full,smartgen"}
    with_old, with_new = _simulate(old, values[old]), _simulate(new, values[old])
    assert with_old.exit_code == 0 == with_new.exit_code, with_old.output + with_old.stderr
    assert with_old.stderr.splitlines()[0] == f"note: {old} is now {new}"
    assert "note:" not in with_new.stderr
    header = lambda result: result.stdout.split("\n\n")[0].split("vs prefill")[0]  # noqa: E731 (the set-up line)
    assert header(with_old) == header(with_new)
    if old == "--gbps":
        assert "link 0.500 Gbit/s" in with_old.stdout


def test_an_old_spelling_is_checked_as_the_new_one():
    result = runner.invoke(app, ["eval", "--model", "m", "--transfer-ratio", "0"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "note: --transfer-ratio is now --stall-ratio" in result.stderr
    assert "--stall-ratio" in result.stderr.split("note:")[-1].split("\n", 1)[1]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_the_new_names_and_not_the_old(command):
    text = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
    for old, new in RENAMED.items():
        assert not re.search(rf"--{old}\b", text), f"smartgen {command} --help shows --{old}"
        if f"--{new}" in _options(command):
            assert f"--{new}" in text
    if command in ("simulate", "demo"):
        assert "--stall-ratio" in text


def test_serve_timeouts_are_checked_as_they_are_read():
    args = ["serve", "--role", "prefill", "--model", "samples/sample-model", "--insecure", "--lease", "inf"]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "--lease must be a finite number, got inf" in result.stderr
