"""One episode's way out of an agent program's sandbox in the sandbox pool (hybridflow.agents.server): a Unix socket
of its own, served by the pool's process and bound into the program's sandbox as the rollout's own socket is under
`hybridflow run`, whose every connection is relayed, byte for byte, to the rollout's endpoint over TCP (its
Listen: the address and port the request named). The relay neither reads nor adds anything: the program's client
sends the episode's bearer token itself, and the endpoint refuses a request without a live one (401).

The socket lies in a private temporary directory that other users may traverse but not list, and is itself
connectable by any user (the sandbox runs as another uid; connect(2) needs write permission on it). At most
MAX_CONNECTIONS connections are relayed at once. `close` ends the listener and every connection still open, and
removes the directory."""
from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import socket
import tempfile
import threading
from urllib.parse import urlsplit

CONNECT_SECONDS = 10.0  # to reach the endpoint; after that a connection waits as long as its program does
CHUNK = 1 << 16
# connections one episode's program may have relayed at once (each holds two of this process's threads and a
# connection to the endpoint); one more is closed as it connects. A program's client needs a few; without a bound
# one program could spend the replica's threads (its pod's pids) that every other episode's sandbox needs
MAX_CONNECTIONS = 64


def endpoint_address(url: str) -> tuple[str, int]:
    """(host, port) of an endpoint URL `http://host:port`; ValueError for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None or parts.path not in ("", "/"):
        raise ValueError(f"the endpoint's address must be http://host:port, got {url[:200]!r}")
    return parts.hostname, parts.port


def allowed_target(url: str, ports: tuple[int, int] | None) -> tuple[str, int]:
    """(host, port) of the endpoint URL a pool request names, if the relay may connect there; ValueError otherwise.
    The request comes from a holder of the job's sandbox token, but the relay is a way out of the pool's pod that no
    NetworkPolicy sees on its loopback: it connects only to an IP address (no name to resolve), never a link-local
    (the cloud's metadata service), multicast, unspecified or reserved one, and, where the pool was given the
    endpoints' ports (ENDPOINT_PORTS_ENV, set by the operator), only to one of those."""
    host, port = endpoint_address(url)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"the endpoint's host must be an IP address (the rollout's pod's), got {host[:100]!r}") \
            from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # ::ffff:169.254.169.254 is that
        ip = ip.ipv4_mapped
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified or (ip.is_reserved and not ip.is_loopback):
        raise ValueError(f"the endpoint's address {ip} is no pod's: the relay does not connect there")
    if ports is not None and not ports[0] <= port <= ports[1]:
        raise ValueError(f"the endpoint's port {port} is outside the rollout endpoints' ports "
                         f"{ports[0]}-{ports[1]}: the relay does not connect there")
    return host, port


class Relay:
    """A Unix socket (`socket_path`) relaying each connection to `target` (host, port) until `close`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._dir = tempfile.mkdtemp(prefix="hybridflow-relay-")
        os.chmod(self._dir, 0o711)  # the sandbox's uid may reach the socket by name, not list the directory
        self.socket_path = os.path.join(self._dir, "openai.sock")
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        try:  # whatever fails (no socket, no thread), the directory and the socket go
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(self.socket_path)
            os.chmod(self.socket_path, 0o666)
            self._listener.listen(64)
            threading.Thread(target=self._accept, name="agent-relay", daemon=True).start()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Relay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keep(self, *socks: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._open.update(socks)
            return True

    def _accept(self) -> None:
        while True:
            try:
                inside, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                full = len(self._open) >= 2 * MAX_CONNECTIONS  # two sockets a connection
            if full:
                inside.close()
                continue
            try:
                outside = socket.create_connection(self.target, timeout=CONNECT_SECONDS)
                outside.settimeout(None)
            except OSError:  # the endpoint is gone: the program's call fails as a refused connection would
                inside.close()
                continue
            if not self._keep(inside, outside):
                inside.close()
                outside.close()
                return
            ended: list[int] = []  # the pair's pumps that ended: the second one closes both sockets
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(a, b, ended), name="agent-relay-pump",
                                 daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, ended: list[int]) -> None:
        """source -> sink until source ends (then sink's writing half is shut: the other side sees the end)."""
        try:
            while data := source.recv(CHUNK):
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
        with self._lock:
            ended.append(1)
            if len(ended) < 2:
                return
            self._open.difference_update((source, sink))
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            live, self._open = list(self._open), set()
        if (listener := getattr(self, "_listener", None)) is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (a close alone would not)
            with contextlib.suppress(OSError):
                listener.close()
        for s in live:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        shutil.rmtree(self._dir, ignore_errors=True)
