"""Cluster DNS double: answers A queries for the names the kubelet double knows (pods, headless Services) on the
bridge address, as kube-dns does for real pods. Needed because not every resolver reads /etc/hosts: gRPC's c-ares
resolver (used by Ray's raylet to reach the GCS at `<job>-head.<namespace>.svc`) asks a DNS server."""
from __future__ import annotations

from typing import Callable

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

SEARCH = "default.svc.cluster.local svc.cluster.local cluster.local"


class ClusterResolver(BaseResolver):
    def __init__(self, names: Callable[[], dict[str, str]]) -> None:
        self.names = names

    def resolve(self, request, handler):
        reply = request.reply()
        qname = str(request.q.qname).rstrip(".")
        ip = self.names().get(qname) or ("127.0.0.1" if qname == "localhost" else None)
        if ip is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype in (QTYPE.A, QTYPE.ANY):
            reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=5))
        return reply  # a known name without an AAAA record: NOERROR and no answer


class ClusterDNS:
    def __init__(self, names: Callable[[], dict[str, str]], address: str) -> None:
        quiet = DNSLogger(log="-request,-reply,-truncated,-error,-recv,-send,-data", prefix=False)
        self.servers = [DNSServer(ClusterResolver(names), port=53, address=address, tcp=tcp, logger=quiet)
                        for tcp in (False, True)]

    def start(self) -> "ClusterDNS":
        for s in self.servers:
            s.start_thread()
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def resolv_conf(nameserver: str) -> str:
    return f"nameserver {nameserver}\nsearch {SEARCH}\noptions ndots:5\n"
