{{/* The chart's name, and the release's full name (what objects are called). */}}
{{- define "devhost.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "devhost.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "devhost.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "devhost.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* What selects this release's pods: the name, and the instance so that one
     DaemonSet per node pool (one release each) never adopts another's pods. */}}
{{- define "devhost.selectorLabels" -}}
app.kubernetes.io/name: {{ include "devhost.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every object: the kustomize base's, plus Helm's bookkeeping. */}}
{{- define "devhost.labels" -}}
{{ include "devhost.selectorLabels" . }}
app.kubernetes.io/component: device-plugin
app.kubernetes.io/part-of: devhost
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "devhost.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* A TOML key: bare when TOML allows it, quoted otherwise. */}}
{{- define "devhost.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{/* A TOML value from a values.yaml value: maps become inline tables, lists
     arrays; a JSON string, number or boolean is also valid TOML. */}}
{{- define "devhost.tomlValue" -}}
{{- if kindIs "map" . -}}
{ {{- $first := true }}{{ range $k, $v := . }}{{ if not $first }},{{ end }} {{ include "devhost.tomlKey" $k }} = {{ include "devhost.tomlValue" $v }}{{ $first = false }}{{ end }} }
{{- else if kindIs "slice" . -}}
[{{ range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "devhost.tomlValue" $v }}{{ end }}]
{{- else if kindIs "invalid" . -}}
{{ fail "a manifest value is null: TOML has no null; leave the key out instead" }}
{{- else -}}
{{ toJson . }}
{{- end }}
{{- end }}

{{/* key = value lines of a map, except the keys in .skip. */}}
{{- define "devhost.tomlPairs" -}}
{{- range $k, $v := .map }}
{{- if not (has $k $.skip) }}
{{ include "devhost.tomlKey" $k }} = {{ include "devhost.tomlValue" $v }}
{{- end }}
{{- end }}
{{- end }}

{{/* The devhost manifest, devhost.toml. */}}
{{- define "devhost.manifest" -}}
{{- if .Values.manifest.toml }}
{{- .Values.manifest.toml }}
{{- else }}
{{- $settings := deepCopy (default dict .Values.manifest.settings) }}
{{- if not (hasKey $settings "metrics_addr") }}
{{- $_ := set $settings "metrics_addr" (printf "0.0.0.0:%d" (int .Values.metrics.port)) }}
{{- end }}
{{- if and .Values.cdi.enabled (not (hasKey $settings "cdi_dir")) }}
{{- $_ := set $settings "cdi_dir" .Values.cdi.hostPath }}
{{- end }}
{{- if and (ne .Values.lock.hostPath "/run/devhost") (not (hasKey $settings "lock_dir")) }}
{{- $_ := set $settings "lock_dir" .Values.lock.hostPath }}
{{- end }}
{{- if and (ne .Values.state.hostPath "/var/lib/devhost") (not (hasKey $settings "state_dir")) }}
{{- $_ := set $settings "state_dir" .Values.state.hostPath }}
{{- end }}
{{- if and .Values.dra.enabled (ne .Values.dra.kubeletRootDir "/var/lib/kubelet") (not (hasKey $settings "kubelet_root_dir")) }}
{{- $_ := set $settings "kubelet_root_dir" .Values.dra.kubeletRootDir }}
{{- end }}
{{- if and .Values.nfd.enabled (not (hasKey $settings "nfd_features_dir")) }}
{{- $_ := set $settings "nfd_features_dir" "/etc/kubernetes/node-feature-discovery/features.d" }}
{{- end }}
# Written by the devhost Helm chart from its `manifest` values.
{{- include "devhost.tomlPairs" (dict "map" $settings "skip" list) }}
{{- range $name, $driver := .Values.manifest.drivers }}
{{- $driver = default dict $driver }}
[driver.{{ include "devhost.tomlKey" $name }}]
{{- include "devhost.tomlPairs" (dict "map" $driver "skip" (list "options")) }}
{{- if $driver.options }}
[driver.{{ include "devhost.tomlKey" $name }}.options]
{{- include "devhost.tomlPairs" (dict "map" $driver.options "skip" list) }}
{{- end }}
{{- end }}
{{- range .Values.manifest.resources }}
[[resource]]
{{- include "devhost.tomlPairs" (dict "map" . "skip" list) }}
{{- end }}
{{- end }}
{{ end }}
