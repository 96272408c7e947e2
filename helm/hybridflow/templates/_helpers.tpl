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
# Every verb below is one the operator's code uses (tests/operator/test_operator_kopf_requests.py compares them with what a job's
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

{{/* The variables a job pod may take from a Secret, and the key each is read from, as a CEL map: the Ray token
and the sandbox pool's token (manifests.py _ray_env, sandbox_token_env) and the storage and tracking credentials, each
from the key of its own name (hybridflow.api.storage STORAGE_CREDENTIAL_KEYS, TRACKING_CREDENTIAL_KEYS;
tests/operator/test_job_policy.py keeps them equal). */}}
{{- define "hybridflow.secretEnv" -}}
{{- $keys := list "AWS_ACCESS_KEY_ID" "AWS_SECRET_ACCESS_KEY" "AWS_SESSION_TOKEN" "AWS_ENDPOINT_URL" "AWS_REGION" "AWS_DEFAULT_REGION" "AZURE_STORAGE_CONNECTION_STRING" "AZURE_STORAGE_ACCOUNT_NAME" "AZURE_STORAGE_ACCOUNT_KEY" "AZURE_STORAGE_SAS_TOKEN" "MLFLOW_TRACKING_TOKEN" "MLFLOW_TRACKING_USERNAME" "MLFLOW_TRACKING_PASSWORD" "WANDB_API_KEY" -}}
{'RAY_AUTH_TOKEN': 'token', 'HYBRIDFLOW_SANDBOX_TOKEN': 'token'{{ range $keys }}, '{{ . }}': '{{ . }}'{{ end }}}
{{- end -}}

{{/* The role label (hybridflow.io/role) of the sandbox pool's pods (manifests.py ENVIRONMENT_ROLE;
tests/operator/test_job_policy.py keeps them equal). */}}
{{- define "hybridflow.sandboxRole" -}}environment{{- end -}}

{{/* A CEL list literal of strings: ['a', 'b'] */}}
{{- define "hybridflow.celList" -}}
[{{- range $i, $v := . }}{{ if $i }}, {{ end }}'{{ $v }}'{{- end -}}]
{{- end -}}

{{/* spec.kubernetes.image's default (workers/hybridflow/spec.py; tests/operator/test_job_policy.py keeps them equal). */}}
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

{{/* The addresses where clouds serve instance metadata and the node's cloud credentials, which no egress rule may
reach (policy.py METADATA_RANGES, in its order): the link-local ranges (169.254.169.254; EKS Pod Identity's
169.254.170.23), AWS's IPv6 metadata service and Pod Identity agent, Alibaba Cloud's metadata service. */}}
{{- define "hybridflow.metadataRanges" -}}
169.254.0.0/16 100.100.100.200/32 fe80::/10 fd00:ec2::254/128 fd00:ec2::23/128
{{- end -}}

{{/* A CIDR as "<bits> <prefix>": its address as 32 (IPv4) or 128 (IPv6) characters 0/1, and its prefix length (the
address's whole length without one). Helm has no address arithmetic: IPv6 is expanded here ("::", an IPv4 tail),
each part printed in binary. Fails on what is not a CIDR. */}}
{{- define "hybridflow.cidrBits" -}}
{{- $cidr := lower (trim (toString .)) -}}
{{- if not (or (regexMatch "^[0-9]{1,3}(\\.[0-9]{1,3}){3}(/[0-9]{1,2})?$" $cidr) (regexMatch "^[0-9a-f:.]*:[0-9a-f:.]*(/[0-9]{1,3})?$" $cidr)) -}}
{{- fail (printf "'%s' is not a CIDR" .) -}}
{{- end -}}
{{- $parts := splitList "/" $cidr -}}
{{- $addr := first $parts -}}
{{- $v4 := not (contains ":" $addr) -}}
{{- $width := ternary 32 128 $v4 -}}
{{- $n := $width -}}
{{- if gt (len $parts) 1 }}{{ $n = atoi (index $parts 1) }}{{ end -}}
{{- if gt $n $width }}{{ fail (printf "'%s' is not a CIDR (prefix over %d)" . $width) }}{{ end -}}
{{- $bits := "" -}}
{{- if $v4 -}}
  {{- range $o := splitList "." $addr -}}
    {{- if gt (atoi $o) 255 }}{{ fail (printf "'%s' is not a CIDR" $cidr) }}{{ end -}}
    {{- $bits = printf "%s%08b" $bits (atoi $o) -}}
  {{- end -}}
{{- else -}}
  {{- $hex := dict "0" 0 "1" 1 "2" 2 "3" 3 "4" 4 "5" 5 "6" 6 "7" 7 "8" 8 "9" 9 "a" 10 "b" 11 "c" 12 "d" 13 "e" 14 "f" 15 -}}
  {{- $halves := splitList "::" $addr -}}
  {{- if gt (len $halves) 2 }}{{ fail (printf "'%s' is not a CIDR" $cidr) }}{{ end -}}
  {{- $sides := list -}}
  {{- range $half := $halves -}}
    {{- $side := "" -}}
    {{- if $half -}}
      {{- range $g := splitList ":" $half -}}
        {{- if contains "." $g -}}
          {{- $o := splitList "." $g -}}
          {{- if ne (len $o) 4 }}{{ fail (printf "'%s' is not a CIDR" $cidr) }}{{ end -}}
          {{- range $x := $o }}{{ $side = printf "%s%08b" $side (atoi $x) }}{{ end -}}
        {{- else -}}
          {{- if or (not $g) (gt (len $g) 4) (contains "." $g) }}{{ fail (printf "'%s' is not a CIDR" $cidr) }}{{ end -}}
          {{- $v := 0 -}}
          {{- range $c := splitList "" $g }}{{ $v = add (mul $v 16) (get $hex $c) }}{{ end -}}
          {{- $side = printf "%s%016b" $side $v -}}
        {{- end -}}
      {{- end -}}
    {{- end -}}
    {{- $sides = append $sides $side -}}
  {{- end -}}
  {{- $have := len (join "" $sides) -}}
  {{- if or (gt $have 128) (and (eq (len $sides) 1) (ne $have 128)) (and (eq (len $sides) 2) (eq $have 128)) -}}
    {{- fail (printf "'%s' is not a CIDR" $cidr) -}}
  {{- end -}}
  {{- $bits = first $sides -}}
  {{- if eq (len $sides) 2 }}{{ $bits = printf "%s%s%s" (first $sides) (repeat (int (sub 128 $have)) "0") (last $sides) }}{{ end -}}
{{- end -}}
{{- printf "%s %d" $bits (int $n) -}}
{{- end -}}

{{/* (list cidr other): what `other` is to the CIDR: "inside" (the CIDR lies in it, or is it), "contains" (the CIDR
holds all of it) or "apart" (no address in common; another family always). policy.py relation() says the same
(tests/operator/test_helm.py holds them to it). */}}
{{- define "hybridflow.relation" -}}
{{- $a := splitList " " (include "hybridflow.cidrBits" (index . 0)) -}}
{{- $b := splitList " " (include "hybridflow.cidrBits" (index . 1)) -}}
{{- if ne (len (first $a)) (len (first $b)) -}}apart
{{- else -}}
{{- $n := atoi (last $a) }}{{ $r := atoi (last $b) -}}
{{- $m := int (min $n $r) -}}
{{- if ne (substr 0 $m (first $a)) (substr 0 $m (first $b)) }}apart
{{- else if ge $n $r }}inside
{{- else }}contains{{ end -}}
{{- end -}}
{{- end -}}

{{/* (list where peers): the NetworkPolicyPeers as JSON, each ipBlock containing a metadata range
(hybridflow.metadataRanges) given it as `except`; an ipBlock inside one fails the render (policy.py confine_peer does
the same for the jobs' policies). */}}
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
  {{- $block := . -}}
  {{- $excepts := .except | default (list) -}}
  {{- $added := false -}}
  {{- range $bad := splitList " " (include "hybridflow.metadataRanges" .) -}}
    {{- $verdict := include "hybridflow.relation" (list $block.cidr $bad) -}}
    {{- if eq $verdict "inside" -}}
      {{- $what := ternary "link-local: the cloud metadata service" "a cloud metadata service's address" (has $bad (list "169.254.0.0/16" "fe80::/10")) -}}
      {{- fail (printf "%s[%d].ipBlock.cidr %s is inside %s (%s); no job or operator may reach it" $where $i $block.cidr $bad $what) -}}
    {{- else if eq $verdict "contains" -}}
      {{- $covered := false -}}
      {{- range $e := $excepts -}}
        {{- if eq (include "hybridflow.relation" (list $bad $e)) "inside" }}{{ $covered = true }}{{ end -}}
      {{- end -}}
      {{- if not $covered }}{{ $excepts = append $excepts $bad }}{{ $added = true }}{{ end -}}
    {{- end -}}
  {{- end -}}
  {{- if $added }}{{ $_ := set . "except" $excepts }}{{ end -}}
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
{{- if and .Values.kueue.required (not .Values.kueue.enabled) -}}
{{- fail "kueue.required refuses every job not queued through Kueue, and kueue.enabled is false (the operator then refuses queued jobs too): set kueue.enabled=true as well" -}}
{{- end -}}
{{- $np := .Values.networkPolicy -}}
{{- $_ := include "hybridflow.confinedRule" (list "networkPolicy.dns" $np.dns) -}}
{{- if $np.objectStore.to }}{{ $_ := include "hybridflow.confinedRule" (list "networkPolicy.objectStore" $np.objectStore) }}{{ end -}}
{{- range $i, $rule := $np.egressExtra }}{{ $_ := include "hybridflow.confinedRule" (list (printf "networkPolicy.egressExtra[%d]" $i) $rule) }}{{ end -}}
{{- end -}}
