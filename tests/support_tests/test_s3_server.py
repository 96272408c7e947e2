"""The `s3_server` fixture (tests/s3_server.py): a real S3-compatible server (SeaweedFS) that s3fs reaches through
the AWS_* environment variables alone, with authentication on, on loopback only, and gone after its tests."""
import os
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from s3_server import S3Server


def _s3fs():
    import fsspec

    # a new instance: fsspec caches filesystems by their arguments, and these tests change only the environment
    return fsspec.filesystem("s3", skip_instance_cache=True)


def test_s3fs_configured_from_the_environment_writes_lists_reads_and_deletes(s3_server, monkeypatch):
    s3_server.use(monkeypatch)
    fs = _s3fs()
    assert fs.key is None and fs.secret is None and not fs.client_kwargs  # nothing but the environment
    root = f"{s3_server.url}/ml/job"
    assert fs.ls(s3_server.bucket, refresh=True) == []  # the test's own bucket starts empty
    blob = os.urandom(11 * 2**20 + 17)
    with fs.open(f"{root}/step_00000002/weights.bin", "wb", block_size=5 * 2**20) as f:
        f.write(blob)  # a multipart upload of three parts (5 MiB is the smallest part S3 allows), as big files go
    with fs.open(f"{root}/steps.jsonl", "w") as f:
        f.write('{"step": 1}\n{"step": 2}\n')
    assert sorted(fs.ls(root, refresh=True)) == [f"{s3_server.bucket}/ml/job/step_00000002",
                                                 f"{s3_server.bucket}/ml/job/steps.jsonl"]
    assert fs.info(f"{root}/step_00000002/weights.bin")["size"] == len(blob)
    assert fs.cat(f"{root}/step_00000002/weights.bin") == blob
    assert fs.cat(f"{root}/steps.jsonl").decode().splitlines() == ['{"step": 1}', '{"step": 2}']
    fs.rm(f"{root}/step_00000002", recursive=True)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/step_00000002/weights.bin")
    assert fs.find(root) == [f"{s3_server.bucket}/ml/job/steps.jsonl"]


def test_authentication_is_on(s3_server, monkeypatch):
    s3_server.use(monkeypatch)
    _s3fs().pipe(f"{s3_server.url}/x.txt", b"x")  # the right key works
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key[:-1] + ("A" if s3_server.secret_key[-1] != "A"
                                                                               else "B"))
    fs = _s3fs()
    with pytest.raises(PermissionError):  # 403 (a HEAD first: no body to tell why)
        fs.cat(f"{s3_server.url}/x.txt")
    with pytest.raises(PermissionError):
        fs.pipe(f"{s3_server.url}/y.txt", b"y")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDNOTKNOWNHERE0000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    with pytest.raises(PermissionError):
        _s3fs().cat(f"{s3_server.url}/x.txt")
    for url in (s3_server.endpoint_url + "/", f"{s3_server.endpoint_url}/{s3_server.bucket}/x.txt"):  # anonymous
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=10)
        assert err.value.code == 403


def _listening(pid: int) -> list:
    return [c for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN or not c.raddr]


def test_server_listens_on_loopback_only(s3_server):
    server = s3_server.server
    sockets = _listening(server.pid)
    assert {c.laddr.port for c in sockets} >= {server.ports["s3"], server.ports["master"], server.ports["filer"]}
    assert sockets and all(c.laddr.ip == "127.0.0.1" for c in sockets), sockets
    assert s3_server.endpoint_url == f"http://127.0.0.1:{server.ports['s3']}"


def test_stop_ends_the_whole_process_group_even_when_the_block_fails(tmp_path):
    with pytest.raises(RuntimeError, match="the test failed"):
        with S3Server(tmp_path) as server:
            pid, ports = server.pid, dict(server.ports)
            assert server.startup_seconds is not None and server.startup_seconds < 60
            assert server.create_bucket("stop-test").bucket == "stop-test"
            raise RuntimeError("the test failed")
    assert server.proc is None and not psutil.pid_exists(pid)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # no member of its process group is left
    assert not [p for p in psutil.process_iter(["exe", "cwd"]) if p.info["cwd"] == str(tmp_path)]
    assert not any(Path(f"/tmp/seaweedfs-{kind}-grpc-{ports[kind + '.grpc']}.sock").exists()
                   for kind in ("master", "volume", "filer", "s3"))
    server.stop()  # idempotent
