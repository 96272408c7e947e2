"""What the controller learns when a worker call fails because a worker is gone: which ranks died, which never answered
(stuck in a collective with a rank that stopped), and which merely failed with them.

A rank whose process or node dies fails its call with Ray's actor error at once; the ranks it shared a collective
with fail soon after (gloo: the peer closed the connection) or, when it only stopped (SIGSTOP, a hung node), when
the collective's timeout runs out (runPolicy's collective timeout). `RankFailure` names them all, so the controller
(trainer.recovery) can decide whether rebuilding the worker groups can mend it, and the user reads which pod to
look at. Errors of the job's own code (a bad reward function, a shape mismatch) are not worker losses and pass
through unchanged.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import ray

# How long the other ranks of a failed call get to fail too (their collective broke with the lost rank) before the
# ones still busy are named as not answering.
SETTLE_SECONDS = 2.0
# What gloo and torch.distributed say when a peer of a collective is gone or never answered.
PEER_LOST = ("connection closed by peer", "connection reset by peer", "timed out", "socket timeout",
             "broken pipe", "connection refused", "no route to host")
LOST_TYPES = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
              ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)
# A rank that stopped answering: Ray's keepalive gave up on it, or the controller's wait for it ran out.
SILENT_TYPES = (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError)


def causes(err: BaseException) -> Iterator[BaseException]:
    """`err` and what it wraps: Python's cause and context chain, and the original exception inside a RayTaskError."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [c for c in (getattr(e, "cause", None), e.__cause__, e.__context__) if isinstance(c, BaseException)]


class PeerLost(RuntimeError):
    """A collective of our own broke off because a peer is gone or stopped answering: what a survivor of a worker
    loss sees (engines.bridge.stream raises it). A type of its own because Ray carries a remote exception's type
    and message to the controller, not its cause: the gloo error underneath does not arrive."""


def is_worker_loss(err: BaseException) -> bool:
    """Whether `err` says a worker process or its node is gone, or that a collective broke with one that is."""
    for e in causes(err):
        if isinstance(e, (*LOST_TYPES, *SILENT_TYPES, RankFailure, PeerLost)):
            return True
        if _distributed_error(e) and any(p in str(e).lower() for p in PEER_LOST):
            return True
    return False


def _distributed_error(e: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(e, getattr(dist, "DistError", ())) or (type(e) is RuntimeError and "gloo" in str(e).lower())


def one_line(err: BaseException, limit: int = 500) -> str:
    """An error as one bounded line (its message's first line, else its type): what a log line or a status says of
    it. A lost node's error from Ray carries the dead raylet's log, thousands of characters, after its first line."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


class RankFailure(RuntimeError):
    """A call's ranks that died, did not answer or failed with them, each named by `where` (pool, rank, node)."""

    def __init__(self, method: str, dead: Sequence[str], silent: Sequence[str], failed: Sequence[str],
                 first: BaseException) -> None:
        self.method, self.dead, self.silent, self.failed = method, list(dead), list(silent), list(failed)
        parts = [f"{', '.join(dead)} died" if dead else "",
                 f"{', '.join(silent)} did not answer" if silent else "",
                 f"{', '.join(failed)} failed with them" if failed else ""]
        said = getattr(first, "cause", None) or first  # a worker's own error, not Ray's line naming the task
        super().__init__(f"{method}: {'; '.join(p for p in parts if p)} ({one_line(said)})")


def rank_failure(method: str, refs: Sequence[ray.ObjectRef], where: Sequence[str], err: BaseException,
                 settle_s: float = SETTLE_SECONDS) -> BaseException:
    """The error to raise for a failed call of `refs` (one per rank, `where` naming each): a RankFailure when a
    worker was lost, `err` itself otherwise. Ray raises the first failed rank's error in the call's order, which
    may be a survivor's own error (its part could not finish without the lost rank): the call is a worker loss
    too when another of its ranks has failed as lost within `settle_s`."""
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=settle_s, fetch_local=False)
    finished = set(done)
    dead, silent, failed = [], [], []
    lost = is_worker_loss(err)  # else ranks still busy are not taken for silent ones: only a rank seen lost counts
    for ref, name in zip(refs, where):
        if ref not in finished:
            silent.append(name)
            continue
        try:
            ray.get(ref, timeout=settle_s)
        except BaseException as e:  # noqa: BLE001 - classified, never swallowed: the call raises
            kinds = list(causes(e))
            if any(isinstance(c, SILENT_TYPES) for c in kinds):
                silent.append(name)
                lost = True
            elif any(isinstance(c, LOST_TYPES) for c in kinds):
                dead.append(name)
                lost = True
            else:
                failed.append(name)
    return RankFailure(method, dead, silent, failed, err) if lost else err
