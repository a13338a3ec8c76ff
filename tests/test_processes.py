"""Node processes die with the process that started them, even when it is killed and cannot stop them; they run the
smartgen package that started them."""

import os
import signal
import subprocess
import sys
import time

import pytest

from smartgen.roles.processes import smartgen_command, smartgen_env

PARENT = """
import subprocess, sys, time
from smartgen.roles.processes import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie awaiting its reaper is dead for our purpose
        return handle.read().split(") ")[1][0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_a_child_started_with_die_with_parent_goes_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the child outlived its killed parent"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="`python -P` (no working directory on sys.path) is 3.11+")
def test_a_node_command_runs_this_smartgen_from_a_folder_holding_another(tmp_path):
    """`smartgen bench` started beside another checkout: its nodes run the package the bench runs, not the folder's."""
    decoy = tmp_path / "smartgen"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("")
    (decoy / "__main__.py").write_text("print('the other checkout')\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    ran = subprocess.run(
        smartgen_command("--help"), cwd=tmp_path, env=smartgen_env(env), capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "the other checkout" not in ran.stdout and "serve" in ran.stdout
    # the folder holding this package comes first, whatever PYTHONPATH held
    assert smartgen_env({"PYTHONPATH": "/x"})["PYTHONPATH"].split(os.pathsep)[1:] == ["/x"]
