"""A real S3-protocol server for the tests: moto's standalone server (``moto_server``) on loopback.

moto lives in a virtualenv of its own under the cache (``$FINETUNE_CACHE_DIR/s3server/moto-<version>-<key>``),
installed once from ``s3server-requirements.txt`` (its pins; the key is their hash): moto needs botocore, whose
``python-dateutil<3`` conflicts with the project's kubernetes client, so it cannot share the project's venv.
The product never talks to moto's Python API: the runtime reaches the server over HTTP through pyarrow's S3
filesystem, with the standard AWS environment (``S3Server.env``) as an EKS pod would have it.

    server = S3Server(workdir)          # workdir holds the log (moto_server.log), kept on failure
    server.start(buckets=["data"])      # free loopback port, waits until it answers, creates buckets
    os.environ.update(server.env)       # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION
    server.stop()

The server runs in its own session and gets SIGKILL when its parent dies, so a killed test run leaves no
process behind. moto accepts any credentials (it does not check signatures unless told to).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

from .build import cache_dir
from .versions import MOTO_VERSION

REQUIREMENTS = Path(__file__).with_name("s3server-requirements.txt")
REGION = "us-east-1"
# moto accepts any key pair; these are what the tests' clients sign with.
ACCESS_KEY_ID = "finetune-test"
SECRET_ACCESS_KEY = "finetune-test-secret"
Log = Callable[[str], None]


class S3ServerError(RuntimeError):
    """moto could not be installed or did not start; the message names the log."""


def install_dir() -> Path:
    key = hashlib.sha256(REQUIREMENTS.read_bytes() + sys.version.encode()).hexdigest()[:12]
    return cache_dir() / "s3server" / f"moto-{MOTO_VERSION}-{key}"


def server_binary() -> Path:
    return install_dir() / "bin" / "moto_server"


def is_installed() -> bool:
    return (install_dir() / ".complete").exists()


def install(log: Log = print) -> Path:
    """Create moto's virtualenv once (pip, ~40 s); a no-op when the cache has it. Returns moto_server's path."""
    target = install_dir()
    if is_installed():
        return server_binary()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".install.lock", "w") as lock:  # two test sessions starting at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_installed():
            return server_binary()
        logfile = target.parent / f"{target.name}.install.log"
        log(f"s3server: installing moto {MOTO_VERSION} into {target} (log: {logfile})")
        t0 = time.monotonic()
        with open(logfile, "wb") as out:
            for cmd in ([sys.executable, "-m", "venv", "--clear", str(target)],
                        [str(target / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                         "-r", str(REQUIREMENTS)]):
                out.write(f"$ {' '.join(cmd)}\n".encode())
                out.flush()
                if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode:
                    raise S3ServerError(f"installing moto failed: {' '.join(cmd[:4])} ...; log: {logfile}")
        (target / ".complete").write_text(MOTO_VERSION + "\n")
        log(f"s3server: moto {MOTO_VERSION} installed in {time.monotonic() - t0:.0f}s")
    return server_binary()


def _set_pdeathsig() -> None:
    """Child side: SIGKILL when the parent (the test session) dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return "(no log)"


class S3Server:
    """One moto_server process; see the module docstring."""

    def __init__(self, workdir: str | Path, log: Log = print) -> None:
        self.workdir = Path(workdir)
        self.log = log
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def logfile(self) -> Path:
        return self.workdir / "moto_server.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS environment a client (pyarrow, boto3, the AWS CLI) needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
            "AWS_REGION": REGION,
        }

    def start(self, buckets: Iterable[str] = (), timeout: float = 30.0) -> S3Server:
        binary = install(self.log)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        args = [str(binary), "-H", "127.0.0.1", "-p", str(self.port)]
        with open(self.logfile, "ab") as out:
            out.write(f"$ {' '.join(args)}\n".encode())
            out.flush()
            self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          cwd=self.workdir, start_new_session=True, preexec_fn=_set_pdeathsig)
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while True:
            if self._proc.poll() is not None:
                raise S3ServerError(f"moto_server exited with status {self._proc.returncode}; last lines of "
                                    f"{self.logfile}:\n{_tail(self.logfile)}")
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=2) as r:
                    if r.status == 200:
                        break
            except (OSError, urllib.error.URLError) as e:
                last = e
            if time.monotonic() > deadline:
                self.stop()
                raise S3ServerError(f"moto_server did not answer on {self.endpoint} within {timeout:.0f}s "
                                    f"(last error: {last}); log: {self.logfile}")
            time.sleep(0.1)
        try:
            for b in buckets:
                self.create_bucket(b)
        except S3ServerError:
            self.stop()
            raise
        return self

    def create_bucket(self, name: str) -> None:
        """PUT /<bucket> (moto accepts it unsigned; a real S3 would need a signed request)."""
        # No body: urllib would label an empty one as a form, which moto rejects (400).
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
        except urllib.error.HTTPError as e:
            raise S3ServerError(f"creating bucket {name!r} on {self.endpoint}: HTTP {e.code}; "
                                f"log: {self.logfile}") from None

    def stop(self) -> None:
        p, self._proc = self._proc, None
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)  # its own session: the group id is its pid
            p.wait(timeout=5)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)

    def __enter__(self) -> S3Server:
        return self.start() if self._proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m finetune_devcluster.s3server",
                                description="Install moto's S3 server (cached), or run one until Ctrl-C.")
    p.add_argument("--install", action="store_true", help="only install (what `make prebuild` does)")
    p.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    p.add_argument("--workdir", default=str(cache_dir() / "s3server" / "run"))
    args = p.parse_args(argv)
    if args.install:
        print(install())
        return 0
    server = S3Server(args.workdir).start(args.bucket)
    print("\n".join(f"export {k}={v}" for k, v in server.env.items()), flush=True)
    try:
        while server._proc is not None and server._proc.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
