"""The dev cluster's process supervisor, with plain processes for components (no cluster needed)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from finetune_devcluster.supervisor import DevClusterError, Supervisor, alive

# Writes its environment variable FOO to a file named by its argument, then waits for signals.
CHILD = "import os, sys, time; open(sys.argv[1], 'a').write(os.environ.get('FOO', '-') + '\\n'); time.sleep(60)"
# Ignores SIGTERM: only SIGKILL stops it.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


def _supervisor(tmp_path: Path) -> Supervisor:
    sup = Supervisor(tmp_path, tmp_path / "kubeconfig")
    sup.logs_dir.mkdir()
    sup.save_state({"processes": {}})
    return sup


def _wait_for(check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_restart_runs_the_same_command_line_with_its_environment_plus_extra(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    out = tmp_path / "out.txt"
    sup.spawn("child", [sys.executable, "-c", CHILD, str(out)], {"FOO": "first"})
    try:
        _wait_for(lambda: out.is_file() and out.read_text() == "first\n")
        before = sup.processes()["child"]
        sup.restart("child")
        after = sup.processes()["child"]
        assert not alive(before) and alive(after) and after["pid"] != before["pid"]
        assert after["args"] == before["args"]
        _wait_for(lambda: out.read_text() == "first\nfirst\n")
        sup.restart("child", env={"FOO": "second"})
        _wait_for(lambda: out.read_text() == "first\nfirst\nsecond\n")
        assert sup.log_file("child").read_text().count("$ ") == 3  # each start logs its command line
    finally:
        sup.stop(["child"])
        sup.reap_all()


def test_restart_kills_a_component_that_ignores_the_signal_after_the_grace(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    sup.spawn("stubborn", [sys.executable, "-c", STUBBORN])
    try:
        _wait_for(lambda: "ready" in sup.log_file("stubborn").read_text())
        before = sup.processes()["stubborn"]
        start = time.monotonic()
        sup.restart("stubborn", signal.SIGTERM, grace=0.5)
        assert time.monotonic() - start < 10
        assert not alive(before) and alive(sup.processes()["stubborn"])
    finally:
        sup.stop(["stubborn"], grace=0.5)
        sup.reap_all()


def test_restart_of_an_unknown_component_names_the_running_ones(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    with pytest.raises(DevClusterError, match=r"no component 'etcd' .*\(running: none\)"):
        sup.restart("etcd")
