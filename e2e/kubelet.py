"""A kubelet *test double*: it watches pods on the (emulated) API server and runs each one's containers as real
processes — init containers first, each pod in its own network namespace (e2e/netns.py), mount namespace (its own
/tmp, /dev/shm and volumes) and hostname, each container in its own PID namespace — then writes phase, pod IP and
container exit codes back through the status subresource, as a kubelet does. A pod that disappears from the API has
its processes killed (a preStop hook runs first, inside its container: e2e/container_exec.py --join).

Volume mounts honour `subPath` (the directory inside the volume, made when missing as the kubelet makes it) and
`readOnly`. Each container gets its termination log (terminationMessagePath), whose content is its termination
message (else, under FallbackToLogsOnError, a failed container's log tail). Security contexts are applied as a CRI
runtime applies them (e2e/pod_security.py: the image's USER or runAsUser, groups with fsGroup, capabilities,
no_new_privs, seccomp RuntimeDefault; fsGroup's ownership of emptyDir and PVC volumes), and a NetworkPolicy that
denies a pod all egress is enforced in its network namespace (e2e/netns.py).

It also plays the two cluster add-ons a pod relies on: a volume provisioner (a PersistentVolumeClaim is a directory
under the harness's work dir that outlives pods) and the data behind cluster DNS (`names`: pods, and headless
Services' `<service>.<namespace>.svc[.cluster.local]` names -> pod addresses), served by e2e/dns.py and also
written to a hosts file bind-mounted over /etc/hosts.

Not emulated: resource limits, probes, image pulls (every "image" is this machine's Python environment, run as the
user its Dockerfile names: e2e/image.py).
"""
from __future__ import annotations

import base64
import datetime
import json
import logging
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e import image, pod_security
from e2e.netns import GATEWAY, PodNetwork, egress_denied

log = logging.getLogger("kubelet-double")
TERMINATION_LOG = "/dev/termination-log"  # a container's default terminationMessagePath

ENV_DROP = ("KUBECONFIG", "PYTEST", "RAY_", "HYBRIDFLOW_")  # the harness's own settings never leak into pods
# Pods get a private /tmp, as containers do; the parts of "the image" (this machine's Python environment and this
# checkout, which the editable install points into) that happen to live under /tmp must stay visible in them.
IMAGE_PATHS_UNDER_TMP = sorted({p for p in (Path(__file__).resolve().parents[1], Path(sys.prefix).resolve())
                                if Path("/tmp") in p.parents})


def _now() -> str:
    return datetime.datetime.now(tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def exit_code(returncode: int) -> int:
    """Popen's -N (killed by signal N) as a container runtime reports it: 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def cluster_names(pods: dict[tuple[str, str], tuple[str, dict]], services: list[dict],
                  hostnames: dict[tuple[str, str], tuple[str, str]] | None = None) -> dict[str, str]:
    """DNS names -> addresses, as kube-dns would answer: pods by name, headless Services by their FQDNs, and a pod
    with spec.hostname and spec.subdomain as `<hostname>.<subdomain>.<namespace>.svc` when a headless Service of
    that name selects it."""
    names = {}
    for (ns, name), (ip, _) in sorted(pods.items()):
        names[name] = ip
        names[f"{ip.replace('.', '-')}.{ns}.pod.cluster.local"] = ip
    for (ns, name), (host, sub) in sorted((hostnames or {}).items()):
        ip, labels = pods.get((ns, name), ("", {}))
        if ip and any(svc["metadata"]["name"] == sub and svc["metadata"].get("namespace", "default") == ns
                      and (svc.get("spec") or {}).get("clusterIP") == "None"
                      and labels_match((svc.get("spec") or {}).get("selector") or {"-": "-"}, labels)
                      for svc in services):
            for fqdn in (f"{host}.{sub}.{ns}.svc.cluster.local", f"{host}.{sub}.{ns}.svc"):
                names[fqdn] = ip
    for svc in services:
        meta, spec = svc["metadata"], svc.get("spec") or {}
        sel = spec.get("selector") or {}
        ns = meta.get("namespace", "default")
        ips = sorted(ip for (pns, _), (ip, labels) in pods.items() if pns == ns and sel and labels_match(sel, labels))
        if ips:
            n = meta["name"]
            for fqdn in (f"{n}.{ns}.svc.cluster.local", f"{n}.{ns}.svc", f"{n}.{ns}"):
                names[fqdn] = ips[0]
    return names


def hosts_file(names: dict[str, str]) -> str:
    lines = ["127.0.0.1 localhost", "::1 localhost"] + [f"{ip} {name}" for name, ip in names.items()]
    return "\n".join(lines) + "\n"


@dataclass
class RunningPod:
    namespace: str
    name: str
    uid: str
    netns: str
    ip: str = ""
    labels: dict = field(default_factory=dict)
    hostname: tuple[str, str] = ("", "")  # spec.hostname, spec.subdomain
    procs: list = field(default_factory=list)
    main_started: bool = False
    deleted: bool = False
    thread: threading.Thread | None = None
    pod: dict = field(default_factory=dict)  # its spec, as admitted
    mounts: tuple = ()  # (volumes, poddir) once its volumes are made: what a preStop hook runs with
    main_procs: list = field(default_factory=list)  # its containers' processes (not its init containers' or hooks')
    containers: dict = field(default_factory=dict)  # container name -> its process (the launcher, its PID 1's parent)
    egress_denied: bool = False  # a NetworkPolicy denies it all egress, and its network namespace says so


class KubeletDouble:
    def __init__(self, kube: Any, net: PodNetwork, workdir: Path, hosts_path: Path, poll: float = 0.3) -> None:
        self.kube, self.net, self.workdir, self.hosts_path, self.poll = kube, net, workdir, hosts_path, poll
        self.pods: dict[str, RunningPod] = {}  # by uid
        self.finished: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kubelet-double")
        self._lock = threading.Lock()
        self._made_dirs: list[Path] = []
        self._made_files: list[Path] = []  # files this double made to bind a container's termination log over
        self._hosts = ""
        self.names: dict[str, str] = {}  # what the cluster DNS double answers (e2e/dns.py reads it)
        self._policies: list[dict] = []  # NetworkPolicies, as of the last sync

    # --- lifecycle ---

    def start(self) -> "KubeletDouble":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for pod in list(self.pods.values()):
            self._stop_pod(pod)
        for f in self._made_files:
            f.unlink(missing_ok=True)
        for d in reversed(self._made_dirs):  # mount points this double had to create
            try:
                d.rmdir()
            except OSError:
                pass

    def kill_processes(self, namespace: str, name: str) -> int:
        """Fault injection: SIGKILL everything in a pod (as an OOM kill or a node loss would); returns the count."""
        pod = next(p for p in self.pods.values() if (p.namespace, p.name) == (namespace, name))
        pids = self.net.pids(pod.netns)
        self.net.kill(pod.netns, grace=0)
        return len(pids)

    def stop_processes(self, namespace: str, name: str) -> int:
        """Fault injection: SIGSTOP everything in a pod (a hung node: the pod stays Running and answers nothing)."""
        pod = next(p for p in self.pods.values() if (p.namespace, p.name) == (namespace, name))
        return self.net.stop(pod.netns)

    def running(self, name: str, namespace: str = "default") -> bool:
        """Whether the pod's main containers have started (init containers done) and have processes."""
        pod = next((p for p in list(self.pods.values()) if (p.namespace, p.name) == (namespace, name)), None)
        return bool(pod and pod.main_started and self.net.pids(pod.netns))

    def running_pids(self) -> list[int]:
        return [pid for p in list(self.pods.values()) for pid in self.net.pids(p.netns)]

    def logs(self, namespace: str, name: str) -> str:
        """Every container's whole log, as `kubectl logs --all-containers` gives it (a scenario that looks for a
        line must not miss it because Ray printed a dead raylet's log after it); failure messages take the tail."""
        out = []
        for f in sorted((self.workdir / "pods").glob(f"{namespace}.{name}.*/*.log")):
            out.append(f"--- {f.parent.name}/{f.name}\n{f.read_text(errors='replace')}")
        return "\n".join(out)

    # --- the sync loop ---

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception:  # the API server double restarting, a pod racing its deletion: try again
                log.exception("kubelet double sync failed")
            self._stop.wait(self.poll)

    def _list(self, kind: str) -> list[dict]:
        resp = getattr(self.kube.core, f"list_{kind}_for_all_namespaces")(_preload_content=False)
        return json.loads(resp.data)["items"]

    def sync(self) -> None:
        live = {}
        for pod in self._list("pod"):
            meta = pod["metadata"]
            uid = meta["uid"]
            live[uid] = pod
            phase = (pod.get("status") or {}).get("phase")
            if uid not in self.pods and uid not in self.finished and phase not in ("Succeeded", "Failed") \
                    and not meta.get("deletionTimestamp"):
                self._admit(pod)
            elif uid in self.pods and meta.get("deletionTimestamp"):
                self._stop_pod(self.pods[uid])
        for uid, pod in list(self.pods.items()):
            if uid not in live:
                self._stop_pod(pod)
        self._write_hosts()
        self._policies = self._list_policies()
        for rp in list(self.pods.values()):
            if rp.ip and not rp.deleted:
                self._enforce_egress(rp)

    def _list_policies(self) -> list[dict]:
        from kubernetes import client

        api = client.NetworkingV1Api(self.kube.core.api_client)
        return json.loads(api.list_network_policy_for_all_namespaces(_preload_content=False).data)["items"]

    def _enforce_egress(self, rp: RunningPod) -> None:
        """What the CNI's policy engine does as policies come and go: the pod's egress denied while a policy denies
        it all egress (e2e/netns.py), lifted when none does."""
        deny = egress_denied(self._policies, rp.namespace, rp.labels)
        if deny != rp.egress_denied:
            self.net.set_egress(rp.netns, deny)
            rp.egress_denied = deny
            log.info("pod %s/%s: egress %s", rp.namespace, rp.name, "denied" if deny else "allowed")

    def _write_hosts(self) -> None:
        pods = {(p.namespace, p.name): (p.ip, p.labels) for p in list(self.pods.values()) if p.ip and not p.deleted}
        hostnames = {(p.namespace, p.name): p.hostname for p in list(self.pods.values()) if all(p.hostname)}
        self.names = cluster_names(pods, self._list("service"), hostnames)
        text = hosts_file(self.names)
        if text != self._hosts:
            with open(self.hosts_path, "r+") as f:  # in place: the bind mount follows the inode
                f.seek(0)
                f.write(text)
                f.truncate()
            self._hosts = text

    def _admit(self, pod: dict) -> None:
        meta = pod["metadata"]
        ns, name = meta.get("namespace", "default"), meta["name"]
        spec = pod.get("spec") or {}
        rp = RunningPod(ns, name, meta["uid"], f"{ns}.{name}", labels=dict(meta.get("labels") or {}),
                        hostname=(spec.get("hostname") or "", spec.get("subdomain") or ""))
        with self._lock:
            self.pods[rp.uid] = rp
        rp.thread = threading.Thread(target=self._run_pod, args=(rp, pod), daemon=True, name=f"pod-{name}")
        rp.thread.start()

    def _stop_pod(self, rp: RunningPod) -> None:
        """The pod was deleted from the API: nothing more is reported for it. As the kubelet does, each running
        container's preStop hook (exec) runs first, within the pod's terminationGracePeriodSeconds (in a thread:
        the other pods are looked after meanwhile); then its processes are ended."""
        if rp.deleted:
            return  # being stopped already (its hook still running)
        rp.deleted = True
        hooks = [c for c in rp.pod.get("spec", {}).get("containers", [])
                 if ((c.get("lifecycle") or {}).get("preStop") or {}).get("exec")]
        if hooks and rp.mounts and any(proc.poll() is None for proc in rp.main_procs):  # (a dead one runs none)
            grace = float(rp.pod["spec"].get("terminationGracePeriodSeconds", 30))
            threading.Thread(target=self._pre_stop, args=(rp, hooks, grace), daemon=True,
                             name=f"prestop-{rp.name}").start()
        else:
            self._release(rp)

    def _pre_stop(self, rp: RunningPod, containers: list[dict], grace: float) -> None:
        deadline = time.monotonic() + grace
        try:
            volumes, poddir = rp.mounts
            for c in containers:
                target = rp.containers.get(c["name"])
                pid1 = _container_pid(target) if target is not None and target.poll() is None else None
                if pid1 is None:
                    continue  # a container that is not running runs no hook
                hook = {**c, "name": f"{c['name']}-prestop", "command": c["lifecycle"]["preStop"]["exec"]["command"],
                        "args": []}
                proc = self._spawn(rp, rp.pod, hook, volumes, poddir, join=pid1)
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.info("pod %s/%s: preStop of %s ran past the grace period", rp.namespace, rp.name, c["name"])
        except Exception:  # a hook that cannot start does not keep the pod alive
            log.exception("pod %s/%s: preStop hook failed", rp.namespace, rp.name)
        finally:
            self._release(rp)

    def _release(self, rp: RunningPod) -> None:
        """Kill what is left of the pod, drop its sandbox and forget it; a finished pod's object stays in the API."""
        self.net.remove(rp.netns)
        for p in rp.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        with self._lock:
            self.pods.pop(rp.uid, None)
            self.finished.add(rp.uid)

    # --- one pod ---

    def _status(self, rp: RunningPod, status: dict) -> None:
        if rp.deleted:
            return
        try:
            self.kube.core.patch_namespaced_pod_status(rp.name, rp.namespace, {"status": status})
        except Exception as err:  # deleted meanwhile
            log.info("status of %s/%s not written: %s", rp.namespace, rp.name, err)

    def _run_pod(self, rp: RunningPod, pod: dict) -> None:
        try:
            self._run_containers(rp, pod)
        finally:  # however the pod ended (a failed init container too), its sandbox goes
            if not rp.deleted:
                self._release(rp)

    def _run_containers(self, rp: RunningPod, pod: dict) -> None:
        try:
            rp.ip = self.net.add(rp.netns)
        except Exception as err:
            log.error("pod %s: no network: %s", rp.name, err)
            return
        base = {"podIP": rp.ip, "podIPs": [{"ip": rp.ip}], "hostIP": GATEWAY, "startTime": _now()}
        self._status(rp, {**base, "phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]})
        self._write_hosts()
        self._enforce_egress(rp)  # before anything of the pod runs (the sync loop follows later changes)
        spec = pod["spec"]
        try:
            for c in [*(spec.get("initContainers") or []), *spec["containers"]]:
                pod_security.identity(pod, c)
        except pod_security.ContainerConfigError as err:  # the kubelet leaves such a pod Pending, saying why
            self._status(rp, {**base, "phase": "Pending", "containerStatuses": [
                {"name": c["name"], "ready": False, "restartCount": 0, "image": c.get("image", ""), "imageID": "",
                 "state": {"waiting": {"reason": "CreateContainerConfigError", "message": str(err)}}}
                for c in spec["containers"]]})
            return
        poddir = self.workdir / "pods" / f"{rp.namespace}.{rp.name}.{rp.uid[:8]}"
        (poddir / "tmp").mkdir(parents=True, exist_ok=True)
        try:
            volumes = self._volumes(pod, poddir)
            for c in [*(spec.get("initContainers") or []), *spec["containers"]]:
                for m in c.get("volumeMounts") or []:
                    _sub_path(volumes[m["name"]], m)  # made now, before any container starts, as the kubelet does
        except Exception as err:
            self._status(rp, {**base, "phase": "Failed", "reason": "VolumeError", "message": str(err)})
            return
        rp.pod, rp.mounts = pod, (volumes, poddir)
        for c in spec.get("initContainers") or []:
            proc = self._spawn(rp, pod, c, volumes, poddir)
            rc = exit_code(proc.wait())
            if rp.deleted:
                return
            if rc:
                self._status(rp, {**base, "phase": "Failed", "initContainerStatuses": [
                    _terminated(c, rc)]})
                return
        procs = [(c, self._spawn(rp, pod, c, volumes, poddir)) for c in spec["containers"]]
        rp.main_procs = [p for _, p in procs]
        rp.containers = {c["name"]: p for c, p in procs}
        for _, p in procs:
            _wait_for_exec(p)
        rp.main_started = True
        self._status(rp, {**base, "phase": "Running",
                          "conditions": [{"type": "Ready", "status": "True"}],
                          "containerStatuses": [{"name": c["name"], "ready": True, "restartCount": 0,
                                                 "image": c.get("image", ""), "imageID": "",
                                                 "state": {"running": {"startedAt": _now()}}} for c, _ in procs]})
        codes = [(c, exit_code(p.wait())) for c, p in procs]
        if rp.deleted:
            return
        phase = "Succeeded" if all(rc == 0 for _, rc in codes) else "Failed"
        self._status(rp, {**base, "phase": phase, "containerStatuses": [
            _terminated(c, rc, _termination_message(c, rc, poddir)) for c, rc in codes]})

    def _volumes(self, pod: dict, poddir: Path) -> dict[str, tuple[str, Path]]:
        """Volume name -> (kind, host directory). As the kubelet sets them up: an emptyDir is a directory of mode
        0777; with the pod's fsGroup, emptyDir and PVC volumes get its ownership (pod_security.set_volume_ownership,
        as volume types with ownership management do), before any subPath in them is made. The pod's /tmp
        (poddir/tmp) is the emptyDir mounted there, else the image's /tmp (mode 1777)."""
        ns = pod["metadata"].get("namespace", "default")
        sc = pod["spec"].get("securityContext") or {}
        fs_group, policy = sc.get("fsGroup"), sc.get("fsGroupChangePolicy")
        at_tmp = {m["name"] for c in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]
                  for m in c.get("volumeMounts") or [] if Path(m["mountPath"]) == Path("/tmp")}
        (poddir / "tmp").chmod(0o1777)
        out = {}
        for v in pod["spec"].get("volumes") or []:
            d = poddir / "volumes" / v["name"]
            if "configMap" in v:
                cm = self.kube.core.read_namespaced_config_map(v["configMap"]["name"], ns)
                d.mkdir(parents=True, exist_ok=True)
                for key, text in (cm.data or {}).items():
                    (d / key).write_text(text)
                out[v["name"]] = ("configMap", d)
            elif "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                d = self.workdir / "volumes" / ns / claim
                d.mkdir(parents=True, exist_ok=True)
                if fs_group is not None:
                    pod_security.set_volume_ownership(d, int(fs_group), policy,
                                                      readonly=bool(v["persistentVolumeClaim"].get("readOnly")))
                out[v["name"]] = ("pvc", d)
            elif "emptyDir" in v:
                medium = (v["emptyDir"] or {}).get("medium", "")
                if medium != "Memory":  # (a tmpfs is mounted in the pod: _spawn)
                    d = poddir / "tmp" if v["name"] in at_tmp else d
                    d.mkdir(parents=True, exist_ok=True)
                    d.chmod(0o777)
                    if fs_group is not None:
                        pod_security.set_volume_ownership(d, int(fs_group), policy)
                out[v["name"]] = ("tmpfs" if medium == "Memory" else "emptyDir", d)
            else:
                raise ValueError(f"volume {v['name']}: only configMap, persistentVolumeClaim and emptyDir are emulated")
        return out

    def _env(self, rp: RunningPod, pod: dict, c: dict, home: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_DROP)}
        env.update(HOSTNAME=rp.name, POD_NAME=rp.name, HOME=home)  # HOME: the runtime's, from the image's user
        fields = {"status.podIP": rp.ip, "metadata.name": rp.name, "metadata.namespace": rp.namespace,
                  "status.hostIP": GATEWAY, "spec.nodeName": "e2e-node"}
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = str(e["value"])
            elif "fieldRef" in (e.get("valueFrom") or {}):
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in (e.get("valueFrom") or {}):
                ref = e["valueFrom"]["secretKeyRef"]
                secret = self.kube.core.read_namespaced_secret(ref["name"], rp.namespace)
                env[e["name"]] = base64.b64decode(secret.data[ref["key"]]).decode()
        return env

    def _mount_point(self, target: Path) -> None:
        missing = []
        p = target
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            d.mkdir()
            self._made_dirs.append(d)

    def _spawn(self, rp: RunningPod, pod: dict, c: dict, volumes: dict, poddir: Path,
               join: int | None = None) -> subprocess.Popen:
        """The container's process: `ip netns exec` into the pod's network namespace, a mount namespace of its own
        where a script (as root) mounts the image's files, volumes and /tmp, then execs e2e/container_exec.py, which
        takes on the container's identity and execs its command. With `join` (a running container's PID 1), an exec
        into that container (a preStop hook): its namespaces, mounts included, are the launcher's to join."""
        who = pod_security.identity(pod, c)
        argv = [*pod_security.launcher(who, join), *(c.get("command") or []), *(c.get("args") or [])]
        if join is not None:
            return self._start(rp, pod, c, ["set -e", 'exec "$@"'], argv, who, poddir)
        fs_group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
        script = ["set -e", f"hostname {shlex.quote(rp.name)}", *image.reachable(poddir / "image")]
        if who.make_home:  # the home the image's Dockerfile made for its user: empty, the user's
            home = poddir / "home"
            home.mkdir(exist_ok=True)
            os.chown(home, who.uid, who.gid)
            with self._lock:
                self._mount_point(Path(who.home))
            script.append(f"mount --bind {shlex.quote(str(home))} {shlex.quote(who.home)}")
        for m in c.get("volumeMounts") or []:
            kind, src = volumes[m["name"]]
            src = _sub_path((kind, src), m)
            target = Path(m["mountPath"])
            if target == Path("/tmp") and kind == "emptyDir":
                continue  # the pod's private /tmp, bound last below, is this emptyDir

            with self._lock:
                self._mount_point(target)
            t = shlex.quote(str(target))
            if kind == "tmpfs":  # its root as the kubelet leaves it: 1777, with fsGroup that group's (and setgid)
                opts = "mode=1777" if fs_group is None else f"mode=3777,gid={int(fs_group)}"
                script.append(f"mount -t tmpfs -o size=2g,{opts} tmpfs {t}")
            else:
                script.append(f"mount --bind {shlex.quote(str(src))} {t}")
                if m.get("readOnly"):
                    script.append(f"mount -o remount,bind,ro {t}")
        # The termination log (terminationMessagePath, /dev/termination-log by default): a file of the container's
        # own, writable by any user as the kubelet makes it (0666), whose content becomes its termination message.
        log_path = Path(c.get("terminationMessagePath") or TERMINATION_LOG)
        own_log = poddir / f"{c['name']}.termination-log"
        own_log.touch()
        own_log.chmod(0o666)
        try:
            with self._lock:
                self._mount_point(log_path.parent)
                if not log_path.exists():  # the bind's target (/dev is the host's here); each pod binds its own
                    log_path.touch(mode=0o644)
                    self._made_files.append(log_path)
            script.append(f"mount --bind {shlex.quote(str(own_log))} {shlex.quote(str(log_path))}")
        except OSError as err:  # not root on the host (a user namespace): no file can be made in its /dev
            log.warning("pod %s: container %s gets no termination log at %s: %s", rp.name, c["name"], log_path, err)
        # The pod's own /tmp last: the volumes' host directories may live under the harness's /tmp. What the "image"
        # provides from under /tmp (this checkout, a virtualenv there) is bound into the pod's /tmp first.
        for keep in IMAGE_PATHS_UNDER_TMP:
            inside = poddir / "tmp" / keep.relative_to("/tmp")
            inside.mkdir(parents=True, exist_ok=True)
            script.append(f"mount --bind {shlex.quote(str(keep))} {shlex.quote(str(inside))}")
        script += [f"mount --rbind {shlex.quote(str(poddir / 'tmp'))} /tmp", f"mkdir -p {shlex.quote(who.workdir)}",
                   'exec "$@"']
        return self._start(rp, pod, c, script, argv, who, poddir)

    def _start(self, rp: RunningPod, pod: dict, c: dict, script: list[str], argv: list[str],
               who: pod_security.Identity, poddir: Path) -> subprocess.Popen:
        logf = open(poddir / f"{c['name']}.log", "ab")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", rp.netns, "unshare", "--mount", "--uts", "--propagation", "private", "--",
             "sh", "-c", "\n".join(script), "sh", *argv],
            env=self._env(rp, pod, c, who.home), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=str(poddir / "tmp"), start_new_session=True)
        logf.close()
        rp.procs.append(proc)
        return proc


def _wait_for_exec(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until the container's process runs the container's own command: its wrapper (`ip netns exec`, `unshare`, then
    the mount script of _spawn, `sh -c SCRIPT`, then e2e/container_exec.py; one process, each exec'ing the next, the
    script or the launcher in every command line) forks it, PID 1 of its own PID namespace, once the pod's mounts are
    in place, and it execs the command once it has taken the container's identity. A kubelet reports a container
    Running once it has started; reported sooner, a scenario that read the mounts of a Running pod saw half of them
    (2026-12-05: the resume-from mount missing, under load)."""
    script = proc.args[proc.args.index("-c") + 1].encode()
    launcher = str(pod_security.LAUNCHER).encode()
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            args = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
            if launcher in args and script not in args:  # the launcher: its child runs the command
                child = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                args = Path(f"/proc/{child[0]}/cmdline").read_bytes().split(b"\0") if child else [b""]
        except OSError:
            return  # ended meanwhile
        if args != [b""] and script not in args and launcher not in args:  # ([b""]: an exec under way)
            return
        time.sleep(0.02)


def _container_pid(proc: subprocess.Popen) -> int | None:
    """A running container's PID 1: the child of its launcher (e2e/container_exec.py), which waits for it."""
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _sub_path(volume: tuple[str, Path], mount: dict) -> Path:
    """The host directory a volumeMount binds: its volume's, or with `subPath` that directory inside it, created
    when missing as the kubelet creates it (with the mode of the volume's root). As the kubelet, refuses a subPath
    that is absolute, climbs ('..') or leads out of the volume through a symlink."""
    kind, root = volume
    sub = mount.get("subPath")
    if not sub:
        return root
    if kind not in ("pvc", "emptyDir"):
        raise ValueError(f"volumeMount {mount['name']}: subPath of a {kind} volume is not emulated")
    if Path(sub).is_absolute() or ".." in Path(sub).parts:
        raise ValueError(f"volumeMount {mount['name']}: subPath {sub!r} must be a relative path without '..'")
    path = root / sub
    missing, there = [], path
    while not there.exists():
        missing.append(there)
        there = there.parent
    if root.resolve() not in [there.resolve(), *there.resolve().parents]:
        raise ValueError(f"volumeMount {mount['name']}: subPath {sub!r} leads out of its volume")
    mode = root.stat().st_mode & 0o7777
    for d in reversed(missing):
        d.mkdir(exist_ok=True)  # the job's other pods start at the same time
        d.chmod(mode)  # not the umask's: the root's, as the kubelet does
    return path


def _terminated(c: dict, rc: int, message: str = "") -> dict:
    term = {"exitCode": rc, "reason": "Completed" if rc == 0 else "Error", "finishedAt": _now()}
    if message:
        term["message"] = message
    return {"name": c["name"], "ready": False, "restartCount": 0, "image": c.get("image", ""), "imageID": "",
            "state": {"terminated": term}}


def _termination_message(c: dict, rc: int, poddir: Path) -> str:
    """As the kubelet makes it: what the container wrote to its termination log (at most 4096 bytes); when it wrote
    nothing, under terminationMessagePolicy FallbackToLogsOnError, a failed container's log tail, at most 80 lines
    and 2048 bytes."""
    written = poddir / f"{c['name']}.termination-log"
    if written.is_file() and (text := written.read_bytes()[:4096]):
        return text.decode(errors="replace")
    if rc == 0 or c.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return ""
    lines = (poddir / f"{c['name']}.log").read_bytes().splitlines()[-80:]
    return b"\n".join(lines)[-2048:].decode(errors="replace")
