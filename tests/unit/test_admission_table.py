"""Issue 30: every field is checked at admission to the rule the cluster applies later. The Python side of
tests/admission_table.py (`finetune validate`); the API server's side is tests/integration/test_admission.py.
Also: the CRD carries the grammars of api/grammar.py (one definition), and the grammars say what upstream says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_operator.api import env_policy
from finetune_operator.api import grammar as g
from finetune_operator.api.crd import build_crd
from finetune_operator.api.validation import check

from tests.admission_table import INVALID, ROWS, VALID, Row

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("row", VALID, ids=[r.id for r in VALID])
def test_valid_rows_pass_validate(row: Row) -> None:
    job, issues = check(row.doc())
    errors = [str(i) for i in issues if i.severity == "error"]
    assert job is not None and not errors, errors


@pytest.mark.parametrize("row", INVALID, ids=[r.id for r in INVALID])
def test_invalid_rows_name_the_field_and_the_rule(row: Row) -> None:
    job, issues = check(row.doc())
    assert job is None, f"accepted; issues: {[str(i) for i in issues]}"
    errors = [i for i in issues if i.severity == "error"]
    assert row.path is not None
    mine = [i for i in errors if i.path == row.path or i.path.startswith((row.path + ".", row.path + "["))]
    assert mine, [str(i) for i in errors]
    for issue in errors:
        line = str(issue)
        assert "\n" not in line and "Traceback" not in line, line
        assert len(issue.message.split()) >= 3, f"the rule, in words: {line}"


def test_finetune_validate_cli_gives_the_same_verdicts(tmp_path: Path) -> None:
    path = tmp_path / "table.yaml"
    path.write_text(yaml.safe_dump_all([r.doc() for r in ROWS], sort_keys=False))
    out = subprocess.run([sys.executable, "-m", "finetune_operator.cli", "validate", str(path)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    for i, row in enumerate(ROWS):
        where = f"{path}[{i}]: "
        ok = [ln for ln in out.stdout.splitlines() if ln.startswith(where + "ok")]
        errors = [ln[len(where):] for ln in out.stderr.splitlines()
                  if ln.startswith(where) and not ln.startswith(where + "warning:")]
        if row.path is None:
            assert ok and not errors, (row.id, errors)
        else:
            assert not ok and any(e.startswith(row.path) for e in errors), (row.id, errors)


# ---------------------------------------------------------------------------------- one definition


def _validations(node: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(node, dict):
        out += node.get("x-kubernetes-validations") or []
        for value in node.values():
            out += _validations(value)
    elif isinstance(node, list):
        for value in node:
            out += _validations(value)
    return out


def test_crd_rules_are_the_grammar_modules() -> None:
    rules = {r["rule"] for r in _validations(build_crd())}
    for grammar in (g.DNS1123_SUBDOMAIN, g.LABEL_VALUE, g.NODE_LABEL_VALUE, g.ENV_VAR_NAME, g.CONFIG_MAP_KEY,
                    g.QUANTITY, g.IMAGE):
        assert f"self.matches(r'{grammar.pattern}')" in rules, grammar.name
    assert any(g.LABEL_KEY.cel("k") in r for r in rules)
    assert any(env_policy.ALWAYS_REJECTED[0] in r for r in rules)
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for part, field in (("model", "source"), ("dataset", "source")):
        assert spec[part]["properties"][field]["pattern"].startswith("^(s3://"), part
    assert spec["training"]["properties"]["checkpoint"]["properties"]["storageUri"]["pattern"].startswith("^(s3://")
    # RE2 and Rust/Python agree only on explicit ASCII classes.
    for grammar in g.ALL:
        assert "\\d" not in grammar.pattern and "\\w" not in grammar.pattern, grammar.name


GRAMMAR_CASES = [
    # (grammar, valid, invalid): examples from the upstream tests and docs
    (g.DNS1123_SUBDOMAIN, ["a", "my-name", "123-abc", "a.b.c", "a" * 253],
     ["", "A", "a_b", "-a", "a-", "a..b", ".a", "a" * 254]),
    (g.DNS1123_LABEL, ["a", "my-name", "123-abc", "a" * 63], ["", "a.b", "A", "-a", "a" * 64]),
    (g.LABEL_KEY, ["a", "MyName", "my.name", "123-abc", "example.com/a_b", "a/" + "b" * 63],
     ["", "a/", "/a", "a/b/c", "Example.com/a", "a b", "_a", "a/" + "b" * 64, "a" * 254 + "/b"]),
    (g.LABEL_VALUE, ["", "MyValue", "my_value", "12345", "a" * 63], ["-a", "a-", "a b", "a/b", "a" * 64]),
    (g.ENV_VAR_NAME, ["my.env-name", "MY_ENV.NAME", "MyEnvName1", "_A"], ["", "1A", "A=B", "A B"]),
    (g.CONFIG_MAP_KEY, ["key.name", "KEY_NAME", "key-name", ".a"], ["", ".", "..", "..a", "a/b", "a b"]),
    (g.QUANTITY, ["40", "500m", "160Gi", "1e3", "1E-3", "+1", "1.", ".5", "0.5Ki", "5n", "7u"],
     ["", "-1", "1.2.3", ".", "Gi", "1e", "1Gii", "5GiMi", "1 Gi", "1K", "1ki"]),
    (g.IMAGE, ["ubuntu", "ubuntu:22.04", "docker.io/library/ubuntu:latest", "localhost:5000/a/b:c",
               "[::1]:5000/a", "a.b/c__d/e-f---g", f"a@sha256:{'a' * 64}", f"a:t@sha512:{'f' * 128}",
               "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.0"],
     ["", "Ubuntu", "a/B", "a:", "a@", "a:-t", "a//b", "a_-b", ":tag", "a b", f"a@sha256:{'A' * 64}",
      f"a@sha256:{'a' * 63}", f"a@sha1:{'a' * 40}", "a" * 64, "a/" + "b" * 254]),
]


@pytest.mark.parametrize(("grammar", "valid", "invalid"), GRAMMAR_CASES, ids=[c[0].name for c in GRAMMAR_CASES])
def test_grammar_examples(grammar: g.Grammar, valid: list[str], invalid: list[str]) -> None:
    for value in valid:
        assert grammar.check(value) is None, (value, grammar.check(value))
    for value in invalid:
        message = grammar.check(value)
        assert message is not None and len(message.split()) >= 5, (value, message)


def test_infinity_and_nan_are_rejected() -> None:
    from tests.builders import JobDoc

    for value in (float("inf"), float("nan")):
        job, issues = check(JobDoc().set("spec.training.maxGradNorm", value).obj())
        assert job is None and [i.path for i in issues] == ["spec.training.maxGradNorm"]


def test_env_warnings_name_the_item() -> None:
    row = next(r for r in VALID if r.id == "valid-env-overrides-with-warnings")
    _, issues = check(row.doc())
    assert {i.path for i in issues if i.severity == "warning"} >= {"spec.cluster.env[0].name", "spec.cluster.env[1].name"}
    assert not any(i.path == "spec.cluster.env[2].name" for i in issues)


def test_every_reserved_variable_is_documented() -> None:
    doc = (ROOT / "docs" / "api.md").read_text()
    for r in env_policy.RESERVED:
        assert re.search(rf"^\| `{r.name}` \|", doc, re.M), r.name


def test_a_job_too_big_for_the_head_pods_annotation_is_refused_by_validate() -> None:
    # Python only: affinity is free-form, so the CRD cannot size it (the env list it can: a table row).
    from tests.builders import JobDoc

    doc = JobDoc().set("spec.cluster.affinity", {"nodeAffinity": {"x": ["y" * 1000] * 250}}).obj()
    job, issues = check(doc)
    assert job is None
    (issue,) = issues
    assert issue.path == "spec" and "annotation of the Ray head pod" in issue.message, str(issue)
