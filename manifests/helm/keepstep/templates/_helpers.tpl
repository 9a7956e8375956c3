{{/*
Names, labels and the values derived from several others. The release `keepstep` renders
the names of manifests/ (keepstep-operator, keepstep-etcd, ...).
*/}}

{{- define "keepstep.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object's name. At most 40 characters: the StatefulSet
<fullname>-etcd must stay within 52 (its pods' controller-revision-hash label) and the
Service <fullname>-etcd-peers within 63.
*/}}
{{- define "keepstep.fullname" -}}
{{- $name := "" }}
{{- if .Values.fullnameOverride }}
{{- $name = .Values.fullnameOverride }}
{{- else if contains (include "keepstep.name" .) .Release.Name }}
{{- $name = .Release.Name }}
{{- else }}
{{- $name = printf "%s-%s" .Release.Name (include "keepstep.name" .) }}
{{- end }}
{{- if gt (len $name) 40 }}
{{- fail (printf "the object name prefix %q (from the release name or fullnameOverride) is %d characters; at most 40 fit the etcd StatefulSet's and Services' names" $name (len $name)) }}
{{- end }}
{{- $name }}
{{- end }}

{{- define "keepstep.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels; call with (dict "ctx" $ "component" "operator"). */}}
{{- define "keepstep.selectorLabels" -}}
app.kubernetes.io/name: {{ include "keepstep.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end }}

{{/* Every object's labels; call with (dict "ctx" $ "component" "operator"). */}}
{{- define "keepstep.labels" -}}
{{ include "keepstep.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ include "keepstep.chart" .ctx }}
{{- end }}

{{/* An image reference from {repository, tag, digest}; call with (list $image $defaultTag). */}}
{{- define "keepstep.image" -}}
{{- $image := index . 0 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default (index . 1) $image.tag) }}
{{- end }}
{{- end }}

{{- define "keepstep.operatorName" -}}
{{- printf "%s-operator" (include "keepstep.fullname" .) }}
{{- end }}

{{- define "keepstep.etcdName" -}}
{{- printf "%s-etcd" (include "keepstep.fullname" .) }}
{{- end }}

{{- define "keepstep.etcdPeersName" -}}
{{- printf "%s-etcd-peers" (include "keepstep.fullname" .) }}
{{- end }}

{{/*
The etcd client URL(s) the operator uses and hands to every agent pod. The bundled etcd's
name carries the namespace: the agents resolve it from the jobs' namespaces.
*/}}
{{- define "keepstep.etcdEndpoints" -}}
{{- if .Values.etcd.enabled }}
{{- printf "https://%s.%s.svc:2379" (include "keepstep.etcdName" .) .Release.Namespace }}
{{- else }}
{{- join "," .Values.etcd.endpoints }}
{{- end }}
{{- end }}

{{/* "namespace/name" of the etcd CA Secret, or "" for a plain external etcd. */}}
{{- define "keepstep.etcdCASecret" -}}
{{- $secret := .Values.etcd.caSecret }}
{{- if and (not $secret) .Values.etcd.enabled }}
{{- $secret = printf "%s-etcd-ca" (include "keepstep.fullname" .) }}
{{- end }}
{{- if and $secret (not (contains "/" $secret)) }}
{{- $secret = printf "%s/%s" .Release.Namespace $secret }}
{{- end }}
{{- $secret }}
{{- end }}

{{- define "keepstep.etcdServerSecret" -}}
{{- default (printf "%s-etcd-server" (include "keepstep.fullname" .)) .Values.etcd.serverSecret }}
{{- end }}

{{/*
Rules across values that the schema cannot say; each message names the value. Included
once, by the operator's template.
*/}}
{{- define "keepstep.validate" -}}
{{- $etcd := .Values.etcd }}
{{- if and (not $etcd.enabled) (not $etcd.endpoints) }}
{{- fail "etcd.endpoints: etcd.enabled is false, so list the external etcd's client URLs (e.g. [https://etcd.infra.svc:2379])" }}
{{- end }}
{{- if and $etcd.enabled $etcd.endpoints }}
{{- fail (printf "etcd.endpoints (%s) is for an external etcd: set etcd.enabled=false, or leave it empty for the bundled one" (join "," $etcd.endpoints)) }}
{{- end }}
{{- if and $etcd.enabled (contains "/" $etcd.caSecret) (ne (split "/" $etcd.caSecret)._0 .Release.Namespace) }}
{{- fail (printf "etcd.caSecret (%s): the bundled etcd's CA Secret must be in the release's namespace %s, where the members mount their certificate from" $etcd.caSecret .Release.Namespace) }}
{{- end }}
{{- if and (not $etcd.enabled) $etcd.serverSecret }}
{{- fail (printf "etcd.serverSecret (%s) is for the bundled etcd's members; an external etcd's server certificate is made by whoever runs it" $etcd.serverSecret) }}
{{- end }}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.operator.healthPort)) }}
{{- fail (printf "metrics.port (%d) must differ from operator.healthPort (%d)" (int .Values.metrics.port) (int .Values.operator.healthPort)) }}
{{- end }}
{{- end }}

{{/* The operator's rules in a watched namespace (manifests/README.md says why each). */}}
{{- define "keepstep.operatorRules" -}}
# Read jobs (kopf's watch, each reconcile's GET); patch adds and removes kopf's finalizer
# and its annotations.
- apiGroups: [keepstep.dev]
  resources: [trainjobs]
  verbs: [get, list, watch, patch]
# Write the aggregated status (a JSON merge patch).
- apiGroups: [keepstep.dev]
  resources: [trainjobs/status]
  verbs: [patch]
# One pod per node; lost pods are replaced, scale-down and suspend delete pods.
- apiGroups: [""]
  resources: [pods]
  verbs: [create, delete, list, watch]
# The job's headless Service: a GET tells whether it exists.
- apiGroups: [""]
  resources: [services]
  verbs: [create, get]
# The job's NetworkPolicy: a GET tells whether it exists.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, get]
# Events on TrainJobs, each a new object.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# Each TrainJob's etcd client certificate (and, cluster-wide, the etcd CA and server
# certificate): a GET tells whether one exists, a create makes it.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, get]
{{- end }}
