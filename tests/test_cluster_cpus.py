"""The local cluster can put the prefill and decode nodes on disjoint CPUs, as separate machines would be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smartgen.apps.cluster import ClusterSpec, LocalCluster, node_process, split_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")

PROBE = "import json, os; print(json.dumps([sorted(os.sched_getaffinity(0)), os.environ.get('OMP_NUM_THREADS')]))"


def test_the_cpus_are_halved_and_the_decode_node_gets_the_odd_one(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6})
    assert split_cpus() == ([4], [5, 6])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert split_cpus() is None


def test_a_node_runs_on_its_cpus_with_one_thread_each():
    cpus = sorted(os.sched_getaffinity(0))[-1:]
    env, prepare = node_process(dict(os.environ), cpus)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, preexec_fn=prepare, capture_output=True, text=True)
    assert json.loads(out.stdout) == [cpus, "1"]


def test_without_cpus_a_node_keeps_this_process_cpus():
    env, prepare = node_process({**os.environ, "OMP_NUM_THREADS": "7"}, None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, preexec_fn=prepare, capture_output=True, text=True)
    assert json.loads(out.stdout) == [sorted(os.sched_getaffinity(0)), "7"]


def test_only_a_cluster_of_processes_splits_its_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert LocalCluster(ClusterSpec(model=Path("."), separate_cpus=True)).cpus == ([0], [1])
    assert LocalCluster(ClusterSpec(model=Path("."))).cpus is None  # off unless asked
    assert LocalCluster(ClusterSpec(model=Path("."), separate_cpus=True, lane="inproc")).cpus is None  # one process
