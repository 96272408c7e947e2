"""The kubelet double runs pods as a cluster would (e2e/README.md "Test doubles"): the job pods' security context
(the restricted Pod Security Standard the operator asks for) becomes uid 1000 with no capability, no_new_privs and
seccomp RuntimeDefault, under which a process cannot make a user namespace (so bubblewrap cannot sandbox there);
each container is PID 1 of its own PID namespace; fsGroup owns the volumes; a NetworkPolicy with no egress rule
leaves a pod no outgoing connection. Each check here runs the double's own pieces (e2e/container_exec.py,
e2e/seccomp_profile.py, e2e/pod_security.py, e2e/netns.py) on this machine, in a few seconds."""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hybridflow_operator import manifests as mf

from support.paths import ROOT

sys.path.insert(0, str(ROOT))  # the e2e harness's modules

from e2e import image, pod_security  # noqa: E402
from e2e.netns import egress_denied  # noqa: E402
from e2e.seccomp_profile import PROFILE, applies, rules  # noqa: E402

WORKER = "hybridflow/worker-cpu:0.1.0"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="taking another uid's identity needs root")


def _job_pod(**container) -> dict:
    """A pod with the security contexts the operator gives every job pod (manifests.POD_SECURITY and
    CONTAINER_SECURITY), its working directory and the worker image."""
    c = {"name": "c", "image": WORKER, "securityContext": dict(mf.CONTAINER_SECURITY), "workingDir": mf.SCRATCH_MOUNT,
         **container}
    return {"spec": {"securityContext": dict(mf.POD_SECURITY), "containers": [c]}}


def _as(ident: pod_security.Identity, argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`argv` under `ident`, as the double starts a container: a mount namespace where the image's files are
    reachable by any uid (e2e/image.py), then the launcher."""
    script = ["set -e", *image.reachable(tmp_path / "image"), 'exec "$@"']
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script), "sh",
                           *pod_security.launcher(ident), *argv], capture_output=True, text=True, timeout=60, cwd="/")


def test_the_job_pods_security_context_is_the_images_user_without_capabilities():
    pod = _job_pod()
    ident = pod_security.identity(pod, pod["spec"]["containers"][0])
    assert (ident.uid, ident.gid, ident.groups) == (1000, 1000, (mf.FS_GROUP,))  # images/worker-cpu: USER 1000
    assert ident.caps == frozenset() and ident.no_new_privs and ident.seccomp == PROFILE
    assert (ident.home, ident.make_home) == ("/home/ray", True)
    # a container's own settings win over the pod's; without drop, the runtime's default capabilities
    other = pod_security.identity(pod, {"image": WORKER, "securityContext": {
        "runAsUser": 2000, "runAsGroup": 3000, "capabilities": {"drop": ["NET_RAW"], "add": ["SYS_NICE"]}}})
    assert (other.uid, other.gid, other.no_new_privs) == (2000, 3000, False)
    assert other.caps == pod_security.DEFAULT_CAPS - {"CAP_NET_RAW"} | {"CAP_SYS_NICE"}
    # runAsNonRoot where the image runs as root (one this repository does not build): refused, as the kubelet does
    with pytest.raises(pod_security.ContainerConfigError, match="runAsNonRoot"):
        pod_security.identity(pod, {"image": "busybox:1.36", "securityContext": dict(mf.CONTAINER_SECURITY)})


@root_only
def test_under_runtime_default_the_jobs_user_cannot_make_a_user_namespace_but_python_runs(tmp_path):
    pod = _job_pod()
    ident = pod_security.identity(pod, pod["spec"]["containers"][0])
    probe = ["sh", "-c", "grep -E '^(Uid|Groups|CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; "
                         "echo Pid: $$; unshare -U true && echo userns=made || echo userns=refused"]
    unconfined = _as(dataclasses.replace(ident, seccomp=None), probe, tmp_path)
    if "userns=refused" in unconfined.stdout:  # the machine's own policy: then the profile's part cannot be seen
        pytest.skip(f"this machine refuses user namespaces to non-root users itself: {unconfined.stderr}")
    assert "userns=made" in unconfined.stdout, unconfined  # without the profile the same user makes one
    confined = _as(ident, probe, tmp_path)
    status = dict(line.split(":", 1) for line in confined.stdout.splitlines() if ":" in line)
    assert status["Uid"].split() == ["1000"] * 4 and status["Groups"].split() == [str(mf.FS_GROUP)], confined
    assert int(status["CapEff"], 16) == int(status["CapBnd"], 16) == 0, status
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2", status
    assert status["Pid"].strip() == "1", status  # PID 1 of its own PID namespace: no other pod's processes seen
    assert "userns=refused" in confined.stdout and "Operation not permitted" in confined.stderr, confined
    # this virtualenv's Python (packages, threads, a child process) still runs
    python = _as(ident, [sys.executable, "-c", "import json, subprocess, threading; "
                         "print(json.dumps(subprocess.run(['true']).returncode))"], tmp_path)
    assert python.returncode == 0 and python.stdout.strip() == "0", python


def test_profile_entries_follow_the_containers_capabilities_architecture_and_kernel():
    admin_only = {"names": ["unshare"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}}
    without_admin = {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "excludes": {"caps": ["CAP_SYS_ADMIN"]}}
    for caps, included in ((set(), False), ({"CAP_SYS_ADMIN"}, True)):
        assert applies(admin_only, caps, "amd64", (6, 1)) is included
        assert applies(without_admin, caps, "amd64", (6, 1)) is not included
    assert applies({"includes": {"arches": ["amd64", "x32"]}}, set(), "amd64", (6, 1))
    assert not applies({"includes": {"arches": ["amd64", "x32"]}}, set(), "arm64", (6, 1))
    assert not applies({"includes": {"minKernel": "4.8"}}, set(), "amd64", (4, 7))
    # the vendored profile, as the job's containers (drop ALL) and as one with CAP_SYS_ADMIN get it
    profile = json.loads(PROFILE.read_text())
    dropped, admin = rules(profile, set(), "amd64", (6, 1)), rules(profile, {"CAP_SYS_ADMIN"}, "amd64", (6, 1))
    allowed = {name for act, _, name, conds in dropped if act == "SCMP_ACT_ALLOW" and not conds}
    assert {"read", "execve", "setuid", "capset"} <= allowed and not {"unshare", "setns", "mount"} & allowed
    clone = [conds for act, _, name, conds in dropped if name == "clone"]
    assert clone == [((0, "SCMP_CMP_MASKED_EQ", 0x7E020000, 0),)]  # only without any CLONE_NEW* flag
    assert ("SCMP_ACT_ERRNO", 38, "clone3", ()) in dropped  # ENOSYS: glibc falls back to clone
    assert {"unshare", "clone"} <= {name for act, _, name, conds in admin if act == "SCMP_ACT_ALLOW" and not conds}
    assert not [r for r in admin if r[2] == "clone3" and r[0] == "SCMP_ACT_ERRNO"]


@root_only
def test_fs_group_owns_a_volume_as_the_kubelet_leaves_it(tmp_path):
    volume = tmp_path / "claim"
    (volume / "ns" / "job").mkdir(parents=True)
    (volume / "ns" / "job" / "steps.jsonl").write_text("{}\n")
    (volume / "ns" / "job" / "steps.jsonl").chmod(0o600)
    pod_security.set_volume_ownership(volume, 4242, "OnRootMismatch")
    job = volume / "ns" / "job"
    for path, bits in ((volume, 0o2770), (job, 0o2770), (job / "steps.jsonl", 0o660)):
        st = path.stat()
        assert st.st_gid == 4242 and stat.S_IMODE(st.st_mode) & bits == bits, (path, oct(st.st_mode))
    (volume / "ns" / "job" / "steps.jsonl").chmod(0o600)
    pod_security.set_volume_ownership(volume, 4242, "OnRootMismatch")  # the root matches: nothing walked
    assert stat.S_IMODE((volume / "ns" / "job" / "steps.jsonl").stat().st_mode) == 0o600
    pod_security.set_volume_ownership(volume, 4242)  # Always (the default): every file again
    assert stat.S_IMODE((volume / "ns" / "job" / "steps.jsonl").stat().st_mode) == 0o660


def test_only_a_policy_without_egress_rules_denies_a_pods_egress():
    # the shape of operator/hybridflow_operator/environments.environment_policy: Egress with no rule at all
    deny = {"metadata": {"name": "j-env", "namespace": "default"},
            "spec": {"podSelector": {"matchLabels": {"hybridflow.io/job": "j", "hybridflow.io/role": "environment"}},
                     "policyTypes": ["Ingress", "Egress"], "ingress": [{"from": []}], "egress": []}}
    env_pod, head = {"hybridflow.io/job": "j", "hybridflow.io/role": "environment"}, {"hybridflow.io/job": "j"}
    assert egress_denied([deny], "default", env_pod)
    assert not egress_denied([deny], "default", head) and not egress_denied([deny], "other", env_pod)
    allow = {"metadata": {"name": "j", "namespace": "default"},  # policyTypes left out: Egress, since it has rules
             "spec": {"podSelector": {"matchExpressions": [{"key": "hybridflow.io/job", "operator": "Exists"}]},
                      "egress": [{"to": [{"podSelector": {}}]}]}}
    assert not egress_denied([deny, allow], "default", env_pod)  # policies add up: something is allowed


NETWORK_CHECK = """
import os, socket, subprocess, sys
sys.path.insert(0, sys.argv[1])
from e2e.netns import GATEWAY, PodNetwork

os.makedirs("/run/netns", exist_ok=True)
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/run/netns"], check=True)
net = PodNetwork()
pod = net.add("pod")
here = socket.create_server((GATEWAY, 0))
served = subprocess.Popen(["ip", "netns", "exec", "pod", sys.executable, "-c",
    "import socket; s = socket.create_server(('0.0.0.0', 8100)); print('up', flush=True); "
    "c, _ = s.accept(); c.sendall(b'reply'); c.close()"], stdout=subprocess.PIPE, text=True)
assert served.stdout.readline().strip() == "up"
dial = ("import socket, sys\\ntry:\\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), 1).close(); "
        "print('connected')\\nexcept OSError as e:\\n    print('refused', e)")

def outgoing():
    return subprocess.run(["ip", "netns", "exec", "pod", sys.executable, "-c", dial, GATEWAY,
                           str(here.getsockname()[1])], capture_output=True, text=True).stdout.strip()

net.set_egress("pod", True)
print("denied:", outgoing())
print("incoming:", socket.create_connection((pod, 8100), 2).recv(16).decode())
net.set_egress("pod", True)
net.set_egress("pod", False)
print("lifted:", outgoing())
"""


def test_a_pod_denied_egress_connects_nowhere_but_answers_connections(tmp_path):
    out = subprocess.run(["unshare", "--map-root-user", "--net", "--mount", "--propagation", "private",
                          sys.executable, "-c", NETWORK_CHECK, str(ROOT)], capture_output=True, text=True, timeout=60)
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    assert out.returncode == 0, out
    assert lines["denied"].startswith("refused"), out  # the dial timed out: its SYN dropped
    assert lines["incoming"] == "reply", out  # a reply to a connection made to the pod flows
    assert lines["lifted"] == "connected", out


def test_a_containers_termination_message_is_its_termination_log_else_a_failed_ones_log_tail(tmp_path):
    """As the kubelet makes it (a plan pod's plan comes back so, issue 52): what the container wrote to its
    termination log, at most 4096 bytes, whatever its policy; when it wrote nothing, FallbackToLogsOnError gives a
    failed container's log tail."""
    from e2e.kubelet import _termination_message

    c = {"name": "plan", "terminationMessagePolicy": "FallbackToLogsOnError"}
    (tmp_path / "plan.log").write_text("loading\nerror: no placement fits\n")
    (tmp_path / "plan.termination-log").write_text("")
    assert _termination_message(c, 2, tmp_path) == "loading\nerror: no placement fits"
    assert _termination_message(c, 0, tmp_path) == ""
    (tmp_path / "plan.termination-log").write_text('{"summary": {}}' + "x" * 5000)
    for container in (c, {"name": "plan"}):
        assert _termination_message(container, 0, tmp_path) == ('{"summary": {}}' + "x" * 5000)[:4096]
