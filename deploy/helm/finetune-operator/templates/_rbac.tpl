{{/* The rules of deploy/rbac.yaml (a test renders both and compares). */}}

{{/* ClusterRole finetune-operator: read what it watches, patch FinetuneJob status, Events, TokenReviews. */}}
{{- define "finetune.readRules" -}}
# The API it serves.
- apiGroups: ["finetune.dev"]
  resources: ["finetunejobs"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["finetune.dev"]
  resources: ["finetunejobs/status"]
  verbs: ["get", "patch"]
# Observed: RayJobs/RayClusters (KubeRay's status), pods for scheduling/image-pull reasons and
# progress-token checks, nodes for preflight and for figures of instance types no ConfigMap describes.
- apiGroups: ["ray.io"]
  resources: ["rayjobs", "rayclusters"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["pods", "nodes"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch", "list"]
# Verifying progress tokens.
- apiGroups: ["authentication.k8s.io"]
  resources: ["tokenreviews"]
  verbs: ["create"]
# kopf discovers the resources it watches.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end -}}

{{/* ClusterRole finetune-operator-children: write the children. RayJobs: created with a POST, then
changed by server-side apply (patch). ConfigMaps: only the shared runtime ConfigMaps (labelled
finetune.dev/runtime), created once per namespace, listed and deleted when no job uses them any more. */}}
{{- define "finetune.childrenRules" -}}
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["create", "patch"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end -}}

{{/* Role finetune-operator-leader in the release namespace: the Lease, its own pod's leader label,
the configuration ConfigMaps (instance-type figures, allow-list). */}}
{{- define "finetune.leaderRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "create", "update"]
# The leader labels its own pod (finetune.dev/operator-leader) so the Service routes progress to it.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch"]
{{- end -}}

{{/* A binding of a (Cluster)Role to the operator's ServiceAccount. Arguments: dict root kind name role roleKind [namespace]. */}}
{{- define "finetune.binding" -}}
apiVersion: rbac.authorization.k8s.io/v1
kind: {{ .kind }}
metadata:
  name: {{ .name }}
  {{- with .namespace }}
  namespace: {{ . }}
  {{- end }}
  labels:
    {{- include "finetune.labels" .root | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: {{ .roleKind }}
  name: {{ .role }}
subjects:
  - kind: ServiceAccount
    name: finetune-operator
    namespace: {{ .root.Release.Namespace }}
{{- end -}}
