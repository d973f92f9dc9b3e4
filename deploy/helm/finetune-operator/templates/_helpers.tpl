{{/* Names are fixed: one operator per cluster (it owns the FinetuneJob CRD and one leader Lease). */}}
{{- define "finetune.name" -}}finetune-operator{{- end -}}

{{- define "finetune.labels" -}}
app.kubernetes.io/name: finetune-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "finetune.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{- define "finetune.scheme" -}}{{ if .Values.progress.tls.enabled }}https{{ else }}http{{ end }}{{- end -}}

{{- define "finetune.progressURL" -}}
{{- .Values.progress.url | default (printf "%s://finetune-operator.%s.svc:8080" (include "finetune.scheme" .) .Release.Namespace) -}}
{{- end -}}
