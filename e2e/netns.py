"""Pod networking for the kubelet double: one network namespace per pod, joined to a bridge by a veth pair, with
its own address on 10.244.0.0/24 — what a CNI plugin gives each pod. Runs inside the e2e user+network namespace
(see e2e/README.md), so nothing here touches the host's network.

Of NetworkPolicy, what a CNI's policy engine does for a pod whose egress is denied outright (a policy with
policyTypes Egress and no egress rule selects it, and no other one allows it anything): nftables in the pod's network
namespace drops every new outgoing connection, while replies to incoming ones (and the pod's loopback) still flow.
Allow-lists and ingress rules are not emulated.
"""
from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import threading
import time

BRIDGE = "hfe2e0"
SUBNET = ipaddress.ip_network("10.244.0.0/24")
GATEWAY = str(next(SUBNET.hosts()))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


EGRESS_TABLE = "hf-netpol"
DENY_EGRESS = f"""table inet {EGRESS_TABLE} {{
  chain output {{
    type filter hook output priority 0; policy drop;
    oif "lo" accept
    ct state established,related accept
  }}
}}
"""


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions) against a pod's labels; {} selects every pod."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[op]:
            return False
    return True


def egress_denied(policies: list[dict], namespace: str, labels: dict[str, str]) -> bool:
    """Whether the pod's egress is denied outright: NetworkPolicies of its namespace with Egress among their
    policyTypes (without policyTypes: those with egress rules) select it and none of them has an egress rule
    (policies add up: any rule would allow something)."""
    specs = [p.get("spec") or {} for p in policies if p["metadata"].get("namespace", "default") == namespace]
    egress = [s for s in specs if _selects(s.get("podSelector") or {}, labels)
              and "Egress" in (s.get("policyTypes") or (["Ingress", "Egress"] if s.get("egress") else []))]
    return bool(egress) and not any(s.get("egress") for s in egress)


def next_free(used: set[str]) -> str:
    """Lowest pod address not in use (the gateway is the bridge)."""
    for host in SUBNET.hosts():
        addr = str(host)
        if addr != GATEWAY and addr not in used:
            return addr
    raise RuntimeError(f"no free address in {SUBNET}")


class PodNetwork:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[str, tuple[str, str]] = {}  # netns name -> (address, host-side veth)
        self._serial = 0
        _ip("link", "set", "lo", "up")
        if _ip("link", "show", BRIDGE, check=False).returncode:
            _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "replace", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")

    def add(self, netns: str) -> str:
        """A namespace named `netns` with eth0 on the bridge; returns its address."""
        with self._lock:
            addr = next_free({a for a, _ in self._pods.values()})
            self._serial += 1
            veth = f"hfv{self._serial}"
            self._pods[netns] = (addr, veth)
        _ip("netns", "add", netns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", veth, "master", BRIDGE, "up")
        for cmd in (("link", "set", "lo", "up"), ("addr", "add", f"{addr}/{SUBNET.prefixlen}", "dev", "eth0"),
                    ("link", "set", "eth0", "up"), ("route", "add", "default", "via", GATEWAY)):
            _ip("-n", netns, *cmd)
        return addr

    def set_egress(self, netns: str, deny: bool) -> None:
        """Deny the pod's new outgoing connections (deny=True) or lift that; idempotent, applied atomically."""
        script = f"add table inet {EGRESS_TABLE}\ndelete table inet {EGRESS_TABLE}\n" + (DENY_EGRESS if deny else "")
        out = subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=script, capture_output=True,
                             text=True)
        if out.returncode:
            raise RuntimeError(f"nft in {netns}: {out.stderr.strip()}")

    def pids(self, netns: str) -> list[int]:
        out = _ip("netns", "pids", netns, check=False)
        return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []

    def kill(self, netns: str, grace: float = 3.0) -> None:
        """Every process in the pod's network namespace: SIGTERM, then SIGKILL after `grace` seconds (grace 0: SIGKILL
        straight away, as an OOM kill or a lost node would end them)."""
        for sig in (signal.SIGTERM, signal.SIGKILL) if grace > 0 else (signal.SIGKILL,):
            for pid in self.pids(netns):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + grace
            while self.pids(netns) and time.time() < deadline:
                time.sleep(0.1)
            if not self.pids(netns):
                return

    def stop(self, netns: str) -> int:
        """SIGSTOP every process in the pod's network namespace (a hung pod: alive, its sockets open, silent);
        returns how many. A later `kill` (SIGKILL) ends stopped processes too."""
        pids = self.pids(netns)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        return len(pids)

    def remove(self, netns: str) -> None:
        """The pod's processes, its interface and its namespace; only then is its address free for another pod. A
        namespace outlives `ip netns del` while a process in it is still exiting (slowly, on a loaded machine), and
        with it its eth0: a new pod given the same address would share it with the old one, and the peers of the
        new pod could reach the old one (seen: gloo's 'Connection reset by peer' right after a gang restart)."""
        self.kill(netns, grace=0.5)
        deadline = time.time() + 30
        while self.pids(netns) and time.time() < deadline:
            self.kill(netns, grace=0)
            time.sleep(0.1)
        with self._lock:
            _, veth = self._pods.get(netns, ("", ""))
        if veth:
            _ip("link", "del", veth, check=False)  # both ends of the pair: the old eth0 is gone whatever lingers
        _ip("netns", "del", netns, check=False)
        with self._lock:
            self._pods.pop(netns, None)

    def namespaces(self) -> list[str]:
        out = _ip("netns", "list", check=False)
        return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
