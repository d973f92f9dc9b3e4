"""Run the real operator (`finetune operator`) as a subprocess against the dev cluster."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OperatorProcess:
    """One `finetune operator` process; `start()`/`kill()` can be called repeatedly."""

    def __init__(self, kubeconfig: Path, logdir: Path, identity: str = "op-a", lease_namespace: str = "default",
                 extra_env: dict[str, str] | None = None, extra_args: list[str] | None = None,
                 host: str = "127.0.0.1", port: int | None = None):
        self.kubeconfig = kubeconfig
        self.logdir = logdir
        self.identity = identity
        self.lease_namespace = lease_namespace
        self.host = host  # the address it listens on (a pod's IP added to lo: reached through a Service)
        self.port = port or free_port()
        self.extra_env = extra_env or {}
        self.extra_args = extra_args or []  # later flags override the defaults above (argparse: last wins)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, wait_ready: bool = True, env: dict[str, str] | None = None) -> OperatorProcess:
        self.starts += 1
        log = open(self.logdir / f"operator-{self.identity}-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "finetune_operator.cli", "operator",
             "--kubeconfig", str(self.kubeconfig), "--listen", self.host, "--port", str(self.port),
             "--progress-url", self.url, "--flush-interval", "1", "--resync-interval", "15",
             "--lease-namespace", self.lease_namespace, "--identity", self.identity, "--log-level", "INFO",
             *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.extra_env, **(env or {})},
            cwd=ROOT,
        )
        if wait_ready:
            self.wait_ready()
        return self

    def readyz(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}; see {self.logdir}")
            if self.readyz() == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(f"operator not ready after {timeout}s; see {self.logdir}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            return r.read().decode()

    def post(self, namespace: str, name: str, body: dict[str, Any], token: str | None) -> tuple[int, str]:
        import json

        req = urllib.request.Request(
            f"{self.url}/v1/progress/{namespace}/{name}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode()


# Everything in deploy/ but the operator's Deployment: RBAC, admission policies and their parameters.
DEPLOY_FILES = ("namespace.yaml", "rbac.yaml", "rbac-clusterwide.yaml", "instance-types.yaml", "policy.yaml",
                "admission.yaml")


def _kubectl(admin: Path, *args: str) -> str:
    res = subprocess.run(["kubectl", "--kubeconfig", str(admin), *args], capture_output=True, text=True,
                         timeout=60, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {res.stderr}")
    return res.stdout


def install_deploy(admin: Path) -> None:
    args = ["apply", "--server-side", "--force-conflicts"]
    for name in DEPLOY_FILES:
        args += ["-f", str(ROOT / "deploy" / name)]
    _kubectl(admin, *args)


def token_kubeconfig(admin: Path, out: Path, token: str, user: str) -> Path:
    cfg = yaml.safe_load(admin.read_text())
    cluster = cfg["clusters"][0]
    out.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": cluster["name"], "user": user}}],
        "current-context": user,
    }))
    return out


def service_account_kubeconfig(admin: Path, out: Path) -> Path:
    """Install deploy/ (RBAC, admission policies, their ConfigMaps) and return a kubeconfig that
    authenticates as the operator's ServiceAccount, so the tests prove the shipped least-privilege RBAC is
    sufficient and the admission policies let the operator do its job."""
    install_deploy(admin)
    token = _kubectl(admin, "create", "token", "finetune-operator", "-n", "finetune-system", "--duration=6h").strip()
    return token_kubeconfig(admin, out, token, "finetune-operator")


def pod_token(core: Any, namespace: str, pod: Any, audience: str, seconds: int = 600) -> str:
    """A service-account token bound to ``pod`` for ``audience``: what the kubelet projects into a Ray pod
    for the progress channel (minted here through TokenRequest, as kwok runs no kubelet)."""
    from kubernetes import client

    req = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
        audiences=[audience], expiration_seconds=seconds,
        bound_object_ref=client.V1BoundObjectReference(kind="Pod", api_version="v1", name=pod.metadata.name,
                                                       uid=pod.metadata.uid)))
    sa = pod.spec.service_account_name or "default"
    return str(core.create_namespaced_service_account_token(sa, namespace, req).status.token)
