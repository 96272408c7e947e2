import contextlib
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1 only (see STACK.md)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Shared across the session so the tiny and SmolLM2 models are built once."""
    return Path(os.environ.get("HYBRIDFLOW_TEST_MODEL_CACHE") or tmp_path_factory.mktemp("models"))


@pytest.fixture
def one_rank(tmp_path):
    """A one-process gloo group (FSDP2 needs one), destroyed even when the test fails."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def word_problems(tmp_path_factory) -> Path:
    """examples/data/make_word_problems.py's two data sets (200 train, 20 test rows), as a user makes them."""
    import subprocess

    out = tmp_path_factory.mktemp("word-problems")
    subprocess.run([sys.executable, str(ROOT / "examples" / "data" / "make_word_problems.py"), "--out", str(out),
                    "--train", "200", "--test", "20"], check=True, capture_output=True)
    return out


def run_cli(args, cwd, env_extra=None, timeout=900):
    import subprocess

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "hybridflow.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def local_ray(ray_tmp):
    """Starts a job's private local Ray when the test asks (`local_ray(job)`); shut down after the test however it
    ends. A Ray that something before this test left running is shut down first (with a warning), so a failure in
    one test never turns into `ray.init` errors in the next ones."""
    import warnings

    import ray

    from hybridflow.cli import start_local_ray

    if ray.is_initialized():
        warnings.warn("a Ray session from an earlier test was still running; shutting it down")
        ray.shutdown()
    try:
        yield lambda job: start_local_ray(job, ray_tmp)
    finally:
        ray.shutdown()


@pytest.fixture
def ray_tmp():
    """Ray's session dir must be short: its socket paths are limited to 107 bytes."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    try:
        yield d
    finally:
        kill_processes_mentioning(d)  # Ray daemons of a run that was killed or timed out
        shutil.rmtree(d, ignore_errors=True)


def kill_processes_mentioning(text: str, grace: float = 5.0) -> int:
    """SIGKILL every process whose command line contains `text` (a per-test temp dir), after `grace` seconds for
    them to end by themselves; returns how many had to be killed."""
    import time

    import psutil

    def left() -> list:
        me = os.getpid()
        return [p for p in psutil.process_iter(["cmdline"])
                if p.pid != me and text in " ".join(p.info["cmdline"] or [])]

    deadline = time.time() + grace
    while (procs := left()) and time.time() < deadline:
        time.sleep(0.5)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return len(procs)


@contextlib.contextmanager
def running(cmd: list[str], **kwargs):
    """A subprocess in its own session for the length of a block; its whole process group is ended however the
    block ends (SIGTERM, then SIGKILL after 10 s), so a failing test leaves nothing running."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
            try:
                os.killpg(proc.pid, sig)  # the group outlives its leader while any member is alive
            except ProcessLookupError:
                pass
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture(scope="session")
def s3_server_process(tmp_path_factory):
    """One SeaweedFS S3 server (tests/s3_server.py) for the whole session, started on first use: startup takes
    about 3-4 s. Stopped at the end of the session however the tests ended (SIGTERM, 2 s, then SIGKILL of its
    process group); it also dies with the pytest process."""
    from s3_server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_server(s3_server_process, request):
    """A fresh, empty bucket of the session's S3 server for this test: `.endpoint_url`, `.access_key`,
    `.secret_key`, `.bucket`, `.url` (s3://bucket) and `.env()` (the AWS_* variables); `.use(monkeypatch)` makes
    those the test's whole AWS environment."""
    import re
    import secrets

    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    return s3_server_process.create_bucket(f"t{secrets.token_hex(4)}-{slug or 'test'}")


def readme_own_data_job() -> tuple[str, str]:
    """The job YAML and the reward file that README.md's "Your own data" section prints (its one yaml and one
    python block), as text: what a user copies."""
    section = (ROOT / "README.md").read_text().split("### Your own data\n", 1)[1].split("\n### ", 1)[0]
    jobs, rewards = re.findall(r"```yaml\n(.*?)```", section, re.S), re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(jobs) == 1 and len(rewards) == 1, "the section should print one job and one reward file"
    return jobs[0], rewards[0]


def save_readme_own_data_job(root: Path) -> tuple[Path, Path]:
    """README's own-data job saved as the README says (my-job.yaml, and the reward file it names) in `root`, which
    the caller lays out like the repository after `python examples/data/make_word_problems.py`; returns the job
    file and its checkpointDir."""
    import yaml

    job_text, reward_text = readme_own_data_job()
    doc = yaml.safe_load(job_text)
    # what a newcomer writes, and what this job checks stays accepted: one path for train and eval, no reward type
    assert isinstance(doc["spec"]["data"]["train"], str) and isinstance(doc["spec"]["data"]["eval"], str), doc
    assert "type" not in doc["spec"]["models"]["reward"], doc
    (root / "my-job.yaml").write_text(job_text)
    (root / doc["spec"]["models"]["reward"]["function"]["path"]).write_text(reward_text)
    return root / "my-job.yaml", root / doc["spec"]["trainer"]["checkpointDir"]
