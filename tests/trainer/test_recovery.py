"""In-place recovery (runPolicy.restartPolicy failedPod): the controller tells a lost worker from the job's own errors,
names the ranks that died or never answered, and, when a worker process is killed or stops mid-run, rebuilds its
worker groups and resumes from the last checkpoint without ending the job; every step is logged exactly once. The
operator's side (replacing the failed pod alone, Stalled) is in tests/operator/test_operator_phases.py and e2e/test_faults.py.
"""
import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from hybridflow.api import RunPolicy
from hybridflow.api.run_policy import STALL_FLOOR_SECONDS, collective_timeout, progress_deadline, startup_call_timeout
from hybridflow.engines.bridge.stream import WeightStreamBroken, WeightStreamError
from hybridflow.single_controller.failures import RankFailure, is_worker_loss, one_line
from hybridflow.trainer.recovery import Recoveries

from support.paths import ROOT

GLOO_RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:6549: Connection "
              "reset by peer. This is typically caused by a remote worker hanging")
GLOO_TIMEOUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"


def _task_error(cause: BaseException) -> ray.exceptions.RayTaskError:
    """What ray.get raises for a worker method that raised `cause`."""
    return ray.exceptions.RayTaskError("execute", "Traceback ...", cause)


def test_an_error_is_told_in_one_bounded_line():
    """What the driver prints of a lost worker: a lost node's error from Ray carries the dead raylet's log after its
    first line (thousands of characters), which pushed the "worker lost" line out of a pod log's tail."""
    raylet_dump = "The node was marked dead.\n" + "\n".join(f"[state-dump] stats line {i}" for i in range(300))
    assert one_line(RuntimeError(raylet_dump)) == "The node was marked dead."
    assert one_line(RuntimeError("x" * 5000)) == "x" * 500
    assert one_line(TimeoutError()) == "TimeoutError"
    err = RankFailure("generate", ["rollout rank 1 (node a)"], [], [], RuntimeError(raylet_dump))
    assert "\n" not in str(err) and str(err).endswith("(The node was marked dead.)"), str(err)


def test_a_lost_worker_is_told_from_the_jobs_own_errors():
    assert is_worker_loss(ray.exceptions.ActorDiedError())
    assert is_worker_loss(_task_error(RuntimeError(GLOO_RESET)))  # a survivor whose collective lost its peer
    assert is_worker_loss(_task_error(RuntimeError(GLOO_TIMEOUT)))  # a survivor waiting on a stopped peer
    assert is_worker_loss(RankFailure("actor.update_actor", [], ["pool default rank 1 (10.0.0.3)"], [],
                                      RuntimeError(GLOO_TIMEOUT)))
    try:  # Python's own chain: an error raised while handling a lost worker
        try:
            raise ray.exceptions.ActorDiedError()
        except ray.exceptions.ActorDiedError as e:
            raise ValueError("while reading results") from e
    except ValueError as chained:
        assert is_worker_loss(chained)
    # a survivor of a weight stream whose peer is gone: its own error type says so (Ray carries no cause across)
    assert is_worker_loss(_task_error(WeightStreamBroken(
        "rollout rank 0: sender trainer rank 0 did not send bucket 0 of policy version 7: Connection closed by peer")))
    # the job's own failures are not retried by rebuilding workers
    assert not is_worker_loss(_task_error(WeightStreamError("rollout rank 0: unknown dtype 'fp7' in a header")))
    assert not is_worker_loss(_task_error(ValueError("reward function returned a string")))
    assert not is_worker_loss(_task_error(RuntimeError("shape mismatch: timed out is not in here")))
    assert not is_worker_loss(RuntimeError("CUDA error: device-side assert triggered"))


def test_a_rank_failure_names_the_ranks_that_died_and_that_never_answered():
    err = RankFailure("actor.update_actor", ["pool default rank 1 (10.244.0.5)"], ["pool default rank 2 (10.244.0.6)"],
                      ["pool default rank 0 (10.244.0.4)"], RuntimeError(GLOO_RESET))
    msg = str(err)
    assert msg.startswith("actor.update_actor: pool default rank 1 (10.244.0.5) died; pool default rank 2 "
                          "(10.244.0.6) did not answer; pool default rank 0 (10.244.0.4) failed with them"), msg
    assert "Connection reset by peer" in msg


def test_recoveries_follow_the_restart_policy_and_stop_at_the_replacement_limit():
    lost = ray.exceptions.ActorDiedError()
    r = Recoveries(RunPolicy(replacement_limit=2))
    assert not r.recoverable(ValueError("the job's own bug"))
    assert r.recoverable(lost) and r.recoverable(lost)
    assert not r.recoverable(lost), "a third loss is past replacementLimit 2: the driver fails, the gang restarts"
    assert r.step_logged() is not None and r.step_logged() is None  # the first step after a recovery carries it
    assert not Recoveries(RunPolicy(restart_policy="gang")).recoverable(lost)


def test_the_progress_deadline_scales_with_the_slowest_step_above_a_floor():
    default = RunPolicy()
    assert progress_deadline(default, None) == STALL_FLOOR_SECONDS  # before the first step: the floor
    assert progress_deadline(default, 30.0) == STALL_FLOOR_SECONDS
    assert progress_deadline(default, 300.0) == 3000.0
    assert progress_deadline(RunPolicy(progress_deadline_seconds=60), 300.0) == 60.0
    assert collective_timeout(RunPolicy(progress_deadline_seconds=60)) == 60.0
    assert collective_timeout(default) == 1800.0  # torch's own default: a long stage of a large model is no hang
    # until the first step the controller waits as long as the operator's start-up deadline allows
    assert startup_call_timeout(RunPolicy(progress_deadline_seconds=60)) == STALL_FLOOR_SECONDS
    assert startup_call_timeout(RunPolicy(progress_deadline_seconds=60, startup_deadline_seconds=3600)) == 3600.0
    assert startup_call_timeout(default) == 1800.0


def _worker_pids() -> set[int]:
    """This job's worker processes: the WorkerHosts under this process (the shared Ray is in-process: its raylet,
    and the workers it spawns, descend from it). Not every WorkerHost on the machine: make test runs another pytest
    process with a Ray and jobs of its own beside this one, whose worker a fault here once killed instead."""
    import psutil

    out = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("ray::WorkerHost" in part for part in p.cmdline()):
                out.add(p.pid)
    return out


def _logged(ckpt: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (ckpt / "steps.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _wait(what, timeout: float, done: threading.Event):
    end = time.monotonic() + timeout
    while time.monotonic() < end and not done.is_set():
        got = what()
        if got:
            return got
        time.sleep(0.2)
    return None


@pytest.mark.slow
def test_a_killed_and_a_stopped_worker_are_recovered_in_place_and_no_step_is_lost_or_repeated(tmp_path, run_here):
    """The tiny job, 10 steps, a checkpoint every 2. After step 3 one worker process is SIGKILLed (its call dies at
    once, the other rank's collective loses its peer): the controller names the dead rank, rebuilds both worker
    processes and resumes from step 2's checkpoint. After step 7 a worker is SIGSTOPped (it never answers): the other
    rank's collective times out after runPolicy's deadline (20 s here), the stopped rank is named as not answering,
    and the job recovers again. It ends with exit 0, steps 1..10 logged once each, two recoveries timed."""
    ckpt = tmp_path / "ckpt"
    done = threading.Event()
    faults: list[tuple[str, int]] = []

    def inject() -> None:
        first = _wait(lambda: any(r["step"] >= 3 for r in _logged(ckpt)) and _worker_pids(), 300, done)
        if not first:
            return
        victim = sorted(first)[-1]
        os.kill(victim, signal.SIGKILL)
        faults.append(("kill", victim))
        if not _wait(lambda: any("recovery_seconds" in r for r in _logged(ckpt))
                     and max(r["step"] for r in _logged(ckpt)) >= 7, 300, done):
            return
        victim = sorted(_worker_pids())[-1]
        os.kill(victim, signal.SIGSTOP)
        faults.append(("stop", victim))

    thread = threading.Thread(target=inject, daemon=True)
    thread.start()
    try:
        rc, printed = run_here(ROOT / "examples" / "tiny-grpo.yaml", {
            "spec.rollout.engine": "hf", "spec.trainer.steps": 10, "spec.trainer.saveFreq": 2,
            "spec.trainer.eval": False, "spec.trainer.checkpointDir": str(ckpt),
            "spec.runPolicy.progressDeadlineSeconds": 20})
    finally:
        done.set()
        thread.join(timeout=10)
        for _, pid in faults:  # a stopped process must not outlive the test, whatever happened
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert [kind for kind, _ in faults] == ["kill", "stop"], (faults, printed[-3000:])
    assert rc == 0, printed[-3000:]
    assert "worker lost (1/3 in-place recoveries)" in printed and " died" in printed, printed[-3000:]
    assert "worker lost (2/3 in-place recoveries)" in printed and "did not answer" in printed, printed[-3000:]
    records = _logged(ckpt)
    assert [r["step"] for r in records] == list(range(1, 11)), "a step was lost or repeated"
    recovered = [r["recovery_seconds"] for r in records if "recovery_seconds" in r]
    assert len(recovered) == 2 and all(s > 0 for s in recovered), recovered
