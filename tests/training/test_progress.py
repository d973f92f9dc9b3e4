"""The progress client never blocks or raises into training, coalesces, authenticates; the bar renders."""

from __future__ import annotations

import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from finetune_operator.api.status import NetworkHealth, ProgressReport, TrainingProgress
from finetune_training.progress import ProgressBar, ProgressClient, ProgressServer, merge


class SlowServer:
    """A progress endpoint that takes `delay` seconds per request and records what it got."""

    def __init__(self, delay: float) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(delay)
                outer.bodies.append(json.loads(body))
                outer.auth.append(self.headers.get("Authorization"))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/progress/ns/job"

    def close(self) -> None:
        self.server.shutdown()


def report(step: int) -> ProgressReport:
    return ProgressReport(phase="Training", training=TrainingProgress(step=step, total_steps=100, loss=1.0 / step))


def test_publish_never_waits_for_a_slow_endpoint() -> None:
    srv = SlowServer(delay=1.0)
    client = ProgressClient(srv.url, interval=0.0, timeout=5.0)
    t0 = time.perf_counter()
    for step in range(1, 201):
        client.publish(report(step))
    elapsed = time.perf_counter() - t0
    client.close(timeout=5.0)
    srv.close()
    assert elapsed < 0.5, f"200 publishes took {elapsed:.2f}s"
    # Coalesced: far fewer POSTs than publishes, and the last one carries the newest step.
    assert 1 <= len(srv.bodies) <= 5 and client.coalesced >= 190
    assert srv.bodies[-1]["training"]["step"] == 200


def test_dead_endpoint_is_harmless() -> None:
    client = ProgressClient("http://127.0.0.1:9/unreachable", interval=0.0, timeout=0.5)
    t0 = time.perf_counter()
    for step in range(1, 50):
        client.publish(report(step))
    assert time.perf_counter() - t0 < 0.5
    client.close(timeout=3.0)
    assert client.failed >= 1 and client.sent == 0


def test_token_is_read_again_for_every_post(tmp_path: Path) -> None:
    srv = SlowServer(delay=0.0)
    token = tmp_path / "token"
    token.write_text("first\n")
    client = ProgressClient(srv.url, token_file=str(token), interval=0.0, attempt=3)
    client.publish(report(1))
    client.close(timeout=3.0)
    token.write_text("rotated")
    client2 = ProgressClient(srv.url, token_file=str(token), interval=0.0)
    client2.publish(report(2))
    client2.close(timeout=3.0)
    srv.close()
    assert srv.auth == ["Bearer first", "Bearer rotated"]
    assert srv.bodies[0]["attempt"] == 3 and srv.bodies[0]["rank"] == 0


def test_no_url_means_no_thread_and_no_work() -> None:
    client = ProgressClient(None)
    client.publish(report(1))
    client.close()
    assert client.sent == 0 and client._thread is None


def test_merge_keeps_network_and_updates_training() -> None:
    a = ProgressReport(phase="Starting", network=NetworkHealth(transport="efa", healthy=True))
    b = report(5)
    m = merge(a, b)
    assert m.network is not None and m.network.transport == "efa"
    assert m.training is not None and m.training.step == 5 and m.phase == "Training"
    m2 = merge(m, ProgressReport(training=TrainingProgress(step=6)))
    assert m2.training is not None and m2.training.step == 6 and m2.training.loss == pytest.approx(0.2)


def test_server_and_bar_roundtrip() -> None:
    out = io.StringIO()
    bar = ProgressBar(stream=out)
    server = ProgressServer(bar.update)
    client = ProgressClient(server.url, interval=0.0)
    client.publish(ProgressReport(training=TrainingProgress(step=5, total_steps=10, loss=2.5,
                                                            tokens_per_second=1234.0, eta_seconds=65)))
    client.close(timeout=3.0)
    server.close()
    assert "[############............] 5/10  loss 2.5000  1,234 tok/s  eta 1:05" in out.getvalue()
