"""When a job has nothing to do (`resting`, pure), and the handler's scheduler of those rests: a resting job's
tick returns at once, until its object changes, its time is up (a TTL, a backoff while it waits for something
outside it) or, for a Pending job, a followed child is lost, or, for a queued job, its Workload changes."""
from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import NamedTuple

import kopf

from hybridflow.api import RLHFJob
from hybridflow.api.status import TERMINAL, JobStatus, Phase
from hybridflow_operator import kueue
from hybridflow_operator.plan import Plan, Queue, parse_time
from hybridflow_operator.state import INTERVAL, RETRY_MAX_SECONDS, JobMemory, Resting

# Rests (phases.resting) of a Pending job, whose pods may be on their way: a followed child lost ends them. A
# suspended or finished job has no running pod to fence; a resume is a gang start, which checks its children anyway.
PENDING_RESTS = ("inputs", "refused")


class Rest(NamedTuple):
    """Why a job has nothing to do, and how long it may rest without any change to its spec or its pods."""
    why: str  # suspended | queued | finished | ttl | inputs | refused
    at_most: float | None  # seconds; None: until a change
    retry: bool = False  # what it waits for is outside the job (a PVC made, a quota raised): look again with a backoff


def resting(job: RLHFJob | None, status: JobStatus, now: dt.datetime) -> Rest | None:
    """Whether a job, in this status, has nothing to do until its spec or its pods change, or None when it is active
    (Pending with its pods on their way, Initializing, Running, Restarting, Suspending: every tick counts).

    - "suspended": runPolicy.suspend, every pod gone; only unsuspending (a spec change) moves it.
    - "queued": its Kueue Workload is not admitted; a change of the Workload (the caller follows it) or of the job
      moves it.
    - "finished" / "ttl": Succeeded or Failed; its TTL (runPolicy.ttlSecondsAfterFinished) is all that is left, so
      it rests until then, or for good without one.
    - "inputs" / "refused": Pending while a PVC or the reward file is missing (InputsReady False), or while the API
      server refuses its pods (CreateRefused True: a quota, an admission policy). Nothing of the job's own tells when
      that ends: the caller looks again with a backoff, never past runPolicy.activeDeadlineSeconds."""
    phase, conds = status.get("phase"), status.get("conditions", [])
    if phase in TERMINAL:
        ttl = job.spec.run_policy.ttl_seconds_after_finished if job is not None else None
        done = parse_time(status.get("completionTime"))
        if ttl is None or done is None:
            return Rest("finished", None)
        return Rest("ttl", max(0.0, ttl - (now - done).total_seconds()))
    if job is None:
        return None
    if phase == Phase.SUSPENDED:
        return Rest("suspended", None) if job.spec.run_policy.suspend else None
    if phase == Phase.QUEUED:  # until its Workload changes (Kueue admits it), or the job does
        return Rest("queued", None)
    if phase != Phase.PENDING:
        return None
    why = ("inputs" if any(c["type"] == "InputsReady" and c["status"] == "False" for c in conds) else
           "refused" if any(c["type"] == "CreateRefused" and c["status"] == "True" for c in conds) else None)
    if why is None:
        return None
    deadline, started = job.spec.run_policy.active_deadline_seconds, parse_time(status.get("startTime"))
    left = max(0.0, deadline - (now - started).total_seconds()) if deadline and started else None
    return Rest(why, left, retry=True)


def backoff(tries: int, first: float, most: float) -> float:
    """Seconds before the next look at a job waiting for something outside it: first, doubling each try, at most
    `most`."""
    return min(most, first * 2 ** min(tries, 32))


def job_rests(body: kopf.Body, memory: JobMemory, lost: Callable[[], set[tuple[str, str]]],
           workload: Callable[[], kueue.Admission | None]) -> bool:
    """Whether this tick has nothing to do: the job rests, unchanged since, and its time is not up. No API call,
    no parse, no decide: 5,000 suspended jobs at a 5 s interval are 1,000 ticks a second (a job waiting for a PVC
    used to make 8 requests at each). A Pending job's rest also ends when one of its followed children is gone
    (`lost`, from the watches' index: still no request), so that the tick makes it again; no other event of its
    children ends a rest."""
    rest = memory.rest
    if rest is None:
        return False
    if body["metadata"].get("resourceVersion") != rest.version:  # edited (e.g. unsuspended): act, back off anew
        _wake(memory, again=True)
        return False
    ended = ((rest.until is not None and time.monotonic() >= rest.until)
             or (rest.why in PENDING_RESTS and lost())
             or (rest.why == "queued" and workload() != rest.workload))  # Kueue decided (or the Workload went)
    if ended:
        _wake(memory)
        return False
    return True


def _wake(memory: JobMemory, again: bool = False) -> None:
    """The rest ends; `again`: the job changed, so a wait that follows backs off from its first delay."""
    memory.rest = None
    if again:
        memory.rest_tries = 0


def rest_after(body: kopf.Body, memory: JobMemory, job: RLHFJob | None, status: JobStatus, plan: Plan,
                now: dt.datetime, queue: Queue | None = None) -> None:
    """After a tick that did nothing (no write, create, delete or event), let the job rest if `resting` says it has
    nothing to do: until a change when suspended or finished without a TTL; until its TTL; when it waits for
    something outside it, for a backoff (INTERVAL doubling up to RETRY_MAX_SECONDS, never past its deadline)."""
    idle = (plan.status == status and not plan.delete_pods and plan.create_gang is None and not plan.events
            and not plan.delete_job)
    rest = resting(job, plan.status, now) if idle else None
    if rest is None:
        _wake(memory, again=True)
        return
    tries = memory.rest_tries if rest.retry else 0
    wait = backoff(tries, INTERVAL, RETRY_MAX_SECONDS) if rest.retry else None
    if rest.at_most is not None:
        wait = rest.at_most if wait is None else min(wait, rest.at_most)
    memory.rest_tries = tries + 1
    memory.rest = Resting(rest.why, body["metadata"].get("resourceVersion"),
                          None if wait is None else time.monotonic() + wait, queue.workload if queue else None)
