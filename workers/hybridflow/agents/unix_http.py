"""The agent endpoint's HTTP servers (hybridflow.agents.endpoint): HTTP on a Unix socket (an agent program's sandbox
has no network, the socket is bound into it) and, for programs run in the job's sandbox pool, on TCP at the pod's
address (Listen; the pool's replica relays its program's socket there: hybridflow.agents.relay). Both serve the
same handler, so a request on either needs a live episode token (401 otherwise). A thread per connection and at most
a given number of connections at once, one more answered 503 (BUSY) and closed as it connects; a connection that
fails (its program went) is logged at debug level, never with a traceback on the console."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hybridflow.agents.openai_wire import ApiError, raw_answer
from hybridflow.agents.protocol import Listen

log = logging.getLogger("hybridflow.agents.endpoint")

BUSY = raw_answer("503 Service Unavailable", ApiError(503, "too many connections", kind="server_error"))


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most `connections` at once: one more is answered BUSY and closed."""

    daemon_threads = True

    def __init__(self, address: Any, handler: type[BaseHTTPRequestHandler], connections: int) -> None:
        self._slots = threading.BoundedSemaphore(connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(BUSY)
                request.setblocking(False)  # what it sent already is read, so that closing does not reset it
                request.recv(1 << 16)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:  # a program that went: no traceback
        log.debug("agent endpoint connection failed", exc_info=True)


class UnixHTTPServer(BoundedHTTPServer):
    address_family = socket.AF_UNIX

    def server_bind(self) -> None:  # HTTPServer's would resolve the path as a host name
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "hybridflow", 0


class TCPHTTPServer(BoundedHTTPServer):
    """On `listen.host` (an IPv4 or IPv6 address: a pod's may be either), at the first free port of `listen.ports`
    (None: the OS chooses one)."""

    def __init__(self, listen: Listen, handler: type[BaseHTTPRequestHandler], connections: int) -> None:
        self.address_family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
        first, last = listen.ports or (0, 0)
        for port in range(first, last + 1):
            try:
                super().__init__((listen.host, port), handler, connections)
                return
            except OSError as err:
                if err.errno != errno.EADDRINUSE or port == last:
                    raise
        raise OSError(errno.EADDRINUSE, f"no free port in {first}-{last} on {listen.host}")

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Listeners:
    """The endpoint's servers, each on a thread of its own: its Unix socket (connectable by any user: the sandbox
    runs as another uid, the token is the authentication) and, with `listen`, its TCP listener (`url`)."""

    def __init__(self, socket_path: str, handler: type[BaseHTTPRequestHandler], connections: int,
                 listen: Listen | None = None) -> None:
        self.servers: list[BoundedHTTPServer] = [UnixHTTPServer(socket_path, handler, connections)]
        os.chmod(socket_path, 0o666)  # connecting needs write permission on the socket; the token is the auth
        self.url: str | None = None
        if listen is not None:
            try:
                tcp = TCPHTTPServer(listen, handler, connections)
            except BaseException:
                self.servers[0].server_close()
                raise
            self.servers.append(tcp)
            self.url = tcp.url
        for server in self.servers:
            threading.Thread(target=server.serve_forever, name="agent-endpoint", daemon=True).start()

    def stop(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()
