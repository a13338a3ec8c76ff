"""Every command that touches the profile store, against a missing folder, a read-only folder, a corrupt file and a
database from a newer SmartGen: a one-line error or a sensible answer, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_store import make_profile
from tiny_models import save_tiny_model
from typer.testing import CliRunner

from smartgen.cli.app import app
from smartgen.store import ProfileStore

runner = CliRunner()
SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "sample-model"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tinym")


@pytest.fixture(scope="module")
def export_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("export") / "profile.json"
    with ProfileStore(":memory:") as store:
        path.write_text(json.dumps(store.export(store.add(make_profile()))))
    return path


def _read_only(folder: Path) -> Iterator[None]:
    """Makes `folder` unwritable, also for root (chattr +i), or skips."""
    folder.chmod(0o555)
    probe = folder / ".probe"
    immutable = False
    try:
        probe.touch()
    except OSError:
        pass
    else:
        probe.unlink()
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            folder.chmod(0o755)
            pytest.skip("cannot make a folder read-only here (root without chattr)")
        immutable = True
    try:
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def _db(tmp_path: Path, fault: str) -> Iterator[Path]:
    if fault == "missing folder":
        yield tmp_path / "no" / "such" / "profiles.db"
        return
    path = tmp_path / "store" / "profiles.db"
    path.parent.mkdir()
    if fault == "corrupt file":
        path.write_bytes(b"this is not SQLite" * 100)
        yield path
        return
    with ProfileStore(path) as store:
        store.add(make_profile())
        store.add(make_profile(seed=1))
        if fault == "newer database":
            store.db.table("_migrations").insert({"name": "m999_from_the_future", "applied_at": "2030-01-01"})
    if fault == "read-only folder":
        yield from (path for _ in _read_only(path.parent))
        return
    yield path


FAULTS = ["missing folder", "read-only folder", "corrupt file", "newer database"]
COMMANDS = {
    "profiles list": lambda db, ctx: ["profiles", "list", "--db", db],
    "profiles show": lambda db, ctx: ["profiles", "show", "1", "--db", db],
    "profiles export": lambda db, ctx: ["profiles", "export", "1", "--db", db],
    "profiles compare": lambda db, ctx: ["profiles", "compare", "1", "2", "--db", db],
    "profiles rm": lambda db, ctx: ["profiles", "rm", "1", "--db", db],
    "profiles import": lambda db, ctx: ["profiles", "import", str(ctx["export"]), "--db", db],
    "profile": lambda db, ctx: ["profile", "--model", str(ctx["model"]), "--db", db, "--ranges", "8-64"],
    "eval": lambda db, ctx: (
        ["eval", "--model", str(ctx["model"]), "--db", db, "--lengths", "64", "--num", "1"]
        + ["--tasks", "passkey", "--schemes", "smartgen"]
    ),
}
# What a user should get: "ok" (works, exit 0) or the words the one-line error must hold.
EXPECTED = {
    "missing folder": {
        "profiles list": "ok",
        "profile": "does not exist",
        "profiles import": "does not exist",
    },
    "read-only folder": {
        "profiles list": "ok",
        "profiles show": "ok",
        "profiles export": "ok",
        "profiles compare": "ok",
        "eval": "ok",
    },
    "corrupt file": {},
    "newer database": {},
}
DEFAULT_ERROR = {
    "missing folder": "no profile database",
    "read-only folder": "read-only",
    "corrupt file": "not a SmartGen profile database",
    "newer database": "newer SmartGen",
}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_store_faults_give_one_line_errors(command, fault, tmp_path, model_dir, export_file):
    for db in _db(tmp_path, fault):
        args = COMMANDS[command](str(db), {"model": model_dir, "export": export_file})
        result = runner.invoke(app, args)
        output = result.stdout + result.stderr
        assert "Traceback" not in output, output
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        expected = EXPECTED[fault].get(command, DEFAULT_ERROR[fault])
        if expected == "ok":
            assert result.exit_code == 0, output
        else:
            assert result.exit_code != 0, output
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
            assert str(db) in lines[0] or str(db.parent) in lines[0]


def test_the_default_folder_is_made_on_first_use_private_to_the_user(tmp_path, monkeypatch):
    monkeypatch.delenv("SMARTGEN_DB")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "fresh" / "data"))
    listed = runner.invoke(app, ["profiles", "list"])
    assert listed.exit_code == 0 and "no profiles yet" in listed.stdout
    assert not (tmp_path / "fresh").exists()  # listing creates nothing
    with ProfileStore() as store:
        store.add(make_profile())
    folder = tmp_path / "fresh" / "data" / "smartgen"
    assert (folder / "profiles.db").is_file()
    assert folder.stat().st_mode & 0o777 == 0o700
    assert "1" in runner.invoke(app, ["profiles", "list"]).stdout


def test_an_explicit_smartgen_db_in_a_missing_folder_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SMARTGEN_DB", str(tmp_path / "missing" / "p.db"))
    result = runner.invoke(app, ["profiles", "import", os.devnull])
    assert result.exit_code != 0


@pytest.mark.skipif(not (SAMPLE / "config.json").exists(), reason="the sample model is not in this checkout")
@pytest.mark.parametrize("fault", ["missing folder", "corrupt file", "newer database"])
def test_demo_fails_in_one_line_before_any_long_work(fault, tmp_path):
    for db in _db(tmp_path, fault):
        result = runner.invoke(app, ["demo", "--db", str(db)])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error: "), result.output
        assert "Traceback" not in result.output
