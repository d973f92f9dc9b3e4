"""HTTPS for the progress endpoint, with certificate reload.

The certificate comes from a Secret volume (cert-manager or `kubectl create secret tls`); the kubelet
swaps the files when the Secret changes. `CertificateReloader` loads the pair into one SSLContext and
reloads it when either file changes: new connections get the new certificate, no restart needed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl

log = logging.getLogger("finetune.tls")


class CertificateReloader:
    """`context` is what the server listens with; each handshake is switched (SNI callback, called for
    every ClientHello) to the newest fully loaded context, so a half-written pair never breaks it."""

    def __init__(self, cert: str, key: str):
        self.cert = cert
        self.key = key
        self._stamp = self._mtimes()
        self._current = self._load()
        self.context = self._load()
        self.context.sni_callback = self._pick
        self.reloads = 0

    def _load(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def _pick(self, sslobj: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        sslobj.context = self._current

    def _mtimes(self) -> tuple[int, int]:
        return os.stat(self.cert).st_mtime_ns, os.stat(self.key).st_mtime_ns  # follows the Secret's symlinks

    def check(self) -> bool:
        """Reload if the files changed; True if reloaded. A half-written pair keeps the old certificate."""
        try:
            stamp = self._mtimes()
            if stamp == self._stamp:
                return False
            new = self._load()
        except (OSError, ssl.SSLError) as err:
            log.warning("TLS certificate %s not reloaded (keeping the current one): %s", self.cert, err)
            return False
        self._current = new
        self._stamp = stamp
        self.reloads += 1
        log.info("TLS certificate %s reloaded", self.cert)
        return True

    async def watch(self, interval: float = 10.0) -> None:
        while True:
            await asyncio.sleep(interval)
            self.check()
