"""What the multi-turn rollout needs of the places user code runs: tool calls and environment sessions, as data and
two Protocols, the same whether they run in sandboxes on this machine (hybridflow.agents.local) or in the job's
environment pool over HTTP (hybridflow.agents.remote). Plain values only cross them (str, float, bool, dicts of
those), so that a reply can travel as JSON and the rollout never unpickles anything user code made."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol, Sequence

Info = dict[str, Any]  # JSON-able: str, int, float, bool, None, and lists and dicts of those


@dataclass(frozen=True)
class ToolResult:
    """What one tool call gave back: its text (an error's or a timeout's too: the model sees it as the tool's
    answer), and how it went, for the metrics."""

    text: str
    error: str | None = None  # the tool raised, returned something unusable, or a sandbox limit stopped it
    timed_out: bool = False
    seconds: float = 0.0
    # a user's tool whose code cannot work, decided by the driver (hybridflow.agents.local), never by what the
    # sandboxed process says of itself: its file did not load (or its sandbox died loading it), or the call raised
    # NameError, or ImportError at an import line, in the tools file itself (broken whatever the model passed). Never
    # a built-in tool, a timeout, what else the tool raised (its answer to the model's arguments), nor its sandbox
    # dying during the call (the model's arguments can do that). The model still reads it; the episode goes on,
    # counted as failed, against spec.rollout.agent.maxFailedFraction
    crashed: bool = False
    # no sandbox could run it (the machine could not start one, the pool's replica answered an HTTP error): reported
    # with the episode, never counted against maxFailedFraction (not the user's code)
    unavailable: bool = False

    def to_json(self) -> Info:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Info) -> "ToolResult":
        """A pool replica's answer (its driver's ToolResult, never a tool process's own reply)."""
        return cls(str(d["text"]), d.get("error"), bool(d.get("timed_out", False)), float(d.get("seconds", 0.0)),
                   bool(d.get("crashed", False)), bool(d.get("unavailable", False)))


@dataclass(frozen=True)
class Observation:
    """What an environment says after `reset` (text only) or after a step: its text for the model, the step's
    reward, whether the episode is over, and its info. `error`: the step failed (raised, timed out, its sandbox
    died); the episode then ends with the rewards so far and the error is reported with its sample."""

    text: str
    reward: float = 0.0
    done: bool = False
    info: Info = field(default_factory=dict)
    error: str | None = None
    # the pool could not step it (its replica answered an HTTP error): the episode ends, reported, but not counted
    # against maxFailedFraction. Set by the rollout's own client only: from_json never reads it
    unavailable: bool = False

    def to_json(self) -> Info:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Info) -> "Observation":
        """Raises ValueError for what no environment may answer (JSON allows NaN; a forged reply can hold anything)."""
        try:
            reward = float(d.get("reward", 0.0))
        except OverflowError:  # a JSON integer of hundreds of digits
            raise ValueError("the reward is too large for a float") from None
        if not math.isfinite(reward):
            raise ValueError(f"the reward {reward} is not a finite number")
        return cls(str(d["text"]), reward, bool(d.get("done", False)), dict(d.get("info") or {}), d.get("error"))


class EnvironmentLoadError(RuntimeError):
    """The environment's code does not load (a syntax error, no such class, it raises at import): the job stops,
    naming the file, since every episode would fail the same way."""


class SessionLost(RuntimeError):
    """The place holding a session is gone (an environment pod died or restarted): the episode cannot go on there
    and is started again from its prompt elsewhere, not lost."""


class Tools(Protocol):
    """Runs the job's tools (built-in and the user's) in the sandbox, each call with its own deadline."""

    def call(self, name: str, arguments: Info, session: str | None = None) -> ToolResult:
        """One tool call. Never raises for what the tool does (an error or a timeout is a ToolResult); raises
        SessionLost only when the place that runs it is gone. `session`: the episode's session, if any (a remote
        pool keeps an episode's calls on one replica)."""

    def close(self) -> None: ...


class Sessions(Protocol):
    """Environment sessions: one environment object per episode, living in the sandbox for the episode's life."""

    def open(self, sample: Info) -> tuple[str, Observation]:
        """A new episode for `sample` (its prompt text, ground truth, data source, extra info): its session id and
        the environment's first observation (reset)."""

    def step(self, session: str, action: str) -> Observation:
        """The model's turn (its text) -> the environment's answer. A step past its deadline or whose sandbox died
        is an Observation with `error` and done; SessionLost when the session's replica is gone."""

    def close(self, session: str) -> None:
        """The episode is over: its sandbox goes (idempotent; unknown ids are ignored)."""

    def shutdown(self) -> None:
        """Every session goes, and whatever runs them."""


def _no_requests() -> dict[str, int]:
    return {}


@dataclass(frozen=True)
class EndpointAddress:
    """Where an agent program reaches the job's OpenAI-compatible endpoint for one episode: a Unix socket (bound
    into the program's sandbox, which has no network) and the episode's bearer token, which the endpoint accepts
    for that episode only and forgets when the episode ends. The client's base URL is BASE_URL over that socket."""

    socket_path: str
    token: str
    # the endpoint's TCP listener, "http://host:port" (Listen), when the job's programs run in its sandbox pool:
    # the replica serves the program a socket of its own that relays to it (hybridflow.agents.relay); None: the
    # endpoint listens on its Unix socket alone (programs run in this machine's sandboxes)
    url: str | None = None

    BASE_URL = "http://hybridflow/v1"


@dataclass(frozen=True)
class Listen:
    """Where the rollout's endpoint also listens on TCP, for programs run in the sandbox pool: `host` (the pod's
    address), and `ports`, the range (first, last) it takes the first free port of (None: one the OS chooses).
    Every request there needs a live episode token too (401 otherwise), as on the Unix socket."""

    host: str
    ports: tuple[int, int] | None = None


@dataclass(frozen=True)
class ProgramResult:
    """What one run of a user's agent program (spec.rollout.agent.program) came to: its reward and metrics, or why
    it failed (`error`, with the program's file and line where there is one; `failure`, the kind, one of
    hybridflow.agents.loop's failure kinds: PROGRAM when the user's code failed, else the places')."""

    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    failure: str | None = None


class Programs(Protocol):
    """Where a job's agent programs run: each run in a sandbox of its own, the endpoint's socket bound in (a socket
    of the sandbox pool's replica relaying to the endpoint's TCP listener, EndpointAddress.url, where it runs
    there)."""

    def run(self, sample: Info, endpoint: EndpointAddress, timeout: float) -> ProgramResult:
        """`await run(client, sample)` of the user's file, `client` an openai.AsyncOpenAI at `endpoint`, within
        `timeout` seconds; never raises for the program's own failures (they are the result's error)."""

    def close(self) -> None:
        """Kills the runs still going (their `run` returns them failed); later runs still start (a rollout whose
        engine failed closes its programs, and the job's next rollout runs on the same Programs)."""


@dataclass
class Places:
    """Where a job's tools, environment sessions and agent programs run (None: the job has none), and the requests
    sent so far to each replica of its environment pool (none when they run on this machine)."""

    tools: Tools | None = None
    sessions: Sessions | None = None
    request_counts: Callable[[], dict[str, int]] = _no_requests
    programs: Programs | None = None
    listen: Listen | None = None  # the endpoint's TCP listener, for programs run elsewhere (None: its socket alone)


class AgentSettings(Protocol):
    """What the places read of an agent's settings (spec.rollout.agent, hybridflow.api.agents.Agent): the tools and
    the environment the job names, and their deadlines. A Protocol here: the job's API sits above this package (it
    checks names against its registries)."""

    @property
    def tools(self) -> Sequence[str]: ...  # registered built-in tools

    @property
    def tools_file(self) -> str | None: ...

    @property
    def environment(self) -> str | None: ...  # a registered environment

    @property
    def environment_file(self) -> str | None: ...

    @property
    def environment_class(self) -> str: ...

    @property
    def tool_timeout_seconds(self) -> float: ...

    @property
    def step_timeout_seconds(self) -> float: ...

    @property
    def has_environment(self) -> bool: ...
