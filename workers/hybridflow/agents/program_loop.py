"""A rollout of agent programs (spec.rollout.agent.program): the user's `async def run(client, sample)` drives each
episode, calling the model through the job's OpenAI-compatible endpoint (hybridflow.agents.endpoint), and what is
trained is what the engine read and wrote in those calls (hybridflow.agents.trajectory), never the text the program
kept or sent back.

Up to `settings.concurrent` programs run at once, each on a thread of a pool waiting on its sandbox
(Programs.run); this function's thread is the only one that calls the engine (Endpoint.pump), so that concurrent
episodes' requests share its batches as run_episodes' turns do. The endpoint stops when the rollout ends, an engine
error included: then the programs still running are killed (Programs.close, every STOP_SECONDS until none is left:
a run may have started its sandbox a moment after the last kill) rather than waited for to their deadlines, and the
error raised (EngineFailed) names the rows and the first sample whose requests the engine failed on.

Programs run in the job's sandbox pool (hybridflow.agents.remote_programs) reach the endpoint on TCP (`listen`); an
episode whose replica was lost (failure LOST) is run again from its prompt with a new token, at most loop.RETRIES
times, its lost run's calls dropped (as run_episodes starts an episode again after SessionLost); a PoolError (the
pool refused the job's token or request) ends the rollout as an engine error does.
"""
from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Sequence

from hybridflow.agents.codec import ObservationCodec
from hybridflow.agents.endpoint import Endpoint, EndpointSettings, Ended
from hybridflow.agents.loop import LOST, NOT_RUN, PROGRAM, RETRIES, Episode, EpisodeSettings, Model
from hybridflow.agents.protocol import EndpointAddress, Info, Listen, ProgramResult, Programs
from hybridflow.agents.trajectory import Call, sequences
from hybridflow.sandbox_pool import PoolError

PUMP_SECONDS = 0.05  # how long the engine's thread waits for a request before it looks at the programs again
STOP_SECONDS = 0.5  # after an error: how often the programs still running are killed until none is left


class EngineFailed(RuntimeError):
    """The engine raised answering agent programs' requests (the original is its __cause__): the rollout fails."""


class _Engine:
    """The model as the endpoint calls it, keeping the rows of a call that raised (for EngineFailed's message)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.failed_rows: list[int] | None = None

    def generate(self, rows: Sequence[int], contexts: Sequence[list[int]],
                 max_tokens: Sequence[int]) -> list[tuple[list[int], list[float]]]:
        try:
            return self.model.generate(rows, contexts, max_tokens)
        except BaseException:
            self.failed_rows = list(rows)
            raise


def _engine_failure(rows: Sequence[int], samples: Sequence[Info], err: BaseException) -> str:
    """EngineFailed's message: the failed call's rows and its first row's sample, as failed episodes name theirs."""
    first = samples[rows[0]] if rows else {}
    parts = [f"{name} {first[key]!r:.80}" for key, name in (("ground_truth", "ground truth"),
                                                             ("data_source", "data source")) if key in first]
    shown = ", ".join(str(r) for r in rows[:8]) + (f" and {len(rows) - 8} more" if len(rows) > 8 else "")
    sample = f"; the first, sample {rows[0]}" + (f" ({', '.join(parts)})" if parts else "") if rows else ""
    return (f"the engine failed on agent programs' requests of rows {shown}{sample}: {type(err).__name__}: {err} "
            "(the rollout's programs were stopped)")


def run_program_episodes(samples: Sequence[Info], model: Model, codec: ObservationCodec, programs: Programs,
                         settings: EpisodeSettings, timeout: float,
                         max_context: int | None = None, trajectory: str = "merged",
                         listen: Listen | None = None) -> list[list[Episode]]:
    """Every sample's episode: its program run to its end (or `timeout` seconds), its calls assembled into its
    trained sequences (`trajectory`: merged or per_call; `assemble`). Episode i's engine calls carry row i
    (Model.generate's `rows`), so that per-row sampling settings (greedy rows) hold. `listen`: the endpoint's TCP
    listener too (Places.listen), for programs run in the sandbox pool."""
    n = len(samples)
    if n == 0:
        return []
    endpoint = Endpoint(codec, EndpointSettings(settings.max_tokens, settings.max_tokens_per_turn,
                                                settings.max_turns, max_context=max_context), listen)
    pool = ThreadPoolExecutor(max(1, min(settings.concurrent, n)), thread_name_prefix="agent-program")

    def one(i: int) -> tuple[ProgramResult, Ended]:
        for runs in range(1, RETRIES + 2):
            token = endpoint.open(i)
            try:
                result = programs.run(samples[i], EndpointAddress(endpoint.socket_path, token, endpoint.url), timeout)
            except PoolError:  # the pool refused the job itself (its token, the request): the rollout fails, saying why
                raise
            except Exception as err:  # noqa: BLE001 - else Programs.run raises only when no sandbox could run it
                result = ProgramResult(error=f"{type(err).__name__}: {err}", failure=NOT_RUN)
            finally:
                ended = endpoint.end(token)
            if result.failure != LOST:
                break
        if result.failure == LOST:
            result = ProgramResult(error=f"its sandbox replica was lost {runs} times ({result.error})",
                                   failure=LOST)
        return result, ended

    engine = _Engine(model)
    futures: list[Future] = []
    try:
        futures = [pool.submit(one, i) for i in range(n)]
        while not all(f.done() for f in futures):
            endpoint.pump(engine, PUMP_SECONDS)
        return [assemble(r, ended.calls, settings.max_tokens, trajectory, ended.cut)
                for r, ended in (f.result() for f in futures)]
    except Exception as err:
        if engine.failed_rows is None:
            raise
        raise EngineFailed(_engine_failure(engine.failed_rows, samples, err)) from err
    finally:
        endpoint.stop()  # first: a program still waiting on the model gets its answer (an error), not a hang
        pool.shutdown(wait=False, cancel_futures=True)  # the programs not started yet never start
        while not all(f.done() for f in futures):  # an error: the programs running are killed, not waited for
            programs.close()
            wait(futures, STOP_SECONDS)
        pool.shutdown(wait=True)


def assemble(result: ProgramResult, calls: Sequence[Call], max_tokens: int, trajectory: str = "merged",
             cut: frozenset[int] = frozenset()) -> list[Episode]:
    """One episode's trained sequences (its rows in the batch, at least one) from its program's result and its calls
    (a pure function): its calls cut by `trajectory` (hybridflow.agents.trajectory.sequences), each sequence with
    the program's reward on its last model token (every row of the episode carries the episode's reward:
    env_reward), the failure if any. A sequence holding no token of the model's is dropped (a row scored 0 beside
    its episode's would skew its group's baseline). Each row counts its own calls (`turns`, the calls it holds);
    the episode's breaks and its program's metrics are on its first row only, so that sums over rows are the
    episode's.

    A failed episode (the program raised, timed out, returned no finite reward) is one row, its last sequence,
    kept for the rollout's log with its tokens and log-probs, but its loss mask is all 0: it contributes no
    gradient. The built-in loop (loop.run_episodes) trains its failed episodes as they are, on the rewards the
    environment gave before the failure: those rewards are the environment's verdicts on the model's turns, and
    the failure is often the model's doing (a tool's arguments, a step's text). A failed program leaves no reward
    at all: the reward 0 it would be trained on is no verdict on the model's tokens, and a program's bug or
    deadline would push the model away from them."""
    found, breaks = sequences(calls, trajectory, cut)
    rows = [e for e in found if any(e.loss_mask)] or found[-1:] or [Episode()]
    for e in rows:
        e.truncated = e.truncated or (bool(found) and len(e.tokens) >= max_tokens)
    rows[0].trajectory_breaks = breaks
    error, failure = result.error, result.failure
    reward = result.reward
    if error is None and (reward is None or not math.isfinite(reward)):
        error, failure = f"the program returned no finite reward (it returned {reward!r})", PROGRAM
    elif error is None and not found:
        error, failure = "the program made no call to the model", PROGRAM
    if error is not None:
        e = rows[-1]
        e.turns, e.trajectory_breaks = len(calls), breaks
        e.error, e.failure = error, failure or PROGRAM
        e.loss_mask = [0] * len(e.tokens)
        return [e]
    rows[0].metrics = dict(result.metrics)
    for e in rows:
        e.env_reward = float(reward or 0.0)
        model_positions = [j for j, m in enumerate(e.loss_mask) if m]
        if e.env_reward and model_positions:
            e.turn_rewards.append((model_positions[-1], e.env_reward))
    return rows
