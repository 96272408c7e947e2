"""`hybridflow environments serve`: one replica of a job's sandbox pool (a sandbox pod on Kubernetes), assembled
from the job's spec: its reward function's workers and its agent's tools and environment sessions or its agent
program's runs, each in the sandbox, behind the pool's HTTP server. Its own module: it draws on rewards and agents,
which may not import each other."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from hybridflow.api import RLHFJob, RewardFunctionSpec, SpecError, load_job
from hybridflow.api.agents import Agent
from hybridflow.sandbox_pool import SERVES_AGENTS, SERVES_REWARDS


def cmd_environments_serve(args: argparse.Namespace) -> int:
    """One replica of the job's sandbox pool (a sandbox pod): its reward function, tools and environment sessions or
    agent program over HTTP, each request authenticated with the job's sandbox token (HYBRIDFLOW_SANDBOX_TOKEN,
    never the Ray token: these pods hold no credential of the job's), until SIGTERM or SIGINT."""
    import signal
    import threading

    from hybridflow.agents.server import PoolServer, PoolService
    from hybridflow.sandbox_pool import TOKEN_ENV

    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise SpecError(f"{TOKEN_ENV}: the sandbox pool serves only callers holding the job's sandbox token; set it")
    job = load_job(args.spec)
    agent, function = replica_halves(job, args.spec, args.serves)
    reward = job.spec.models.reward
    from hybridflow import sandbox
    from hybridflow.agents.places import local_places
    from hybridflow.sandbox import reaper
    from hybridflow.data.files import job_private_paths
    from hybridflow.rewards.remote import serve_rewards
    from hybridflow.rewards.sandbox import RewardFunction

    # Refused here, before anything is served, when HYBRIDFLOW_SANDBOX=require and this pod lacks a layer (exit
    # EXIT_SANDBOX_UNAVAILABLE: the operator fails the job with this message); else the job reads what is missing.
    layers = sandbox.probe()
    sandbox.check_required(layers, "the job's user code (its sandbox pool)")
    reaper.start()  # every child of this process is a sandbox: what one leaves behind (setsid, double forks) dies
    places = local_places(agent, job_private_paths(job.spec)) if agent is not None else None
    rewards = None
    if (f := function) is not None:
        rewards = serve_rewards(RewardFunction(f.path, f.name, f.batched, workers=reward.workers,
                                               timeout_seconds=reward.timeout_seconds,
                                               error_score=reward.error_score))
    programs = None
    if places is not None and places.programs is not None and agent is not None:
        from hybridflow.agents.pool_programs import PoolPrograms
        from hybridflow.sandbox_pool import endpoint_ports_from_env

        # the relay connects only to the endpoints' ports the operator named (its NetworkPolicy's), none else
        programs = PoolPrograms(places.programs, agent.program_timeout_seconds, endpoint_ports_from_env())
    service = PoolService(places.tools if places else None, places.sessions if places else None,
                          idle_seconds=args.idle_session_seconds, max_sessions=args.max_sessions, rewards=rewards,
                          max_session_seconds=args.max_session_seconds, serves=args.serves, programs=programs,
                          layers=_pool_layers(layers, places is not None, rewards is not None, programs is not None))
    server = PoolServer(service, token, args.address, args.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"sandbox pool replica serving on {server.url}", flush=True)
    stop.wait()
    server.stop()
    return 0


def replica_halves(job: RLHFJob, spec_file: str, serves: str) -> tuple[Agent | None, RewardFunctionSpec | None]:
    """What a replica serving `serves` builds of the job's user code: its agent (tools, environment) and its reward
    function, or one of them for a replica set apart for one half (hybridflow.api.agents.rewards_apart), which
    loads nothing of the other (and has only its own half's files mounted). Refuses a spec with neither, and an
    environment file that is not here."""
    agent, reward = job.spec.rollout.agent, job.spec.models.reward
    if agent is None and reward.function is None:
        raise SpecError(f"{spec_file}: the sandbox pool runs a job's reward function (spec.models.reward.function) "
                        "and its agent's tools and environment (spec.rollout.agent); this spec has neither")
    agent = agent if serves != SERVES_REWARDS else None
    function = reward.function if serves != SERVES_AGENTS else None
    for field, path in (("environmentFile", agent.environment_file), ("program", agent.program)) if agent else ():
        if path and not Path(path).is_file():
            raise SpecError(f"spec.rollout.agent.{field}: {path}: no such file here (on Kubernetes put it in "
                            "kubernetes.rewardConfigMap, the job's code ConfigMap, under that key)")
    return agent, function


def _pool_layers(first: Any, agent: bool, reward: bool, program: bool = False) -> dict[str, Any]:
    """What GET /v1/sandbox tells the job: the layers missing from any kind of sandbox this replica's workers run in
    (each kind's probe, cached, is the one its workers use; a worker may land on a weaker kind than the first)."""
    from hybridflow import sandbox
    from hybridflow.agents.local import WORKER_CHECK as AGENT_CHECK
    from hybridflow.agents.program import WORKER_CHECK as PROGRAM_CHECK
    from hybridflow.rewards.sandbox import WORKER_CHECK as REWARD_CHECK

    kinds = [first, *([sandbox.probe(PROGRAM_CHECK if program else AGENT_CHECK)] if agent else []),
             *([sandbox.probe(REWARD_CHECK)] if reward else [])]
    missing = {name: why for layers in kinds for name, why in layers.required_missing}
    return {"how": "; ".join(sorted({k.how for k in kinds})), "missing": [[k, v] for k, v in sorted(missing.items())]}
