"""For tests that run a job in this process while something happens to its workers (a replica killed, added or
removed mid-run): the run beside the fault, and what the rollout log (trainer.rolloutLog) says was trained."""
from __future__ import annotations

import collections
import json
import threading
from pathlib import Path
from typing import Any, Callable

from hybridflow.api import RLHFJob
from hybridflow.metrics import JobMetrics
from hybridflow.trainer import loop


def fit_while(job: RLHFJob, workers: Any, task: Any, act: Callable[[threading.Event], None]) -> Any:
    """`loop.fit` with `act(done)` running beside it in a thread (it watches the step log and acts); `done` is
    set once fit ends, however it ends, and the thread is joined before this returns or raises."""
    done = threading.Event()
    thread = threading.Thread(target=act, args=(done,), name="fault")
    thread.start()
    try:
        return loop.fit(job, workers, task, JobMetrics(job.metadata.name), progress=print)
    finally:
        done.set()
        thread.join()


def assert_each_draw_trained_once(job: RLHFJob, steps: int) -> None:
    """The groups trained are the first `steps` x promptsPerStep prompt draws (their uids), each once, with all
    of its responses."""
    log_dir = Path(job.spec.trainer.checkpoint_dir) / "rollouts"
    uids = collections.Counter(json.loads(line)["uid"] for f in sorted(log_dir.glob("step_*.jsonl"))
                               for line in f.read_text().splitlines())
    per_step, n = job.spec.trainer.prompts_per_step, job.spec.rollout.responses_per_prompt
    assert uids == {uid: n for uid in range(steps * per_step)}
