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

{{/*
A manifest of deploy/ that the chart ships as it is (files/<name>, a byte-identical copy, checked by a
test): each document with finetune-system replaced by the release namespace (names, paramRefs, the
messages naming the policy ConfigMap) and the chart's labels added to its own.
*/}}
{{- define "finetune.shipped" -}}
{{- $root := .root -}}
{{- $text := $root.Files.Get (printf "files/%s" .file) | replace "finetune-system" $root.Release.Namespace -}}
{{- $labels := include "finetune.labels" $root | fromYaml -}}
{{- range $doc := regexSplit "(?m)^---\\s*$" $text -1 }}
{{- $obj := fromYaml $doc }}
{{- if $obj }}
{{- $_ := set $obj.metadata "labels" (merge (deepCopy $labels) ($obj.metadata.labels | default dict)) }}
---
{{ toYaml $obj }}
{{- end }}
{{- end }}
{{- end -}}
