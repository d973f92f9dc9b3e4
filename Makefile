# The two commands of the README, and the pieces they are made of.
.PHONY: setup demo test test-unit test-training test-integration control-plane crd golden lint helm-files

setup:
	./scripts/setup

# First command: set up and fine-tune the embedded tiny model on CPU (Ray + FSDP + gloo, 2 workers).
demo: setup
	.venv/bin/finetune run examples/local-tiny.yaml

# Second command: set up (venv + Go-built control plane), lint/type-check, and run the whole test suite.
test: setup control-plane lint
	.venv/bin/python -m pytest -ra

control-plane: setup
	.venv/bin/finetune dev-cluster build

test-unit: setup
	.venv/bin/python -m pytest -ra tests/unit

test-training: setup
	.venv/bin/python -m pytest -ra tests/training

test-integration: setup control-plane
	.venv/bin/python -m pytest -ra tests/integration

crd: setup
	.venv/bin/finetune crd > crds/finetune.dev_finetunejobs.yaml
	cp crds/finetune.dev_finetunejobs.yaml deploy/helm/finetune-operator/crds/  # Helm reads only files in the chart
	.venv/bin/finetune crd --markdown > docs/api.md

golden: setup
	.venv/bin/python -m pytest -q tests/unit/test_render.py --update-golden
	.venv/bin/python -m pytest -q tests/deploy/test_helm_chart.py -k golden --update-golden

# The chart ships copies of deploy/observability/ (tests/deploy/test_helm_chart.py keeps them equal).
helm-files:
	cp deploy/observability/prometheusrule.yaml deploy/observability/finetune-dashboard.json deploy/helm/finetune-operator/files/

lint: setup
	.venv/bin/ruff check operator training tests benchmarks examples
	.venv/bin/mypy --strict operator/finetune_operator training/finetune_training
