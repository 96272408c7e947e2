"""Checks only the machine that runs the job can make: model directories, the reward file, prompt files, a
resumeFrom checkpoint, writable directories, the pools' allocator. `hybridflow validate` and `run` call them; the operator cannot."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hybridflow.api import RLHFJob
from hybridflow.api.storage import is_url
from hybridflow.data.files import DataError, resolve_paths
from hybridflow.rewards.reward_file import RewardFileError, check_reward_file
from hybridflow.single_controller.allocator import ALLOCATORS, AllocatorMissing, choose_allocator, find_allocator


def _has_checkpoints(job: RLHFJob) -> bool:
    """Whether the job has checkpoints of its own (then resumeFrom is not used: a restart continues from them,
    even once the old job's directory is gone). Object storage is not looked at before the job runs."""
    from hybridflow.checkpoint import list_checkpoints

    where = job.spec.trainer.checkpoint_dir
    return is_url(where) or bool(list_checkpoints(Path(where)))


def check_runtime_paths(job: RLHFJob) -> list[str]:
    """Problems only visible where the job runs (files, permissions); the operator cannot check these."""
    out: list[str] = []
    models = {"spec.models.actor": job.spec.models.actor, "spec.models.critic": job.spec.models.critic}
    if job.spec.models.reward.model is not None:
        models["spec.models.reward.model"] = job.spec.models.reward.model
    for field, m in models.items():
        if m is not None and m.source == "path":
            d = Path(m.path or "")
            if not (d / "config.json").is_file():
                out.append(f"{field}.path: '{d}' is not an HF model directory (no config.json); fix the path")
    fn = job.spec.models.reward.function
    if fn is not None:  # type function, or a combined reward weighing it
        try:
            check_reward_file(fn.path, fn.name, fn.batched)
        except RewardFileError as err:
            out.append(f"spec.models.reward.function: {err}")
    out += _agent_file_problems(job)
    out += _allocator_problems(job)
    if job.spec.data.source == "files":
        for field, entries in (("spec.data.train", job.spec.data.train), ("spec.data.eval", job.spec.data.eval)):
            try:
                if entries:
                    resolve_paths(field, entries)
            except DataError as err:
                out.append(str(err))
    resume_from = job.spec.trainer.resume_from
    if resume_from and not is_url(resume_from) and not Path(resume_from).exists() and not _has_checkpoints(job):
        out.append(f"spec.trainer.resumeFrom: '{resume_from}' does not exist; name the old job's checkpointDir (on "
                   f"Kubernetes: the old job's name) or one of its step_* directories")
    writable = {"spec.trainer.checkpointDir": job.spec.trainer.checkpoint_dir}
    if job.spec.data.source == "files" and job.spec.data.cache_dir:
        writable["spec.data.cacheDir"] = job.spec.data.cache_dir
    for field, where in writable.items():
        if not is_url(where):  # object storage: reached (and refused) only when the job runs
            problem = unwritable_dir_problem(Path(where))
            if problem:
                out.append(f"{field}: '{where}' is not writable ({problem}); choose a directory you can write")
    return out


def _agent_file_problems(job: RLHFJob) -> list[str]:
    """A multi-turn job's environment and tools files and agent program: there, Python, and (the tools file)
    holding tools the model can call, none with a listed built-in's name. What only loading them can tell: hybridflow.agents.file_check."""
    from hybridflow.agents.places import job_tools
    from hybridflow.agents.tool_file import ToolFileError
    from hybridflow.user_files import UserFileError, parse_user_file

    a = job.spec.rollout.agent
    if a is None:
        return []
    out = []
    if a.environment_file:
        p = Path(a.environment_file)
        try:
            parse_user_file(p, "environment file not found; fix the path")
        except UserFileError as err:
            out.append(f"spec.rollout.agent.environmentFile: {err}")
    if a.program:
        try:
            parse_user_file(Path(a.program), "agent program not found; fix the path")
        except UserFileError as err:
            out.append(f"spec.rollout.agent.program: {err}")
    if a.tools_file:
        try:
            job_tools(a)
        except ToolFileError as err:
            out.append(f"spec.rollout.agent.toolsFile: {err}")
    return out


def loaded_code_problems(job: RLHFJob) -> list[str]:
    """The user's code loaded in the sandbox as its workers will: the reward function by one reward worker, the
    agent's tools and environment files (hybridflow.agents.file_check, out of sight of the job's data and
    checkpoints). What loads but cannot work (an import the sandbox lacks, a signature a decorator changed, an
    environment class without step) is a problem naming the field and file. `validate` and `run` call it, not
    `driver` (on Kubernetes the sandbox pool loads user code, never a pod with the job's credentials)."""
    out: list[str] = []
    fn = job.spec.models.reward.function
    if fn is not None:  # type function, or a combined reward weighing it
        from hybridflow.rewards.sandbox import RewardFunction

        try:
            RewardFunction(fn.path, fn.name, fn.batched, workers=1).close()
        except RewardFileError as err:
            out.append(f"spec.models.reward.function: {err}")
    if job.spec.rollout.agent is not None:
        from hybridflow.agents.file_check import loaded_file_problems
        from hybridflow.data.files import job_private_paths

        out += loaded_file_problems(job.spec.rollout.agent, job_private_paths(job.spec))
    return out


def _allocator_problems(job: RLHFJob) -> list[str]:
    """A pool that asks for an allocator by name needs it on this machine (the driver's: on Kubernetes the head pod
    runs the pools' image)."""
    found = {name: find_allocator(name) for name in ALLOCATORS}
    out = []
    for i, pool in enumerate(job.spec.resource_pools):
        try:
            choose_allocator(pool.allocator, found, f"spec.resourcePools[{i}].allocator")
        except AllocatorMissing as err:
            out.append(str(err))
    return out


def unwritable_dir_problem(path: Path) -> str | None:
    """Why the job could not make `path` and write files in it, found by doing so in its nearest existing directory:
    permission bits say nothing for root, and a pseudo filesystem (/proc, /sys) or a read-only mount refuses what
    os.access allows. The probe is a fresh temporary directory, removed again, so a check (`hybridflow validate`)
    leaves nothing behind: neither `path` nor its missing parents are created."""
    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        return f"'{base}' is a file, not a directory"
    try:
        probe = tempfile.mkdtemp(prefix=".hybridflow-write-check-", dir=base)
    except OSError as err:
        return f"cannot make a directory in '{base}': {err.strerror or err}"
    try:
        (Path(probe) / "probe").write_bytes(b"x")
    except OSError as err:
        return f"cannot write a file in a new directory under '{base}': {err.strerror or err}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None
