"""The rollout's end of agent programs run in the job's sandbox pool (hybridflow.agents.pool_programs):
`RemotePrograms`, the Programs of hybridflow.agents.protocol over HTTP, each episode's run sent to the replica with
the fewest runs this client has under way there (replicas that just failed to answer last; ties: the next one in
turn), with the endpoint's TCP address (EndpointAddress.url) and the episode's token. The replica relays its
program's socket there.

A replica that does not answer (refused, reset, past the run's deadline plus the sandbox's start and MARGIN_SECONDS)
loses the episode: its result is failure LOST, and run_program_episodes runs it again from its prompt, with a new
token, on another replica (as the built-in loop does for SessionLost). A replica that answers a server error (5xx)
could not run it (failure UNAVAILABLE); neither counts against spec.rollout.agent.maxFailedFraction. A refusal that
no other replica or later step mends, of its sandbox token (401) or of the request (400, 404: a replica that serves no
program, an endpoint its relay may not reach), raises PoolError, as RemoteTools and RemoteSessions do: counted
nowhere, every episode would fail that way, step after step, and the job would train on nothing."""
from __future__ import annotations

import math
import threading
from collections import Counter

from hybridflow.agents.local import LOAD_SECONDS
from hybridflow.agents.loop import LOST, NOT_RUN, UNAVAILABLE, USER_CODE
from hybridflow.agents.protocol import EndpointAddress, Info, ProgramResult
from hybridflow.sandbox_pool import MARGIN_SECONDS, PoolClient, PoolError, Unreachable, unexpected

PATH = "/v1/programs/run"
KINDS = frozenset({*USER_CODE, LOST, NOT_RUN, UNAVAILABLE})  # the failure kinds a replica may answer


class RemotePrograms:
    """Agent programs run by the pool's replicas."""

    def __init__(self, client: PoolClient) -> None:
        self.client = client
        self._running: Counter[int] = Counter()  # replica index -> runs under way there
        self._lock = threading.Lock()

    def _pick(self) -> int:
        n = len(self.client.replicas)
        start = self.client.next_index()
        order = [(start + i) % n for i in range(n)]
        with self._lock:
            index = min(order, key=lambda i: (self.client.cooling(i), self._running[i]))
            self._running[index] += 1
        return index

    def run(self, sample: Info, endpoint: EndpointAddress, timeout: float) -> ProgramResult:
        if endpoint.url is None:
            return ProgramResult(error="the rollout's endpoint has no TCP listener for the sandbox pool to reach",
                                 failure=NOT_RUN)
        index = self._pick()
        url = self.client.replicas[index].url
        body = {"sample": sample, "endpoint": endpoint.url, "token": endpoint.token}
        try:  # PoolError (a wrong token, an answer too large) is raised: the job stops, saying why
            code, out = self.client.request(index, "POST", PATH, body, timeout + LOAD_SECONDS + MARGIN_SECONDS)
        except Unreachable as err:
            return ProgramResult(error=str(err), failure=LOST)
        finally:
            with self._lock:
                self._running[index] -= 1
        if code in (400, 404):  # the request refused (no program here, an endpoint it may not reach): every episode's
            raise unexpected(url, "an agent program's run", code, out)  # would be, and none would be counted
        if code != 200:
            return ProgramResult(error=str(unexpected(url, "an agent program's run", code, out)), failure=UNAVAILABLE)
        try:
            return result_from_json(out)
        except (KeyError, TypeError, ValueError) as err:
            return ProgramResult(error=f"sandbox replica {url} answered an agent program's run with what is no "
                                       f"result: {err}", failure=UNAVAILABLE)

    def close(self) -> None:
        """Nothing to kill from here: the endpoint stopped first (run_program_episodes), so a run still under way
        fails at its next call to the model, and its replica kills it at its deadline at the latest."""

    def request_counts(self) -> dict[str, int]:
        return self.client.request_counts()

    def running_counts(self) -> dict[str, int]:
        """Runs this client has under way on each replica."""
        with self._lock:
            return {r.url: self._running[i] for i, r in enumerate(self.client.replicas)}


def result_from_json(d: Info) -> ProgramResult:
    """A replica's answer (its driver's ProgramResult, never the program's own reply); ValueError for what no
    replica may answer (a reward that is not finite, an unknown failure kind)."""
    error, failure = d.get("error"), d.get("failure")
    if error is not None:
        if failure not in KINDS:
            raise ValueError(f"unknown failure kind {failure!r:.80}")
        return ProgramResult(error=str(error)[:4000], failure=str(failure))
    reward = float(d["reward"])
    metrics = {str(k): float(v) for k, v in dict(d.get("metrics") or {}).items()}
    if not all(math.isfinite(x) for x in (reward, *metrics.values())):
        raise ValueError("a reward or metric is not a finite number")
    return ProgramResult(reward=reward, metrics=metrics)
