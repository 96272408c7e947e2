#!/usr/bin/env bash
# Runs the e2e scenarios inside fresh network, mount and PID namespaces, and a user namespace unless run as root
# (no root on the host needed where unprivileged user namespaces and subordinate ids are allowed). pytest is PID 1
# there: when it exits, every process still in the namespace (pods, Ray, the operator) is ended by the kernel, so
# nothing outlives the run.
# With KUBECONFIG set, the same scenarios run against that cluster instead (see e2e/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ -n "${KUBECONFIG:-}" ]; then
  exec "$PYTHON" -m pytest e2e -ra -p no:cacheprovider "$@"
fi
# Pods run as their images' users (uid 1000, ...), so the user namespace maps a range of ids, not root's alone:
# subordinate ids (/etc/subuid, /etc/subgid, through newuidmap/newgidmap). Real root needs no user namespace.
if [ "$(id -u)" = 0 ]; then
  userns=()
else
  userns=(--user --map-root-user --map-auto)
fi
exec unshare "${userns[@]}" --net --mount --pid --fork --kill-child --mount-proc \
  env HF_E2E_NAMESPACE=1 "$PYTHON" -m pytest e2e -ra --durations=0 --durations-min=1 -p no:cacheprovider "$@"
