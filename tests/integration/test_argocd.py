"""FinetuneJobs synced by a real Argo CD (application-controller + repo-server v3.6.1) on the dev cluster.

Argo CD runs as host processes, as its own Procfile runs them (`ARGOCD_FAKE_IN_CLUSTER=true`: the
in-cluster destination is the dev cluster's kubeconfig), built from the argo-cd Go module
(tools/argocd/argocd: one binary acting as application-controller, repo-server, kustomize and an
in-process Redis). It syncs from a `file://` git repository in the test's temp dir, as Argo CD's e2e
fixtures do; argocd-cm is upstream's with our Component (deploy/argocd/) applied by kustomize, and the
`default` AppProject (normally created by argocd-server, which is not run) is created here.

The operator runs as in test_operator.py (the real `finetune operator` process, as its ServiceAccount).
kwok plays kubelet, so no Ray job can really finish here: where a test needs a finished training it
writes the terminal status KubeRay writes to the RayJob's status subresource (as test_operator.py does),
and says so. Everything Argo CD does (render, diff, sync waves, health, sync failures) is real.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_devcluster import build
from kubernetes.client.rest import ApiException

from tests.integration.conftest import Kube, wait_for
from tests.integration.operator_fixtures import ROOT, OperatorProcess, free_port, service_account_kubeconfig

pytestmark = pytest.mark.needs_build("argocd")

ARGO_NS = "argocd"
G, V, P = "finetune.dev", "v1alpha1", "finetunejobs"
EXAMPLES = ROOT / "deploy" / "argocd" / "examples"
APPS = ("argoproj.io", "v1alpha1", ARGO_NS, "applications")
# Argo CD's retry for automated syncs when an Application has none (limit 5), with a 1 s backoff
# instead of the default 5 s, 10 s, ... 80 s so that a test of a failing sync does not wait 2.5 min.
RETRY = {"limit": 5, "backoff": {"duration": "1s", "factor": 1, "maxDuration": "1s"}}


# ------------------------------------------------------------------------------------------ fixtures


class GitRepo:
    """A local git repository Argo CD pulls from over file://."""

    def __init__(self, path: Path):
        self.path = path
        path.mkdir(parents=True)
        self.git("init", "-q", "-b", "main")
        self.git("config", "user.email", "test@finetune.dev")
        self.git("config", "user.name", "test")

    @property
    def url(self) -> str:
        return f"file://{self.path}"

    def git(self, *args: str) -> str:
        return subprocess.run(["git", *args], cwd=self.path, check=True, capture_output=True, text=True).stdout

    def write(self, rel: str, docs: list[dict[str, Any]] | str) -> None:
        f = self.path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(docs if isinstance(docs, str) else yaml.safe_dump_all(docs, sort_keys=False))

    def commit(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "HEAD").strip()


class ArgoCD:
    """application-controller, repo-server and Redis as host processes against the dev cluster."""

    def __init__(self, kubeconfig: Path, workdir: Path):
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.bindir = build.optional_binaries("argocd")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        out = subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args], input=stdin,
                             capture_output=True, text=True, timeout=120, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {out.stderr}")
        return out.stdout

    def _path_dir(self) -> Path:
        # Argo CD calls its helpers by name: `kustomize` for kustomize sources, `argocd` (with
        # ARGOCD_BINARY_NAME=argocd-git-ask-pass) as GIT_ASKPASS. All are the one binary we built.
        d = self.workdir / "bin"
        d.mkdir(exist_ok=True)
        for name in ("argocd", "kustomize", "argocd-application-controller", "argocd-repo-server", "argocd-redis"):
            link = d / name
            if not link.exists():
                link.symlink_to(self.bindir / "argocd")
        if not (d / "git-verify-wrapper.sh").exists():
            (d / "git-verify-wrapper.sh").symlink_to(self.bindir / "git-verify-wrapper.sh")
        return d

    def install(self) -> None:
        """CRDs, namespace, upstream's config with our Component, and the default AppProject."""
        self.kubectl("apply", "--server-side", "-f", str(self.bindir / "crds"))
        deadline = time.monotonic() + 60
        while True:  # `kubectl wait` errors out while a new CRD has no status.conditions yet
            try:
                self.kubectl("wait", "--for=condition=Established", "crd/applications.argoproj.io",
                             "crd/appprojects.argoproj.io", "--timeout=30s")
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        self.kubectl("create", "namespace", ARGO_NS)
        kz = self.workdir / "config"
        shutil.copytree(self.bindir / "config", kz / "base")
        (kz / "base" / "kustomization.yaml").unlink(missing_ok=True)
        bases = sorted(p.name for p in (kz / "base").glob("*.yaml"))
        (kz / "kustomization.yaml").write_text(yaml.safe_dump({
            "namespace": ARGO_NS,
            "resources": [f"base/{b}" for b in bases],
            "components": [os.path.relpath(ROOT / "deploy" / "argocd", kz)],
        }))
        self.kubectl("apply", "-k", str(kz))
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump({
            "apiVersion": "argoproj.io/v1alpha1", "kind": "AppProject",
            "metadata": {"name": "default", "namespace": ARGO_NS},
            "spec": {"sourceRepos": ["*"], "destinations": [{"server": "*", "namespace": "*"}],
                     "clusterResourceWhitelist": [{"group": "*", "kind": "*"}]},
        }))

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = open(self.logs / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen(
            [str(self._path_dir() / name), *args], stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
            env={**os.environ, **env}, start_new_session=True,
        ))

    def start(self) -> None:
        redis, repo, repo_metrics, ctrl_metrics = (free_port() for _ in range(4))
        tmp = self.workdir / "tmp"
        for d in ("tmp", "tls", "ssh", "gpg"):
            (self.workdir / d).mkdir(exist_ok=True)
        env = {
            "PATH": f"{self._path_dir()}:{os.environ['PATH']}",
            "ARGOCD_FAKE_IN_CLUSTER": "true",
            "KUBECONFIG": str(self.kubeconfig),
            "TMPDIR": str(tmp),
            "ARGOCD_TLS_DATA_PATH": str(self.workdir / "tls"),
            "ARGOCD_SSH_DATA_PATH": str(self.workdir / "ssh"),
            "ARGOCD_GNUPGHOME": str(self.workdir / "gpg"),
            "ARGOCD_GPG_ENABLED": "false",
        }
        self._start("argocd-redis", ["--addr", f"127.0.0.1:{redis}"], env)
        self._start("argocd-repo-server", [
            "--address", "127.0.0.1", "--port", str(repo), "--metrics-port", str(repo_metrics),
            "--redis", f"127.0.0.1:{redis}", "--disable-tls", "--client-ca-path=", "--loglevel", "info", "--logformat", "text",
        ], env)
        self._start("argocd-application-controller", [
            "--kubeconfig", str(self.kubeconfig), "--namespace", ARGO_NS,
            "--redis", f"127.0.0.1:{redis}", "--repo-server", f"127.0.0.1:{repo}", "--repo-server-plaintext",
            # A refresh every 20 s without jitter (default 120 s + up to 60 s): a change of the job's status that
            # keeps its health status (Progressing: starting -> Running: step n/N) triggers no refresh of its own.
            "--metrics-port", str(ctrl_metrics), "--app-resync", "20", "--app-resync-jitter", "0", "--status-processors", "4",
            "--operation-processors", "4", "--loglevel", "info", "--logformat", "text",
            # Resource health in the Application's status (the UI reads it from Redis otherwise).
            "--persist-resource-health",
        ], env)
        time.sleep(1)
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}; logs in {self.logs}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()


@pytest.fixture(scope="module")
def argocd(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ArgoCD]:
    argo = ArgoCD(Path(control_plane.kubeconfig), tmp_path_factory.mktemp("argocd"))
    argo.install()
    argo.start()
    yield argo
    argo.stop()


@pytest.fixture(scope="module")
def operator(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    kubeconfig = service_account_kubeconfig(Path(control_plane.kubeconfig), tmp_path_factory.mktemp("sa") / "kubeconfig")
    op = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("operator-logs"), identity="op-argocd",
                         lease_namespace="finetune-system")
    op.start()
    yield op
    op.stop()


@pytest.fixture
def repo(tmp_path: Path) -> GitRepo:
    return GitRepo(tmp_path / "gitops")


# ------------------------------------------------------------------------------------------- helpers


def application(name: str, repo: GitRepo, path: str, namespace: str, automated: bool = True) -> dict[str, Any]:
    """The example Application (deploy/argocd/examples/finetunejob-app.yaml), pointed at the test repo."""
    app = yaml.safe_load((EXAMPLES / "finetunejob-app.yaml").read_text())
    app["metadata"]["name"] = name
    app["spec"]["source"] = {"repoURL": repo.url, "targetRevision": "main", "path": path}
    app["spec"]["destination"]["namespace"] = namespace
    # Client-side apply and diff (docs/gitops.md: with ServerSideApply=true an immutable edit fails the
    # Application's server-side diff instead of its sync); Argo CD's default retry.
    assert "ServerSideApply=true" not in app["spec"]["syncPolicy"]["syncOptions"]
    assert "retry" not in app["spec"]["syncPolicy"]
    if not automated:
        del app["spec"]["syncPolicy"]["automated"]
    return app  # type: ignore[no-any-return]


def create_app(kube: Kube, app: dict[str, Any]) -> None:
    kube.custom.create_namespaced_custom_object(*APPS, app)


def get_app(kube: Kube, name: str) -> dict[str, Any]:
    return kube.custom.get_namespaced_custom_object(*APPS, name)  # type: ignore[no-any-return]


def refresh(kube: Kube, name: str) -> None:
    """What `argocd app get --refresh` does: ask the controller to compare with git now."""
    kube.custom.patch_namespaced_custom_object(*APPS, name,
                                               {"metadata": {"annotations": {"argocd.argoproj.io/refresh": "normal"}}},
                                               _content_type="application/merge-patch+json")


def delete_app(kube: Kube, name: str) -> None:
    try:
        kube.custom.delete_namespaced_custom_object(*APPS, name)
    except ApiException as e:
        if e.status != 404:
            raise


def app_resource(app: dict[str, Any], kind: str, name: str | None = None) -> dict[str, Any] | None:
    for r in (app.get("status") or {}).get("resources") or []:
        if r.get("kind") == kind and (name is None or r.get("name") == name):
            return r  # type: ignore[no-any-return]
    return None


def health(app: dict[str, Any]) -> str:
    return str(((app.get("status") or {}).get("health") or {}).get("status"))


def sync_status(app: dict[str, Any]) -> str:
    return str(((app.get("status") or {}).get("sync") or {}).get("status"))


def operation(app: dict[str, Any]) -> dict[str, Any]:
    return ((app.get("status") or {}).get("operationState")) or {}


def live_ftj(kube: Kube, ns: str, name: str) -> dict[str, Any] | None:
    try:
        return kube.custom.get_namespaced_custom_object(G, V, ns, P, name)  # type: ignore[no-any-return]
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def phase(kube: Kube, ns: str, name: str) -> str | None:
    obj = live_ftj(kube, ns, name)
    return ((obj or {}).get("status") or {}).get("phase")


def rayjobs(kube: Kube, ns: str) -> list[dict[str, Any]]:
    return kube.custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"]  # type: ignore[no-any-return]


def rayclusters(kube: Kube, ns: str) -> list[dict[str, Any]]:
    return kube.custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayclusters")["items"]  # type: ignore[no-any-return]


def finish_rayjob(kube: Kube, ns: str, name: str, succeeded: bool) -> None:
    """A simulated step (the second, after the dashboard stand-in's jobStatus RUNNING that the tests asking
    for ray_dashboard get): kwok pods run no Ray, so we write the terminal status KubeRay writes when the
    Ray job ends (as tests/integration/support.py's complete_rayjob does)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = ({"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete", "endTime": now} if succeeded else
              {"jobStatus": "FAILED", "jobDeploymentStatus": "Failed", "reason": "AppFailed",
               "message": "Ray job failed: train.py exited with code 1", "endTime": now})
    kube.custom.patch_namespaced_custom_object_status("ray.io", "v1", ns, "rayjobs", name, {"status": status},
                                                      _content_type="application/merge-patch+json")


def sync_job(kube: Kube, app: str, job: str, revision: str) -> None:
    """What `argocd app sync APP --resource finetune.dev:FinetuneJob:JOB --replace --force` asks for:
    argocd-server writes this operation to the Application (server/application/application.go, Sync)."""
    source = get_app(kube, app)["spec"]["source"]
    kube.custom.patch_namespaced_custom_object(*APPS, app, {"operation": {
        "initiatedBy": {"username": "test"},
        "sync": {"source": source, "revision": revision, "syncOptions": ["Replace=true"],
                 "syncStrategy": {"hook": {"force": True}},
                 "resources": [{"group": G, "kind": "FinetuneJob", "name": job}]},
    }}, _content_type="application/merge-patch+json")


def small_job(name: str) -> dict[str, Any]:
    """The train-then-serve example's FinetuneJob (wave 0), renamed."""
    doc = yaml.safe_load((EXAMPLES / "train-then-serve" / "finetunejob.yaml").read_text())
    doc["metadata"]["name"] = name
    return doc  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.usefixtures("ray_dashboard")
def test_train_then_serve_waits_for_training(kube: Kube, namespace: str, argocd: ArgoCD, operator: OperatorProcess,
                                            repo: GitRepo) -> None:
    """The train-then-serve example: wave 1 (serving) is applied only once the FinetuneJob is Healthy."""
    example = EXAMPLES / "train-then-serve"
    repo.write("train-then-serve/finetunejob.yaml", (example / "finetunejob.yaml").read_text())
    repo.write("train-then-serve/serve.yaml", (example / "serve.yaml").read_text())
    repo.commit("train then serve")
    app = yaml.safe_load((example / "application.yaml").read_text())
    app["metadata"]["name"] = f"tts-{namespace[-6:]}"
    app["spec"]["source"].update(repoURL=repo.url, targetRevision="main")
    app["spec"]["destination"]["namespace"] = namespace
    name = app["metadata"]["name"]
    job = yaml.safe_load((example / "finetunejob.yaml").read_text())["metadata"]["name"]
    serve = "qwen25-15b-support-serve"
    create_app(kube, app)
    try:
        # Wave 0 applied; Argo CD shows the job Progressing with the operator's words, and waits.
        res = wait_for("FinetuneJob Progressing in Argo CD", lambda: (r := app_resource(get_app(kube, name), "FinetuneJob"))
                       and (r.get("health") or {}).get("status") == "Progressing" and r, timeout=120)
        assert (res.get("health") or {}).get("message"), res  # type: ignore[union-attr]
        wait_for("job Running", lambda: phase(kube, namespace, job) == "Running", timeout=180)
        a = wait_for("Argo CD shows Running", lambda: (a := get_app(kube, name)) and "Running" in str(
            (app_resource(a, "FinetuneJob") or {}).get("health")) and a, timeout=60)
        assert health(a) == "Progressing" and operation(a).get("phase") == "Running"  # type: ignore[arg-type]
        assert kube.apps.list_namespaced_deployment(namespace).items == []  # wave 1 not applied yet
        time.sleep(5)
        assert kube.apps.list_namespaced_deployment(namespace).items == [], "wave 1 applied before training ended"

        finish_rayjob(kube, namespace, job, succeeded=True)  # simulated: see finish_rayjob
        wait_for("job Succeeded", lambda: phase(kube, namespace, job) == "Succeeded", timeout=60)
        wait_for("wave 1 applied", lambda: kube.apps.list_namespaced_deployment(namespace).items, timeout=120)
        a = wait_for("sync Succeeded, Synced", lambda: (a := get_app(kube, name)) and operation(a).get("phase") == "Succeeded"
                     and sync_status(a) == "Synced" and a, timeout=120)
        r = app_resource(a, "FinetuneJob")  # type: ignore[arg-type]
        assert r and (r["health"]["status"], r["health"].get("message")) == ("Healthy", "fine-tuning succeeded"), r
        created = kube.apps.read_namespaced_deployment(serve, namespace).metadata.creation_timestamp
        done = datetime.fromisoformat((live_ftj(kube, namespace, job) or {})["status"]["completionTime"].replace("Z", "+00:00"))
        assert created >= done, (created, done)
        # Only what is in git is the Application's; the operator's and KubeRay's children are not.
        kinds = sorted((r["kind"], r["name"]) for r in a["status"]["resources"])  # type: ignore[index]
        assert kinds == [("Deployment", serve), ("FinetuneJob", job), ("Service", serve)], kinds
    finally:
        delete_app(kube, name)


@pytest.mark.usefixtures("ray_dashboard")
def test_failed_job_is_degraded_and_wave_1_never_runs(kube: Kube, namespace: str, argocd: ArgoCD,
                                                       operator: OperatorProcess, repo: GitRepo) -> None:
    example = EXAMPLES / "train-then-serve"
    repo.write("app/finetunejob.yaml", (example / "finetunejob.yaml").read_text())
    repo.write("app/serve.yaml", (example / "serve.yaml").read_text())
    repo.commit("train then serve")
    name = f"fail-{namespace[-6:]}"
    job = yaml.safe_load((example / "finetunejob.yaml").read_text())["metadata"]["name"]
    create_app(kube, application(name, repo, "app", namespace))
    try:
        wait_for("job Running", lambda: phase(kube, namespace, job) == "Running", timeout=180)
        finish_rayjob(kube, namespace, job, succeeded=False)  # simulated: see finish_rayjob
        a = wait_for("Degraded", lambda: (a := get_app(kube, name)) and health(a) == "Degraded" and a, timeout=120)
        r = app_resource(a, "FinetuneJob")  # type: ignore[arg-type]
        assert r and r["health"]["status"] == "Degraded", r
        assert "train.py exited with code 1" in r["health"]["message"], r
        time.sleep(10)
        assert kube.apps.list_namespaced_deployment(namespace).items == [], "wave 1 applied after a failed training"
    finally:
        delete_app(kube, name)


@pytest.mark.usefixtures("ray_dashboard")
def test_changing_a_job_in_git(kube: Kube, namespace: str, argocd: ArgoCD, operator: OperatorProcess,
                               repo: GitRepo) -> None:
    """Mutable edits sync without disturbing the run; an immutable edit fails the sync (after Argo CD's
    retries) with our message and leaves the job alone; a one-off sync of the job with Replace and Force
    re-runs it, and leaves nothing behind that would re-run it again."""
    job = "edit-me"
    doc = small_job(job)
    repo.write("jobs/ftj.yaml", [doc])
    repo.commit("a job")
    name = f"edit-{namespace[-6:]}"
    app = application(name, repo, "jobs", namespace)
    app["spec"]["syncPolicy"]["retry"] = RETRY
    create_app(kube, app)
    try:
        wait_for("job Running", lambda: phase(kube, namespace, job) == "Running", timeout=180)
        wait_for("Synced", lambda: sync_status(get_app(kube, name)) == "Synced", timeout=60)
        (rj,) = rayjobs(kube, namespace)
        uid, rj_uid = live_ftj(kube, namespace, job)["metadata"]["uid"], rj["metadata"]["uid"]  # type: ignore[index]

        # A mutable field: synced, the run goes on.
        doc["spec"]["activeDeadlineSeconds"] = 86400
        repo.write("jobs/ftj.yaml", [doc])
        rev = repo.commit("longer deadline")
        refresh(kube, name)
        wait_for("mutable edit synced", lambda: (a := get_app(kube, name)) and operation(a).get("syncResult", {}).get(
            "revision") == rev and operation(a).get("phase") == "Succeeded" and sync_status(a) == "Synced", timeout=120)
        assert (live_ftj(kube, namespace, job) or {})["spec"]["activeDeadlineSeconds"] == 86400
        (rj,) = rayjobs(kube, namespace)
        assert rj["metadata"]["uid"] == rj_uid and phase(kube, namespace, job) == "Running"

        # An immutable field: the sync fails with the CRD's message, the job is untouched.
        doc["spec"]["model"]["source"] = "Qwen/Qwen2.5-7B"
        repo.write("jobs/ftj.yaml", [doc])
        rev = repo.commit("bigger model")
        refresh(kube, name)
        # Each attempt fails the same way; after the last retry the operation is Failed (a retrying
        # operation is phase Running with the attempt's message, so wait for the end).
        a = wait_for("sync failed", lambda: (a := get_app(kube, name)) and operation(a).get("phase") == "Failed"
                     and operation(a).get("syncResult", {}).get("revision") == rev and a, timeout=180)
        op = operation(a)  # type: ignore[arg-type]
        assert op["message"].endswith(f"(retried {RETRY['limit']} times)."), op["message"]
        (res,) = op["syncResult"]["resources"]
        assert (res["kind"], res["name"], res["status"]) == ("FinetuneJob", job, "SyncFailed"), res
        for text in (res["message"], op["message"]):
            assert f'FinetuneJob.finetune.dev "{job}" is invalid: spec.model' in text, text
            assert "spec.model is immutable after creation: rename the job to train a new one" in text, text
            assert "Replace=true,Force=true" in text, text
        # Automated sync does not try that commit again: it says so in a SyncError condition.
        a = wait_for("SyncError condition", lambda: (a := get_app(kube, name)) and any(
            c["type"] == "SyncError" and f"Failed last sync attempt to [{rev}]" in c["message"]
            and "spec.model is immutable" in c["message"] for c in a["status"].get("conditions") or []) and a, timeout=90)
        assert sync_status(a) == "OutOfSync" and operation(a)["phase"] == "Failed", a["status"]  # type: ignore[arg-type,index]
        live = live_ftj(kube, namespace, job) or {}
        assert live["metadata"]["uid"] == uid and live["spec"]["model"]["source"] == "Qwen/Qwen2.5-1.5B"
        (rj,) = rayjobs(kube, namespace)
        assert rj["metadata"]["uid"] == rj_uid and phase(kube, namespace, job) == "Running"

        # The documented way to re-run under the same name: a one-off sync of that job with Replace and
        # Force. `argocd app sync APP --resource finetune.dev:FinetuneJob:NAME --replace --force` (or the
        # UI's sync dialog) has argocd-server (not run here) write this operation to the Application.
        # Every finished operation for this revision, by start time: after the replace, automated sync may
        # apply the same revision once more (self-heal: the replaced object lacks kubectl's last-applied
        # annotation; the apply only adds it, "configured"), and that later result overwrites the replace's.
        finished: dict[str, list[str]] = {}

        def note(result: Any = True) -> Any:
            op = operation(get_app(kube, name))
            if op.get("phase") == "Succeeded" and op.get("syncResult", {}).get("revision") == rev:
                finished[str(op.get("startedAt"))] = [r["message"] for r in op["syncResult"].get("resources") or []]
            return result

        sync_job(kube, name, job, rev)
        wait_for("re-created", lambda: note((o := live_ftj(kube, namespace, job)) and o["metadata"]["uid"] != uid),
                 timeout=120)
        wait_for("new run Running", lambda: note(phase(kube, namespace, job) == "Running" and len(rayjobs(kube, namespace)) == 1
                 and rayjobs(kube, namespace)[0]["metadata"]["uid"] != rj_uid), timeout=240)
        live = live_ftj(kube, namespace, job) or {}
        assert live["spec"]["model"]["source"] == "Qwen/Qwen2.5-7B"
        replaced = f'finetunejob.finetune.dev "{job}" deleted from {namespace} namespace\nfinetunejob.finetune.dev/{job} replaced'
        try:
            # The replace's own result may last under a second before self-heal's overwrites it: the re-creation
            # (new UID, new spec, new RayJob) above is what proves the replace; here, the app settles Synced.
            wait_for("re-run synced", lambda: note() and finished and sync_status(get_app(kube, name)) == "Synced",
                     timeout=120)
        except BaseException:
            print(f"finished operations: {finished}; last: {operation(get_app(kube, name))}; "
                  f"sync {sync_status(get_app(kube, name))}")
            raise
        for messages in finished.values():  # the replace, and at most a plain re-apply of the same spec
            assert messages in ([replaced], [f"finetunejob.finetune.dev/{job} configured"]) or (
                len(messages) == 1 and messages[0].startswith(f"finetunejob.finetune.dev/{job} configured.")), finished
        assert live_ftj(kube, namespace, job)["metadata"]["uid"] == live["metadata"]["uid"]  # type: ignore[index]

        # Nothing of the re-run lingers: the next edit in git syncs as any mutable edit does.
        uid, (rj,) = live["metadata"]["uid"], rayjobs(kube, namespace)
        doc["spec"]["activeDeadlineSeconds"] = 7200
        repo.write("jobs/ftj.yaml", [doc])
        rev = repo.commit("shorter deadline")
        refresh(kube, name)
        wait_for("mutable edit synced", lambda: (a := get_app(kube, name)) and operation(a).get("syncResult", {}).get(
            "revision") == rev and operation(a).get("phase") == "Succeeded" and sync_status(a) == "Synced", timeout=120)
        live = live_ftj(kube, namespace, job) or {}
        assert live["metadata"]["uid"] == uid and live["spec"]["activeDeadlineSeconds"] == 7200
        assert [r["metadata"]["uid"] for r in rayjobs(kube, namespace)] == [rj["metadata"]["uid"]]
    finally:
        delete_app(kube, name)


@pytest.mark.usefixtures("ray_dashboard")
def test_server_side_apply_fails_the_comparison_instead(kube: Kube, namespace: str, argocd: ArgoCD,
                                                        operator: OperatorProcess, repo: GitRepo) -> None:
    """Why the job examples use client-side apply (docs/gitops.md): with ServerSideApply=true Argo CD
    diffs server-side, so an immutable edit is rejected by the comparison: sync status Unknown, a
    ComparisonError with our message, and no sync of that commit at all."""
    job = "ssa-job"
    doc = small_job(job)
    repo.write("jobs/ftj.yaml", [doc])
    repo.commit("a job")
    name = f"ssa-{namespace[-6:]}"
    app = application(name, repo, "jobs", namespace)
    app["spec"]["syncPolicy"]["syncOptions"].append("ServerSideApply=true")
    create_app(kube, app)
    try:
        wait_for("job Running", lambda: phase(kube, namespace, job) == "Running", timeout=180)
        wait_for("Synced", lambda: sync_status(get_app(kube, name)) == "Synced", timeout=60)
        uid = (live_ftj(kube, namespace, job) or {})["metadata"]["uid"]
        synced_rev = operation(get_app(kube, name))["syncResult"]["revision"]

        doc["spec"]["model"]["source"] = "Qwen/Qwen2.5-7B"
        repo.write("jobs/ftj.yaml", [doc])
        rev = repo.commit("bigger model")
        refresh(kube, name)
        a = wait_for("ComparisonError", lambda: (a := get_app(kube, name)) and a["status"]["sync"].get("revision") == rev
                     and any(c["type"] == "ComparisonError" and "spec.model is immutable after creation" in c["message"]
                             for c in a["status"].get("conditions") or []) and a, timeout=120)
        time.sleep(5)
        a = get_app(kube, name)
        assert sync_status(a) == "Unknown", a["status"]["sync"]
        assert operation(a)["syncResult"]["revision"] == synced_rev, operation(a)  # no sync of `rev` was attempted
        assert (live_ftj(kube, namespace, job) or {})["metadata"]["uid"] == uid
    finally:
        delete_app(kube, name)


@pytest.mark.usefixtures("ray_dashboard")
def test_children_never_tracked_and_finished_job_stays_synced(kube: Kube, namespace: str, argocd: ArgoCD,
                                                              operator: OperatorProcess, repo: GitRepo) -> None:
    """Label tracking (app.kubernetes.io/instance, which our children also carry with the job's name),
    an Application named like the job, prune on: still, nothing but the FinetuneJob is the app's; when
    the job finishes and KubeRay deletes its Ray cluster, the Application stays Synced and Healthy."""
    job = f"same-{namespace[-6:]}"
    repo.write("jobs/ftj.yaml", [small_job(job)])
    repo.commit("a job")
    argocd.kubectl("-n", ARGO_NS, "patch", "configmap", "argocd-cm", "--type", "merge",
                   "-p", '{"data": {"application.resourceTrackingMethod": "label"}}')
    app = application(job, repo, "jobs", namespace)
    app["spec"]["syncPolicy"]["automated"]["prune"] = True
    create_app(kube, app)
    try:
        wait_for("job Running", lambda: phase(kube, namespace, job) == "Running", timeout=180)
        assert (live_ftj(kube, namespace, job) or {})["metadata"]["labels"]["app.kubernetes.io/instance"] == job
        assert rayjobs(kube, namespace)[0]["metadata"]["labels"]["app.kubernetes.io/instance"] == job
        refresh(kube, job)
        a = wait_for("Synced", lambda: (a := get_app(kube, job)) and sync_status(a) == "Synced" and a, timeout=60)
        assert [(r["kind"], r["name"]) for r in a["status"]["resources"]] == [("FinetuneJob", job)]  # type: ignore[index]

        finish_rayjob(kube, namespace, job, succeeded=True)  # simulated: see finish_rayjob
        wait_for("Ray cluster deleted by KubeRay", lambda: phase(kube, namespace, job) == "Succeeded"
                 and not rayclusters(kube, namespace), timeout=120)
        time.sleep(5)
        refresh(kube, job)
        a = wait_for("Healthy", lambda: (a := get_app(kube, job)) and health(a) == "Healthy" and a, timeout=60)
        time.sleep(5)
        a = get_app(kube, job)
        assert sync_status(a) == "Synced" and health(a) == "Healthy", a["status"]
        assert [(r["kind"], r["name"]) for r in a["status"]["resources"]] == [("FinetuneJob", job)]
        assert rayjobs(kube, namespace), "prune must not have deleted the RayJob"
        # Nor the shared runtime ConfigMap the RayJob's pods mount (it has no job label of its own).
        assert kube.core.list_namespaced_config_map(namespace, label_selector="finetune.dev/runtime").items
    finally:
        argocd.kubectl("-n", ARGO_NS, "patch", "configmap", "argocd-cm", "--type", "json",
                       "-p", '[{"op": "remove", "path": "/data/application.resourceTrackingMethod"}]')
        delete_app(kube, job)


def test_operator_application_from_deploy(kube: Kube, argocd: ArgoCD, repo: GitRepo) -> None:
    """The operator installed by Argo CD from crds/ and deploy/ (examples/finetune-operator-app.yaml)."""
    for d in ("crds", "deploy"):
        shutil.copytree(ROOT / d, repo.path / d, ignore=shutil.ignore_patterns("argocd"))
    repo.commit("operator")
    app = yaml.safe_load((EXAMPLES / "finetune-operator-app.yaml").read_text())
    for src in app["spec"]["sources"]:
        src.update(repoURL=repo.url, targetRevision="main")
    app = copy.deepcopy(app)
    create_app(kube, app)
    name = app["metadata"]["name"]
    try:
        a = wait_for("operator Application Healthy and Synced", lambda: (a := get_app(kube, name))
                     and health(a) == "Healthy" and sync_status(a) == "Synced" and a, timeout=240)
        kinds = {r["kind"] for r in a["status"]["resources"]}  # type: ignore[index]
        assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole"} <= kinds, kinds
        dep = app_resource(a, "Deployment")  # type: ignore[arg-type]
        assert dep and dep["health"]["status"] == "Healthy", dep
    finally:
        # Leave the cluster as other tests expect it: the namespace and RBAC stay (test_operator.py applies
        # them too); the Deployment goes (its pods would only take node capacity).
        delete_app(kube, name)
        try:
            kube.apps.delete_namespaced_deployment("finetune-operator", "finetune-system")
        except ApiException as e:
            if e.status != 404:
                raise


def test_example_applications_are_valid(argocd: ArgoCD) -> None:
    """Every Application/ApplicationSet example is accepted by Argo CD's CRDs (server-side dry run; no
    applicationset-controller runs here, so the ApplicationSet is checked against its schema only)."""
    files = sorted(EXAMPLES.glob("*.yaml")) + sorted(EXAMPLES.glob("*/application.yaml"))
    kinds = []
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            kinds.append(doc["kind"])
            out = argocd.kubectl("apply", "--dry-run=server", "-o", "name", "-f", "-", stdin=yaml.safe_dump(doc))
            assert out.strip(), f
    assert sorted(set(kinds)) == ["Application", "ApplicationSet"]
