"""The agent endpoint's HTTP server (hybridflow.agents.endpoint): HTTP on a Unix socket (no TCP port: an agent
program's sandbox has no network, the socket is bound into it), a thread per connection and at most a given number
of connections at once, one more answered 503 (BUSY) and closed as it connects; a connection that fails (its
program went) is logged at debug level, never with a traceback on the console."""
from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hybridflow.agents.openai_wire import ApiError, raw_answer

log = logging.getLogger("hybridflow.agents.endpoint")

BUSY = raw_answer("503 Service Unavailable", ApiError(503, "too many connections", kind="server_error"))


class UnixHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most `connections` at once: one more is answered BUSY and closed."""

    address_family = socket.AF_UNIX
    daemon_threads = True

    def __init__(self, path: str, handler: type[BaseHTTPRequestHandler], connections: int) -> None:
        self._slots = threading.BoundedSemaphore(connections)
        super().__init__(path, handler)

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

    def server_bind(self) -> None:  # HTTPServer's would resolve the path as a host name
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "hybridflow", 0
