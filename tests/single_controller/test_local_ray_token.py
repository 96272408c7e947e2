"""The local Ray of `hybridflow run` (and of client.local's runs, which are `hybridflow run`) admits only holders of
a token of its own, fresh for each run (issue 51, L7): another local user, or a process holding Ray's default token
(~/.ray/auth_token, the same for every run), cannot submit work to it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hybridflow.api import load_job

from support.paths import ROOT

TINY = ROOT / "examples" / "tiny-grpo.yaml"


def test_each_local_ray_starts_with_token_auth_and_a_fresh_token(monkeypatch):
    import ray

    import hybridflow.cli as cli
    from hybridflow.single_controller import ray_auth

    seen = []
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append({k: os.environ.get(k) for k in cli.RAY_AUTH_ENV}))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_auth, "_reload_ray_auth", lambda: None)  # a Ray of this test process keeps its token
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/somewhere/shared")
    job = load_job(TINY)
    for _ in range(2):
        with cli.local_ray(job, None):
            pass
    assert [s["RAY_AUTH_MODE"] for s in seen] == ["token", "token"]
    tokens = [s["RAY_AUTH_TOKEN"] for s in seen]
    assert all(t and len(t) == 64 for t in tokens) and tokens[0] != tokens[1]
    assert all(s["RAY_AUTH_TOKEN_PATH"] is None for s in seen)  # the run's own token, not a file's
    # the process's environment is as it was once the run's Ray is gone
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in os.environ
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == "/somewhere/shared"


def _idle_workers_within(seconds: float) -> list[str]:
    """Worker processes this process's Ray started before any work was given to it (Ray names them ray::IDLE)."""
    import time

    import psutil

    deadline, idle = time.monotonic() + seconds, []
    while time.monotonic() < deadline and not idle:
        idle = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
                if p.is_running() and p.cmdline()[:1] == ["ray::IDLE"]]
        time.sleep(0.2)
    return idle


JOIN = """
import sys
from ray._raylet import GcsClient  # what any driver or `ray` command talks to first, with the token it finds
try:
    print("joined", GcsClient(address=sys.argv[1]).internal_kv_keys(b"", None, timeout=10) is not None)
except Exception as e:
    print("refused", type(e).__name__, str(e).splitlines()[0][:300])
"""


def test_a_local_ray_refuses_a_caller_without_its_runs_token(private_ray, tmp_path):
    """`hybridflow run`'s Ray (start_local_ray) runs the job's work; a process of the same machine is refused
    without the run's token: with none, and with the user's own default token (~/.ray/auth_token, which Ray would
    otherwise use for every local cluster of that user), and admitted with it."""
    import ray

    job = load_job(TINY)
    private_ray(job)
    assert _idle_workers_within(3.0) == []  # (and it starts no worker it will not use: LOCAL_RAY_SYSTEM_CONFIG)
    assert ray.get(ray.remote(lambda: 6 * 7).remote()) == 42  # the run's own workers hold the token
    address, token = ray.get_runtime_context().gcs_address, os.environ.get("RAY_AUTH_TOKEN", "")
    empty = tmp_path / "home"
    empty.mkdir()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    default = Path.home() / ".ray" / "auth_token"
    default_home = {} if default.is_file() else {"HOME": str(tmp_path / "other")}
    if not default.is_file():  # a default token of that user's own, as `ray start` or an earlier ray.init left
        (tmp_path / "other" / ".ray").mkdir(parents=True)
        (tmp_path / "other" / ".ray" / "auth_token").write_text("a-default-token-" + "0" * 48)
    mode = {"RAY_AUTH_MODE": "token"}  # sends the token it finds (with none found, Ray aborts the process)
    callers = {"no token": {**clean, "HOME": str(empty)}, "the default token": {**clean, **mode, **default_home},
               "the run's token": {**clean, **mode, "RAY_AUTH_TOKEN": token}}
    got = {}
    for who, env in callers.items():
        out = subprocess.run([sys.executable, "-c", JOIN, address], env=env, capture_output=True, text=True,
                             timeout=120)
        got[who] = out.stdout.strip() or out.stderr[-1000:]
    assert got["no token"].startswith("refused AuthenticationError"), got
    assert got["the default token"].startswith("refused AuthenticationError"), got
    assert got["the run's token"] == "joined True", got
