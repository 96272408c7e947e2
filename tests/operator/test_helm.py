"""The Helm chart: lint, render over several values combinations, validate every object, check RBAC and security."""
import json
import re
import shutil

import kubernetes_validate
import pytest
import yaml

from hybridflow.dashboards import DASHBOARDS, render
from support.helm import CHART, COMBOS, helm, render_chart, run_helm
from support.paths import ROOT

K8S_VERSIONS = [f"1.{m}" for m in range(29, 38)]
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}  # CRDs: not in the official schemas


def helm_refuses(*values: str) -> str:
    """`helm template` with these values fails: its error message."""
    out = run_helm("template", "rel", str(CHART), "--namespace", "hybridflow", *values)
    assert out.returncode != 0, "rendered, but should have been refused"
    return out.stderr


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
        return {g for d in docs if d["kind"] in ("Role", "ClusterRole") for r in d["rules"] for g in r["apiGroups"]}

    assert "scheduling.volcano.sh" in groups(render_chart("default"))
    assert "scheduling.volcano.sh" in groups(render_chart("cluster-wide"))
    custom = render_chart("no-volcano-custom-sa")
    assert "Role" in _kinds(custom)  # the rule is absent, not the whole role
    assert "scheduling.volcano.sh" not in groups(custom)


def test_kueue_rights_and_switch_follow_values():
    """kueue.enabled: the Workload rules where the jobs are (Roles, or the ClusterRole), the cluster-scoped reads
    (ResourceFlavors, PriorityClasses) in a ClusterRole in both modes, and the operator told; off, none of it."""
    def rules(docs, kind):
        return {(g, r, v) for d in docs if d["kind"] == kind for rule in d["rules"] for g in rule["apiGroups"]
                for r in rule["resources"] for v in rule["verbs"]}

    def switch(docs):
        dep = next(d for d in docs if d["kind"] == "Deployment")
        return {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}[
            "HYBRIDFLOW_KUEUE"]

    reads = {("kueue.x-k8s.io", "resourceflavors", "get"), ("scheduling.k8s.io", "priorityclasses", "get")}
    workloads = {("kueue.x-k8s.io", "workloads", v) for v in ("get", "list", "watch", "create", "patch", "delete")}
    namespaced = render_chart("namespaced-kueue")
    assert workloads | {("kueue.x-k8s.io", "workloads/status", "patch")} <= rules(namespaced, "Role")
    assert rules(namespaced, "ClusterRole") == reads and switch(namespaced) == "true"
    binding = next(d for d in namespaced if d["kind"] == "ClusterRoleBinding")
    assert binding["roleRef"]["name"].endswith("-kueue")
    wide = render_chart("cluster-wide-kueue")
    assert workloads | reads <= rules(wide, "ClusterRole")
    for combo in ("default", "cluster-wide"):
        docs = render_chart(combo)
        assert not {g for g, _, _ in rules(docs, "Role") | rules(docs, "ClusterRole")} & {"kueue.x-k8s.io"}
        assert switch(docs) == "false"


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


def test_every_shipped_panel_fits_the_grid_and_queries_its_expressions():
    """The JSON Grafana loads (built by the foundation SDK): panels inside 24 columns, none overlapping another,
    each querying exactly its panel's PromQL in order on the picked Prometheus, stacked where asked."""
    for d in DASHBOARDS:
        shipped = json.loads((CHART / "files" / "dashboards" / f"{d.uid}.json").read_text())
        cells = set()
        assert [p["title"] for p in shipped["panels"]] == [p.title for p in d.panels]
        for panel, want in zip(shipped["panels"], d.panels):
            g = panel["gridPos"]
            assert g["w"] == want.width and 0 <= g["x"] and g["x"] + g["w"] <= 24, (d.uid, panel["title"], g)
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, (d.uid, panel["title"], "overlaps a panel before it")
            cells |= mine
            assert [t["expr"] for t in panel["targets"]] == list(want.exprs), (d.uid, panel["title"])
            assert {t["datasource"]["uid"] for t in panel["targets"]} == {"${datasource}"}
            assert panel["type"] == want.kind and panel["fieldConfig"]["defaults"]["unit"] == want.unit
            if want.kind == "timeseries":
                stacking = panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"]
                assert stacking == ("normal" if want.stacked else "none"), (d.uid, panel["title"])
        names = [v["name"] for v in shipped["templating"]["list"]]
        assert names == ["datasource", *d.variables], (d.uid, names)


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


def _env(docs: list[dict]) -> dict:
    dep = next(d for d in docs if d["kind"] == "Deployment")
    return {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def _named(docs: list[dict], kind: str, suffix: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix))


SERVED_DEFAULT = {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["default"]}]}
LABELLED = {"matchLabels": {"hybridflow.io/jobs": "enabled"}}


def test_the_default_install_is_namespaced_to_default():
    """Issue 24, a platform reviewer's objection 2: out of the box the operator holds a Role in `default` only: no
    ClusterRole at all (a namespaced kopf watches no CRDs and lists no namespaces, so nothing cluster-scoped is
    needed), and the admission bindings (but the job-secrets policy's and the operator-pods policy's, which judge
    every namespace: issue 51 H2), the PodMonitor and the operator's own policy look there only."""
    docs = render_chart("default")
    assert not {"ClusterRole", "ClusterRoleBinding"} & set(_kinds(docs))
    assert [(d["kind"], d["metadata"]["namespace"]) for d in docs if d["kind"] in ("Role", "RoleBinding")] == [
        ("Role", "default"), ("RoleBinding", "default")]
    env = _env(docs)
    assert env["HYBRIDFLOW_WATCH_NAMESPACES"] == "default" and "HYBRIDFLOW_NAMESPACE_LABEL" not in env
    for suffix in ("-job-policy", "-job-children"):
        assert _named(docs, "ValidatingAdmissionPolicyBinding", suffix)["spec"]["matchResources"] == {
            "namespaceSelector": SERVED_DEFAULT}, suffix
    for suffix in ("-job-secrets", "-operator-pods"):
        assert "matchResources" not in _named(docs, "ValidatingAdmissionPolicyBinding", suffix)["spec"], suffix
    assert _named(docs, "PodMonitor", "")["spec"]["namespaceSelector"] == {"matchNames": ["default"]}
    heads = _named(docs, "NetworkPolicy", "-operator")["spec"]["egress"][2]["to"]
    assert [p["namespaceSelector"] for p in heads] == [SERVED_DEFAULT]


def test_a_cluster_wide_install_acts_only_in_labelled_namespaces():
    """clusterWide is explicit, and limited to namespaces labelled hybridflow.io/jobs=enabled: the operator is told
    the label (and may `get` namespaces, nothing more), the job policy binds there, the operator's head-pod egress
    goes there; the job-children guard binds everywhere, since the PodMonitor (which cannot select namespaces by
    label) then looks everywhere."""
    from hybridflow_operator.policy import NAMESPACE_LABEL, Policy

    docs = render_chart("cluster-wide")
    assert "Role" not in _kinds(docs) and "RoleBinding" not in _kinds(docs)
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert [r for r in role["rules"] if "namespaces" in r["resources"]] == [
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]}]
    env = _env(docs)
    assert env["HYBRIDFLOW_WATCH_NAMESPACES"] == "" and env["HYBRIDFLOW_NAMESPACE_LABEL"] == NAMESPACE_LABEL
    policy = Policy.from_env({k: v for k, v in env.items() if v is not None})
    assert policy.acts_in({"hybridflow.io/jobs": "enabled"}) and not policy.acts_in({}) and not policy.acts_in(None)
    assert _named(docs, "ValidatingAdmissionPolicyBinding", "-job-policy")["spec"]["matchResources"] == {
        "namespaceSelector": LABELLED}
    assert "matchResources" not in _named(docs, "ValidatingAdmissionPolicyBinding", "-job-children")["spec"]
    assert _named(docs, "PodMonitor", "")["spec"]["namespaceSelector"] == {"any": True}
    heads = _named(docs, "NetworkPolicy", "-operator")["spec"]["egress"][2]["to"]
    assert [p["namespaceSelector"] for p in heads] == [LABELLED]
    assert [(q["metadata"]["namespace"], q["spec"]["hard"]["count/rlhfjobs.hybridflow.io"])
            for q in docs if q["kind"] == "ResourceQuota"] == [("team-a", "4")]


def test_an_install_must_name_its_namespaces_or_choose_cluster_wide():
    for empty in (["--set-json", "watchNamespaces=[]"], ["--set", "watchNamespaces={}"]):  # the second is [""]
        err = helm_refuses(*empty)
        assert "watchNamespaces is empty" in err and "clusterWide=true" in err, (empty, err)
    assert "names an empty namespace" in helm_refuses("--set", "watchNamespaces={team-a,}")
    assert "ClusterRole" in _kinds([d for d in yaml.safe_load_all(helm(
        "template", "rel", str(CHART), "--set-json", "watchNamespaces=[]", "--set", "clusterWide=true")) if d])
    err = helm_refuses("--set", "clusterWide=true", "--set", "resourceQuota.enabled=true")
    assert "resourceQuota.namespaces" in err, err


@pytest.mark.parametrize("where, values", [
    ("networkPolicy.egressExtra[0].to[0]", {"networkPolicy": {"egressExtra": [
        {"to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}], "ports": [{"port": 80}]}]}}),
    ("networkPolicy.objectStore.to[1]", {"networkPolicy": {"objectStore": {
        "to": [{"podSelector": {}}, {"ipBlock": {"cidr": "169.254.169.254/32"}}]}}}),
    ("networkPolicy.dns.to[0]", {"networkPolicy": {"dns": {"to": [{"ipBlock": {"cidr": "169.254.20.10/32"}}]}}}),
    ("networkPolicy.operator.apiServer.to[0]", {"networkPolicy": {"operator": {"apiServer": {
        "to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}]}}}}),
    ("networkPolicy.operator.livenessFrom[0]", {"networkPolicy": {"operator": {"livenessFrom": [
        {"ipBlock": {"cidr": "fe80::1/128"}}]}}}),
])
def test_a_values_file_naming_the_metadata_service_is_refused(tmp_path, where, values):
    """Issue 24 N4: no egress rule (jobs' or operator's) may reach 169.254.0.0/16 or fe80::/10; helm fails naming
    the value. The operator refuses the same rules from its environment (policy.Egress.from_env)."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    err = helm_refuses("-f", str(path))
    assert f"{where}.ipBlock.cidr" in err and "link-local" in err, err


# The metadata addresses an ipBlock around them gets as `except`, per family, in order (policy.METADATA_RANGES).
V4_METADATA = ["169.254.0.0/16", "100.100.100.200/32"]
V6_METADATA = ["fe80::/10", "fd00:ec2::254/128", "fd00:ec2::23/128"]


def test_an_ipblock_around_the_metadata_service_gets_it_as_except():
    """0.0.0.0/0 (or ::/0, or any block containing a metadata range: link-local, AWS's IPv6 fd00:ec2::254 and
    fd00:ec2::23, Alibaba's 100.100.100.200) is allowed less those, in the operator's policy as rendered and in the
    jobs' policies as the operator builds them from the same values."""
    from hybridflow_operator.policy import Policy

    peers = [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}},
             {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}},
             {"ipBlock": {"cidr": "169.0.0.0/8", "except": ["169.254.0.0/15"]}},  # already held by a wider except
             {"ipBlock": {"cidr": "10.0.0.0/8"}}, {"namespaceSelector": {}}]
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "--set-json",
                                               f"networkPolicy.operator.livenessFrom={json.dumps(peers)}",
                                               "--set-json", f"networkPolicy.egressExtra=[{json.dumps({'to': peers})}]"))
            if d]
    expected = [{"ipBlock": {"cidr": "0.0.0.0/0", "except": V4_METADATA}},
                {"ipBlock": {"cidr": "::/0", "except": V6_METADATA}},
                {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8", *V4_METADATA]}},
                {"ipBlock": {"cidr": "169.0.0.0/8", "except": ["169.254.0.0/15"]}},
                {"ipBlock": {"cidr": "10.0.0.0/8"}}, {"namespaceSelector": {}}]
    op = _named(docs, "NetworkPolicy", "-operator")["spec"]
    assert op["ingress"][1] == {"from": expected, "ports": [{"protocol": "TCP", "port": 8081}]}
    assert op["egress"][0]["to"] == [{"ipBlock": {"cidr": "0.0.0.0/0", "except": V4_METADATA}}]  # apiServer
    egress = Policy.from_env({k: v for k, v in _env(docs).items() if v is not None}).egress
    assert egress.rules(object_storage=False)[-1] == {"to": expected}


# (CIDR, what its family's link-local range is to it), as policy.relation and the chart's hybridflow.relation say
LINK_LOCAL_TABLE = [
    ("169.254.169.254/32", "inside"), ("169.254.0.0/16", "inside"), ("169.254.20.10", "inside"),
    ("169.254.128.0/17", "inside"), ("169.254.0.0/15", "contains"), ("169.252.0.0/14", "contains"),
    ("169.0.0.0/8", "contains"), ("169.254.1.1/8", "contains"), ("128.0.0.0/1", "contains"),
    ("0.0.0.0/0", "contains"), ("169.255.0.0/16", "apart"), ("169.253.0.0/16", "apart"), ("10.0.0.0/8", "apart"),
    ("0.0.0.0/1", "apart"), ("192.168.1.0/24", "apart"), ("fe80::/10", "inside"), ("fe80::1/128", "inside"),
    ("FEBF:ffff::/32", "inside"), ("fe80::", "inside"), ("fe00::/8", "contains"), ("fe80::/9", "contains"),
    ("::/0", "contains"), ("8000::/1", "contains"), ("fec0::/10", "apart"), ("2001:db8::/32", "apart"),
    ("::1/128", "apart"), ("::ffff:169.254.1.1/128", "apart"), ("fc00::/7", "apart"),
]
# (CIDR, metadata address, what the address is to it): issue 51 L1, the metadata addresses outside link-local
METADATA_TABLE = [
    ("100.100.100.200/32", "100.100.100.200/32", "inside"), ("100.100.100.200", "100.100.100.200/32", "inside"),
    ("100.64.0.0/10", "100.100.100.200/32", "contains"), ("100.100.100.0/24", "100.100.100.200/32", "contains"),
    ("100.100.100.201/32", "100.100.100.200/32", "apart"), ("100.100.100.128/26", "100.100.100.200/32", "apart"),
    ("fd00:ec2::254/128", "fd00:ec2::254/128", "inside"), ("FD00:EC2:0:0:0:0:0:254", "fd00:ec2::254/128", "inside"),
    ("fd00::/8", "fd00:ec2::254/128", "contains"), ("fc00::/7", "fd00:ec2::254/128", "contains"),
    ("fd00:ec2::/64", "fd00:ec2::23/128", "contains"), ("fd00:ec2::200/120", "fd00:ec2::254/128", "contains"),
    ("fd00:ec2::200/120", "fd00:ec2::23/128", "apart"), ("fd00:ec2::23", "fd00:ec2::23/128", "inside"),
    ("fd00:ec2:0::0:23/127", "fd00:ec2::23/128", "contains"), ("fd00:ec3::/32", "fd00:ec2::254/128", "apart"),
    ("::ffff:100.100.100.200/128", "100.100.100.200/32", "apart"), ("100.100.100.200/32", "fd00:ec2::23/128", "apart"),
    ("1:2:3:4:5:6:7::/112", "fd00:ec2::254/128", "apart"),
]


def test_the_charts_address_check_agrees_with_the_operators(tmp_path):
    """Helm has no address arithmetic: hybridflow.relation compares the CIDRs' bits itself (IPv6 expanded by
    hybridflow.cidrBits). It must say what policy.relation (Python's ipaddress) says, for both families and every
    metadata address, or the chart and the operator would disagree on what a value allows."""
    from hybridflow_operator.policy import METADATA_RANGES, PolicyError, relation

    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)  # the CRD is a symlink into the repository: copied as a file
    (chart / "templates" / "zz-relation.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: relation}\ndata:\n"
        "{{- range $i, $p := .Values.pairs }}\n  c{{ $i }}: {{ include \"hybridflow.relation\" $p | quote }}\n"
        "{{- end }}\n")
    pairs = [(c, "fe80::/10" if ":" in c else "169.254.0.0/16", v) for c, v in LINK_LOCAL_TABLE] + METADATA_TABLE
    pairs += [(c, str(r), None) for c, _ in LINK_LOCAL_TABLE for r in METADATA_RANGES]  # every address, every CIDR
    out = yaml.safe_load(helm("template", "rel", str(chart), "--show-only", "templates/zz-relation.yaml",
                              "--set-json", f"pairs={json.dumps([[c, r] for c, r, _ in pairs])}"))["data"]
    for i, (cidr, other, verdict) in enumerate(pairs):
        if verdict is not None:
            assert relation(cidr, other) == verdict, (cidr, other)
        assert out[f"c{i}"] == relation(cidr, other), (cidr, other)
    with pytest.raises(PolicyError, match="not a CIDR"):
        relation("metadata.google.internal", "169.254.0.0/16")
    assert "is not a CIDR" in helm_refuses("--set-json", 'networkPolicy.egressExtra=[{"to": [{"ipBlock": '
                                                         '{"cidr": "metadata.google.internal"}}]}]')
    for bad in ("fd00::ec2::1/128", "1:2:3:4:5:6:7:8:9/128", "300.1.1.1/32", "10.0.0.0/33"):
        assert "is not a CIDR" in helm_refuses("--set-json", 'networkPolicy.egressExtra=[{"to": [{"ipBlock": '
                                                             f'{{"cidr": "{bad}"}}}}]}}]'), bad


@pytest.mark.parametrize("cidr, inside", [("100.100.100.200/32", "100.100.100.200/32"),
                                          ("fd00:ec2::254/128", "fd00:ec2::254/128"),
                                          ("fd00:ec2::23", "fd00:ec2::23/128")])
def test_a_values_file_naming_a_metadata_address_outside_link_local_is_refused(tmp_path, cidr, inside):
    """Issue 51 L1: Alibaba Cloud's metadata service and AWS's IPv6 metadata service and Pod Identity agent are
    refused like link-local, by helm and by the operator."""
    from hybridflow_operator.policy import Egress, PolicyError

    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"networkPolicy": {"egressExtra": [{"to": [{"ipBlock": {"cidr": cidr}}]}]}}))
    err = helm_refuses("-f", str(path))
    assert f"networkPolicy.egressExtra[0].to[0].ipBlock.cidr {cidr} is inside {inside} (a cloud metadata " in err, err
    with pytest.raises(PolicyError, match=re.escape(f"ipBlock.cidr {cidr} is inside {inside} (a cloud metadata")):
        Egress(extra=({"to": [{"ipBlock": {"cidr": cidr}}]},)).rules(object_storage=False)


def test_the_pod_monitor_selects_only_pods_labelled_as_a_jobs():
    """Issue 24 N10: role and managed-by are labels anyone may put on a pod; hybridflow.io/job only the operator
    may (the job-children policy), so only a job's head is scraped as one."""
    for combo in ("default", "cluster-wide"):
        sel = _named(render_chart(combo), "PodMonitor", "")["spec"]["selector"]
        assert sel["matchExpressions"] == [{"key": "hybridflow.io/job", "operator": "Exists"}], combo
        assert sel["matchLabels"]["hybridflow.io/role"] == "head"


def test_the_operators_network_policy_admits_the_scrapers_and_reaches_the_api_dns_and_job_heads_only():
    """Issue 24 N11: the operator's metrics name every tenant's namespaces, jobs and phases: only
    metricsFromNamespaces may reach that port (and nothing else of the pod); its egress is the API server, DNS and
    the jobs' head pods on their port named metrics, which each job's head declares whatever spec.metrics.port is."""
    from hybridflow.api import parse_job
    from hybridflow_operator import manifests as mf

    docs = render_chart("default")
    np = _named(docs, "NetworkPolicy", "-operator")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert np["metadata"]["namespace"] == "hybridflow"
    assert np["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    (metrics_port,) = [p["containerPort"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]
                       if p["name"] == "metrics"]
    assert np["spec"]["ingress"] == [{"from": [{"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}]}}],
        "ports": [{"protocol": "TCP", "port": metrics_port}]}]
    api, dns, heads = np["spec"]["egress"]
    assert api == {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": V4_METADATA}}],
                   "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert dns == values["networkPolicy"]["dns"]
    assert heads == {"to": [{"namespaceSelector": SERVED_DEFAULT, "podSelector": {
        "matchLabels": {"hybridflow.io/role": "head"},
        "matchExpressions": [{"key": "hybridflow.io/job", "operator": "Exists"}]}}],
        "ports": [{"protocol": "TCP", "port": "metrics"}]}
    doc = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    doc["spec"]["metrics"] = {"port": 9123}
    doc["metadata"] = {"name": "tiny-grpo", "namespace": "default", "uid": "u"}
    head = next(p for p in mf.gang_pods(parse_job(doc), doc["metadata"]["uid"], 0) if p["metadata"]["labels"][mf.LABEL_ROLE] == "head")
    assert {"name": "metrics", "containerPort": 9123} in head["spec"]["containers"][0]["ports"]
    assert _named(render_chart("egress-quota"), "NetworkPolicy", "-operator")["spec"]["ingress"] == [
        {"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"protocol": "TCP", "port": 8081}]}]  # no scrapers
    bare = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "--set-json",
                                               "networkPolicy.metricsFromNamespaces=[]")) if d]
    assert _named(bare, "NetworkPolicy", "-operator")["spec"]["ingress"] == []  # admits nothing
    off = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "--set",
                                              "networkPolicy.operator.enabled=false")) if d]
    assert "NetworkPolicy" not in _kinds(off)


@pytest.mark.parametrize("combo", ["default", "no-volcano-custom-sa"])
def test_the_operators_requests_have_a_flow_schema_and_priority_level_of_their_own(combo):
    """Issue 24 N8: API Priority and Fairness for the operator's ServiceAccount (whatever its name), its flows told
    apart by namespace; on by default, off with flowSchema.enabled=false."""
    docs = render_chart(combo)
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]
    (flow,) = [d for d in docs if d["kind"] == "FlowSchema"]
    (level,) = [d for d in docs if d["kind"] == "PriorityLevelConfiguration"]
    for doc in (flow, level):
        assert doc["apiVersion"] == "flowcontrol.apiserver.k8s.io/v1"
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    assert flow["spec"]["priorityLevelConfiguration"]["name"] == level["metadata"]["name"]
    assert flow["spec"]["distinguisherMethod"] == {"type": "ByNamespace"}
    assert 800 < flow["spec"]["matchingPrecedence"] < 9000  # after the system schemas, before service-accounts
    (rule,) = flow["spec"]["rules"]
    assert rule["subjects"] == [{"kind": "ServiceAccount", "serviceAccount": {"name": sa["name"],
                                                                              "namespace": "hybridflow"}}]
    assert rule["resourceRules"] == [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"], "clusterScope": True,
                                      "namespaces": ["*"]}]
    assert level["spec"]["type"] == "Limited" and level["spec"]["limited"]["limitResponse"]["type"] == "Queue"
    off = yaml.safe_load_all(helm("template", "rel", str(CHART), "--namespace", "hybridflow", *COMBOS[combo],
                                  "--set", "flowSchema.enabled=false"))
    assert not [d for d in off if d and d["kind"] in ("FlowSchema", "PriorityLevelConfiguration")]
