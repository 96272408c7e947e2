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

{{/* The operator's permissions, shared by the ClusterRole and the per-namespace Roles. No Secrets: the Ray
token reaches pods through secretKeyRef, which the kubelet resolves, never the operator. */}}
{{- define "hybridflow.rules" -}}
# RLHFJobs: watch them, record progress in annotations and the finalizer (patch), delete after their TTL.
- apiGroups: ["hybridflow.io"]
  resources: ["rlhfjobs"]
  verbs: ["get", "list", "watch", "patch", "update", "delete"]
# Status subresource: phase, conditions, step, tokens/s.
- apiGroups: ["hybridflow.io"]
  resources: ["rlhfjobs/status"]
  verbs: ["get", "patch", "update"]
# The gang: head and pool pods are created, observed and deleted (restart, suspend, cleanup).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
# The head's headless Service and the job's resolved-spec ConfigMap.
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "delete"]
# Before creating pods: do the job's PersistentVolumeClaims exist? (Read only; the operator never changes them.)
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]
# Events on RLHFJobs (GangRestart, Suspended, ValidationFailed, ...).
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if .Values.rbac.volcano }}
# Volcano gang scheduling (runPolicy.gangScheduling).
- apiGroups: ["scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "create", "delete"]
{{- end }}
{{- end -}}
