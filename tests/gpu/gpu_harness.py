"""What the GPU suite's tests share: its settings (from the environment bench/gpu_check.sh sets), one check's record
(facts, notes, expectations: written to OUT/results.jsonl by conftest.py), a job's workers on a private local Ray,
readings from inside the workers through `WorkerHost.diagnose` (hybridflow.single_controller.diagnostics), and
device memory seen from this process.

Every check drives the project's own code path, the one the CPU tests use (tests/trainer/test_weight_sync.py): an RLHFJob
dict -> `spec.parse_job` -> `setup.prepare` -> `cli.start_local_ray` -> `setup.build_workers` -> `loop.run_iteration`
-> the rollout role's registered `train_checksum` / `weight_checksums` / `instance_id`; what those do not show (the
engine's every tensor, vLLM's sleep flag, device memory, dtypes mid-update, the process group) is read with the
registered diagnostics."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from support.gpu_jobs import GIB, parse
from support.processes import kill_processes_mentioning


@dataclass(frozen=True)
class Settings:
    """GPU_CHECK_ROLLOUT (vllm | hf: the generation engine of the fsdp, megatron and throughput checks),
    GPU_CHECK_CPU=1 (the CPU smoke run: one CPU rank, a small meta_load shape), GPU_CHECK_STEPS (RLHF steps of the
    fsdp / megatron jobs), TP_STEPS and GPU_CHECK_TP_RUNS (throughput: steps; defaults or both), OUT."""

    rollout: str
    cpu: bool
    steps: int | None
    tp_steps: int
    tp_runs: str
    out: Path

    @property
    def device(self) -> str:
        return "cpu" if self.cpu else "gpu"

    def job_steps(self, default: int) -> int:
        return self.steps or (2 if self.cpu else default)


def settings() -> Settings:
    rollout = os.environ.get("GPU_CHECK_ROLLOUT", "vllm")
    if rollout not in ("vllm", "hf"):
        raise pytest.UsageError(f"GPU_CHECK_ROLLOUT={rollout}: vllm or hf")
    out = Path(os.environ.get("OUT") or "/tmp/gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    steps = os.environ.get("GPU_CHECK_STEPS")
    return Settings(rollout, os.environ.get("GPU_CHECK_CPU", "") not in ("", "0"), int(steps) if steps else None,
                    int(os.environ.get("TP_STEPS", "3")),
                    os.environ.get("GPU_CHECK_TP_RUNS") or ("both" if rollout == "vllm" else "defaults"), out)


def limit(var: str, default: int) -> pytest.MarkDecorator:
    """A check's time limit (pytest-timeout), from the environment variable bench/gpu_check.sh sets."""
    return pytest.mark.timeout(int(os.environ.get(var) or default))


@dataclass
class Record:
    """One check's verdict: expectations (every failed one is listed when the test fails), facts and notes, written
    as one JSON line of OUT/results.jsonl with the test's outcome (conftest.py)."""

    name: str
    title: str
    failures: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    summary: str = ""

    def expect(self, ok: Any, what: str) -> bool:
        if not ok:
            self.failures.append(what)
        return bool(ok)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def verdict(self) -> None:
        """Fails the test with every expectation that did not hold."""
        assert not self.failures, f"{len(self.failures)} expectation(s) failed:\n  " + "\n  ".join(self.failures)

    def json(self, outcome: str, seconds: float, error: str | None) -> str:
        return json.dumps({"check": self.name, "title": self.title, "status": outcome, "seconds": round(seconds, 2),
                           "summary": self.summary, "failures": self.failures, "error": error, "facts": self.facts,
                           "notes": self.notes}, default=str)


def gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / GIB:.2f} GiB"


def device_used_bytes() -> int | None:
    """Memory in use on every GPU of this machine together, as the driver reports it; None if neither NVML's
    Python binding nor nvidia-smi is there."""
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        try:
            return sum(int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used)
                       for i in range(pynvml.nvmlDeviceGetCount()))
        finally:
            pynvml.nvmlShutdown()
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout
            return sum(int(float(x)) for x in out.split()) << 20  # MiB
        except Exception:
            return None
    return None


# -- a job's workers -------------------------------------------------------------------------------------------------

@dataclass
class Session:
    job: Any
    w: Any
    task: Any
    ray_dir: str

    def worker_logs(self) -> str:
        return collect_worker_logs(self.ray_dir, self.job.metadata.name)


def _env_for_workers() -> None:
    """Set before Ray starts: its daemons and the workers inherit this process's environment. NCCL says when it
    makes a communicator; vLLM's own log says how much its sleep freed (worker logs, copied to OUT)."""
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # build_workers passes it on (default ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("HYBRIDFLOW_MODEL_CACHE", "/tmp/gpu_check_models")


@contextlib.contextmanager
def job_session(doc: dict[str, Any], out: Path) -> Iterator[Session]:
    """The job's workers on a private local Ray, as `hybridflow run` starts them; everything is shut down however
    the block ends (a timeout included), and the workers' logs (tails) are appended to OUT/worker-logs.txt."""
    import ray

    from hybridflow.capacity import local_capacity_problems, machine_facts
    from hybridflow.cli import start_local_ray
    from hybridflow.trainer import setup

    _env_for_workers()
    job = parse(doc)
    problems = local_capacity_problems(job.spec, machine_facts(job))
    if problems:
        raise RuntimeError("this machine cannot run the check's job: " + "; ".join(problems))
    # short (Ray's socket paths <= 107 bytes), under GPU_CHECK_RAY_DIR when gpu_check.sh names one: its cleanup
    # ends whatever names that dir
    base = os.environ.get("GPU_CHECK_RAY_DIR")
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
    ray_dir = tempfile.mkdtemp(prefix="gc", dir=base or "/tmp")
    prepared = setup.prepare(job, progress=False)
    w = None
    try:
        start_local_ray(job, ray_dir)
        t0 = time.perf_counter()
        w = setup.build_workers(job, prepared.model_dir, prepared.task, None, None)
        print(f"  workers built in {time.perf_counter() - t0:.1f} s", flush=True)
        yield Session(job, w, prepared.task, ray_dir)
    finally:
        with open(out / "worker-logs.txt", "a") as f:  # first: a timed-out run has seconds left
            f.write(collect_worker_logs(ray_dir, doc["metadata"]["name"]))
        if w is not None:
            with contextlib.suppress(Exception):
                w.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        with contextlib.suppress(Exception):
            prepared.close()
        kill_processes_mentioning(ray_dir, grace=5.0)
        shutil.rmtree(ray_dir, ignore_errors=True)


def collect_worker_logs(ray_dir: str, label: str, tail: int = 48 << 10) -> str:
    """The tails of the workers' stdout/stderr and raylet's stderr (log_to_driver is off in `hybridflow run`)."""
    parts = [f"\n===== {label}: Ray worker logs under {ray_dir} =====\n"]
    for path in sorted(Path(ray_dir).glob("session_*/logs/*")):
        if path.is_symlink() or not path.is_file():
            continue
        if not (path.name.startswith("worker-") and path.suffix in (".out", ".err")) and path.name != "raylet.err":
            continue
        data = path.read_bytes()
        if not data.strip():
            continue
        text = data[-tail:].decode(errors="replace")
        parts.append(f"----- {path.name} ({len(data)} bytes{', tail' if len(data) > tail else ''}) -----\n{text}\n")
    return "".join(parts)


def actor_group(w: Any) -> Any:
    return next(g for g in w.groups if "actor" in g.roles)


def diagnose(w: Any, name: str, *args: Any) -> list[Any]:
    """The registered diagnostic `name` on every rank of the actor's group, all at once (collectives inside it
    then match): one reading per rank."""
    import ray

    return ray.get([h.diagnose.remote(name, *args) for h in actor_group(w).hosts], timeout=300)


class ActorProbe:
    """The actor's or the rollout role's handle as `run_iteration` sees it, with readings taken right before
    `update_actor` (vLLM awake, after generation), right after it (vLLM released at the update's start, still asleep
    until the sync) and right after the rollout role's `sync_weights` (woken by `load_weights`), into one list shared
    by the two probes. Everything else passes straight through."""

    def __init__(self, handle: Any, read: Callable[..., dict[str, Any]],
                 readings: list[tuple[str, dict[str, Any]]] | None = None) -> None:
        self._handle, self._read = handle, read
        self.readings: list[tuple[str, dict[str, Any]]] = [] if readings is None else readings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def update_actor(self, *args: Any, **kwargs: Any) -> Any:
        self.readings.append(("before_update", self._read(reset_peak=True)))
        out = self._handle.update_actor(*args, **kwargs)
        self.readings.append(("after_update", self._read()))
        return out

    def sync_weights(self, *args: Any, **kwargs: Any) -> Any:
        out = self._handle.sync_weights(*args, **kwargs)
        self.readings.append(("after_sync", self._read()))
        return out


def prompts_for_step(task: Any, step: int) -> Any:
    from hybridflow.trainer import task as tasks

    return tasks.prompt_batch(task.train[8 * (step - 1): 8 * step])


def generation_after_sync(rollout: Any, task: Any, job: Any) -> dict[str, Any]:
    """Sampled and greedy responses to held-out prompts from the engine as the last sync left it (woken): full
    length, in the vocabulary, not all alike; greedy twice gives the same tokens."""
    import statistics

    from hybridflow.data.packing import unpack_responses
    from hybridflow.single_controller.worker_group import resolve
    from hybridflow.trainer.task import prompt_batch

    r = job.spec.rollout
    vocab = job.spec.models.actor.tiny.vocab_size
    n = 16
    prompts = prompt_batch(task.eval[:n])
    sampled = unpack_responses(resolve(rollout.generate(prompts)))
    greedy = unpack_responses(resolve(rollout.generate(prompts, greedy=True)))
    greedy2 = unpack_responses(resolve(rollout.generate(prompts, greedy=True)))
    problems = []
    if len(sampled) != n or len(greedy) != n:
        problems.append(f"{len(sampled)} sampled and {len(greedy)} greedy responses for {n} prompts")
    lengths = sorted({len(x) for x in sampled + greedy})
    if not lengths or lengths[0] == 0:
        problems.append("an empty response")
    if any(t < 0 or t >= vocab for x in sampled + greedy for t in x):
        problems.append(f"a token outside the vocabulary [0, {vocab})")
    distinct_tokens = len({t for x in sampled for t in x})
    distinct_responses = len({tuple(x) for x in sampled})
    if distinct_tokens < 2 or distinct_responses < 2:
        problems.append(f"sampled responses collapse: {distinct_responses} distinct of {len(sampled)}, "
                        f"{distinct_tokens} distinct tokens")
    if greedy != greedy2:
        problems.append("greedy generation is not repeatable")
    rule = task.reward.rule
    greedy_reward = None
    if rule is not None:
        greedy_reward = statistics.mean(rule(s.prompt, g, s.truth, task.decode) for s, g in zip(task.eval[:n], greedy))
    return {"ok": not problems, "problems": problems, "lengths": lengths, "max_response_length": r.max_response_length,
            "distinct_tokens": distinct_tokens, "distinct_responses": distinct_responses,
            "greedy_reward": greedy_reward, "sampled_example": sampled[:2], "greedy_example": greedy[:2]}


def unit_roundoff(dtype: str | None) -> float:
    import torch

    try:
        return float(torch.finfo(getattr(torch, str(dtype).removeprefix("torch."))).eps) / 2
    except (AttributeError, TypeError):
        return 0.0


def all_equal(a: dict[str, Any] | None) -> bool:
    return a is None or (a["tensors"] > 0 and a["exact"] == a["tensors"] and not a["unmatched"])


def judge_every_tensor(c: Record, a: dict[str, Any] | None, when: str, cpu: bool) -> None:
    """Every generation tensor equals the trainer's; on the GPU none may be hidden (packed) from the comparison."""
    if a is None:
        return
    c.expect(all_equal(a),
             f"{when}: {a['exact']} of {a['tensors']} generation tensors equal the trainer's; differ: {a['differ']}; "
             f"no trainer tensor for: {a['unmatched']}")
    if a["packed"]:
        if cpu:
            c.note(f"{a['packed']} linear weights are packed by vLLM's CPU backend (shape (0,)) and not compared; "
                   f"{a['tensors']} tensors (embedding, norms) are")
        else:
            c.failures.append(f"{when}: {a['packed']} vLLM parameters are empty (packed?) and could not be compared")
