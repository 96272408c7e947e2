"""The Helm chart rendered as the tests render it: the helm binary (`make install-tools`; $HELM overrides), the values
combinations the chart is checked over, and `helm template` of one of them as objects. Shared by tests/operator/test_helm.py,
tests/operator/test_job_policy.py and the operator's tests."""
import os
import subprocess
from pathlib import Path

import yaml

from support.paths import ROOT

CHART = ROOT / "helm" / "hybridflow"
HELM = os.environ.get("HELM", str(ROOT / ".tools" / "bin" / "helm"))

COMBOS = {
    "default": [],
    "namespaced": ["--set", "watchNamespaces={team-a,team-b}"],
    "no-monitoring": ["--set", "serviceMonitor.enabled=false", "--set", "podMonitor.enabled=false",
                      "--set", "prometheusRule.enabled=false", "--set", "grafana.dashboards.enabled=false"],
    "no-volcano-custom-sa": ["--set", "rbac.volcano=false", "--set", "serviceAccount.name=rlhf-op",
                             "--set", "image.tag=0.2.0", "--set", "nodeSelector.pool=system"],
    "cluster-wide": ["--set", "clusterWide=true", "--set", "resourceQuota.enabled=true",
                     "--set", "resourceQuota.namespaces={team-a}"],
    "cluster-wide-kueue": ["--set", "clusterWide=true", "--set", "kueue.enabled=true"],
    "namespaced-kueue": ["--set", "watchNamespaces={team-a,team-b}", "--set", "kueue.enabled=true",
                         "--set", "kueue.required=true"],
    # every egress value set, the quota on, no scrapers: the operator's policy then admits no ingress at all
    "egress-quota": ["--set", "watchNamespaces={team-a,team-b}", "--set", "resourceQuota.enabled=true",
                     "--set-json", 'networkPolicy.objectStore={"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], '
                                   '"ports": [{"protocol": "TCP", "port": 443}]}',
                     "--set-json", 'networkPolicy.egressExtra=[{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}]}]',
                     "--set-json", 'networkPolicy.operator.livenessFrom=[{"ipBlock": {"cidr": "10.0.0.0/8"}}]',
                     "--set-json", "networkPolicy.metricsFromNamespaces=[]"],
}


def run_helm(*args: str) -> subprocess.CompletedProcess:
    assert Path(HELM).exists(), f"helm not found at {HELM}: run scripts/install-helm.sh (make install does)"
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)


def helm(*args: str) -> str:
    out = run_helm(*args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def render_chart(combo: str) -> list[dict]:
    text = helm("template", "rel", str(CHART), "--namespace", "hybridflow", "--include-crds", *COMBOS[combo])
    return [d for d in yaml.safe_load_all(text) if d]
