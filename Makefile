# The three commands of the README, and the pieces they are made of.
.PHONY: setup demo demo-cluster test test-unit test-training test-training-dlc test-integration control-plane crd golden lint images helm-files

setup:
	./scripts/setup

# First command: set up and fine-tune the embedded tiny model on CPU (Ray + FSDP + gloo, 2 workers).
demo: setup
	.venv/bin/finetune run examples/local-tiny.yaml

# Third command: the whole product path for real on CPU (root): a dev cluster with a real kubelet node,
# the Ray and operator images built here, the operator from deploy/, examples/local-cluster.yaml applied and
# watched (kubectl get ftj -w) until it ends; then the cluster goes down (KEEP=1 leaves it running).
demo-cluster: setup control-plane
	.venv/bin/finetune dev-cluster demo $(if $(KEEP),--keep)

# Second command: set up (venv + Go-built control plane), lint/type-check, and run the whole test suite (three
# lanes side by side, scripts/test-lanes: tests/conftest.py LANES);
# then tests/training once more on the Ray Train DLC's own stack (Python 3.13 + requirements/dlc.txt).
test: setup prebuild lint
	.venv/bin/python scripts/test-lanes
	./scripts/test-training-dlc

# Everything the suite builds, once, cached by version under ~/.cache/finetune-operator (a no-op when warm):
# every Go-built part (control plane, KubeRay, kwok, the real node's parts, Argo CD, Helm, promtool, Grafana's
# schema check), moto's S3 server (its own venv) and, side by side with the Go builds (mostly downloads and unpacking), the real node's images
# with the Ray Train DLC's stack that tests/training also runs on.
prebuild: setup
	@.venv/bin/finetune dev-cluster images > .venv/prebuild-images.log 2>&1 & images=$$!; \
	.venv/bin/finetune dev-cluster build --real-node && .venv/bin/python -m finetune_devcluster.s3server --install; rc=$$?; \
	if ! wait $$images; then cat .venv/prebuild-images.log; rc=1; fi; \
	tail -n 3 .venv/prebuild-images.log; exit $$rc

control-plane: setup
	.venv/bin/finetune dev-cluster build

test-unit: setup
	.venv/bin/python -m pytest -ra tests/unit

# The training runtime on both stacks: the project's pins (.venv) and the DLC's (Python 3.13, /opt/venv).
test-training: setup
	.venv/bin/python -m pytest -ra tests/training
	./scripts/test-training-dlc

test-training-dlc: setup
	./scripts/test-training-dlc

# The real node's images (Ray image on the DLC stack, operator image by buildah), cached; prints the archives.
images: setup
	.venv/bin/finetune dev-cluster images

test-integration: setup control-plane
	.venv/bin/python -m pytest -ra tests/integration

crd: setup
	.venv/bin/finetune crd > crds/finetune.dev_finetunejobs.yaml
	cp crds/finetune.dev_finetunejobs.yaml deploy/helm/finetune-operator/crds/  # Helm reads only files in the chart
	.venv/bin/finetune crd --markdown > docs/api.md
	.venv/bin/finetune crd --instance-types > deploy/instance-types.yaml
	cp deploy/instance-types.yaml deploy/helm/finetune-operator/files/

golden: setup
	.venv/bin/python -m pytest -q tests/unit/test_render.py --update-golden
	.venv/bin/python -m pytest -q tests/deploy/test_helm_chart.py -k golden --update-golden

# The chart ships copies of deploy/observability/, deploy/admission.yaml and deploy/instance-types.yaml
# (tests/deploy/test_helm_chart.py keeps them equal).
helm-files:
	cp deploy/observability/prometheusrule.yaml deploy/observability/finetune-dashboard.json deploy/admission.yaml \
	  deploy/instance-types.yaml deploy/helm/finetune-operator/files/

lint: setup
	.venv/bin/ruff check operator training devcluster tests benchmarks examples
	.venv/bin/mypy --strict operator/finetune_operator training/finetune_training devcluster/finetune_devcluster
