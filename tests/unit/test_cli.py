"""The `finetune` command as a user runs it: exit codes, one line per problem, no tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.builders import JobDoc

ROOT = Path(__file__).resolve().parents[2]


def finetune(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "finetune_operator.cli", *args], capture_output=True, text=True,
                          input=stdin, cwd=ROOT, timeout=120, check=False)


def test_crd_matches_committed_file() -> None:
    out = finetune("crd")
    assert out.returncode == 0
    assert out.stdout == (ROOT / "crds" / "finetune.dev_finetunejobs.yaml").read_text()


def test_validate_examples_pass() -> None:
    examples = sorted(str(p) for p in (ROOT / "examples").glob("*.yaml"))
    out = finetune("validate", *examples)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(": ok (") == len(examples)


def test_validate_reports_each_problem_on_one_line(tmp_path: Path) -> None:
    bad = JobDoc().set("spec.dataset.format", "alpaca").set("spec.training.learningRat", 1).obj()
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(bad))
    out = finetune("validate", str(f))
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2, out.stderr
    assert any(line.startswith(f"{f}: spec.dataset.format: ") for line in lines)
    assert any(line.startswith(f"{f}: spec.training.learningRat: unknown field") for line in lines)
    assert "Traceback" not in out.stderr


def test_validate_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    out = finetune("validate", str(tmp_path / "nope.yaml"))
    assert out.returncode == 1 and "no such file" in out.stderr
    f = tmp_path / "broken.yaml"
    f.write_text("spec: [\n")
    out = finetune("validate", str(f))
    assert out.returncode == 1 and "not valid YAML" in out.stderr and "Traceback" not in out.stderr


def test_render_seed_example() -> None:
    out = finetune("render", "examples/qwen2.5-1.5b-g6-efa.yaml", "--namespace", "ml")
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "RayJob"]
    runtime = docs[0]["data"]
    assert "finetune_training____main__.py" in runtime
    (group,) = docs[1]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == 2
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "4" and limits["vpc.amazonaws.com/efa"] == "1" and "hugepages-2Mi" in limits


def test_render_rejects_a_spec_that_does_not_fit(tmp_path: Path) -> None:
    f = tmp_path / "big.yaml"
    f.write_text(yaml.safe_dump(JobDoc().set("spec.cluster.workers.gpusPerWorker", 8)
                                .set("spec.training.globalBatchSize", 64).obj()))
    out = finetune("render", str(f))
    assert out.returncode == 1 and out.stdout == ""
    assert "spec.cluster.workers.gpusPerWorker: 8 GPUs per worker do not fit g6.12xlarge" in out.stderr


def test_dev_cluster_where_the_dev_package_is_not_installed_says_how_to_get_it(monkeypatch) -> None:
    # The operator's distribution has no dev cluster: it comes in through the `finetune.commands` entry point of
    # the separate finetune-devcluster package. Without it, the command still answers, with how to get it.
    from finetune_operator import cli

    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    args = cli.build_parser().parse_args(["dev-cluster", "up", "--real-node"])
    assert args.func(args) == 2


def test_dev_cluster_comes_from_the_dev_packages_entry_point() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="finetune.commands") if e.name == "dev-cluster"]
    assert ep.value == "finetune_devcluster.cli:register"
    out = finetune("dev-cluster", "--help")
    assert out.returncode == 0 and "kubeconfig" in out.stdout, out.stderr
