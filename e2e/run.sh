#!/usr/bin/env bash
# Runs the e2e scenarios inside fresh user, network, mount and PID namespaces (no root on the host needed where
# unprivileged user namespaces are allowed). pytest is PID 1 there: when it exits, every process still in the
# namespace (pods, Ray, the operator) is ended by the kernel, so nothing outlives the run.
# With KUBECONFIG set, the same scenarios run against that cluster instead (see e2e/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ -n "${KUBECONFIG:-}" ]; then
  exec "$PYTHON" -m pytest e2e -ra -p no:cacheprovider "$@"
fi
exec unshare --user --map-root-user --net --mount --pid --fork --kill-child --mount-proc \
  env HF_E2E_NAMESPACE=1 "$PYTHON" -m pytest e2e -ra --durations=0 --durations-min=1 -p no:cacheprovider "$@"
