"""How the dev cluster itself talks to its apiserver and components: just enough REST for bootstrapping
(CRDs, nodes, add-on objects, readiness), the admin kubeconfig, and health probes. Tests and the operator
use the kubernetes client with the kubeconfig written here."""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from . import pki
from .supervisor import DevClusterError

FIELD_MANAGER = "finetune-dev-cluster"


class Api:
    """Admin (system:masters) requests to the apiserver at ``server``, JSON in and out."""

    def __init__(self, server: str, keys: pki.Pki) -> None:
        self.server = server
        self.ctx = ssl.create_default_context(cafile=str(keys.ca_crt))
        self.ctx.load_cert_chain(str(keys.admin_crt), str(keys.admin_key))

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json", timeout: float = 30
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        with urllib.request.urlopen(req, context=self.ctx, timeout=timeout) as resp:
            raw = resp.read()
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode()

    def get(self, path: str) -> Any:
        return self.request("GET", path)


def status_message(e: urllib.error.HTTPError) -> str:
    body = e.read().decode(errors="replace")
    try:
        return str(json.loads(body)["message"])
    except (ValueError, KeyError):
        return body or str(e)


PLURALS = {
    "Service": "services",
    "EndpointSlice": "endpointslices",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "StorageClass": "storageclasses",
    "PersistentVolume": "persistentvolumes",
    "PersistentVolumeClaim": "persistentvolumeclaims",
}


def apply(api: Api, doc: dict[str, Any]) -> None:
    """Create ``doc`` (a 409 means it is there already: fine for these fixed objects)."""
    meta = doc["metadata"]
    group_version = doc["apiVersion"]
    plural = PLURALS[doc["kind"]]
    base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    ns = f"/namespaces/{meta['namespace']}" if "namespace" in meta else ""
    try:
        api.request("POST", f"{base}{ns}/{plural}", doc)
    except urllib.error.HTTPError as e:
        if e.code != 409:
            raise DevClusterError(f"creating {doc['kind']} {meta['name']}: {status_message(e)}") from e


def node_ready(node: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions") or [])


def write_kubeconfig(path: Path, server: str, keys: pki.Pki) -> None:
    """The admin kubeconfig (certificates inline), readable by its owner only."""

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "finetune-dev", "cluster": {"server": server, "certificate-authority-data": b64(keys.ca_crt)}}
        ],
        "users": [
            {
                "name": "finetune-dev-admin",
                "user": {"client-certificate-data": b64(keys.admin_crt), "client-key-data": b64(keys.admin_key)},
            }
        ],
        "contexts": [{"name": "finetune-dev", "context": {"cluster": "finetune-dev", "user": "finetune-dev-admin"}}],
        "current-context": "finetune-dev",
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    path.chmod(0o600)


# ---- health probes of the components -----------------------------------------------------------------
def http_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def http_json(url: str) -> dict[str, Any]:
    return dict(json.loads(http_text(url)))


def https_ok(url: str) -> bool:
    # The components' serving certificates are self-signed; this only checks they answer "ok".
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
        return bool(r.read().decode() == "ok")
