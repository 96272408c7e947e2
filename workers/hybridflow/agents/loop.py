"""Many episodes at once over one generation engine (HybridFlow's rollout, multi-turn).

An episode alternates the model's turn with an answer: a tool's, when the turn calls tools, else the
environment's step (or, with no environment, the turn is the final answer). Token in, token out: the episode is the
exact ids the engine produced, with the tokenized answers appended between turns, and a loss mask that is 1 on the
model's own tokens only; decoded text is only ever read (to find tool calls, to give the environment its action),
never tokenized back.

Scheduling: every episode that waits for the model goes into the next engine call, so turns of different episodes
share the engine's batches; tool calls and environment steps run on a thread pool meanwhile, so a slow tool holds
back its own episode only. When no episode waits for the model the loop waits for the first answer, then briefly
for others, so that answers arriving together share a call.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from hybridflow.agents.protocol import (EnvironmentLoadError, Info, Observation, SessionLost, Sessions, ToolResult,
                                       Tools)
from hybridflow.agents.toolcalls import parse_tool_calls

GATHER_SECONDS = 0.05  # after the first answer, how long the loop waits for more before the next engine call
RETRIES = 2  # an episode whose session's replica is lost starts again this many times, then fails
# What failed an episode (Episode.failure): the step's report counts them by kind (hybridflow.trainer.episodes).
# The user's code failed: counted against spec.rollout.agent.maxFailedFraction
RESET, STEP, TOOL, PROGRAM = "environment reset", "environment step", "tool crash", "agent program"
USER_CODE = frozenset({RESET, STEP, TOOL, PROGRAM})
# The places that run it failed (a replica lost, no sandbox could start, a replica's HTTP error): reported, not counted
LOST, NOT_RUN, UNAVAILABLE = "replica lost", "not run", "sandbox unavailable"


class Model(Protocol):
    def generate(self, rows: Sequence[int], contexts: Sequence[list[int]],
                 max_tokens: Sequence[int]) -> list[tuple[list[int], list[float]]]:
        """One turn for each context (episode `rows[i]`'s prompt and tokens so far): its tokens and their
        log-probs (empty when not asked for)."""


class Codec(Protocol):
    stop_token_ids: frozenset[int]

    def decode(self, ids: Sequence[int]) -> str: ...

    def observation_ids(self, parts: Sequence[tuple[str, str]], closed: bool) -> list[int]:
        """The tokens of answers (role, text) appended after a model turn, the turn's own end included when the
        model did not write it (`closed` false)."""


@dataclass(frozen=True)
class EpisodeSettings:
    max_tokens: int  # the episode's tokens after its prompt, model and observation tokens together
    max_turns: int = 4
    max_tokens_per_turn: int | None = None
    has_environment: bool = False
    concurrent: int = 64


@dataclass
class Episode:
    """One trajectory after its prompt: tokens, loss mask (1: the model's), the engine's log-probs (0 elsewhere),
    and what happened."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    env_reward: float = 0.0
    # each environment step's reward at the position of the model's last token of the turn it answered, so that
    # token-level estimators (GAE, discounted returns) credit the turn that earned it; env_reward is their sum
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    env_steps: int = 0
    retries: int = 0
    truncated: bool = False  # it ran out of its token budget
    # its first failure, reported with the sample: its environment's reset or a step failed (a non-finite reward
    # included), its replica was lost too often, or a sandbox did not start (the episode ended there); or one of its
    # tools crashed (ToolResult.crashed: the episode went on); the user's code's first failure before any other
    error: str | None = None
    failure: str | None = None  # the kind of that failure: one of USER_CODE, LOST, NOT_RUN or UNAVAILABLE
    # an agent program's episode (hybridflow.agents.program_loop): the prompt it trained on (its first call's, not
    # the data set's: None for the loop's episodes), and how often its calls did not continue each other
    prompt_ids: list[int] | None = None
    trajectory_breaks: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # what its program returned beside its reward

    def add(self, ids: Sequence[int], model: bool, log_probs: Sequence[float] = ()) -> None:
        self.tokens.extend(ids)
        self.loss_mask.extend([1 if model else 0] * len(ids))
        self.log_probs.extend(list(log_probs) if model and log_probs else [0.0] * len(ids))

    def restart(self) -> None:
        kept = self.retries + 1
        self.__init__()  # type: ignore[misc]
        self.retries = kept


@dataclass
class _Live:
    episode: Episode
    session: str | None = None
    done: bool = False


def run_episodes(prompts: Sequence[list[int]], samples: Sequence[Info], model: Model, codec: Codec,
                 settings: EpisodeSettings, tools: Tools | None = None,
                 sessions: Sessions | None = None) -> list[Episode]:
    """Every prompt's episode to its end; `samples[i]` is what the environment's reset gets for prompt i."""
    n = len(prompts)
    live: dict[int, _Live] = {}
    waiting = list(range(n))  # not started yet (at most `concurrent` run at once)
    ready: list[int] = []  # waiting for the model
    pending: dict[Future, int] = {}  # an answer (reset, tool calls, a step) being computed
    finished: dict[int, Episode] = {}
    with ThreadPoolExecutor(max(1, min(settings.concurrent, n)), thread_name_prefix="episode") as pool:

        def start(i: int, episode: Episode | None = None) -> None:
            live[i] = _Live(episode or Episode())
            if sessions is None:
                ready.append(i)
            else:
                pending[pool.submit(_reset, sessions, samples[i], codec)] = i

        def finish(i: int) -> None:
            state = live.pop(i)
            if sessions is not None and state.session is not None:
                sessions.close(state.session)
            finished[i] = state.episode

        def lost(i: int, why: str) -> None:
            state = live.pop(i)
            if sessions is not None and state.session is not None:
                sessions.close(state.session)  # what is left of it on its replica, if anything
            if state.episode.retries >= RETRIES:
                state.episode.error = f"its environment replica was lost {RETRIES + 1} times ({why})"
                state.episode.failure = LOST
                finished[i] = state.episode
                return
            state.episode.restart()
            start(i, state.episode)

        def top_up() -> None:
            while waiting and len(live) < settings.concurrent:
                start(waiting.pop(0))

        top_up()
        while live or waiting:
            if ready:
                rows, ready[:] = list(ready), []
                budgets = [_turn_budget(live[i].episode, settings) for i in rows]
                outs = model.generate(rows, [list(prompts[i]) + live[i].episode.tokens for i in rows], budgets)
                for i, (tokens, log_probs) in zip(rows, outs):
                    answer = _after_turn(live[i], tokens, log_probs, settings, codec, tools, sessions)
                    if answer is None:
                        finish(i)
                    else:
                        pending[pool.submit(answer)] = i
            elif pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                more, _ = wait([f for f in pending if f not in done], timeout=GATHER_SECONDS)
                for fut in [*done, *more]:
                    i = pending.pop(fut)
                    try:
                        result = fut.result()
                    except SessionLost as err:
                        lost(i, str(err))
                        continue
                    except EnvironmentLoadError:
                        raise
                    except Exception as err:  # noqa: BLE001 - e.g. no sandbox could start: this episode ends, reported
                        result = _Answer([], done=True, error=f"{type(err).__name__}: {err}",
                                         failure=UNAVAILABLE if live[i].episode.turns else NOT_RUN)
                    _apply(live[i], result, settings, codec)
                    if live[i].done:
                        finish(i)
                    else:
                        ready.append(i)
            top_up()
    return [finished[i] for i in range(n)]


@dataclass
class _Answer:
    """What came back for an episode: observation parts to append, reward, whether it is over."""

    parts: list[tuple[str, str]]
    closed: bool = True
    reward: float = 0.0
    done: bool = False
    error: str | None = None
    session: str | None = None
    tools: list[ToolResult] = field(default_factory=list)
    env_step: bool = False
    failure: str | None = None  # the kind of `error` (Episode.failure)


def _reset(sessions: Sessions, sample: Info, codec: Codec) -> _Answer:
    sid, first = sessions.open(sample)
    return _Answer([("user", first.text)] if first.text else [], closed=False, done=first.done or bool(first.error),
                   error=first.error, session=sid, failure=RESET if first.error else None)


def _turn_budget(episode: Episode, settings: EpisodeSettings) -> int:
    left = settings.max_tokens - len(episode.tokens)
    return max(1, min(left, settings.max_tokens_per_turn or left))


def _after_turn(state: _Live, tokens: list[int], log_probs: list[float], settings: EpisodeSettings, codec: Codec,
                tools: Tools | None, sessions: Sessions | None) -> Callable[[], _Answer] | None:
    """Record the model's turn; the answer to compute next (a callable for the pool), or None when it is over."""
    e = state.episode
    tokens = tokens[: settings.max_tokens - len(e.tokens)]
    e.add(tokens, model=True, log_probs=log_probs[: len(tokens)])
    e.turns += 1
    closed = bool(tokens) and tokens[-1] in codec.stop_token_ids
    if len(e.tokens) >= settings.max_tokens and not closed:
        e.truncated = True
    text = codec.decode(tokens)
    calls = parse_tool_calls(text) if tools is not None else []
    last_turn = e.turns >= settings.max_turns or len(e.tokens) >= settings.max_tokens
    session = state.session
    if calls:
        if last_turn:
            return None

        def run_tools() -> _Answer:
            results = [ToolResult(f"Error: {c.error}.", error=c.error) if c.error else tools.call(c.name, c.arguments,
                                                                                                   session)
                       for c in calls]
            crash = next(((c.name, r.error) for c, r in zip(calls, results) if r.crashed), None)
            down = next(((c.name, r.error) for c, r in zip(calls, results) if r.unavailable), None)
            error = (f"the {crash[0]} tool crashed: {crash[1]}" if crash else
                     f"the {down[0]} tool could not run: {down[1]}" if down else None)
            return _Answer([("tool", r.text) for r in results], closed, tools=results, error=error,
                           failure=TOOL if crash else UNAVAILABLE if down else None)

        return run_tools
    if settings.has_environment and sessions is not None and session is not None:
        def step() -> _Answer:
            obs: Observation = sessions.step(session, text)
            over = obs.done or bool(obs.error) or last_turn
            return _Answer([] if over else [("user", obs.text)], closed, obs.reward, over, obs.error, env_step=True,
                           failure=None if not obs.error else UNAVAILABLE if obs.unavailable else STEP)

        return step
    return None


def _apply(state: _Live, answer: _Answer, settings: EpisodeSettings, codec: Codec) -> None:
    e = state.episode
    if answer.session is not None:
        state.session = answer.session
    e.env_reward += answer.reward
    if answer.env_step and answer.reward and e.tokens:
        e.turn_rewards.append((len(e.tokens) - 1, answer.reward))  # before the answer's own tokens are added
    e.env_steps += int(answer.env_step)
    for r in answer.tools:
        e.tool_calls += 1
        e.tool_errors += int(r.error is not None and not r.timed_out)
        e.tool_timeouts += int(r.timed_out)
        e.tool_seconds += r.seconds
    if answer.error and (e.error is None or (e.failure not in USER_CODE and answer.failure in USER_CODE)):
        e.error, e.failure = answer.error, answer.failure
    if answer.parts:
        ids = codec.observation_ids(answer.parts, answer.closed)
        room = settings.max_tokens - len(e.tokens)
        e.add(ids[:room], model=False)
        if len(ids) >= room:
            e.truncated = True
    state.done = answer.done or len(e.tokens) >= settings.max_tokens
