"""The Helm chart: lint, render over several values combinations, validate every object, check RBAC and security."""
import json
import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from hybridflow.dashboards import DASHBOARDS, render

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "hybridflow"
HELM = os.environ.get("HELM", str(ROOT / ".tools" / "bin" / "helm"))
K8S_VERSIONS = [f"1.{m}" for m in range(29, 38)]
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}  # CRDs: not in the official schemas

COMBOS = {
    "default": [],
    "namespaced": ["--set", "watchNamespaces={team-a,team-b}"],
    "no-monitoring": ["--set", "serviceMonitor.enabled=false", "--set", "podMonitor.enabled=false",
                      "--set", "prometheusRule.enabled=false", "--set", "grafana.dashboards.enabled=false"],
    "no-volcano-custom-sa": ["--set", "rbac.volcano=false", "--set", "serviceAccount.name=rlhf-op",
                             "--set", "image.tag=0.2.0", "--set", "nodeSelector.pool=system"],
}


def helm(*args: str) -> str:
    assert Path(HELM).exists(), f"helm not found at {HELM}: run scripts/install-helm.sh (make install does)"
    out = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def render_chart(combo: str) -> list[dict]:
    text = helm("template", "rel", str(CHART), "--namespace", "hybridflow", "--include-crds", *COMBOS[combo])
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.mark.parametrize("combo", list(COMBOS))
def test_lint_strict(combo):
    helm("lint", "--strict", str(CHART), *COMBOS[combo])


@pytest.mark.parametrize("combo", list(COMBOS))
def test_rendered_objects_validate_for_every_supported_kubernetes(combo):
    docs = render_chart(combo)
    assert docs
    for doc in docs:
        if doc["kind"] in PROMETHEUS_OPERATOR_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["spec"]
            continue
        for version in K8S_VERSIONS:
            if doc["kind"].startswith("ValidatingAdmissionPolicy") and version < "1.30":
                continue  # admissionregistration.k8s.io/v1 since 1.30: values say admissionPolicy.enabled=false before
            kubernetes_validate.validate(doc, version, strict=True)


def _kinds(docs):
    return [d["kind"] for d in docs]


def test_monitoring_objects_follow_values():
    default, off = render_chart("default"), render_chart("no-monitoring")
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert kind in _kinds(default) and kind not in _kinds(off)
    assert not [d for d in off if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"]["labels"]]


def test_namespaced_mode_renders_roles_not_cluster_roles():
    docs = render_chart("namespaced")
    assert "ClusterRole" not in _kinds(docs) and "ClusterRoleBinding" not in _kinds(docs)
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "hybridflow"}], b
        assert b["roleRef"]["kind"] == "Role" and b["roleRef"]["name"] in {r["metadata"]["name"] for r in roles}
    dep = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HYBRIDFLOW_WATCH_NAMESPACES"] == "team-a,team-b"
    pm = next(d for d in docs if d["kind"] == "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


@pytest.mark.parametrize("combo", list(COMBOS))
def test_operator_service_account_creates_secrets_but_never_reads_them(combo):
    for doc in render_chart(combo):
        if doc["kind"] in ("Role", "ClusterRole"):
            for rule in doc["rules"]:
                assert "*" not in rule["resources"] and "*" not in rule["verbs"] and "*" not in rule["apiGroups"], rule
                if "secrets" in rule["resources"]:
                    assert rule["resources"] == ["secrets"] and sorted(rule["verbs"]) == ["create", "delete"]


def test_volcano_rule_follows_values():
    def groups(docs):
        return {g for d in docs if d["kind"] == "ClusterRole" for r in d["rules"] for g in r["apiGroups"]}

    assert "scheduling.volcano.sh" in groups(render_chart("default"))
    custom = render_chart("no-volcano-custom-sa")
    assert "ClusterRole" in _kinds(custom)  # the rule is absent, not the whole role
    assert "scheduling.volcano.sh" not in groups(custom)


def test_operator_deployment_is_locked_down():
    dep = next(d for d in render_chart("default") if d["kind"] == "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    c = pod["containers"][0]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_chart_crd_is_the_generated_crd():
    crd = next(d for d in render_chart("default") if d["kind"] == "CustomResourceDefinition")
    assert crd == yaml.safe_load((ROOT / "crds" / "rlhfjob.yaml").read_text())


def test_dashboards_in_the_chart_are_the_generated_ones():
    for d in DASHBOARDS:
        shipped = json.loads((CHART / "files" / "dashboards" / f"{d.uid}.json").read_text())
        assert shipped == render(d), f"{d.uid}.json drifted: run `hybridflow dashboards`"
    cms = [d for d in render_chart("default") if d["kind"] == "ConfigMap"]
    assert len(cms) == len(DASHBOARDS)
    for cm in cms:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        (body,) = cm["data"].values()
        assert json.loads(body)["panels"]


def test_prometheus_rule_carries_the_alerts_file():
    rule = next(d for d in render_chart("default") if d["kind"] == "PrometheusRule")
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert rule["spec"] == alerts
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"]}
    assert names == {"HybridFlowJobFailed", "HybridFlowJobRestartingRepeatedly", "HybridFlowThroughputDropped",
                     "HybridFlowJobStalled"}
