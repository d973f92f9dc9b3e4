"""A real API Priority and Fairness limit that answers 429 to every request of a flow, deterministically.

A PriorityLevelConfiguration with no seats (nominalConcurrencyShares 0, nothing lent or borrowed, limitResponse
Reject) does not reject by itself: k8s.io/apiserver (v0.37.2, fairqueuing/queueset/queueset.go,
``canAccommodateSeatsLocked``) still dispatches a request whose seats exceed the level's limit when no request
of that level is executing. A client that writes one request at a time (the operator's progress flusher) is
then never rejected. So the level is kept busy: a blocker identity creates labelled ConfigMaps in a loop, and a
validating admission webhook served here holds each create for HOLD_SECONDS. APF holds a request's seat for
all of its handling, admission included (server/filters/priority-and-fairness.go wraps the whole handler; a
create is not long-running), so while a create is held every other request of the level is answered 429.

Two FlowSchemas send into the level: the flow under test (``flow_schema_name``) and the blocker's creates
(``<name>-blocker``), so ``apiserver_flowcontrol_rejected_requests_total{flow_schema=<name>}`` counts the
flow's rejections alone. One blocker thread, sending its next create as soon as the last one returns: a second
thread would only collect 429s itself, and the API server raises the level's Retry-After (up to 32 s) when it
rejects 3 or more a second (util/flowcontrol/dropped_requests_tracker.go), and that Retry-After, not the flow's
own backoff, would then pace the flow under test.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.integration.conftest import Kube, wait_for
from tests.integration.operator_fixtures import token_kubeconfig
from tests.integration.support import kubectl, metric

HOLD_SECONDS = 20.0  # how long the webhook holds each blocker create (under its timeoutSeconds, 30)
HOLD_LABEL = "finetune.dev/apf-hold"


def rejected(kube: Kube, flow_schema: str) -> float:
    """The 429s the API server's APF gave ``flow_schema`` (its own /metrics; admin is exempt from APF)."""
    return metric(kubectl(kube, "get", "--raw", "/metrics"), "apiserver_flowcontrol_rejected_requests_total",
                  flow_schema=flow_schema)


class _SlowWebhook:
    """HTTPS on 127.0.0.1 with the dev cluster's apiserver serving certificate (SAN 127.0.0.1, signed by the
    dev cluster CA): each AdmissionReview is allowed after HOLD_SECONDS, or at once after ``release()``."""

    def __init__(self, certfile: Path, keyfile: Path) -> None:
        self.released = threading.Event()
        self.reviews = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.reviews += 1
                outer.released.wait(HOLD_SECONDS)
                body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                   "response": {"uid": review["request"]["uid"], "allowed": True}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(certfile), str(keyfile))
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, name="apf-webhook", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@dataclass
class _Blocker:
    """Creates labelled ConfigMaps one after the other as its own ServiceAccount; each holds the level."""

    core: client.CoreV1Api
    namespace: str
    stop: threading.Event = field(default_factory=threading.Event)
    created: int = 0
    rejected: int = 0
    errors: list[str] = field(default_factory=list)

    def run(self) -> None:
        body = {"metadata": {"generateName": "apf-hold-", "labels": {HOLD_LABEL: "true"}}}
        while not self.stop.is_set():
            try:
                self.core.create_namespaced_config_map(self.namespace, body, _request_timeout=45)
                self.created += 1
            except ApiException as e:
                if e.status == 429:  # the level is busy (the operator slipped in between two creates)
                    self.rejected += 1
                else:
                    self.errors.append(f"{e.status} {e.reason}")
                self.stop.wait(0.1)
            except Exception as e:  # a timeout or a reset: keep holding
                self.errors.append(repr(e))
                self.stop.wait(0.1)


def _blocker_client(kube: Kube, namespace: str, sa: str, workdir: Path) -> client.CoreV1Api:
    kube.core.create_namespaced_service_account(namespace, {"metadata": {"name": sa}})
    kube.rbac.create_namespaced_role(namespace, {
        "metadata": {"name": sa},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]}]})
    kube.rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": sa},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]})
    token = kube.core.create_namespaced_service_account_token(
        sa, namespace, {"spec": {"expirationSeconds": 3600}}).status.token or ""
    path = token_kubeconfig(Path(kube.kubeconfig), workdir / f"{sa}.kubeconfig", token, sa)
    return client.CoreV1Api(config.new_client_from_config(config_file=str(path)))


def _flow_control(name: str, namespace: str, subject: dict[str, str], rule: dict[str, list[str]],
                  blocker_sa: str) -> list[dict[str, Any]]:
    def schema(fs_name: str, sa: dict[str, str], resource_rule: dict[str, list[str]]) -> dict[str, Any]:
        return {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": fs_name},
                "spec": {"priorityLevelConfiguration": {"name": name}, "matchingPrecedence": 100,
                         "distinguisherMethod": {"type": "ByUser"},
                         "rules": [{"subjects": [{"kind": "ServiceAccount", "serviceAccount": sa}],
                                    "resourceRules": [resource_rule]}]}}

    return [
        {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
         "metadata": {"name": name},
         "spec": {"type": "Limited", "limited": {
             # No seats, none lent or borrowed: one request at a time (see the module's docstring).
             "nominalConcurrencyShares": 0, "lendablePercent": 0, "borrowingLimitPercent": 0,
             "limitResponse": {"type": "Reject"}}}},
        schema(name, subject, rule),
        schema(f"{name}-blocker", {"name": blocker_sa, "namespace": namespace},
               {"verbs": ["create"], "apiGroups": [""], "resources": ["configmaps"], "namespaces": [namespace]}),
    ]


def _webhook_config(name: str, namespace: str, port: int, ca: bytes) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{
            "name": "hold.apf.finetune.dev",
            "clientConfig": {"url": f"https://127.0.0.1:{port}/hold", "caBundle": base64.b64encode(ca).decode()},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                       "resources": ["configmaps"], "scope": "Namespaced"}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "objectSelector": {"matchLabels": {HOLD_LABEL: "true"}},
            "failurePolicy": "Ignore", "sideEffects": "None", "timeoutSeconds": 30,
            "admissionReviewVersions": ["v1"],
        }],
    }


def _apply(kube: Kube, path: Path, docs: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    kubectl(kube, "apply", "-f", str(path))


@contextmanager
def rejecting(kube: Kube, cluster: Any, namespace: str, name: str, subject: dict[str, str],
              rule: dict[str, list[str]]) -> Iterator[_Blocker]:
    """While inside, every request of ``subject`` that matches ``rule`` is answered 429 by APF (FlowSchema
    ``name``); on entry the level is already held (a blocker create rejected proves it). Everything is removed
    on exit: the webhook configuration first (no create waits on a server about to stop), then the
    FlowSchemas and the level, then the blocker and the server."""
    workdir = Path(kube.kubeconfig).parent
    blocker_sa = f"{name}-blocker"
    webhook = _SlowWebhook(cluster.certs.serving_crt, cluster.certs.serving_key)
    blocker = _Blocker(_blocker_client(kube, namespace, blocker_sa, workdir), namespace)
    thread = threading.Thread(target=blocker.run, name="apf-blocker", daemon=True)
    webhook.start()
    try:
        _apply(kube, workdir / f"{name}-webhook.json",
               [_webhook_config(name, namespace, webhook.port, cluster.certs.ca_crt.read_bytes())])
        _apply(kube, workdir / f"{name}.json", _flow_control(name, namespace, subject, rule, blocker_sa))
        time.sleep(2)  # the API server's informers take in the configuration before the first create
        thread.start()
        # Held: a create reached the webhook, and a second request of the level was refused meanwhile.
        wait_for("a blocker create held by the webhook", lambda: webhook.reviews > 0, timeout=30, interval=0.2)
        probe = _Blocker(blocker.core, namespace)
        wait_for("the held level rejects", lambda: _probe_rejected(probe), timeout=30, interval=0.5)
        yield blocker
    finally:
        blocker.stop.set()
        try:
            kubectl(kube, "delete", "validatingwebhookconfiguration", name, "--ignore-not-found")
            kubectl(kube, "delete", "flowschema", name, f"{name}-blocker", "--ignore-not-found")
            kubectl(kube, "delete", "prioritylevelconfiguration", name, "--ignore-not-found")
        finally:
            webhook.stop()  # a create still held is let through at once, so the blocker's loop ends now
            thread.join(timeout=60)


def _probe_rejected(probe: _Blocker) -> bool:
    """One create outside the blocker's loop (unlabelled: the webhook lets it through at once): 429?"""
    try:
        probe.core.create_namespaced_config_map(probe.namespace, {"metadata": {"generateName": "apf-probe-"}},
                                                _request_timeout=10)
    except ApiException as e:
        return e.status == 429
    return False
