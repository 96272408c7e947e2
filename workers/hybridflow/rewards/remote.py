"""A user's reward function in the job's sandbox pool: the same call as hybridflow.rewards.sandbox.RewardFunction,
made over HTTP to the pool's replicas (`hybridflow environments serve`), which run the function in their own
sandboxed workers.

On Kubernetes this is how a job scores with its own function: the head and the pool pods hold the Ray token and the
storage and tracking keys, and a function run beside them could read those wherever the pod's runtime refuses the
sandbox's namespaces (a default cluster's seccomp profile refuses user namespaces, so bubblewrap cannot start). The
sandbox pool's pods hold none of them, and reach nothing.

The driver's side (`RemoteRewardFunction`) splits a batch into one contiguous part per replica and sends the parts
side by side; a part whose replica does not answer goes to the next replica, and when none answers the job stops
saying so. Each replica scores its part exactly as a local pool does (deadlines, errors with their samples); its
answer is checked for finite scores and indexes inside its part, as a worker's line is, since the replica runs user
code. The replica's side (`serve_rewards`) turns a request into a RewardFunction call and its RewardResult into JSON.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from hybridflow.rewards.sandbox import RewardError, RewardFunction, RewardResult
from hybridflow.sandbox_pool import MARGIN_SECONDS, PoolClient, PoolError, Unreachable, unexpected

Info = dict[str, Any]
PATH = "/v1/rewards/score"
FIELDS = ("data_sources", "solutions", "ground_truths", "extra_infos")


def serve_rewards(function: RewardFunction) -> Callable[[Info], Info]:
    """The replica's end: POST /v1/rewards/score's body in, {scores, extras, errors: [{index, error}]} out."""

    def score(body: Info) -> Info:
        out = function.score(*[body[k] for k in FIELDS])  # the server checked: lists of one length
        return {"scores": out.scores, "extras": out.extras,
                "errors": [{"index": e.index, "error": e.error} for e in out.errors]}

    return score


def _finite(v: Any) -> bool:
    try:  # an int past a float's range (JSON allows any) is no score either
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
    except OverflowError:
        return False


class RemoteRewardFunction:
    """The function `name` of the job's reward file, run by the sandbox pool's replicas."""

    def __init__(self, client: PoolClient, what: str, batched: bool = False, timeout_seconds: float = 10.0,
                 workers: int = 2, error_score: float = 0.0) -> None:
        self.client, self.what, self.batched = client, what, batched
        self.timeout, self.workers, self.error_score = timeout_seconds, max(1, workers), error_score

    def close(self) -> None:
        """Nothing lives between calls on this side."""

    def score(self, data_sources: Sequence[str], solutions: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Sequence[dict[str, Any]]) -> RewardResult:
        n = len(solutions)
        parts = 1 if self.batched else min(max(1, n), len(self.client.replicas))
        bounds = [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]
        args = (list(data_sources), list(solutions), list(ground_truths), list(extra_infos))
        with ThreadPoolExecutor(max_workers=parts) as pool:
            answers = list(pool.map(lambda b: self._part(args, *b[1], first=b[0]), enumerate(bounds)))
        out = RewardResult(scores=[])
        keys = sorted({k for a in answers for k in a.extras})
        out.extras = {k: [] for k in keys}
        for (lo, hi), a in zip(bounds, answers):
            out.scores += a.scores
            for k in keys:
                out.extras[k] += a.extras.get(k, [float("nan")] * (hi - lo))
            out.errors += a.errors
        return out

    def _part(self, args: tuple[list, ...], lo: int, hi: int, first: int) -> RewardResult:
        """Samples lo..hi on replica `first`, or on the next ones when it does not answer."""
        body = {k: a[lo:hi] for k, a in zip(FIELDS, args)}
        # the replica's workers take the part's samples a few at a time, each within its deadline
        rounds = (hi - lo) if self.batched else math.ceil((hi - lo) / self.workers)
        timeout = self.timeout * max(1, rounds) + MARGIN_SECONDS
        n, lost = len(self.client.replicas), []
        for index in [(first + i) % n for i in range(n)]:
            try:
                code, out = self.client.request(index, "POST", PATH, body, timeout)
            except Unreachable as err:
                lost.append(str(err))
                continue
            if code != 200:
                raise unexpected(self.client.replicas[index].url, f"the reward function {self.what}", code, out)
            return self._checked(out, args, lo, hi, self.client.replicas[index].url)
        raise PoolError(f"the reward function {self.what}: no sandbox replica answered: " + "; ".join(lost))

    def _checked(self, out: Info, args: tuple[list, ...], lo: int, hi: int, url: str) -> RewardResult:
        """The replica's answer as this part's RewardResult, indexes made the batch's; anything malformed is the
        replica's error, named, never a score."""
        size = hi - lo
        scores, extras, errors = out.get("scores"), out.get("extras") or {}, out.get("errors") or []
        bad = not (isinstance(scores, list) and len(scores) == size and all(_finite(s) for s in scores))
        bad = bad or not isinstance(extras, dict) or not all(
            isinstance(v, list) and len(v) == size and all(_finite(x) or x != x for x in v)  # (NaN: no metric)
            for v in extras.values())
        bad = bad or not isinstance(errors, list) or not all(
            isinstance(e, dict) and isinstance(e.get("index"), int) and 0 <= e["index"] < size for e in errors)
        if bad:
            raise PoolError(f"sandbox replica {url} answered the reward function {self.what} with something that "
                            f"is not {size} scores: {str(out)[:200]}")
        solutions, truths = args[1], args[2]
        return RewardResult(
            scores=[float(s) for s in scores], extras={str(k): [float(x) for x in v] for k, v in extras.items()},
            errors=[RewardError(lo + e["index"], solutions[lo + e["index"]], truths[lo + e["index"]],
                                str(e.get("error", ""))[:2000]) for e in errors])
