"""Issue 30, as a property: specs generated field by field (grammar-shaped strings, arbitrary text, integers
around the bounds). Whatever `finetune validate` (check) accepts renders into objects whose names, labels,
images, quantities and int32 fields satisfy the grammars of api/grammar.py; whatever it rejects, it rejects
with one line per problem that names a field path (no traceback, no exception)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from finetune_operator.api import grammar as g
from finetune_operator.api import instance_types as it
from finetune_operator.api.validation import check, parse_job
from finetune_operator.render.config import RenderConfig
from finetune_operator.render.rayjob import render_children
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.builders import JobDoc

FILES = {"finetune_training/__init__.py": ""}
CFG = RenderConfig(progress_url="http://finetune-operator.finetune-system.svc:8080")


def _shaped(grammar: g.Grammar, examples: list[str]) -> st.SearchStrategy[str]:
    """Mostly valid-looking values (the grammar's regex, upstream examples), some arbitrary text."""
    return st.one_of(
        st.from_regex(grammar.pattern[1:-1], fullmatch=True).filter(lambda s: len(s) <= grammar.max_length + 8),
        st.sampled_from(examples),
        st.text(max_size=40),
    )


NAME = _shaped(g.DNS1123_SUBDOMAIN, ["sa", "team-a.high", "A", "a..b", "-x", "a_b"])
LABEL_KEY = _shaped(g.LABEL_KEY, ["topology.kubernetes.io/zone", "pool", "bad key", "a/", "x" * 64])
LABEL_VALUE = _shaped(g.LABEL_VALUE, ["", "us-east-1a", "a b", "-a", "a" * 64])
QUANTITY = _shaped(g.QUANTITY, ["1", "500m", "8Gi", "1.5.0Gi", "1e", "-1", ".Gi", "5GiMi"])
IMAGE = _shaped(g.IMAGE, ["public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.0", "", "Ray:1",
                          "ray:bad tag", f"ray@sha256:{'a' * 64}", "ray@sha256:abc"])
ENV_NAME = st.one_of(_shaped(g.ENV_VAR_NAME, ["MY_FLAG", "1X", "A=B"]),
                     st.sampled_from(["PYTHONPATH", "RAY_ADDRESS", "NCCL_NET", "NCCL_SOCKET_IFNAME", "HF_TOKEN"]))
INT = st.one_of(st.integers(min_value=-2, max_value=2**33), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63]))
INSTANCE = st.one_of(st.sampled_from(sorted(it.INSTANCE_TYPES)), st.sampled_from(["g6 12xlarge", "", "x" * 64]))

FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "spec.cluster.image": IMAGE,
    "spec.cluster.serviceAccountName": NAME,
    "spec.cluster.priorityClassName": NAME,
    "spec.cluster.instanceType": INSTANCE,
    "spec.cluster.nodeSelector": st.dictionaries(LABEL_KEY, LABEL_VALUE, max_size=3),
    "spec.cluster.head.nodeSelector": st.dictionaries(LABEL_KEY, LABEL_VALUE, max_size=2),
    "spec.cluster.head.cpu": QUANTITY,
    "spec.cluster.head.memory": QUANTITY,
    "spec.cluster.workers.cpu": QUANTITY,
    "spec.cluster.workers.memory": QUANTITY,
    "spec.cluster.workers.shmSize": QUANTITY,
    "spec.cluster.workers.hugepages2Mi": QUANTITY,
    "spec.cluster.env": st.lists(st.fixed_dictionaries({"name": ENV_NAME, "value": st.text(max_size=8)}), max_size=3),
    "spec.cluster.envFrom": st.lists(st.one_of(
        st.fixed_dictionaries({"configMapRef": NAME}),
        st.fixed_dictionaries({"secretRef": NAME, "prefix": ENV_NAME})), max_size=2),
    "spec.model.hubTokenSecretRef": st.fixed_dictionaries(
        {"name": NAME, "key": _shaped(g.CONFIG_MAP_KEY, ["token", "..", "a/b"])}),
    "spec.model.source": st.one_of(st.sampled_from(["Qwen/Qwen2.5-1.5B", "/models/q"]),
                                   NAME.map(lambda c: f"pvc://{c}/model")),
    "spec.training.checkpoint.storageUri": st.one_of(st.just("s3://b/ckpt"), NAME.map(lambda c: f"pvc://{c}/ckpt")),
    "spec.activeDeadlineSeconds": INT,
    "spec.ttlSecondsAfterFinished": INT,
    "spec.backoffLimit": INT,
    "spec.training.seed": INT,
    "spec.training.maxSteps": INT,
    "spec.dataset.maxSamples": INT,
    "spec.training.checkpoint.intervalSteps": INT,
    "spec.network.requireEFA": st.booleans(),
    "spec.cluster.tolerations": st.lists(st.fixed_dictionaries({}, optional={
        "key": st.one_of(LABEL_KEY, st.just("")), "operator": st.sampled_from(["Equal", "Exists", "In"]),
        "value": LABEL_VALUE, "effect": st.sampled_from(["NoSchedule", "NoExecute", "Never"]),
        "tolerationSeconds": INT}), max_size=2),
    "metadata.labels": st.dictionaries(LABEL_KEY, LABEL_VALUE, max_size=2),
}


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    doc = JobDoc.example("prop")
    for path in draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=6, unique=True)):
        doc.set(path, draw(FIELDS[path]))
    return doc.obj()


def _pods(rayjob: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = rayjob["spec"]
    yield "head", spec["rayClusterSpec"]["headGroupSpec"]["template"]
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        yield group["groupName"], group["template"]
    yield "submitter", spec["submitterPodTemplate"]


def _ok(grammar: g.Grammar, value: str, where: str) -> None:
    message = grammar.check(value)
    assert message is None, f"{where}: {message}"


def assert_fits_the_grammars(objs: list[dict[str, Any]]) -> None:
    for obj in objs:
        for key, value in obj["metadata"].get("labels", {}).items():
            _ok(g.LABEL_KEY, key, "label key")
            _ok(g.LABEL_VALUE, value, f"label {key}")
        _ok(g.DNS1123_SUBDOMAIN, obj["metadata"]["name"], "name")
    rayjob = objs[-1]
    spec = rayjob["spec"]
    for field in ("backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished"):
        assert 0 <= spec.get(field, 0) <= g.INT32_MAX, field
    for rule in (spec.get("deletionStrategy") or {}).get("deletionRules", []):
        assert 0 <= rule["condition"]["ttlSeconds"] <= g.INT32_MAX
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        for field in ("replicas", "minReplicas", "maxReplicas"):
            assert 0 <= group[field] <= g.INT32_MAX, field
    for where, template in _pods(rayjob):
        pod = template["spec"]
        for key, value in template["metadata"].get("labels", {}).items():
            _ok(g.LABEL_KEY, key, f"{where} label key")
            _ok(g.LABEL_VALUE, value, f"{where} label {key}")
        for key, value in pod.get("nodeSelector", {}).items():
            _ok(g.LABEL_KEY, key, f"{where} nodeSelector key")
            _ok(g.LABEL_VALUE, value, f"{where} nodeSelector {key}")
        for tol in pod.get("tolerations", []):
            if tol.get("key"):
                _ok(g.LABEL_KEY, tol["key"], f"{where} toleration key")
            else:
                assert tol.get("operator") == "Exists", tol
            _ok(g.LABEL_VALUE, tol.get("value", ""), f"{where} toleration value")
            assert tol.get("operator", "Equal") in ("Equal", "Exists") and not (
                tol.get("operator") == "Exists" and tol.get("value")), tol
            assert tol.get("effect", "") in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"), tol
            assert "tolerationSeconds" not in tol or tol.get("effect") == "NoExecute", tol
        for field in ("serviceAccountName", "priorityClassName"):
            if field in pod:
                _ok(g.DNS1123_SUBDOMAIN, pod[field], f"{where} {field}")
        for volume in pod.get("volumes", []):
            _ok(g.DNS1123_LABEL, volume["name"], f"{where} volume")
            if "persistentVolumeClaim" in volume:
                _ok(g.DNS1123_SUBDOMAIN, volume["persistentVolumeClaim"]["claimName"], f"{where} claim")
            if "emptyDir" in volume and "sizeLimit" in volume["emptyDir"]:
                _ok(g.QUANTITY, volume["emptyDir"]["sizeLimit"], f"{where} {volume['name']} sizeLimit")
        for container in pod["containers"]:
            if where != "submitter":  # the submitter's image is the admin's (RenderConfig), not the spec's
                _ok(g.IMAGE, container["image"], f"{where} image")
            for kind in ("requests", "limits"):
                for res, value in container.get("resources", {}).get(kind, {}).items():
                    _ok(g.QUANTITY, value, f"{where} {kind}.{res}")
            for env in container.get("env", []):
                _ok(g.ENV_VAR_NAME, env["name"], f"{where} env")
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    _ok(g.DNS1123_SUBDOMAIN, ref["name"], f"{where} secretKeyRef")
                    _ok(g.CONFIG_MAP_KEY, ref["key"], f"{where} secretKeyRef key")
            for src in container.get("envFrom", []):
                for ref in ("configMapRef", "secretRef"):
                    if ref in src:
                        _ok(g.DNS1123_SUBDOMAIN, src[ref]["name"], f"{where} envFrom {ref}")
                if "prefix" in src:
                    _ok(g.ENV_VAR_NAME, src["prefix"], f"{where} envFrom prefix")


@settings(max_examples=600, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(specs())
def test_accepted_specs_render_to_valid_objects_and_rejected_ones_name_a_field(doc: dict[str, Any]) -> None:
    job, issues = check(doc)
    errors = [i for i in issues if i.severity == "error"]
    for issue in issues:
        line = str(issue)
        assert "\n" not in line and "Traceback" not in line, line
        assert issue.path.startswith(("spec.", "metadata.")), line
    if job is None:
        event("rejected")
        assert errors
        return
    assert not errors
    if job.spec.cluster.instance_type not in it.INSTANCE_TYPES:
        return  # waits for figures in the cluster: nothing to render here
    event("accepted and rendered")
    objs = render_children(parse_job(doc), FILES, CFG)
    assert_fits_the_grammars(objs)
