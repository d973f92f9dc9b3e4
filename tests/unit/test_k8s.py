"""controller/k8s.py against a local socket server (no cluster): how many connections one API call makes,
and what an error answer carries. A plain HTTP listener on 127.0.0.1, not a mock of the client."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


class Pages(http.server.BaseHTTPRequestHandler):
    """Answers a LIST of ConfigMaps' metadata in two pages, and records each request's path, query and Accept."""

    seen: list[tuple[str, dict[str, list[str]], str]] = []

    def do_GET(self) -> None:  # http.server calls it by this name
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        Pages.seen.append((url.path, query, self.headers.get("Accept", "")))
        last = "continue" in query
        body = json.dumps({
            "kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1",
            "metadata": {} if last else {"continue": "page-2"},
            "items": [{"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                       "metadata": {"name": f"finetune-runtime-{'b' if last else 'a'}", "namespace": "ns-b" if last else "ns-a"}}],
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_startup_clean_up_lists_runtime_configmaps_metadata_only_and_paged(tmp_path: Path) -> None:
    """It listed every runtime ConfigMap cluster-wide with its data (~225 KB each), in one answer."""
    from finetune_operator.controller.runtime_configmaps import namespaces_with_runtimes

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Pages.seen = []
    try:
        kube = Kube(load_config(_kubeconfig(tmp_path, server.server_address[1])), timeout=5.0)
        assert namespaces_with_runtimes(kube, None) == {"ns-a", "ns-b"}
    finally:
        server.shutdown()
        server.server_close()
    assert [(path, q.get("labelSelector"), q.get("limit"), q.get("continue")) for path, q, _ in Pages.seen] == [
        ("/api/v1/configmaps", ["finetune.dev/runtime"], ["500"], None),
        ("/api/v1/configmaps", ["finetune.dev/runtime"], ["500"], ["page-2"]),
    ]
    assert all(accept == "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1" for _, _, accept in Pages.seen)
