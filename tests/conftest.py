import os
import sys
from pathlib import Path

import pytest

from support.paths import ROOT
from support.processes import kill_processes_mentioning

pytest_plugins = ["support.module_claims"]  # make test's two streams share the slow tests (scripts/run-tests.sh)

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


@pytest.fixture(scope="session")
def tiny_example_job(tmp_path_factory, model_cache):
    """examples/tiny-grpo.yaml run once as a script runs it: submitted through the Python client to a local
    `hybridflow run` (its 40 steps) and waited for: the finished client.local job (its log, step log, checkpoints).
    Its learning is asserted in test_end_to_end; test_export and test_client read it. One run of it costs ~30 s
    here, so the tests that only read a tiny run's outputs share this one."""
    import shutil
    import tempfile

    from hybridflow import client

    work = tmp_path_factory.mktemp("tiny-example")
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths are limited
    jobs = client.local(work, env={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)}, ray_temp_dir=ray_dir)
    job = jobs.submit(ROOT / "examples" / "tiny-grpo.yaml")
    try:
        job.wait(timeout=900, progress=False)
    except client.JobFailed:
        pass  # the tests reading it say what failed (its log)
    finally:
        job.delete()  # (a run past the timeout: ended here, not left behind)
        kill_processes_mentioning(ray_dir)
        shutil.rmtree(ray_dir, ignore_errors=True)
    return job


@pytest.fixture(scope="session")
def tiny_example_run(tiny_example_job):
    """(checkpoint dir, the run's outcome as a CompletedProcess-like: returncode, and its log as stdout/stderr)."""
    from types import SimpleNamespace

    log = "\n".join(tiny_example_job.logs())
    return Path(tiny_example_job.checkpoint_dir), SimpleNamespace(
        returncode=tiny_example_job.returncode(), stdout=log, stderr=log)


# --- one in-process Ray for consecutive tests ---------------------------------------------------------------------
# `ray.init` costs ~5 s and `ray.shutdown` ~1.5 s. Tests that drive worker groups from this process share one Ray
# while they run one after another (`local_ray`, or `shared_ray` for a module's fixtures), and it is stopped as soon
# as the next test does not need it, so it never idles beside unrelated tests. A pool's "devices" are only counters
# (`hybridflow_pool_<name>`, hybridflow.api.pool_resource) that placement groups reserve, so one Ray with room for
# the largest job of each pool name serves them all; a job needing more fails clearly (raise the numbers here).
SHARED_RAY_POOLS = {"default": 8, "ref": 2, "p1": 2, "p2": 4, "trainer": 1, "rollout": 2, "actor": 2,
                    "judges": 1}  # pool name -> devices
# CPUs reserved at once (devices x cpusPerDevice): the megatron TP=4 job needs 4. Like start_local_ray, never fewer
# than the machine has; Ray starts that many idle workers when the driver connects.
SHARED_RAY_CPUS = max(4, os.cpu_count() or 1)


class SharedRay:
    """The shared in-process Ray: started on first use, with the options of hybridflow.cli.start_local_ray (loopback
    only, a small object store, quiet workers) but room for every test's job. Between tests it is checked to hold
    nothing from the test before: placement groups and actors a test left behind are removed, with a warning."""

    def __init__(self) -> None:
        self.temp_dir: str | None = None
        self.address: str | None = None

    @property
    def running(self) -> bool:
        import ray

        return self.address is not None and ray.is_initialized() \
            and ray.get_runtime_context().gcs_address == self.address

    def ensure_running(self) -> None:
        import logging
        import tempfile
        import warnings

        import ray

        from hybridflow.api import pool_resource, pool_slot_resource
        from hybridflow.cli import LOCAL_RAY_SYSTEM_CONFIG

        if self.running:
            return
        self.stop()  # ours, if something shut it down under us
        if ray.is_initialized():
            warnings.warn("a Ray session from an earlier test was still running; shutting it down")
            ray.shutdown()
        os.environ.setdefault("RAY_DEDUP_LOGS", "1")
        self.temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths are limited
        try:
            # and a slot per device (api.pool_slot_resource): a rollout pool of replicas asks for its pods' slots
            slots = {pool_slot_resource(n, i): d for n, d in SHARED_RAY_POOLS.items() for i in range(d)}
            ray.init(num_cpus=SHARED_RAY_CPUS,
                     resources={**{pool_resource(n): d for n, d in SHARED_RAY_POOLS.items()}, **slots},
                     include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False,
                     logging_level=logging.ERROR, _temp_dir=self.temp_dir,
                     runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "1"}}, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
            self.address = ray.get_runtime_context().gcs_address
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        import shutil

        import ray

        if self.running:
            ray.shutdown()
        self.address = None
        if self.temp_dir is not None:
            kill_processes_mentioning(self.temp_dir)  # daemons that outlived the shutdown
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def check_fits(self, job) -> None:
        """Start the shared Ray if it is not running (the session's fixture starts it once; a test that needs no Ray
        stops it), then fail the test, naming what is missing, when `job`'s pools need more than it has."""
        self.ensure_running()
        if any(p.nodes > 1 for p in job.spec.resource_pools):
            pytest.fail("spec.resourcePools[].nodes > 1 needs a Ray cluster, not the tests' local Ray")
        self.check_room(job.spec.resource_pools)

    def check_room(self, pools) -> None:
        """The same for resource pools (spec or worker-group ones) that are reserved at the same time."""
        import ray

        from hybridflow.api import pool_resource

        need = {"CPU": sum(p.world_size * p.cpus_per_device for p in pools),
                "GPU": sum(p.world_size for p in pools if p.device == "gpu")}
        for p in pools:
            need[pool_resource(p.name)] = need.get(pool_resource(p.name), 0) + p.world_size
        have = ray.cluster_resources()
        short = {k: (v, have.get(k, 0)) for k, v in need.items() if v > have.get(k, 0)}
        if short:
            pytest.fail("the tests' shared Ray is too small for this job (needed, has): "
                        + ", ".join(f"{k} {v} > {h}" for k, (v, h) in short.items())
                        + "; raise SHARED_RAY_POOLS / SHARED_RAY_CPUS in tests/conftest.py")

    def snapshot(self) -> tuple[set, set, dict]:
        """(placement groups, actors) there now, by id, and the CPUs, GPUs and pool devices free now."""
        import ray

        if not self.running:
            return set(), set(), {}
        free = {k: v for k, v in ray.available_resources().items()
                if k in ("CPU", "GPU") or (k.startswith("hybridflow_pool_") and "_group_" not in k)}
        return ({pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"},
                {a for a, info in ray._private.state.actors().items() if info["State"] != "DEAD"}, free)

    def empty(self) -> tuple[set, set, dict]:
        """What snapshot() gives when nothing is there: every resource free."""
        import ray

        _, _, free = self.snapshot()
        return set(), set(), {k: ray.cluster_resources().get(k, 0) for k in free}

    def _left(self, before: tuple[set, set, dict]) -> tuple[set, set, set]:
        """What is there now that was not at `before`: placement groups, actors, and resources still held."""
        pgs, actors, free = self.snapshot()
        return pgs - before[0], actors - before[1], {k for k, v in before[2].items() if free.get(k, 0) < v}

    def _wait_gone(self, before: tuple[set, set, dict], seconds: float) -> tuple[set, set, set]:
        import time

        deadline = time.monotonic() + seconds
        while any(left := self._left(before)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def remove_leftovers(self, before: tuple[set, set, dict], who: str, wait_s: float = 10.0) -> None:
        """Remove the placement groups and actors made since `before` that are still there, with a warning, and
        wait until the resources free at `before` are free again; if they are not, stop this Ray (the next test
        gets a new one). What was just killed or removed (ray.kill and remove_placement_group return before it is)
        is given `wait_s` to go by itself first."""
        import warnings

        if not self.running:
            return
        try:
            self._remove_leftovers(before, who, wait_s)
        except Exception as err:  # noqa: BLE001 - a Ray that cannot even be asked is no Ray for the next test
            warnings.warn(f"{who}: the shared Ray could not be checked ({type(err).__name__}: {err}); stopping it")
            self.stop()

    def _remove_leftovers(self, before: tuple[set, set, dict], who: str, wait_s: float) -> None:
        import warnings

        import ray
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        pgs, actors, held = self._wait_gone(before, wait_s)
        if not (pgs or actors or held):
            return
        warnings.warn(f"{who} left {len(pgs)} placement group(s) and {len(actors)} actor(s) in the shared Ray"
                      + (f" ({', '.join(sorted(held))} still reserved)" if held else "") + "; removing them")
        for pg in pgs:  # also ends the actors placed in it
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg))))
        for actor in actors:
            try:
                ray._private.worker.global_worker.core_worker.kill_actor(ray.ActorID(bytes.fromhex(actor)), True)
            except Exception:  # noqa: BLE001 - dead by now; whatever is not is checked just below
                pass
        if any(self._wait_gone(before, wait_s)):
            warnings.warn(f"{who}: what it left in the shared Ray would not go away; stopping that Ray")
            self.stop()


_SHARED_RAY = SharedRay()


def _uses_shared_ray(item) -> bool:
    return item is not None and "shared_ray" in getattr(item, "fixturenames", ())


@pytest.fixture(scope="session")
def shared_ray():
    """The shared in-process Ray (see SharedRay), running. Module-scoped fixtures may hold workers in it for their
    module; nothing session-scoped may (whatever is left when a module ends is removed)."""
    _SHARED_RAY.ensure_running()
    try:
        yield _SHARED_RAY
    finally:
        _SHARED_RAY.stop()


@pytest.fixture(autouse=True)
def _shared_ray_left_clean(request):
    """After each test that uses the shared Ray: what the test (not its module's fixtures) left there is removed."""
    if not _uses_shared_ray(request.node):
        yield
        return
    before = _SHARED_RAY.snapshot()
    yield
    _SHARED_RAY.remove_leftovers(before, request.node.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Once a test and the fixtures that end with it are torn down: the shared Ray is stopped when the next test
    does not use it, and emptied when the next test is in another module."""
    yield
    if not _SHARED_RAY.running:
        return
    if not _uses_shared_ray(nextitem):
        _SHARED_RAY.stop()
    elif getattr(nextitem, "module", None) is not getattr(item, "module", None):
        _SHARED_RAY.remove_leftovers(_SHARED_RAY.empty(), f"the fixtures of {item.nodeid.split('::')[0]}")


@pytest.fixture
def local_ray(shared_ray):
    """`local_ray(job)` makes sure the shared Ray runs and has room for `job`'s resource pools (as
    hybridflow.cli.start_local_ray would give it); whatever the test leaves there is removed after it, however it
    ends, so a failure in one test never spills into the next ones. A test that needs a Ray of its own (one that
    stops or kills Ray, or whose job needs other resources) takes `private_ray` instead."""
    def start(job) -> None:
        shared_ray.ensure_running()
        shared_ray.check_fits(job)

    return start


@pytest.fixture
def run_here(local_ray, model_cache, monkeypatch):
    """`run_here(JOB, overrides, cwd)`: `hybridflow run JOB` in this process on the shared Ray, with `overrides`
    dotted like the CLI's flags ({"spec.trainer.steps": 2}) and relative paths from `cwd`: the CLI's own load,
    prepare and execute, without the ~10-15 s of a new process and its `ray.init`. Returns the exit code and what
    the job printed. The tests of the CLI itself (its flags, exit codes, signals) run `hybridflow run` (run_cli)."""
    import contextlib
    import io

    from hybridflow.cli import _load
    from hybridflow.trainer.loop import execute
    from hybridflow.trainer.setup import prepare

    monkeypatch.setenv("HYBRIDFLOW_MODEL_CACHE", str(model_cache))

    def run(job_path, overrides=None, cwd=None) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out):
            job = _load(str(job_path), {"spec.metrics.port": 0, **(overrides or {})})
            prepared = prepare(job)
            try:
                local_ray(job)
                rc = execute(job, prepared)
            finally:
                prepared.close()
        return rc, out.getvalue()

    return run


@pytest.fixture
def private_ray(ray_tmp):
    """`private_ray(job)`: the job's own local Ray (hybridflow.cli.start_local_ray), shut down after the test however
    it ends; the shared Ray is stopped first. A Ray that something before this test left running is shut down first
    (with a warning)."""
    import warnings

    import ray

    from hybridflow.cli import start_local_ray

    _SHARED_RAY.stop()
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
