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
# and before the job's deletion deletes it. Listed and watched (one watch, filtered by the API server to objects
# carrying the hybridflow.io/job label) so that one deleted while its job lives is made again at the next tick.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "delete"]
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
# Each job's NetworkPolicy: the fence of its pods' ingress and egress. Read, listed and watched as the Service is (a
# job's pods must not go on unfenced because someone deleted it).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "delete"]
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
{{- if .Values.kueue.enabled }}
# Kueue (kueue.enabled): each queued job's Workload, made by the operator, followed by one watch (filtered by the
# API server to the jobs' own), read as the Service is, spec.active patched (runPolicy.suspend) and deleted with it.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# What the job's controller writes in Kueue's job framework: the quota of an evicted job given back, PodsReady,
# Finished.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end }}
{{- end -}}

{{/* Cluster-scoped reads Kueue admission needs (a ClusterRole in both install modes): the ResourceFlavors assigned
to a job (their node labels and tolerations go into its pods) and the value of its PriorityClass (its Workload's
priority, which Kueue orders and preempts by). */}}
{{- define "hybridflow.kueueClusterRules" -}}
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors"]
  verbs: ["get"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["get"]
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

{{/* The operator's own user, as the API server names it in admission requests. */}}
{{- define "hybridflow.operatorUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "hybridflow.serviceAccountName" . }}
{{- end -}}

{{/* The label a namespace carries for a cluster-wide operator to act in it (policy.py NAMESPACE_LABEL). */}}
{{- define "hybridflow.namespaceLabelKey" -}}hybridflow.io/jobs{{- end -}}
{{- define "hybridflow.namespaceLabelValue" -}}enabled{{- end -}}

{{/* A namespaceSelector for the namespaces the operator serves: the labelled ones (clusterWide) or watchNamespaces. */}}
{{- define "hybridflow.jobNamespaceSelector" -}}
{{- if .Values.clusterWide -}}
matchLabels:
  {{ include "hybridflow.namespaceLabelKey" . }}: {{ include "hybridflow.namespaceLabelValue" . }}
{{- else -}}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: In
    values: {{ toJson .Values.watchNamespaces }}
{{- end -}}
{{- end -}}

{{/* What the link-local range of a CIDR's family (169.254.0.0/16, fe80::/10: where clouds serve instance metadata)
is to it: "inside <range>", "contains <range>" or "apart <range>". Helm has no address arithmetic: the CIDR's first 16
bits are compared with the range's, down to the shorter of the two prefixes. operator/.../policy.py link_local() says
the same (tests/test_helm.py holds them to it). */}}
{{- define "hybridflow.linkLocal" -}}
{{- $cidr := lower (trim (toString .)) -}}
{{- if not (or (regexMatch "^[0-9]{1,3}(\\.[0-9]{1,3}){3}(/[0-9]{1,2})?$" $cidr) (regexMatch "^[0-9a-f:.]*:[0-9a-f:.]*(/[0-9]{1,3})?$" $cidr)) -}}
{{- fail (printf "'%s' is not a CIDR" .) -}}
{{- end -}}
{{- $parts := splitList "/" $cidr -}}
{{- $addr := first $parts -}}
{{- $v4 := not (contains ":" $addr) -}}
{{- $n := ternary 32 128 $v4 -}}
{{- if gt (len $parts) 1 }}{{ $n = atoi (index $parts 1) }}{{ end -}}
{{- $h := 0 -}}{{- $range := "169.254.0.0/16" -}}{{- $r := 16 -}}{{- $v := 43518 -}}
{{- if $v4 -}}
  {{- $o := splitList "." $addr -}}
  {{- $h = add (mul (atoi (index $o 0)) 256) (atoi (index $o 1)) -}}
{{- else -}}
  {{- $range = "fe80::/10" }}{{ $r = 10 }}{{ $v = 65152 -}}
  {{- $first := "0" -}}
  {{- if not (hasPrefix ":" $addr) }}{{ $first = first (splitList ":" $addr) }}{{ end -}}
  {{- $first = printf "%s%s" (repeat (int (sub 4 (len $first))) "0") $first -}}
  {{- $hex := dict "0" 0 "1" 1 "2" 2 "3" 3 "4" 4 "5" 5 "6" 6 "7" 7 "8" 8 "9" 9 "a" 10 "b" 11 "c" 12 "d" 13 "e" 14 "f" 15 -}}
  {{- range $c := splitList "" $first }}{{ $h = add (mul $h 16) (get $hex $c) }}{{ end -}}
{{- end -}}
{{- $pow := list 1 2 4 8 16 32 64 128 256 512 1024 2048 4096 8192 16384 32768 65536 -}}
{{- $d := index $pow (int (sub 16 (min $n $r))) -}}
{{- if ne (div $h $d) (div $v $d) }}apart {{ $range }}
{{- else if ge (int $n) $r }}inside {{ $range }}
{{- else }}contains {{ $range }}{{ end -}}
{{- end -}}

{{/* (list where peers): the NetworkPolicyPeers as JSON, each ipBlock containing its link-local range given it as
`except`; an ipBlock inside it fails the render (policy.py confine_peer does the same for the jobs' policies). */}}
{{- define "hybridflow.confinedPeers" -}}
{{- $where := index . 0 -}}
{{- $out := list -}}
{{- range $i, $peer := index . 1 -}}
{{- if or (not (kindIs "map" $peer)) (empty $peer) -}}
{{- fail (printf "%s[%d]: a NetworkPolicyPeer (ipBlock, namespaceSelector, podSelector), got %v" $where $i $peer) -}}
{{- end -}}
{{- $p := deepCopy $peer -}}
{{- with $p.ipBlock -}}
  {{- if not .cidr }}{{ fail (printf "%s[%d].ipBlock: needs a cidr" $where $i) }}{{ end -}}
  {{- $verdict := splitList " " (include "hybridflow.linkLocal" .cidr) -}}
  {{- $bad := last $verdict -}}
  {{- if eq (first $verdict) "inside" -}}
    {{- fail (printf "%s[%d].ipBlock.cidr %s is inside %s (link-local: the cloud metadata service); no job or operator may reach it" $where $i .cidr $bad) -}}
  {{- else if eq (first $verdict) "contains" -}}
    {{- $excepts := .except | default (list) -}}
    {{- $covered := false -}}
    {{- range $e := $excepts -}}
      {{- $ev := splitList " " (include "hybridflow.linkLocal" $e) -}}
      {{- if and (ne (first $ev) "apart") (le (atoi (last (splitList "/" (toString $e)))) (atoi (last (splitList "/" $bad)))) }}{{ $covered = true }}{{ end -}}
    {{- end -}}
    {{- if not $covered }}{{ $_ := set . "except" (append $excepts $bad) }}{{ end -}}
  {{- end -}}
{{- end -}}
{{- $out = append $out $p -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* (list where rule): a NetworkPolicyEgressRule as JSON, its peers confined; a rule must name its peers (one without
`to` allows every destination, the metadata service included). */}}
{{- define "hybridflow.confinedRule" -}}
{{- $where := index . 0 -}}
{{- $rule := index . 1 -}}
{{- if not (kindIs "map" $rule) }}{{ fail (printf "%s: an egress rule {to: [...], ports: [...]}, got %v" $where $rule) }}{{ end -}}
{{- if not $rule.to -}}
{{- fail (printf "%s.to: list the peers it allows (an egress rule without `to` allows every destination); for anywhere but link-local give ipBlock 0.0.0.0/0 (and ::/0)" $where) -}}
{{- end -}}
{{- $out := dict "to" (include "hybridflow.confinedPeers" (list (printf "%s.to" $where) $rule.to) | fromJsonArray) -}}
{{- with $rule.ports }}{{ $_ := set $out "ports" . }}{{ end -}}
{{- toJson $out -}}
{{- end -}}

{{/* Values that no install may have; rendered (empty) by deployment.yaml, so every install checks them. */}}
{{- define "hybridflow.checkValues" -}}
{{- if and (not .Values.clusterWide) (empty (compact .Values.watchNamespaces)) -}}
{{- fail "watchNamespaces is empty: list the namespaces the operator serves (--set 'watchNamespaces={team-a,team-b}'), or set clusterWide=true for one operator acting in every namespace labelled hybridflow.io/jobs=enabled" -}}
{{- else if and (not .Values.clusterWide) (has "" .Values.watchNamespaces) -}}
{{- fail (printf "watchNamespaces %v names an empty namespace: list names only" .Values.watchNamespaces) -}}
{{- end -}}
{{- $np := .Values.networkPolicy -}}
{{- $_ := include "hybridflow.confinedRule" (list "networkPolicy.dns" $np.dns) -}}
{{- if $np.objectStore.to }}{{ $_ := include "hybridflow.confinedRule" (list "networkPolicy.objectStore" $np.objectStore) }}{{ end -}}
{{- range $i, $rule := $np.egressExtra }}{{ $_ := include "hybridflow.confinedRule" (list (printf "networkPolicy.egressExtra[%d]" $i) $rule) }}{{ end -}}
{{- end -}}
