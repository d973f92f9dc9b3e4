"""Progress that never stalls a training step.

`ProgressClient` (rank 0): `publish()` merges a `ProgressReport` into one pending slot and returns at
once; a daemon thread POSTs the pending report to `FINETUNE_PROGRESS_URL` at most every `interval`
seconds. Reports are coalesced (newer training figures replace older ones; network health and phase are
kept until sent), so a slow or dead endpoint costs nothing but dropped intermediate updates. Every POST
has a timeout, failures are counted and logged once, nothing is ever raised into training.

`ProgressServer` (local `finetune run`): a tiny HTTP server on 127.0.0.1 speaking the same wire format as
the operator's endpoint, feeding `ProgressBar`, so the local run exercises the same path as the cluster.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO

from finetune_operator.api.status import ProgressReport

log = logging.getLogger("finetune.progress")


def merge(old: ProgressReport | None, new: ProgressReport) -> ProgressReport:
    """Coalesce two unsent reports: fields of `new` win, fields only `old` has are kept."""
    if old is None:
        return new
    data = old.model_dump(exclude_none=True)
    for key, value in new.model_dump(exclude_none=True).items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return ProgressReport.model_validate(data)


class ProgressClient:
    def __init__(self, url: str | None, token_file: str | None = None, interval: float = 5.0,
                 timeout: float = 3.0, attempt: int | None = None) -> None:
        self.url = url
        self.token_file = token_file
        self.interval = interval
        self.timeout = timeout
        self.attempt = attempt
        # An https:// endpoint with a private CA: the operator renders the CA (PEM) into this variable.
        ca = os.environ.get("FINETUNE_PROGRESS_CA")
        self._ssl = ssl.create_default_context(cadata=ca) if ca else None
        self.sent = 0
        self.failed = 0
        self.coalesced = 0
        self._pending: ProgressReport | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._idle = threading.Event()
        self._idle.set()
        self._flush = threading.Event()
        self._thread: threading.Thread | None = None
        if url:
            self._thread = threading.Thread(target=self._run, name="finetune-progress", daemon=True)
            self._thread.start()

    def publish(self, report: ProgressReport) -> None:
        """Queue a report; O(1), never blocks on the network, never raises."""
        if not self.url:
            return
        try:
            if self.attempt is not None and report.attempt is None:
                report = report.model_copy(update={"attempt": self.attempt})
            with self._lock:
                if self._pending is not None:
                    self.coalesced += 1
                self._pending = merge(self._pending, report)
                self._idle.clear()
            self._wake.set()
        except Exception:
            log.debug("progress publish failed", exc_info=True)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is pending (bounded by `timeout`), then stop the thread."""
        if self._thread is None:
            return
        self._flush.set()  # cut the rate-limit pause short
        self._wake.set()
        self._idle.wait(timeout)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=1.0)

    # ---------------------------------------------------------------------------------- thread

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.token_file:
            try:
                with open(self.token_file) as f:
                    headers["Authorization"] = f"Bearer {f.read().strip()}"
            except OSError:
                pass
        return headers

    def _post(self, report: ProgressReport) -> None:
        assert self.url is not None
        body = json.dumps(report.wire()).encode()
        req = urllib.request.Request(self.url, data=body, headers=self._headers(), method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout, context=self._ssl) as resp:
            resp.read()

    def _run(self) -> None:
        last = 0.0
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                report, self._pending = self._pending, None
            if report is not None:
                try:
                    self._post(report)
                    self.sent += 1
                except Exception as e:
                    self.failed += 1
                    if self.failed == 1:
                        log.warning("progress endpoint %s unreachable (%s); training continues", self.url, e)
                last = time.monotonic()
            with self._lock:
                if self._pending is None:
                    self._idle.set()
            if self._stop:
                return
            # Rate limit: let reports pile up (coalesce) until the interval has passed.
            pause = self.interval - (time.monotonic() - last)
            if pause > 0 and not self._stop and not self._flush.is_set():
                self._flush.wait(min(pause, self.interval))
            with self._lock:
                if self._pending is not None:
                    self._wake.set()


class ProgressServer:
    """Receives ProgressReport POSTs on 127.0.0.1 and hands them to `on_report`."""

    def __init__(self, on_report: Callable[[ProgressReport], None]) -> None:
        handler_cb = on_report

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    report = ProgressReport.model_validate_json(self.rfile.read(length))
                    handler_cb(report)
                    self.send_response(204)
                except Exception:
                    self.send_response(400)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="progress-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        port = self._server.server_address[1]
        return f"http://127.0.0.1:{port}/v1/progress/local"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class ProgressBar:
    """One-line terminal progress: step/total, loss, tokens/s, ETA (a line per update when not a TTY)."""

    def __init__(self, stream: TextIO | None = None, width: int = 24) -> None:
        self.stream = stream or sys.stdout
        self.width = width
        self.tty = self.stream.isatty()
        self.latest: ProgressReport | None = None
        self.lock = threading.Lock()
        self._last_line = ""
        self._last_step: int | None = None

    def update(self, report: ProgressReport) -> None:
        with self.lock:
            self.latest = merge(self.latest, report)
            tr = report.training
            if report.message and not tr:
                self._println(report.message)
                return
            if tr is None or tr.step is None:
                return
            line = self.render(tr.step, tr.total_steps, tr.loss, tr.tokens_per_second, tr.eta_seconds, tr.eval_loss)
            if self.tty:
                self.stream.write("\r" + line.ljust(len(self._last_line)))
                self.stream.flush()
            elif tr.step != self._last_step:
                self.stream.write(line + "\n")
                self.stream.flush()
            self._last_line = line
            self._last_step = tr.step

    def render(self, step: int, total: int | None, loss: float | None, tps: float | None, eta: float | None,
               eval_loss: float | None = None) -> str:
        total = total or 0
        frac = min(1.0, step / total) if total else 0.0
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        parts = [f"[{bar}] {step}/{total}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if eval_loss is not None:
            parts.append(f"eval {eval_loss:.4f}")
        if tps is not None:
            parts.append(f"{tps:,.0f} tok/s")
        parts.append(f"eta {_fmt_time(eta)}")
        return "  ".join(parts)

    def _println(self, text: str) -> None:
        if self.tty and self._last_line:
            self.stream.write("\n")
            self._last_line = ""
        self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        with self.lock:
            if self.tty and self._last_line:
                self.stream.write("\n")
                self.stream.flush()
                self._last_line = ""
