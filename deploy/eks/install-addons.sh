#!/usr/bin/env bash
# The cluster add-ons a FinetuneJob needs, pinned (docs/install.md, step 3). Run against the cluster
# of cluster.yaml (or karpenter.yaml) with kubectl's current context:
#   bash deploy/eks/install-addons.sh
# KUBERAY_VERSION must match devcluster/finetune_devcluster/versions.py (a test checks it):
# the operator is tested against that KubeRay.
set -euo pipefail
KUBERAY_VERSION=1.6.1
NVIDIA_DEVICE_PLUGIN_VERSION=0.20.0
EFA_DEVICE_PLUGIN_VERSION=v0.5.32
here=$(cd "$(dirname "$0")" && pwd)

helm repo add kuberay https://ray-project.github.io/kuberay-helm/
helm repo add nvdp https://nvidia.github.io/k8s-device-plugin
helm repo add eks https://aws.github.io/eks-charts
helm repo update

# KubeRay: the RayJob/RayCluster CRDs and their operator (on the CPU nodes).
helm upgrade --install kuberay-operator kuberay/kuberay-operator --version "$KUBERAY_VERSION" \
  --namespace kuberay-system --create-namespace -f "$here/values/kuberay-operator.yaml" --wait

# NVIDIA device plugin: advertises nvidia.com/gpu (4 per g6.12xlarge) on the GPU nodes.
helm upgrade --install nvidia-device-plugin nvdp/nvidia-device-plugin --version "$NVIDIA_DEVICE_PLUGIN_VERSION" \
  --namespace kube-system -f "$here/values/nvidia-device-plugin.yaml" --wait

# EFA device plugin: advertises vpc.amazonaws.com/efa (1 per g6.12xlarge) on the EFA nodes.
helm upgrade --install aws-efa-k8s-device-plugin eks/aws-efa-k8s-device-plugin --version "$EFA_DEVICE_PLUGIN_VERSION" \
  --namespace kube-system -f "$here/values/efa-device-plugin.yaml" --wait

# Huge pages are reserved on the nodes themselves (cluster.yaml preBootstrapCommands, or the
# EC2NodeClass userData in karpenter.yaml); `finetune preflight` checks hugepages-2Mi is allocatable.
echo "add-ons installed; now: finetune preflight"
