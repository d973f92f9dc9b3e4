"""The progress endpoint's certificate reload (controller/tls.py), with real certificates and a real
TLS handshake: after the files change, new connections get the new certificate."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
from pathlib import Path

import pytest
from finetune_operator.controller.tls import CertificateReloader


def _cert(directory: Path, cn: str) -> tuple[Path, Path]:
    cert, key = directory / f"{cn}.crt", directory / f"{cn}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={cn}",
                    "-addext", f"subjectAltName=DNS:{cn}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


async def _served_cn(ctx: ssl.SSLContext, ca: Path, name: str) -> str:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    client = ssl.create_default_context(cafile=str(ca))
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=name)
        peer = writer.get_extra_info("peercert")
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
    return str(dict(x[0] for x in peer["subject"])["commonName"])


def test_certificate_is_reloaded_when_the_secret_changes(tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    old_cert, old_key = _cert(tmp_path, "old.example")
    new_cert, new_key = _cert(tmp_path, "new.example")
    cert, key = live / "tls.crt", live / "tls.key"
    cert.write_bytes(old_cert.read_bytes())
    key.write_bytes(old_key.read_bytes())
    reloader = CertificateReloader(str(cert), str(key))
    assert asyncio.run(_served_cn(reloader.context, old_cert, "old.example")) == "old.example"
    assert reloader.check() is False  # unchanged
    # A half-written pair (new certificate, old key) keeps the current certificate.
    cert.write_bytes(new_cert.read_bytes())
    os.utime(cert, ns=(10**18, 10**18))
    assert reloader.check() is False
    key.write_bytes(new_key.read_bytes())
    os.utime(key, ns=(10**18 + 1, 10**18 + 1))
    assert reloader.check() is True and reloader.reloads == 1
    assert asyncio.run(_served_cn(reloader.context, new_cert, "new.example")) == "new.example"


def test_missing_files_fail_at_start(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        CertificateReloader(str(tmp_path / "none.crt"), str(tmp_path / "none.key"))


def test_training_client_verifies_the_endpoint_with_the_rendered_ca(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The renderer gives pods FINETUNE_PROGRESS_CA (the PEM); the runtime's client trusts exactly it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from finetune_operator.api.status import ProgressReport
    from finetune_training.progress import ProgressClient

    cert, key = _cert(tmp_path, "localhost")
    got: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(202)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://localhost:{server.server_address[1]}/v1/progress/ns/a"
    try:
        untrusted = ProgressClient(url, interval=0.01)
        untrusted.publish(ProgressReport.model_validate({"rank": 0, "training": {"step": 1}}))
        untrusted.close()
        assert untrusted.failed == 1 and got == []  # a certificate it was not told to trust
        monkeypatch.setenv("FINETUNE_PROGRESS_CA", cert.read_text())
        client = ProgressClient(url, interval=0.01)
        client.publish(ProgressReport.model_validate({"rank": 0, "training": {"step": 2}}))
        client.close()
        assert client.sent == 1 and len(got) == 1
    finally:
        server.shutdown()
