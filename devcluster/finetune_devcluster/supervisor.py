"""The dev cluster's processes: spawn, watch, signal, reap, restart; their state file and their logs.

Each component runs in its own session (its process group id is its pid) with stdout and stderr in
``<workdir>/logs/<name>.log`` (the command line first, ``$ ...``). ``<workdir>/state.json`` records every
process (pid, kernel start time, command line, extra environment), so another process (the CLI) can tell
whether they are alive and stop them; the start time guards against signalling a recycled pid.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Log = Callable[[str], None]


class DevClusterError(RuntimeError):
    """A component failed to start or become ready; the message names it and quotes its log."""


def proc_start_time(pid: int) -> int | None:
    """Kernel start time of a process (guards against killing a recycled pid), None if gone/zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _set_pdeathsig() -> None:
    """Child side: get SIGKILL when the parent dies (so a killed test run leaves no processes).

    SIGKILL, not SIGTERM: a terminating kube-apiserver waits for etcd, a terminating etcd for the
    apiserver's connections; together they linger ~20s. The cluster is throwaway anyway."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return "(no log)"


def alive(p: dict[str, Any]) -> bool:
    """Whether the process a state entry records is still the one that was started."""
    start = proc_start_time(int(p["pid"]))
    return start is not None and (p.get("start") is None or start == p["start"])


class Supervisor:
    """The processes of one work directory. ``kubeconfig``: exported as ``KUBECONFIG`` to every component.
    ``die_with_parent``: components get SIGKILL when this process dies."""

    def __init__(self, workdir: Path, kubeconfig: Path, die_with_parent: bool = False) -> None:
        self.workdir = workdir
        self.kubeconfig = kubeconfig
        self.die_with_parent = die_with_parent
        self._popen: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def state_file(self) -> Path:
        return self.workdir / "state.json"

    def log_file(self, name: str) -> Path:
        return self.logs_dir / f"{name}.log"

    # ---- state -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.state_file.read_text()))
        except (OSError, ValueError):
            return {}

    def save_state(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    def processes(self) -> dict[str, dict[str, Any]]:
        return dict(self.state().get("processes", {}))

    def _process(self, name: str) -> dict[str, Any]:
        procs = self.processes()
        if name not in procs:
            known = ", ".join(procs) or "none"
            raise DevClusterError(f"no component {name!r} in {self.state_file} (running: {known})")
        return procs[name]

    # ---- processes ---------------------------------------------------------------------------------
    def spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> None:
        """Start a component; its command line and ``extra_env`` are recorded for :meth:`restart`."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env.update(extra_env or {})
        with open(self.log_file(name), "ab") as logf:
            logf.write(f"$ {' '.join(args)}\n".encode())
            logf.flush()
            p = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=env,
                start_new_session=True,
                preexec_fn=_set_pdeathsig if self.die_with_parent else None,
            )
        self._popen[name] = p
        with self._lock:
            state = self.state()
            state.setdefault("processes", {})[name] = {
                "pid": p.pid,
                "start": proc_start_time(p.pid),
                "args": args,
                "env": dict(extra_env or {}),
            }
            self.save_state(state)

    def send_signal(self, p: dict[str, Any], sig: int) -> None:
        try:
            os.killpg(int(p["pid"]), sig)  # its own session: the group id is its pid
        except ProcessLookupError:
            pass

    def reap(self, name: str, block: bool = False) -> None:
        popen = self._popen.get(name)
        if popen is None:
            return
        try:
            popen.wait(timeout=5 if block else 0.001)
            del self._popen[name]
        except subprocess.TimeoutExpired:
            pass

    def reap_all(self) -> None:
        for name in list(self._popen):
            self.reap(name, block=True)

    def stop(self, names: Sequence[str], sig: int = signal.SIGTERM, grace: float = 10, kill_wait: float = 5) -> list[str]:
        """Signal the live ones of ``names`` at once, wait up to ``grace`` s for each, then SIGKILL (and wait up
        to ``kill_wait`` s). Returns the names that were running."""
        procs = self.processes()
        running = [n for n in names if n in procs and alive(procs[n])]
        for name in running:
            self.send_signal(procs[name], sig)
        deadline = time.monotonic() + grace
        for name in running:
            while alive(procs[name]) and time.monotonic() < deadline:
                self.reap(name)
                time.sleep(0.02)
            if alive(procs[name]):
                self.send_signal(procs[name], signal.SIGKILL)
                kill_deadline = time.monotonic() + kill_wait
                while alive(procs[name]) and time.monotonic() < kill_deadline:
                    self.reap(name)
                    time.sleep(0.02)
        return running

    def restart(self, name: str, sig: int = signal.SIGTERM, grace: float = 15, env: dict[str, str] | None = None) -> None:
        """Stop one component (``sig``; SIGKILL after ``grace`` s) and start it again with its recorded command
        line and environment, plus ``env``. Works from any process that sees the state file."""
        p = self._process(name)
        self.stop([name], sig, grace=grace, kill_wait=30)
        if alive(p):
            raise DevClusterError(f"{name} (pid {p['pid']}) survived SIGKILL; not starting it again")
        self.reap(name, block=True)
        args = p.get("args") or self._logged_args(name)
        self.spawn(name, list(args), {**p.get("env", {}), **(env or {})})

    def _logged_args(self, name: str) -> list[str]:
        """The command line from the log's first line (state files written before it was recorded there)."""
        first = self.log_file(name).read_text().splitlines()[0]
        if not first.startswith("$ "):
            raise DevClusterError(f"no command line recorded for {name}")
        return first[2:].split()

    def check_alive(self) -> None:
        for name, p in self.processes().items():
            self.reap(name)
            if not alive(p):
                log = self.log_file(name)
                raise DevClusterError(f"{name} exited; last lines of {log}:\n{tail(log)}")

    def wait(self, what: str, check: Callable[[], bool], deadline: float) -> None:
        """Poll ``check`` until it is true; fail at ``deadline`` or as soon as any component exited."""
        last: Exception | None = None
        while True:
            self.check_alive()
            try:
                if check():
                    return
                last = None
            except (OSError, urllib.error.URLError, ValueError, KeyError) as e:
                last = e
            if time.monotonic() > deadline:
                raise DevClusterError(f"timed out waiting for {what} (last error: {last}); logs in {self.logs_dir}")
            time.sleep(0.2)
