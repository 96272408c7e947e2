{{- define "hybridflow.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "hybridflow.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "hybridflow.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "hybridflow.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "hybridflow.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator's permissions, shared by the ClusterRole and the per-namespace Roles. The Ray token reaches
pods through secretKeyRef, which the kubelet resolves: the operator creates a job's token but never reads one. */}}
{{- define "hybridflow.rules" -}}
# Every verb below is one the operator's code uses (tests/test_operator_kopf.py compares them with what a job's
# whole life asks of the API server); nothing else.
# RLHFJobs: watch them (kopf lists, then watches), finalizer and progress annotations (patch), TTL deletion.
- apiGroups: ["hybridflow.io"]
  resources: ["rlhfjobs"]
  verbs: ["list", "watch", "patch", "delete"]
# Status subresource: phase, conditions, step, tokens/s.
- apiGroups: ["hybridflow.io"]
  resources: ["rlhfjobs/status"]
  verbs: ["patch"]
# The gang: head and pool pods are created, followed by one watch, and deleted (restart, suspend, cleanup).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "delete"]
# The head's headless Service. Read: one found under its name must be the job's (its owner) before the job uses it,
# and before the job's deletion deletes it.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "delete"]
# The job's accepted-spec ConfigMap and its copy of the reward file (created, read back to check owner and
# content), and a job's reward ConfigMap (read: does it exist, is it marked for jobs, the file to copy).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "delete"]
# Each job's Ray token: created (random) and deleted with the job, by the uid its create returned. Never get, list
# or watch: the operator does not read Secrets (a user's rayAuthSecret is checked by the admission policy, against
# its author's own rights).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "delete"]
# Each job's NetworkPolicy: ingress only from the job's own pods and the metrics scrapers. Read as the Service is.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "delete"]
# Before creating pods: do the job's PersistentVolumeClaims exist, and are they marked for jobs? (Read only.)
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]
# Events on RLHFJobs (GangRestart, Suspended, ValidationFailed, ...).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.rbac.volcano }}
# Volcano gang scheduling (runPolicy.gangScheduling). Read as the Service is.
- apiGroups: ["scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "create", "delete"]
{{- end }}
{{- end -}}

{{/* Image prefixes ending at a path boundary, as a CEL list (policy.py image_prefixes does the same). */}}
{{- define "hybridflow.celImagePrefixes" -}}
[{{- range $i, $v := . }}{{ if $i }}, {{ end }}'{{ $v }}{{ if not (or (hasSuffix "/" $v) (hasSuffix ":" $v) (hasSuffix "@" $v)) }}/{{ end }}'{{- end -}}]
{{- end -}}

{{/* A CEL list literal of strings: ['a', 'b'] */}}
{{- define "hybridflow.celList" -}}
[{{- range $i, $v := . }}{{ if $i }}, {{ end }}'{{ $v }}'{{- end -}}]
{{- end -}}

{{/* spec.kubernetes.image's default (workers/hybridflow/spec.py; tests/test_job_policy.py keeps them equal). */}}
{{- define "hybridflow.defaultJobImage" -}}
hybridflow/worker-cpu:0.1.0
{{- end -}}
