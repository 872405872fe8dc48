{{/*
The release's resources are named after it: "nettap" for a release named nettap (as
deploy/kubernetes names them), "<release>-nettap" otherwise.
*/}}
{{- define "nettap.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
The pods' selector. app.kubernetes.io/name is "nettap": the capture's PodMonitor takes the job
name from it (job="nettap", the mixin's nettapSelector).
*/}}
{{- define "nettap.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "nettap.labels" -}}
{{ include "nettap.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "nettap.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
A container's requests and limits, as a whole block: its own (capture.resources,
ingest.resources) when set, else the one block for both (ebpf.nettap.resources, the resource
document's), else its measured defaultResources. Called with (dict "root" $ "container" <the
container's values>).
*/}}
{{- define "nettap.resources" -}}
{{- $c := .container -}}
{{- toYaml ($c.resources | default .root.Values.ebpf.nettap.resources | default $c.defaultResources) -}}
{{- end -}}

{{/*
nettap's config file: ebpf.configuration, with ingest.servers in its ingest section while
ingest.enabled, and its kubernetes section off (kubelet_url: off) unless kubernetes.enabled. Without the ingest: no ingest section (no NATS setting), and a jsonl output,
files no one would forward, becomes type none.
*/}}
{{- define "nettap.config" -}}
{{- $cfg := deepCopy (.Values.ebpf.configuration | default dict) -}}
{{- $kube := deepCopy ($cfg.kubernetes | default dict) -}}
{{- if not .Values.kubernetes.enabled -}}
{{- $_ := set $kube "kubelet_url" "off" -}}
{{- else if .Values.kubernetes.insecureSkipVerify -}}
{{- $_ := set $kube "insecure_skip_verify" true -}}
{{- end -}}
{{- $_ := set $cfg "kubernetes" $kube -}}
{{- if .Values.ingest.enabled -}}
{{- $ingest := deepCopy ($cfg.ingest | default dict) -}}
{{- $_ := set $ingest "servers" .Values.ingest.servers -}}
{{- $_ := set $cfg "ingest" $ingest -}}
{{- else -}}
{{- $_ := unset $cfg "ingest" -}}
{{- if eq (toString (($cfg.output | default dict).type)) "jsonl" -}}
{{- $_ := set $cfg "output" (dict "type" "none") -}}
{{- end -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}
