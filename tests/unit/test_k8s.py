"""controller/k8s.py against a local socket server (no cluster): how many connections one API call makes,
and what an error answer carries. A plain HTTP listener on 127.0.0.1, not a mock of the client."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from finetune_operator.controller.k8s import ApiError, Kube, load_config, parse_retry_after


class Listener:
    """Accepts connections on 127.0.0.1 and answers each with `reply` (None: closes it at once, as a
    server that died mid-request does); counts the connections."""

    def __init__(self, reply: bytes | None) -> None:
        self.reply = reply
        self.connections = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                    if self.reply is not None:
                        conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _kubeconfig(tmp_path: Path, port: int) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    return str(path)


@pytest.fixture
def dropping() -> Iterator[Listener]:
    listener = Listener(None)
    yield listener
    listener.close()


def test_an_api_call_is_one_attempt_not_four(tmp_path: Path, dropping: Listener) -> None:
    """urllib3's default Retry(3) repeated a call whose connection broke three times, each with the full
    timeout: 4 x Kube.timeout for one call, past the leader Lease's renew deadline. load_config sets no
    retries: the callers (work queue, flusher, leader loop) retry with their own backoff."""
    kube = Kube(load_config(_kubeconfig(tmp_path, dropping.port)), timeout=5.0)
    with pytest.raises(Exception):  # noqa: B017 -- urllib3's connection error, whichever class it is
        kube.request("GET", "/api/v1/namespaces/default/configmaps/x")
    assert dropping.connections == 1
    retries = kube.api.configuration.retries
    assert retries is not None and retries.total == 0


def test_an_error_answer_carries_retry_after(tmp_path: Path) -> None:
    body = b'{"kind":"Status","message":"too many requests, please try again later","code":429}'
    listener = Listener(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 7\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    try:
        kube = Kube(load_config(_kubeconfig(tmp_path, listener.port)), timeout=5.0)
        with pytest.raises(ApiError) as err:
            kube.patch_status("ns", "a", {"step": "1"})
    finally:
        listener.close()
    assert (err.value.status, err.value.retry_after, listener.connections) == (429, 7.0, 1)
    assert "too many requests" in err.value.message


@pytest.mark.parametrize(("header", "seconds"), [("3", 3.0), ("0", 0.0), (None, None), ("-1", None),
                                                 ("Wed, 21 Oct 2015 07:28:00 GMT", None)],
                         ids=["seconds", "zero", "absent", "negative", "http-date"])
def test_parse_retry_after(header: str | None, seconds: float | None) -> None:
    assert parse_retry_after(header) == seconds
